//! `tessera-kubelet-plugin`: the Tessera node agent.

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args_os().skip(1);
    if args
        .next()
        .is_some_and(|a| a == tessera_kubelet_plugin::gpus::isolation::SUBCOMMAND)
    {
        // The isolation probe's child, dispatched first, while the process has one thread: it
        // may make a mount namespace of its own. No flags, no logs, no runtime.
        std::process::exit(tessera_kubelet_plugin::gpus::isolation::run_child(
            args.collect(),
        ));
    }
    tessera_kubelet_plugin::cli::args::Args::parse_and_run()
}
