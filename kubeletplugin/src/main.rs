//! `tessera-kubelet-plugin`: the Tessera node agent.

fn main() -> anyhow::Result<()> {
    tessera_kubelet_plugin::args::Args::parse_and_run()
}
