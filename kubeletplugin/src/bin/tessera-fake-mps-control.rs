//! The fake backend's `nvidia-cuda-mps-control` (`tessera_kubelet_plugin::mps::fake_control`).

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(tessera_kubelet_plugin::mps::fake_control::run(&args)?);
}
