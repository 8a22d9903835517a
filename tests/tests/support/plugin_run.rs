//! Runs the plugin's whole wiring (`Args::run`, as the binary does) on a fake inventory file
//! against the in-process fake API server, for the tests that follow its behaviour over time.
#![allow(dead_code, reason = "each test file uses a subset")]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Parser as _;
use serde_json::{Value, json};
use tessera_tests::fake_apiserver::FakeApiServer;
use tonic::transport::Channel;

/// A plugin running in this process until [`RunningArgs::stop`].
pub(crate) struct RunningArgs {
    pub(crate) dir: tempfile::TempDir,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl RunningArgs {
    /// Starts the plugin of `node` on `inventory` (YAML), polling it every second, enforcing
    /// with `none` and accepting unverified isolation unless `extra` says otherwise, talking to
    /// `server`, with `extra` flags.
    pub(crate) fn start(
        server: &FakeApiServer,
        node: &str,
        inventory: &str,
        extra: &[&str],
    ) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = |p: &str| dir.path().join(p).display().to_string();
        std::fs::write(dir.path().join("kubeconfig"), server.kubeconfig()).unwrap();
        std::fs::write(dir.path().join("boot_id"), "boot-1\n").unwrap();
        std::fs::write(dir.path().join("inventory.yaml"), inventory).unwrap();
        let mut command_line: Vec<String> = [
            "tessera-kubelet-plugin",
            "--node-name",
            node,
            "--gpu-backend",
            "fake",
        ]
        .iter()
        .map(ToString::to_string)
        .collect();
        // Defaults that `extra` may replace (a flag given twice is an error).
        // Without enforcement nothing is verified: these runs accept unverified isolation
        // explicitly, as an admin of such a node would.
        for (flag, value) in [
            ("--inventory-poll-seconds", "1"),
            ("--enforcement", "none"),
            ("--accept-unverified-isolation", "true"),
        ] {
            if !extra.contains(&flag) {
                command_line.push(flag.to_owned());
                command_line.push(value.to_owned());
            }
        }
        for (flag, file) in [
            ("--fake-inventory", "inventory.yaml"),
            ("--kubeconfig", "kubeconfig"),
            ("--registration-dir", "registry"),
            ("--plugin-dir", "plugin"),
            ("--cdi-dir", "cdi"),
            ("--boot-id-file", "boot_id"),
        ] {
            command_line.push(flag.to_owned());
            command_line.push(path(file));
        }
        command_line.extend(extra.iter().map(ToString::to_string));
        let args = tessera_kubelet_plugin::cli::args::Args::try_parse_from(command_line).unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(args.run(async move {
            let _ = stopped.await;
        }));
        Self { dir, stop, task }
    }

    /// A file in the plugin's temp directory.
    pub(crate) fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Replaces the inventory file.
    pub(crate) fn write_inventory(&self, inventory: &str) {
        std::fs::write(self.path("inventory.yaml"), inventory).unwrap();
    }

    /// Stops the plugin (as SIGTERM would) and checks it stopped cleanly.
    pub(crate) async fn stop(self) {
        self.stop.send(()).unwrap();
        self.task.await.unwrap().unwrap();
    }
}

/// A fake API server (API version `v1`) that holds one Node, `node`.
pub(crate) async fn server_with_node(node: &str) -> FakeApiServer {
    let server = FakeApiServer::start(&["v1"]).await.unwrap();
    server
        .create(
            "nodes",
            json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}}),
        )
        .unwrap();
    server
}

/// A gRPC channel over the unix socket at `socket`, once it exists.
pub(crate) async fn connect(socket: &Path) -> Channel {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !socket.exists() {
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            socket.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tessera_tests::plugin_socket::dial(socket).await.unwrap()
}

/// Device `name` as the stored slices list it, if any does.
pub(crate) fn published_device(server: &FakeApiServer, name: &str) -> Option<Value> {
    server
        .objects("resourceslices")
        .iter()
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
        .find(|d| d["name"] == name)
}

/// Waits up to 30 s until device `name` is published and `check` accepts it.
pub(crate) async fn wait_for_device(
    server: &FakeApiServer,
    name: &str,
    what: &str,
    check: impl Fn(&Value) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let device = published_device(server, name);
        if device.as_ref().is_some_and(&check) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{name}: never {what}; last seen {device:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
