//! `tandem`: data-parallel training of image classifiers, in pure Rust.
//!
//! One binary, one subcommand per job: `train`, `eval`, `predict`, `bench` and `launch`.
//! Each subcommand lives in a module of its own; this file only parses the command line
//! and reports errors.

mod bench;
mod launch;

use clap::{Parser, Subcommand};

/// The command line of `tandem`.
#[derive(Parser)]
#[command(name = "tandem", version, about = "Data-parallel training of image classifiers, in pure Rust")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The subcommands of `tandem`.
#[derive(Subcommand)]
enum Command {
    /// Measure the speed of a part of Tandem.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Start workers on this node, restart them on failure (like torchrun).
    Launch(launch::LaunchArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bench(command) => bench::run(command),
        Command::Launch(args) => launch::run(args),
    };
    if let Err(error) = result {
        eprintln!("error: {error:#}");
        std::process::exit(1);
    }
}
