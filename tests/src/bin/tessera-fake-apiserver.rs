//! `tessera-fake-apiserver`: the in-process fake API server of the integration tests, as a
//! process, for the GPU acceptance suite (`tests/gpu/run.sh`): the plugin publishes its NVML
//! slices to it, the suite stores claims and reads Events through plain HTTP.
//!
//! `tessera-fake-apiserver --kubeconfig PATH [--versions v1[,v1beta2...]]` writes a kubeconfig
//! for it to PATH (atomically: the file appears complete), prints its URL, and serves until
//! SIGTERM or SIGINT.

use std::path::PathBuf;

use anyhow::Context as _;
use tessera_tests::fake_apiserver::FakeApiServer;

fn usage() -> anyhow::Error {
    anyhow::anyhow!("usage: tessera-fake-apiserver --kubeconfig PATH [--versions v1,...]")
}

fn main() -> anyhow::Result<()> {
    let mut kubeconfig: Option<PathBuf> = None;
    let mut versions = "v1".to_owned();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--kubeconfig" => kubeconfig = Some(args.next().ok_or_else(usage)?.into()),
            "--versions" => versions = args.next().ok_or_else(usage)?,
            _ => return Err(usage()),
        }
    }
    let kubeconfig = kubeconfig.ok_or_else(usage)?;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(async {
            let list: Vec<&str> = versions.split(',').collect();
            let server = FakeApiServer::start(&list)
                .await
                .context("starting the fake API server")?;
            let tmp = kubeconfig.with_extension("tmp");
            std::fs::write(&tmp, server.kubeconfig())
                .with_context(|| format!("writing {}", tmp.display()))?;
            std::fs::rename(&tmp, &kubeconfig)
                .with_context(|| format!("writing {}", kubeconfig.display()))?;
            let mut stdout = std::io::stdout().lock();
            std::io::Write::write_all(&mut stdout, format!("{}\n", server.url()).as_bytes())?;
            drop(stdout);
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .context("watching SIGTERM")?;
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            Ok(())
        })
}
