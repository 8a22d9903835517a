//! MPS daemons through plugin restarts, with the fake backend's control binary (a real
//! `SOCK_SEQPACKET` control socket) and a fake CUDA client attached: a plugin `SIGKILLed` and
//! started again adopts the daemon (no `quit`, no second daemon, the same CDI ids), whether
//! the plugin runs the daemons itself (`--mps-daemons local`) or the node's `tessera-mps host`
//! does (`--mps-daemons host`, the chart's way, where the daemon is not even the plugin's
//! child). The daemon stops only once its last claim is unprepared.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use tessera_driver::node::mps::ControlSocket;
use tessera_kubelet_plugin::mps::socket;
use tessera_proto::dra::v1;
use tessera_tests::host::{libraries, may_mount_and_chroot};
use tessera_tests::plugin_socket::{Dra, prepare_one, unprepare_one};

mod support;
use support::Plugin;
use support::mps::{FAKE_MPS, MpsNode as Node, Reaped};

const UID: &str = "uid-share";

fn claim_ref() -> v1::Claim {
    support::mps::claim_ref("share", UID)
}

fn node() -> Node {
    Node::new(&[support::mps::share_claim("share", UID)])
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
    node.remember_daemons();
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
        !log.iter().any(|l| l.starts_with("client disconnected")),
        "the client stayed attached: {log:?}"
    );
    (plugin, dra, client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_plugin_adopts_the_daemon_it_started() {
    let mut node = node();
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
    let mut node = node();
    let host = node.host();
    let (plugin, mut dra, client) = kill_and_replace(&mut node, "host").await;
    let control = node.pipe().join("control");

    // A host restart (a process restart; in a pod its children would end with it) adopts.
    let mut host = host;
    host.child.0.kill().unwrap();
    host.child.0.wait().unwrap();
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
    let mut node = node();
    let root = node.path("driver");
    if fake_driver_root(&root).is_none() {
        eprintln!("skipped: no dynamic loader to list the fake control binary's libraries");
        return;
    }
    let root_arg = root.display().to_string();
    let _host = Reaped(
        node.host_command(&[
            "--driver-root",
            &root_arg,
            "--mps-exec-binary",
            env!("CARGO_BIN_EXE_tessera-mps"),
        ])
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap(),
    );
    let mut plugin = node.plugin("host");
    let mut dra = node.connect(&mut plugin).await;
    prepare(&mut dra).await;
    node.remember_daemons();
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
