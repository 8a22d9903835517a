//! `tessera-controller`: allocates the claims of gated pods; see docs/controller.md.

fn main() -> anyhow::Result<()> {
    tessera_controller::args::Args::parse_and_run()
}
