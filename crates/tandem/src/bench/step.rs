//! `tandem bench step`.

use clap::Args;

/// Settings of `tandem bench step`.
#[derive(Args)]
pub struct StepArgs {}

/// Runs the benchmark.
pub fn run(_args: StepArgs) -> anyhow::Result<()> {
    anyhow::bail!("tandem bench step is not built yet")
}
