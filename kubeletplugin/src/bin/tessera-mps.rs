//! The MPS daemons' node host and mount-namespace wrapper (`tessera_kubelet_plugin::cli::mps_cli`).

fn main() -> anyhow::Result<()> {
    tessera_kubelet_plugin::cli::mps_cli::Cli::parse_and_run()
}
