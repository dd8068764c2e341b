//! `tandem`: data-parallel training of image classifiers, in pure Rust.
//!
//! One binary, one subcommand per job: `train`, `eval`, `predict`, `bench`, `launch` (the
//! `tandem-launch` crate) and `completions` (shell completions). Each subcommand lives in a
//! module of its own; this file only parses the command line
//! and reports errors.

#[macro_use]
extern crate tandem_files;

mod backend;
mod bench;
mod checkpoint_info;
mod clock;
mod data_source;
mod device;
mod eval;
mod evaluation;
mod exit;
mod math;
mod model_args;
mod predict;
mod remote;
mod settings;
mod train;
mod weights;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use tandem_files as files;
use tandem_files::terminal;

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
    Launch(tandem_launch::LaunchArgs),
    /// Show a live job's round and each rank's progress and heartbeat.
    Status(tandem_launch::StatusArgs),
    /// Print shell completions for tandem (e.g. `tandem completions bash > ~/.local/share/bash-completion/completions/tandem`).
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

fn main() {
    let matches = command().try_get_matches().unwrap_or_else(|error| {
        let words: Vec<String> = std::env::args().collect();
        if let Some(hint) = tandem_launch::missing_separator_hint(&words, &error) {
            tell!("error: {hint}");
            std::process::exit(exit::SETTINGS_ERROR_EXIT_CODE);
        }
        exit::fail_on_command_line(error)
    });
    let cli =
        Cli::from_arg_matches(&matches).unwrap_or_else(|error| exit::fail_on_command_line(error));
    let result = match cli.command {
        Command::Train(options) => train::run(*options),
        Command::Eval(args) => eval::run(args),
        Command::Predict(args) => predict::run(args),
        Command::Bench(command) => bench::run(command),
        Command::Launch(args) => launch(&args),
        Command::Status(args) => tandem_launch::status(&args).map(|report| print!("{report}")),
        Command::Completions { shell } => {
            clap_complete::generate(shell, &mut command(), "tandem", &mut std::io::stdout());
            Ok(())
        }
    };
    if let Err(error) = result {
        exit::fail(&error);
    }
}

/// Runs `tandem launch`; the logs of a run in object storage are uploaded when the job ends.
fn launch(args: &tandem_launch::LaunchArgs) -> anyhow::Result<()> {
    match tandem_launch::run(args, remote::launcher_logs::upload)? {
        tandem_launch::Outcome::Succeeded => Ok(()),
        tandem_launch::Outcome::Refused(summary) => {
            Err(exit::SettingsError::from_error(anyhow::anyhow!(summary)))
        }
    }
}

/// The command line of `tandem`, as argparse reads one: a flag given twice takes its last
/// value (a wrapper's flags come first, the user's after them), and a value may be a
/// negative number (`--lr -1` reaches the check that names the flag).
fn command() -> clap::Command {
    with_negative_values(Cli::command().args_override_self(true))
}

/// `command` and its subcommands with every flag that takes a value taking a negative number.
fn with_negative_values(command: clap::Command) -> clap::Command {
    command
        .mut_args(|arg| match arg.get_action().takes_values() {
            true => arg.allow_negative_numbers(true),
            false => arg,
        })
        .mut_subcommands(with_negative_values)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `train` options a command line gives.
    fn train_options(words: &[&str]) -> Result<settings::TrainOptions, clap::Error> {
        let mut line = vec!["tandem", "train"];
        line.extend(words);
        let cli = Cli::from_arg_matches(&command().try_get_matches_from(line)?)?;
        match cli.command {
            Command::Train(options) => Ok(*options),
            _ => unreachable!("the command line is a train command"),
        }
    }

    #[test]
    fn a_repeated_flag_takes_its_last_value() {
        let options = train_options(&[
            "--epochs",
            "1",
            "--epochs",
            "3",
            "--n-blocks",
            "6,6,6",
            "--n-blocks",
            "1,2,1",
            "--no-augment",
            "--no-augment",
            "--optimizer",
            "sgd",
            "--optimizer",
            "adamw",
        ])
        .unwrap();
        assert_eq!(options.epochs, Some(3));
        assert_eq!(options.model.n_blocks, Some(vec![1, 2, 1]));
        assert!(options.no_augment);
        assert_eq!(options.optimizer, Some(settings::OptimizerKind::Adamw));
    }

    #[test]
    fn a_negative_number_is_a_value_for_the_check_to_refuse() {
        let options = train_options(&["--lr", "-1", "--momentum", "-0.5"]).unwrap();
        assert_eq!((options.lr, options.momentum), (Some(-1.0), Some(-0.5)));
        let error = options.resolve().unwrap_err();
        assert_eq!(error.to_string(), "--lr must be a positive number, got -1");
        let error = train_options(&["--epochs", "-2"]).err().unwrap();
        assert!(
            error
                .to_string()
                .starts_with("error: invalid value '-2' for '--epochs <EPOCHS>'"),
            "{error}"
        );
    }

    #[test]
    fn switches_take_no_value() {
        let options = train_options(&["--sync-bn", "--scale-lr"]).unwrap();
        assert!(options.sync_bn && options.scale_lr && !options.nesterov);
        let error = train_options(&["--no-augment=true"]).err().unwrap();
        assert_eq!(error.kind(), clap::error::ErrorKind::TooManyValues);
    }
}
