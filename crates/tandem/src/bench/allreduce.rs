//! `tandem bench allreduce`.

use clap::Args;

/// Settings of `tandem bench allreduce`.
#[derive(Args)]
pub struct AllreduceArgs {}

/// Runs the benchmark.
pub fn run(_args: AllreduceArgs) -> anyhow::Result<()> {
    anyhow::bail!("tandem bench allreduce is not built yet")
}
