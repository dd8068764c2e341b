//! `tandem bench loader`.

use clap::Args;

/// Settings of `tandem bench loader`.
#[derive(Args)]
pub struct LoaderArgs {}

/// Runs the benchmark.
pub fn run(_args: LoaderArgs) -> anyhow::Result<()> {
    anyhow::bail!("tandem bench loader is not built yet")
}
