//! PLACEHOLDER
pub fn run(_args: &crate::cli::RunArgs, _quiet: bool) -> anyhow::Result<()> {
    anyhow::bail!("not yet")
}
