//! `tandem`: data-parallel training of image classifiers, in pure Rust.
//!
//! One binary, one subcommand per job: `train`, `eval`, `predict`, `bench`, `launch`, and `completions` (shell completions).
//! Each subcommand lives in a module of its own; this file only parses the command line
//! and reports errors.

/// Prints a line to standard output like `println!`, but a closed output (`tandem ... | head`)
/// does not panic: the line is dropped and the job goes on.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}

/// Prints a line to standard error like `eprintln!`, but in one write: `eprintln!` writes its
/// pieces one by one to the unbuffered stderr, and the lines of ranks sharing a terminal or
/// pipe (mpirun, srun) would interleave mid-line. A closed stderr drops the line.
macro_rules! tell {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let line = format!("{}\n", format_args!($($arg)*));
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }};
}

mod backend;
mod bench;
mod checkpoint_info;
mod clock;
mod compute;
mod data_source;
mod device;
mod eval;
mod evaluation;
mod files;
mod launch;
mod model_args;
mod plot;
mod predict;
mod remote;
mod settings;
mod train;
mod weights;

use clap::{CommandFactory, Parser, Subcommand};

/// The command line of `tandem`.
#[derive(Parser)]
#[command(
    name = "tandem",
    version,
    about = "Data-parallel training of image classifiers, in pure Rust"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The subcommands of `tandem`.
#[derive(Subcommand)]
enum Command {
    /// Train a model (resumes from the snapshot in the output folder when there is one).
    Train(Box<settings::TrainOptions>),
    /// Evaluate a checkpoint on a data set's test split.
    Eval(eval::EvalArgs),
    /// Classify image files with a checkpoint.
    Predict(predict::PredictArgs),
    /// Measure the speed of a part of Tandem.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Start workers on this node, restart them on failure (like torchrun).
    Launch(launch::LaunchArgs),
    /// Print shell completions for tandem (e.g. `tandem completions bash > ~/.local/share/bash-completion/completions/tandem`).
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

fn main() {
    let cli = Cli::try_parse().unwrap_or_else(|error| {
        let words: Vec<String> = std::env::args().collect();
        if let Some(hint) = launch::missing_separator_hint(&words, &error) {
            tell!("error: {hint}");
            std::process::exit(2);
        }
        error.exit()
    });
    let result = match cli.command {
        Command::Train(options) => train::run(*options),
        Command::Eval(args) => eval::run(args),
        Command::Predict(args) => predict::run(args),
        Command::Bench(command) => bench::run(command),
        Command::Launch(args) => launch::run(args),
        Command::Completions { shell } => {
            clap_complete::generate(shell, &mut Cli::command(), "tandem", &mut std::io::stdout());
            Ok(())
        }
    };
    if let Err(error) = result {
        report_fatal_error(&error);
        if let Some(stopped) = error.downcast_ref::<train::stop_signal::StoppedBySignal>() {
            train::stop_signal::end_on(stopped);
        }
        std::process::exit(1);
    }
}

/// Prints the error on stderr (prefixed with the rank on ranks other than 0) and, under
/// `tandem launch`, records it in this worker's error file.
fn report_fatal_error(error: &anyhow::Error) {
    use tandem_dist::cluster::contract::{WorkerErrorRecord, ERROR_FILE_ENV};
    let rank = worker_rank();
    match rank.filter(|rank| *rank != 0) {
        Some(rank) => tell!("[rank {rank}] error: {error:#}"),
        None => tell!("error: {error:#}"),
    }
    if let Some(path) = std::env::var_os(ERROR_FILE_ENV) {
        let record = WorkerErrorRecord::now(rank, format!("{error:#}"));
        if let Err(write_error) =
            files::write_atomically(std::path::Path::new(&path), record.to_json().as_bytes())
        {
            tell!(
                "warning: cannot record the error in {}: {write_error:#}",
                path.to_string_lossy()
            );
        }
    }
}

/// This process's rank in a job: `RANK` (torchrun's, what `tandem launch` sets), else the
/// rank the cluster that started it gives (`mpirun`, `srun`, ...); `None` outside a job.
fn worker_rank() -> Option<u64> {
    use tandem_dist::cluster::{contract::RANK_ENV, WorkerEnv};
    match std::env::var(RANK_ENV) {
        Ok(rank) => rank.parse::<u64>().ok(),
        Err(_) => WorkerEnv::from_env()
            .ok()
            .flatten()
            .map(|worker| worker.rank as u64),
    }
}
