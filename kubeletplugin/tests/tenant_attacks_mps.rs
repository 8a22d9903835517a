//! Attacks a hostile tenant plays on a node's MPS daemons, each against the real binaries: the
//! plugin and the node's `tessera-mps host`, the fake backend's control binary on a real
//! `SOCK_SEQPACKET` control socket, and real processes stopped through pidfds (NVML's process
//! list is the fake GPU's, naming those real pids).
//!
//! * The pipe directory is mounted read-write into every share container of its GPU set: a
//!   tenant unlinks `control` and listens there itself, answering every command "done". The
//!   plugin, the host and the accounting must not speak to it, and the tenant's over-booked
//!   process is still killed.
//! * `tessera-mps host` reads its checkpoint and boot id as the plugin does: `/dev/zero` there
//!   is a clear error, not a process that grows until it runs out of memory.
//! * An MPS daemon serves one Unix user at a time (the fake queues a client of another user as
//!   MPS does): share pods of two users on one GPU get a daemon each and neither waits; a pod
//!   whose user the node cannot know is refused, with what to set.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::BTreeSet;
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_driver::node::checkpoint::{Checkpoint, ClaimEntry, HeldDevice, PrepareState};
use tessera_driver::node::mps::MpsDaemon;
use tessera_kubelet_plugin::accounting::{
    Accountant, BinaryMpsControl, FakeGpu, HostProcesses, PreparedClaims, ProcFiles, ProcFs, Seams,
};
use tessera_kubelet_plugin::claims::FakeClaimSource;
use tessera_kubelet_plugin::mps::record;
use tessera_tests::plugin_socket::prepare_one;

mod support;
use support::Plugin;
use support::mps::{
    FAKE_MPS, Impostor, Logged, MpsNode, Reaped, claim_ref, share_claim, start_client,
};

const GIB: u64 = 1 << 30;
/// The tenant's pod.
const POD: &str = "0c6f33a4-5e2b-4a1b-9e0c-51d4b2a3f7e1";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_share_prepared_after_a_tenant_took_over_the_control_socket_is_refused() {
    let mut node = MpsNode::new(&[
        share_claim("first", "uid-a"),
        share_claim("second", "uid-b"),
    ]);
    let _host = node.host();
    let mut plugin = node.plugin("host");
    let mut dra = node.connect(&mut plugin).await;
    prepare_one(&mut dra, claim_ref("first", "uid-a"))
        .await
        .unwrap();
    node.remember_daemons();

    // A container of the first claim replaces the daemon's socket with its own.
    let tenant = Impostor::take_over(&node.pipe(), 0);
    let err = prepare_one(&mut dra, claim_ref("second", "uid-b"))
        .await
        .expect_err("a claim is never pointed at a tenant's socket")
        .to_string();
    assert!(err.contains("not the daemon"), "{err}");
    assert!(err.contains("nothing was sent"), "{err}");
    assert!(tenant.received().is_empty(), "{:?}", tenant.received());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_host_does_not_adopt_a_tenant_listening_on_the_control_socket() {
    let mut node = MpsNode::new(&[share_claim("first", "uid-a")]);
    let mut host = node.host();
    let mut plugin = node.plugin("host");
    let mut dra = node.connect(&mut plugin).await;
    prepare_one(&mut dra, claim_ref("first", "uid-a"))
        .await
        .unwrap();
    node.remember_daemons();

    // The host restarts (its daemon lives on); meanwhile a tenant takes the socket over.
    host.child.0.kill().unwrap();
    host.child.0.wait().unwrap();
    let tenant = Impostor::take_over(&node.pipe(), 0);
    let host = node.host();
    let refused = host.wait_for("not answered by its daemon");
    assert!(refused.contains(&node.daemon_id()), "{refused}");
    assert!(tenant.received().is_empty(), "{:?}", tenant.received());
    assert_eq!(node.starts(), 1, "no second daemon beside the tenant");
}

/// The prepared claims of the accounting test: claim `c1` books 1 GiB of `GPU-1` through
/// `daemon`.
struct OneShare(Checkpoint);

impl PreparedClaims for OneShare {
    fn record(&self) -> tessera_kubelet_plugin::error::Result<Checkpoint> {
        Ok(self.0.clone())
    }
}

fn one_share(daemon: &MpsDaemon) -> OneShare {
    let mut record = Checkpoint::new("b");
    record.claims.insert(
        "c1".to_owned(),
        ClaimEntry {
            namespace: "team".to_owned(),
            name: "train".to_owned(),
            state: PrepareState::PrepareCompleted,
            devices: vec![HeldDevice {
                request: "gpu".to_owned(),
                pool: "node-a".to_owned(),
                device: "gpu-0".to_owned(),
                gpu_uuid: "GPU-1".to_owned(),
                mig: false,
                exclusive: false,
                cdi_ids: Vec::new(),
                share_memory_bytes: Some(GIB),
                share_compute_percent: Some(50),
                share_id: Some("s1".to_owned()),
                share_tier: None,
            }],
            host_dirs: Vec::new(),
            mps_daemon: Some(daemon.clone()),
        },
    );
    OneShare(record)
}

fn reserved_for_the_tenant() -> FakeClaimSource {
    let mut source = FakeClaimSource::new();
    source.insert(
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "train", "namespace": "team", "uid": "c1"},
            "spec": {},
            "status": {"reservedFor": [{"resource": "pods", "name": "trainer", "uid": POD}]}
        }))
        .unwrap(),
    );
    source
}

/// The real `/proc` (start times, pidfd kills), where `tenant` runs in the tenant pod's cgroup
/// (this test's processes run in no pod's).
struct InThePod {
    proc: ProcFs,
    tenant: u32,
}

impl HostProcesses for InThePod {
    fn read(&self, pid: u32) -> tessera_kubelet_plugin::error::Result<Option<ProcFiles>> {
        let Some(mut files) = self.proc.read(pid)? else {
            return Ok(None);
        };
        if pid == self.tenant {
            files.cgroup = format!(
                "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/cri-containerd-1.scope\n",
                POD.replace('-', "_")
            )
            .into_bytes();
        } else {
            files.cgroup.clear();
        }
        Ok(Some(files))
    }

    fn kill(&self, pid: u32, start_ticks: u64) -> tessera_kubelet_plugin::error::Result<bool> {
        self.proc.kill(pid, start_ticks)
    }
}

fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn daemon_in(dir: &Path) -> MpsDaemon {
    let base = dir.join("mps-1");
    MpsDaemon {
        id: "mps-1".to_owned(),
        devices: vec!["GPU-1".to_owned()],
        pipe_dir: base.join("pipe").display().to_string(),
        shm_dir: base.join("shm").display().to_string(),
        log_dir: dir.join("log").display().to_string(),
        user: None,
    }
}

/// The fake control daemon on `daemon`'s pipe directory, recorded as its supervisor records it.
fn started(daemon: &MpsDaemon) -> Reaped {
    std::fs::create_dir_all(&daemon.pipe_dir).unwrap();
    let child = Command::new(FAKE_MPS)
        .arg("-f")
        .env("CUDA_MPS_PIPE_DIRECTORY", &daemon.pipe_dir)
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    record::write(daemon, &record::of_child(daemon, child.id()).unwrap()).unwrap();
    let control = PathBuf::from(&daemon.pipe_dir).join("control");
    eventually("the daemon listens", || control.exists());
    Reaped(child)
}

fn exit_signal(child: &mut Child) -> Option<i32> {
    let mut status = None;
    eventually("the process exits", || {
        status = child.try_wait().unwrap();
        status.is_some()
    });
    status.and_then(|s| s.signal())
}

#[tokio::test]
async fn a_tenant_answering_done_on_the_socket_does_not_save_its_over_booked_process() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = daemon_in(dir.path());
    let _daemon = started(&daemon);
    // The tenant's process holds 2 GiB on a 1 GiB booking ...
    let mut over = Reaped(Command::new("sleep").arg("600").spawn().unwrap());
    let pid = over.0.id();
    let gpu = FakeGpu::new();
    gpu.run(pid, "GPU-1", 2 * GIB);
    // ... and the tenant answers for the daemon: "my process is your client; terminated".
    let tenant = Impostor::take_over(Path::new(&daemon.pipe_dir), pid);

    let accountant = Accountant::new(
        Seams {
            prepared: Arc::new(one_share(&daemon)),
            claims: Arc::new(reserved_for_the_tenant()),
            gpus: Arc::new(gpu.clone()),
            host: Arc::new(InThePod {
                proc: ProcFs::default(),
                tenant: pid,
            }),
            mps: Arc::new(BinaryMpsControl::new(FAKE_MPS, Duration::from_secs(10))),
            events: None,
        },
        None,
    );
    let report = accountant.pass(Instant::now()).await.unwrap();
    assert_eq!(report.killed, [pid], "{report:?}");
    assert!(report.terminated.is_empty(), "{report:?}");
    assert_eq!(
        exit_signal(&mut over.0),
        Some(9),
        "killed through its pidfd"
    );
    assert!(tenant.received().is_empty(), "{:?}", tenant.received());
}

/// `tessera-mps host` under a 2 GiB address-space limit, so that a host that reads an endless
/// file fails fast instead of taking the machine's memory.
fn bounded_host(node: &MpsNode, boot_id: &Path) -> Logged {
    let host = node.host_command(&[
        "--mps-shm-namespace=false",
        "--mps-control-binary",
        FAKE_MPS,
    ]);
    let mut command = Command::new("sh");
    command
        .arg("-c")
        .arg("ulimit -v 2097152 && exec \"$0\" \"$@\"")
        .arg(host.get_program())
        .args(host.get_args().map(|a| {
            if a == node.path("boot_id").as_os_str() {
                boot_id.as_os_str()
            } else {
                a
            }
        }))
        .envs(host.get_envs().filter_map(|(k, v)| Some((k, v?))))
        .stdout(Stdio::null());
    Logged::spawn(&mut command)
}

#[test]
fn the_mps_host_refuses_dev_zero_as_its_boot_id_file_with_a_clear_error() {
    let node = MpsNode::new(&[]);
    let zero = node.path("boot_id_zero");
    std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
    let mut host = bounded_host(&node, &zero);
    let mut status = None;
    eventually("the host stops", || {
        status = host.child.0.try_wait().unwrap();
        status.is_some()
    });
    assert!(!status.unwrap().success());
    let line = host.wait_for("the boot id file must be a regular file, and this is a device");
    assert!(line.contains(&zero.display().to_string()), "{line}");
}

#[test]
fn the_mps_host_reads_no_checkpoint_that_is_a_device_and_keeps_serving() {
    let node = MpsNode::new(&[]);
    std::fs::create_dir_all(node.path("plugin")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", node.path("plugin").join("checkpoint.json")).unwrap();
    let mut host = bounded_host(&node, &node.path("boot_id"));
    let line = host.wait_for("the checkpoint must be a regular file, and this is a device");
    assert!(line.contains("checkpoint.json"), "{line}");
    assert!(
        host.child.0.try_wait().unwrap().is_none(),
        "the host runs on, for when the checkpoint is a file again"
    );
    let daemons: BTreeSet<String> = node.daemon_ids().into_iter().collect();
    assert!(daemons.is_empty(), "{daemons:?}");
}

/// Whether this process may start processes as another user (the tests of several users need
/// it: the fake daemon tells a client's user by `SO_PEERCRED`).
fn may_change_user() -> bool {
    rustix::process::geteuid().is_root()
}

/// Lets every user walk to the node's directories (a temporary directory is its owner's alone;
/// a node's `/run` is not).
fn open_to_every_user(node: &MpsNode) {
    std::fs::set_permissions(
        node.path(""),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
}

/// The daemon whose id ends with `suffix` (`-u<uid>`).
fn daemon_of(node: &MpsNode, suffix: &str) -> String {
    let ids = node.daemon_ids();
    ids.iter()
        .find(|id| id.ends_with(suffix))
        .unwrap_or_else(|| panic!("no daemon ending with {suffix} in {ids:?}"))
        .clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn share_pods_of_two_users_on_one_gpu_get_a_daemon_each_and_neither_waits() {
    if !may_change_user() {
        eprintln!("skipped: needs root to run a client as another user");
        return;
    }
    let mut node = MpsNode::with_users(&[
        (share_claim("as-root", "uid-root"), Some(0)),
        (share_claim("as-user", "uid-user"), Some(1000)),
    ]);
    open_to_every_user(&node);
    let _host = node.host();
    let mut plugin = node.plugin("host");
    let mut dra = node.connect(&mut plugin).await;
    prepare_one(&mut dra, claim_ref("as-root", "uid-root"))
        .await
        .unwrap();
    prepare_one(&mut dra, claim_ref("as-user", "uid-user"))
        .await
        .unwrap();
    node.remember_daemons();
    assert_eq!(node.daemon_ids().len(), 2, "{:?}", node.daemon_ids());
    let (root, user) = (daemon_of(&node, "-u0"), daemon_of(&node, "-u1000"));

    // A root process holds its daemon's server; the other user's process starts beside it.
    let _root_client = start_client(&node.pipe_of(&root), Some(0));
    node.wait_attached(&root, 1);
    let _user_client = start_client(&node.pipe_of(&user), Some(1000));
    node.wait_attached(&user, 1);
    assert!(
        !node
            .control_log_of(&user)
            .iter()
            .any(|l| l.starts_with("client queued")),
        "{:?}",
        node.control_log_of(&user)
    );
    let pipe = std::fs::metadata(node.pipe_of(&user)).unwrap();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&pipe.permissions()) & 0o7777,
        0o1777
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_one_daemon_for_every_user_a_second_users_client_waits_for_the_first_users() {
    if !may_change_user() {
        eprintln!("skipped: needs root to run a client as another user");
        return;
    }
    let mut node = MpsNode::with_users(&[
        (share_claim("as-root", "uid-root"), Some(0)),
        (share_claim("as-user", "uid-user"), Some(1000)),
    ]);
    open_to_every_user(&node);
    let _host = node.host();
    let mut plugin = Plugin(
        node.plugin_command("host", &["--mps-users=single"])
            .spawn()
            .unwrap(),
    );
    let mut dra = node.connect(&mut plugin).await;
    for (name, uid) in [("as-root", "uid-root"), ("as-user", "uid-user")] {
        prepare_one(&mut dra, claim_ref(name, uid)).await.unwrap();
    }
    node.remember_daemons();
    let id = node.daemon_id();
    let root_client = start_client(&node.pipe_of(&id), Some(0));
    node.wait_attached(&id, 1);
    let _user_client = start_client(&node.pipe_of(&id), Some(1000));
    let log = node.path("mps-log").join(&id).join("control.log");
    let queued = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("client queued uid=1000")
    };
    eventually("the second user's client is queued", queued);
    assert_eq!(node.attached(&id), 1, "it waits while root's client runs");
    drop(root_client);
    node.wait_attached(&id, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_share_pod_whose_user_the_node_cannot_know_is_refused_naming_what_to_set() {
    let node = MpsNode::with_users(&[(share_claim("image-user", "uid-image"), None)]);
    let _host = node.host();
    let mut plugin = node.plugin("host");
    let mut dra = node.connect(&mut plugin).await;
    let err = prepare_one(&mut dra, claim_ref("image-user", "uid-image"))
        .await
        .expect_err("the image's user is unknown to the node")
        .to_string();
    assert!(
        err.contains(
            "pod \"image-user-pod\", container \"main\" sets no securityContext.runAsUser"
        ),
        "{err}"
    );
    assert!(err.contains("set runAsUser"), "{err}");
    assert!(
        node.daemon_ids().is_empty(),
        "no daemon for a refused claim"
    );
}
