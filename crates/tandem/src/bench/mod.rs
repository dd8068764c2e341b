//! `tandem bench`: benchmarks that print their figures one per line, so scripts can read them.

mod allreduce;
mod gpu_step;
mod loader;
mod step;
mod workload;

use clap::Subcommand;

/// What `tandem bench` can measure.
#[derive(Subcommand)]
pub enum BenchCommand {
    /// Training-step and eval throughput of a model on random data.
    Step(step::StepArgs),
    /// All-reduce time and bandwidth between local processes.
    Allreduce(allreduce::AllreduceArgs),
    /// Data-loader throughput with augmentation.
    Loader(loader::LoaderArgs),
}

/// Runs one benchmark.
pub fn run(command: BenchCommand) -> anyhow::Result<()> {
    match command {
        BenchCommand::Step(args) => match step::run(args)? {
            Some(on_gpu) => gpu_step::run(on_gpu),
            None => Ok(()),
        },
        BenchCommand::Allreduce(args) => allreduce::run(args),
        BenchCommand::Loader(args) => loader::run(args),
    }
}
