//! MPS daemons through plugin restarts, with the fake backend's control binary (a real
//! `SOCK_SEQPACKET` control socket) and a fake CUDA client attached: a plugin `SIGKILLed` and
//! started again adopts the daemon (no `quit`, no second daemon, the same CDI ids), whether
//! the plugin runs the daemons itself (`--mps-daemons local`) or the node's `tessera-mps host`
//! does (`--mps-daemons host`, the chart's way, where the daemon is not even the plugin's
//! child). The daemon stops only once its last claim is unprepared.
#![allow(clippy::unwrap_used, missing_docs)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1 as res;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use tessera_driver::node::mps::ControlSocket;
use tessera_kubelet_plugin::mps::socket;
use tessera_proto::dra::v1;
use tessera_tests::host::{libraries, may_mount_and_chroot};
use tessera_tests::plugin_socket::{Dra, prepare_one, unprepare_one};

mod support;
use support::{NodeDir, Plugin};

const NODE: &str = "t4-node";
const UID: &str = "uid-share";
const FAKE_MPS: &str = env!("CARGO_BIN_EXE_tessera-fake-mps-control");

/// A 4 GiB, 50 % share of `gpu-0` of the T4 node, as kube-scheduler allocates it.
fn share_claim() -> res::ResourceClaim {
    let mut claim = support::allocated_claim("share", UID, NODE, "gpu-0");
    let result = support::first_result(&mut claim);
    result.share_id = Some("7f3a1c52-0d1e-4b7a-9c44-1b2f3e4d5a6b".to_owned());
    result.consumed_capacity = Some(BTreeMap::from([
        ("memory".to_owned(), Quantity("4Gi".to_owned())),
        ("compute".to_owned(), Quantity("50".to_owned())),
    ]));
    claim
}

fn claim_ref() -> v1::Claim {
    v1::Claim {
        namespace: "default".to_owned(),
        uid: UID.to_owned(),
        name: "share".to_owned(),
    }
}

/// A child killed and reaped when the test lets go of it.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Node {
    dir: NodeDir,
    /// Daemon pids seen in control logs, killed at the end (they outlive their parents).
    daemons: Vec<i32>,
}

impl Drop for Node {
    fn drop(&mut self) {
        for pid in &self.daemons {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(*pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

impl Node {
    fn new() -> Self {
        Self {
            dir: NodeDir::new(tempfile::tempdir().unwrap(), &[share_claim()]),
            daemons: Vec::new(),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path(name)
    }

    fn plugin(&self, daemons: &str) -> Plugin {
        let pipe_root = self.path("mps").display().to_string();
        let log_root = self.path("mps-log").display().to_string();
        let mut command = self.dir.plugin_command(
            NODE,
            &[],
            &[
                "--enforcement",
                "mps",
                &format!("--mps-daemons={daemons}"),
                "--mps-shm-namespace=false",
                "--mps-ready-seconds=20",
                "--mps-control-binary",
                FAKE_MPS,
                "--mps-pipe-dir-root",
                &pipe_root,
                "--mps-log-dir-root",
                &log_root,
            ],
        );
        Plugin(command.env("RUST_LOG", "info").spawn().unwrap())
    }

    fn host(&self) -> Reaped {
        self.host_with(&[
            "--mps-shm-namespace=false",
            "--mps-control-binary",
            FAKE_MPS,
        ])
    }

    fn host_with(&self, launch: &[&str]) -> Reaped {
        let child = Command::new(env!("CARGO_BIN_EXE_tessera-mps"))
            .env("RUST_LOG", "info")
            .arg("host")
            .arg("--state-dir")
            .arg(self.path("plugin"))
            .arg("--boot-id-file")
            .arg(self.path("boot_id"))
            .args(launch)
            .arg("--interval-ms=50")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        Reaped(child)
    }

    async fn connect(&self, plugin: &mut Plugin) -> Dra {
        let socket = self.path("plugin").join("dra.sock");
        let channel = support::dial_until_up(plugin, &socket, Duration::from_mins(1)).await;
        Dra::new(channel)
    }

    /// The one daemon's directory under the pipe root.
    fn daemon_id(&self) -> String {
        let ids: Vec<String> = std::fs::read_dir(self.path("mps"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(ids.len(), 1, "{ids:?}");
        ids.into_iter().next().unwrap()
    }

    fn pipe(&self) -> PathBuf {
        self.path("mps").join(self.daemon_id()).join("pipe")
    }

    fn control_log(&self) -> Vec<String> {
        let file = self
            .path("mps-log")
            .join(self.daemon_id())
            .join("control.log");
        std::fs::read_to_string(file)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    fn starts(&self) -> usize {
        self.control_log()
            .iter()
            .filter(|l| l.starts_with("start "))
            .count()
    }

    fn quits(&self) -> usize {
        self.control_log()
            .iter()
            .filter(|l| *l == "command quit")
            .count()
    }

    /// Remembers the daemon's pid (from its log) so that it is killed at the end.
    fn remember_daemon(&mut self) {
        for line in self.control_log() {
            if let Some(pid) = line
                .strip_prefix("start pid=")
                .and_then(|r| r.split_whitespace().next())
                .and_then(|p| p.parse().ok())
            {
                self.daemons.push(pid);
            }
        }
    }

    /// A CUDA process of the fake, attached to the daemon until it is killed.
    fn client(&self) -> Reaped {
        let child = Command::new(FAKE_MPS)
            .arg("client")
            .env("CUDA_MPS_PIPE_DIRECTORY", self.pipe())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.control_log().iter().any(|l| l == "client connected") {
            assert!(Instant::now() < deadline, "the client did not attach");
            std::thread::sleep(Duration::from_millis(20));
        }
        Reaped(child)
    }

    async fn wait_until(&self, what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !done() {
            assert!(Instant::now() < deadline, "timed out waiting until {what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

async fn prepare(dra: &mut Dra) -> Vec<String> {
    prepare_one(dra, claim_ref()).await.unwrap()
}

async fn unprepare(dra: &mut Dra) {
    unprepare_one(dra, claim_ref()).await.unwrap();
}

fn sigkill(plugin: &mut Plugin) {
    plugin.0.kill().unwrap();
    plugin.0.wait().unwrap();
}

/// Prepare, attach a client, SIGKILL the plugin, start a new one, prepare again; returns the
/// node (with its live client) and the new plugin's connection.
async fn kill_and_replace(node: &mut Node, daemons: &str) -> (Plugin, Dra, Reaped) {
    let mut plugin = node.plugin(daemons);
    let mut dra = node.connect(&mut plugin).await;
    let ids = prepare(&mut dra).await;
    assert!(!ids.is_empty());
    node.remember_daemon();
    assert_eq!(node.starts(), 1, "{:?}", node.control_log());
    let log = node.control_log();
    assert!(
        log[0].contains(" visible=GPU-"),
        "the daemon sees its GPU: {log:?}"
    );
    let spec = std::fs::read_to_string(
        node.path("cdi")
            .join(tessera_driver::node::cdi::spec_file_name(UID)),
    )
    .unwrap();
    assert!(
        spec.contains(&node.pipe().display().to_string()),
        "the containers get the daemon's pipe directory"
    );
    let client = node.client();
    let control = node.pipe().join("control");

    sigkill(&mut plugin);
    drop(dra);
    assert_eq!(
        socket::probe(&control),
        ControlSocket::Answers,
        "the daemon outlives the plugin"
    );

    let mut plugin = node.plugin(daemons);
    let mut dra = node.connect(&mut plugin).await;
    assert_eq!(prepare(&mut dra).await, ids, "the same CDI ids");
    assert_eq!(
        node.starts(),
        1,
        "no second daemon: {:?}",
        node.control_log()
    );
    assert_eq!(
        node.quits(),
        0,
        "no quit to a daemon with a client: {:?}",
        node.control_log()
    );
    assert_eq!(socket::probe(&control), ControlSocket::Answers);
    let log = node.control_log();
    assert!(
        !log.iter().any(|l| l == "client disconnected"),
        "the client stayed attached: {log:?}"
    );
    (plugin, dra, client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_plugin_adopts_the_daemon_it_started() {
    let mut node = Node::new();
    let (plugin, mut dra, client) = kill_and_replace(&mut node, "local").await;
    // The adopted daemon stops once its last claim is unprepared (after its client left, as
    // kubelet stops the containers first).
    drop(client);
    unprepare(&mut dra).await;
    assert_eq!(node.quits(), 1, "{:?}", node.control_log());
    let control = node.pipe().join("control");
    node.wait_until("the daemon is gone", || {
        socket::probe(&control) == ControlSocket::Missing
    })
    .await;
    drop(plugin);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_node_host_the_daemon_is_not_the_plugins_and_outlives_it_and_the_host() {
    let mut node = Node::new();
    let host = node.host();
    let (plugin, mut dra, client) = kill_and_replace(&mut node, "host").await;
    let control = node.pipe().join("control");

    // A host restart (a process restart; in a pod its children would end with it) adopts.
    let mut host = host;
    host.0.kill().unwrap();
    host.0.wait().unwrap();
    let host = node.host();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(node.starts(), 1, "{:?}", node.control_log());
    assert_eq!(node.quits(), 0);

    drop(client);
    unprepare(&mut dra).await;
    node.wait_until("the host stops the daemon", || {
        socket::probe(&control) == ControlSocket::Missing
    })
    .await;
    assert_eq!(node.quits(), 1, "{:?}", node.control_log());
    drop((plugin, host));
}

/// A driver root holding the fake control binary at `/usr/bin/nvidia-cuda-mps-control` and
/// the shared libraries it needs, and nothing else: no shell, no `mount`.
fn fake_driver_root(root: &Path) -> Option<()> {
    for path in libraries(Path::new(FAKE_MPS))? {
        let inside = root.join(path.strip_prefix("/").unwrap());
        std::fs::create_dir_all(inside.parent().unwrap()).unwrap();
        std::fs::copy(&path, &inside).unwrap();
    }
    let control = root.join("usr/bin/nvidia-cuda-mps-control");
    std::fs::create_dir_all(control.parent().unwrap()).unwrap();
    std::fs::copy(FAKE_MPS, &control).unwrap();
    Some(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_driver_root_the_daemon_gets_its_shm_pipe_and_log_directories_without_any_tool() {
    if !may_mount_and_chroot() {
        eprintln!("skipped: needs CAP_SYS_ADMIN and CAP_SYS_CHROOT (mount namespace, chroot)");
        return;
    }
    let mut node = Node::new();
    let root = node.path("driver");
    if fake_driver_root(&root).is_none() {
        eprintln!("skipped: no dynamic loader to list the fake control binary's libraries");
        return;
    }
    let root_arg = root.display().to_string();
    let _host = node.host_with(&[
        "--driver-root",
        &root_arg,
        "--mps-exec-binary",
        env!("CARGO_BIN_EXE_tessera-mps"),
    ]);
    let mut plugin = node.plugin("host");
    let mut dra = node.connect(&mut plugin).await;
    prepare(&mut dra).await;
    node.remember_daemon();
    assert_eq!(node.starts(), 1, "the log directory is bound into the root");
    let pid: i32 = *node.daemons.last().unwrap();

    // The daemon runs with the driver root as its root ...
    assert_eq!(
        std::fs::read_link(format!("/proc/{pid}/root")).unwrap(),
        root
    );
    // ... its /dev/shm is the claim's shm directory ...
    let shm = node.path("mps").join(node.daemon_id()).join("shm");
    std::fs::write(shm.join("marker"), "x").unwrap();
    assert!(Path::new(&format!("/proc/{pid}/root/dev/shm/marker")).exists());
    // ... and its control socket is the one clients outside reach.
    let client = node.client();
    assert!(
        !Path::new("/dev/shm/marker").exists(),
        "nothing leaks into the caller's mounts"
    );
    drop(client);
    unprepare(&mut dra).await;
    let control = node.pipe().join("control");
    node.wait_until("the host stops the daemon", || {
        socket::probe(&control) == ControlSocket::Missing
    })
    .await;
}
