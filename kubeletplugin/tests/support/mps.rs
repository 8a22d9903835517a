//! An MPS node for the suites: the plugin and the node's `tessera-mps host` with the fake
//! backend's control binary (a real `SOCK_SEQPACKET` control socket), fake CUDA clients, and a
//! tenant that takes a daemon's control socket over.

use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1 as res;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use tessera_kubelet_plugin::mps::socket;
use tessera_proto::dra::v1;
use tessera_tests::plugin_socket::Dra;

use super::{NodeDir, Plugin};

/// The node the MPS suites pretend to be (a T4 node of the demo inventory).
pub const NODE: &str = "t4-node";
/// The fake backend's `nvidia-cuda-mps-control`.
pub const FAKE_MPS: &str = env!("CARGO_BIN_EXE_tessera-fake-mps-control");

/// A share claim `name` (UID `uid`) of 4 GiB and 50 % of `gpu-0` of [`NODE`], as
/// kube-scheduler allocates it, reserved for the pod [`share_pod`] makes for it.
pub fn share_claim(name: &str, uid: &str) -> res::ResourceClaim {
    let mut claim = super::allocated_claim(name, uid, NODE, "gpu-0");
    claim.status.as_mut().unwrap().reserved_for = Some(vec![res::ResourceClaimConsumerReference {
        resource: "pods".to_owned(),
        name: format!("{name}-pod"),
        uid: format!("pod-{uid}"),
        api_group: None,
    }]);
    let result = super::first_result(&mut claim);
    result.share_id = Some(format!(
        "7f3a1c52-0d1e-4b7a-9c44-{:012x}",
        uid.bytes().map(u64::from).sum::<u64>()
    ));
    result.consumed_capacity = Some(BTreeMap::from([
        ("memory".to_owned(), Quantity("4Gi".to_owned())),
        ("compute".to_owned(), Quantity("50".to_owned())),
    ]));
    claim
}

/// The pod `<claim>-pod` that `claim` is reserved for: on [`NODE`], one container that uses the
/// claim, running as `user` (`None`: no `runAsUser`, the image's user).
pub fn share_pod(claim: &res::ResourceClaim, user: Option<i64>) -> serde_json::Value {
    let name = claim.metadata.name.as_deref().unwrap();
    let uid = claim.metadata.uid.as_deref().unwrap();
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"namespace": "default", "name": format!("{name}-pod"), "uid": format!("pod-{uid}")},
        "spec": {
            "nodeName": NODE,
            "securityContext": user.map(|u| serde_json::json!({"runAsUser": u})),
            "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
            "containers": [{"name": "main", "image": "cuda", "resources": {"claims": [{"name": "gpu"}]}}]
        }
    })
}

/// Kubelet's reference to the claim `name` (UID `uid`) in `default`.
pub fn claim_ref(name: &str, uid: &str) -> v1::Claim {
    v1::Claim {
        namespace: "default".to_owned(),
        uid: uid.to_owned(),
        name: name.to_owned(),
    }
}

/// A CUDA process of the fake on the daemon of `pipe`, running as `uid` when given (the
/// daemon tells its user by `SO_PEERCRED`); not waited for.
pub fn start_client(pipe: &Path, uid: Option<u32>) -> Reaped {
    let mut command = Command::new(FAKE_MPS);
    command
        .arg("client")
        .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
        .stdout(Stdio::null());
    if let Some(uid) = uid {
        std::os::unix::process::CommandExt::uid(&mut command, uid);
        std::os::unix::process::CommandExt::gid(&mut command, uid);
    }
    Reaped(command.spawn().unwrap())
}

/// A child killed and reaped when the test lets go of it.
pub struct Reaped(pub Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A child whose stderr lines are kept (and passed on to the test's stderr).
pub struct Logged {
    /// The child.
    pub child: Reaped,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Logged {
    /// Starts `command` with its stderr kept.
    pub fn spawn(command: &mut Command) -> Self {
        let mut child = command.stderr(Stdio::piped()).spawn().unwrap();
        let stderr = child.stderr.take().unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let kept = Arc::clone(&lines);
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                eprintln!("{line}");
                kept.lock().unwrap().push(line);
            }
        });
        Self {
            child: Reaped(child),
            lines,
        }
    }

    /// The lines so far.
    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// Waits (at most 30 s) until a line contains `text`; returns it.
    pub fn wait_for(&self, text: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(line) = self.lines().into_iter().find(|l| l.contains(text)) {
                return line;
            }
            assert!(
                Instant::now() < deadline,
                "no line with {text:?} in: {:#?}",
                self.lines()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A node directory with the MPS roots, the daemons it saw started (killed at the end: they
/// outlive their parents).
pub struct MpsNode {
    /// The node's directories.
    pub dir: NodeDir,
    /// Daemon pids seen in control logs.
    pub daemons: Vec<i32>,
}

impl Drop for MpsNode {
    fn drop(&mut self) {
        for pid in &self.daemons {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(*pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

impl MpsNode {
    /// A node whose fake API holds `claims`, each with its pod running as root.
    pub fn new(claims: &[res::ResourceClaim]) -> Self {
        let users: Vec<(res::ResourceClaim, Option<i64>)> =
            claims.iter().map(|c| (c.clone(), Some(0))).collect();
        Self::with_users(&users)
    }

    /// A node whose fake API holds each claim with its pod, running as the user beside it.
    pub fn with_users(claims: &[(res::ResourceClaim, Option<i64>)]) -> Self {
        let only: Vec<res::ResourceClaim> = claims.iter().map(|(c, _)| c.clone()).collect();
        let dir = NodeDir::new(tempfile::tempdir().unwrap(), &only);
        let mut yaml = std::fs::read_to_string(dir.path("claims.yaml")).unwrap();
        for (claim, user) in claims {
            yaml.push_str("---\n");
            yaml.push_str(&serde_json::to_string(&share_pod(claim, *user)).unwrap());
            yaml.push('\n');
        }
        std::fs::write(dir.path("claims.yaml"), yaml).unwrap();
        Self {
            dir,
            daemons: Vec::new(),
        }
    }

    /// `name` in the node's directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path(name)
    }

    /// The plugin's command with `--enforcement mps`, daemons run by `daemons` (`local` or
    /// `host`), the fake control binary, and `args`.
    pub fn plugin_command(&self, daemons: &str, args: &[&str]) -> Command {
        let pipe_root = self.path("mps").display().to_string();
        let log_root = self.path("mps-log").display().to_string();
        let mut flags = vec![
            "--enforcement",
            "mps",
            "--mps-shm-namespace=false",
            "--mps-ready-seconds=20",
            "--mps-control-binary",
            FAKE_MPS,
            "--mps-pipe-dir-root",
            &pipe_root,
            "--mps-log-dir-root",
            &log_root,
        ];
        let daemons = format!("--mps-daemons={daemons}");
        flags.push(&daemons);
        flags.extend_from_slice(args);
        let mut command = self.dir.plugin_command(NODE, &[], &flags);
        command.env("RUST_LOG", "info");
        command
    }

    /// The plugin (see [`MpsNode::plugin_command`]).
    pub fn plugin(&self, daemons: &str) -> Plugin {
        Plugin(self.plugin_command(daemons, &[]).spawn().unwrap())
    }

    /// The node's `tessera-mps host` command on this node, with `launch` flags.
    pub fn host_command(&self, launch: &[&str]) -> Command {
        let mut command = Command::new(env!("CARGO_BIN_EXE_tessera-mps"));
        command
            .env("RUST_LOG", "info")
            .arg("host")
            .arg("--state-dir")
            .arg(self.path("plugin"))
            .arg("--boot-id-file")
            .arg(self.path("boot_id"))
            .args(launch)
            .arg("--interval-ms=50")
            .stdout(Stdio::null());
        command
    }

    /// The host with the fake control binary, its log kept.
    pub fn host(&self) -> Logged {
        Logged::spawn(&mut self.host_command(&[
            "--mps-shm-namespace=false",
            "--mps-control-binary",
            FAKE_MPS,
        ]))
    }

    /// A connection to the plugin once it serves.
    pub async fn connect(&self, plugin: &mut Plugin) -> Dra {
        let socket = self.path("plugin").join("dra.sock");
        let channel = super::dial_until_up(plugin, &socket, Duration::from_mins(1)).await;
        Dra::new(channel)
    }

    /// The daemons' directories under the pipe root.
    pub fn daemon_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = std::fs::read_dir(self.path("mps"))
            .map(|dir| {
                dir.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        ids.sort();
        ids
    }

    /// The one daemon's id.
    pub fn daemon_id(&self) -> String {
        let ids = self.daemon_ids();
        assert_eq!(ids.len(), 1, "{ids:?}");
        ids.into_iter().next().unwrap()
    }

    /// The one daemon's pipe directory.
    pub fn pipe(&self) -> PathBuf {
        self.pipe_of(&self.daemon_id())
    }

    /// Daemon `id`'s pipe directory.
    pub fn pipe_of(&self, id: &str) -> PathBuf {
        self.path("mps").join(id).join("pipe")
    }

    /// Daemon `id`'s control log (`control.log` of the fake).
    pub fn control_log_of(&self, id: &str) -> Vec<String> {
        let file = self.path("mps-log").join(id).join("control.log");
        std::fs::read_to_string(file)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// The one daemon's control log.
    pub fn control_log(&self) -> Vec<String> {
        self.control_log_of(&self.daemon_id())
    }

    /// How often the one daemon started.
    pub fn starts(&self) -> usize {
        self.control_log()
            .iter()
            .filter(|l| l.starts_with("start "))
            .count()
    }

    /// How often the one daemon was told to quit.
    pub fn quits(&self) -> usize {
        self.control_log()
            .iter()
            .filter(|l| *l == "command quit")
            .count()
    }

    /// Remembers every daemon's pid (from the control logs) so that it is killed at the end.
    pub fn remember_daemons(&mut self) {
        for id in self.daemon_ids() {
            for line in self.control_log_of(&id) {
                if let Some(pid) = line
                    .strip_prefix("start pid=")
                    .and_then(|r| r.split_whitespace().next())
                    .and_then(|p| p.parse().ok())
                    && !self.daemons.contains(&pid)
                {
                    self.daemons.push(pid);
                }
            }
        }
    }

    /// How many clients daemon `log_id` attached so far.
    pub fn attached(&self, log_id: &str) -> usize {
        self.control_log_of(log_id)
            .iter()
            .filter(|l| l.starts_with("client connected"))
            .count()
    }

    /// A CUDA process of the fake on the daemon of `pipe` (logging as `log_id`), attached until
    /// it is killed.
    pub fn client_of(&self, pipe: &Path, log_id: &str) -> Reaped {
        let before = self.attached(log_id);
        let child = start_client(pipe, None);
        self.wait_attached(log_id, before + 1);
        child
    }

    /// Waits (at most 20 s) until daemon `log_id` attached `count` clients.
    pub fn wait_attached(&self, log_id: &str, count: usize) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.attached(log_id) < count {
            assert!(
                Instant::now() < deadline,
                "daemon {log_id} attached fewer than {count} clients: {:?}",
                self.control_log_of(log_id)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A CUDA process of the fake on the one daemon.
    pub fn client(&self) -> Reaped {
        self.client_of(&self.pipe(), &self.daemon_id())
    }

    /// Waits (at most 30 s) until `done`.
    pub async fn wait_until(&self, what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !done() {
            assert!(Instant::now() < deadline, "timed out waiting until {what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A tenant that unlinked a daemon's `control` socket (the pipe directory is mounted read-write
/// into its container) and listens there itself on a `SOCK_SEQPACKET` socket, answering every
/// command as the daemon would to its own advantage; it keeps what it was sent. Stops when
/// dropped.
pub struct Impostor {
    received: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// What the impostor answers: a server (4242) that lists `victim` as its client, and "done" (an
/// empty answer) to `terminate_client` and `quit`.
fn impostor_answer(command: &str, victim: u32) -> String {
    match command.split_whitespace().next() {
        Some("get_server_list") => "4242\n".to_owned(),
        Some("get_client_list") => format!("{victim}\n"),
        _ => "\n".to_owned(),
    }
}

impl Impostor {
    /// Takes over the control socket in `pipe`, answering as if `victim` were a client.
    pub fn take_over(pipe: &Path, victim: u32) -> Self {
        let path = pipe.join("control");
        std::fs::remove_file(&path).unwrap();
        let listener = socket::listen_at(&path).unwrap();
        // accept(2) honours SO_RCVTIMEO: the thread looks at its stop flag every 50 ms.
        nix::sys::socket::setsockopt(
            &listener,
            nix::sys::socket::sockopt::ReceiveTimeout,
            &nix::sys::time::TimeVal::new(0, 50_000),
        )
        .unwrap();
        let received = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (received, stop) = (Arc::clone(&received), Arc::clone(&stop));
            std::thread::spawn(move || serve(&listener, &path, &received, &stop, victim))
        };
        Self {
            received,
            stop,
            thread: Some(thread),
        }
    }

    /// Every message it was sent.
    pub fn received(&self) -> Vec<String> {
        self.received.lock().unwrap().clone()
    }
}

fn serve(
    listener: &OwnedFd,
    path: &Path,
    received: &Mutex<Vec<String>>,
    stop: &AtomicBool,
    victim: u32,
) {
    while !stop.load(Ordering::Relaxed) {
        let Ok(conn) = socket::accept_on(listener, path) else {
            continue;
        };
        let _ = nix::sys::socket::setsockopt(
            &conn,
            nix::sys::socket::sockopt::ReceiveTimeout,
            &nix::sys::time::TimeVal::new(1, 0),
        );
        while let Ok(message) = socket::receive_message(&conn, path) {
            if message.is_empty() {
                break;
            }
            let command = String::from_utf8_lossy(&message).trim().to_owned();
            let answer = impostor_answer(&command, victim);
            received.lock().unwrap().push(command);
            if socket::send_message(&conn, answer.as_bytes(), path).is_err() {
                break;
            }
        }
    }
}

impl Drop for Impostor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
