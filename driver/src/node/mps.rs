//! MPS control daemons as the kubelet plugin runs them: what a daemon is ([`MpsDaemon`], named
//! by its device set: [`mps_daemon_id`]), which daemons the recorded claims need, the command
//! line and environment of each, and how soon one that died is started again. `cdi` renders a
//! claim's daemon into its spec, the checkpoint records it, `accounting` asks it for its
//! clients; none of them is imported here.
//!
//! A supervisor (the plugin itself, or the node's `tessera-mps host`) runs
//! `nvidia-cuda-mps-control -f` (foreground) as its own child rather than `-d`: with `-d` the
//! binary forks and the parent exits at once, so there would be no process to watch and a dead
//! daemon would be learned of only when a client failed. As a child the daemon's exit is seen
//! at the next check and it is restarted with backoff. It is stopped the way NVIDIA documents,
//! by writing `quit` to `nvidia-cuda-mps-control` run without arguments against the same pipe
//! directory, and only once no claim uses it.
//!
//! A supervisor that starts finds the daemons an earlier run left by connecting to their
//! control sockets (`SOCK_SEQPACKET`, as the real daemon's is): one that answers is adopted
//! with its clients ([`start_action`]).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::node::host_dir::{CONTAINER_DIR_MODE, HostDir, NODE_DIR_MODE};

/// The argument that keeps the control daemon in the foreground.
pub const FOREGROUND_ARG: &str = "-f";
/// What is written to the control binary's stdin to stop a daemon.
pub const QUIT_COMMAND: &str = "quit\n";
/// The socket the control daemon creates in its pipe directory once it accepts clients.
pub const CONTROL_SOCKET: &str = "control";
/// The first delay before a daemon that died is started again.
pub const FIRST_RESTART_DELAY: Duration = Duration::from_secs(1);
/// The longest delay before a daemon that died is started again.
pub const MAX_RESTART_DELAY: Duration = Duration::from_mins(1);

/// An MPS control daemon serving one set of CUDA devices (for one Unix user).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MpsDaemon {
    /// [`mps_daemon_id`] of `devices`, with `-u<uid>` when the daemon serves one user
    /// ([`mps_user_daemon_id`]).
    pub id: String,
    /// The devices' UUIDs in the order the daemon must list them in `CUDA_VISIBLE_DEVICES`:
    /// clients number devices in this order, and the spec's per-device limits use it.
    pub devices: Vec<String>,
    /// Host pipe directory (`CUDA_MPS_PIPE_DIRECTORY` of the daemon).
    pub pipe_dir: String,
    /// Host directory the daemon and its clients share as `/dev/shm`: a plain directory beside
    /// the pipe directory that the plugin creates ([`daemon_dirs`]); nothing
    /// mounts a filesystem on it. The claim's containers get it bound over `/dev/shm` by the
    /// CDI spec, and the daemon by the `tessera-mps exec` wrapper in its own mount namespace
    /// ([`crate::node::mps_exec`]); a daemon started without the wrapper keeps its own
    /// `/dev/shm`.
    pub shm_dir: String,
    /// Host log directory (`CUDA_MPS_LOG_DIRECTORY` of the daemon).
    pub log_dir: String,
    /// The Unix user whose clients the daemon serves (`crate::node::mps_user`): an MPS daemon
    /// runs a server for one user at a time. `None`: any user (a node with `--mps-users single`,
    /// and daemons recorded before daemons were per user).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<u32>,
}

/// The id of the MPS daemon serving a set of CUDA device UUIDs: `mps-` and 32 hex digits of a
/// name-based (v5) UUID of the sorted, de-duplicated set. The same set always gives the same id
/// (whatever the order), and the id is a valid directory name.
pub fn mps_daemon_id<I, S>(uuids: I) -> String
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    let mut set: Vec<String> = uuids.into_iter().map(|u| u.as_ref().to_owned()).collect();
    set.sort();
    set.dedup();
    let namespace = uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_DNS, b"mps.gpu.tessera.dev");
    let id = uuid::Uuid::new_v5(&namespace, set.join(",").as_bytes());
    format!("mps-{}", id.simple())
}

/// The id of the daemon serving the set `uuids` for `user`: [`mps_daemon_id`], followed by
/// `-u<uid>` when the daemon serves one user.
pub fn mps_user_daemon_id<I, S>(uuids: I, user: Option<u32>) -> String
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    let id = mps_daemon_id(uuids);
    match user {
        Some(uid) => format!("{id}-u{uid}"),
        None => id,
    }
}

/// A daemon the recorded claims need, with the claims that use it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WantedDaemon {
    /// The daemon.
    pub daemon: MpsDaemon,
    /// UIDs of the claims that use it.
    pub claims: BTreeSet<String>,
}

/// The daemons the recorded claims need, by daemon id: what a restarted plugin starts again.
/// `claims` is each recorded claim that has a daemon, as (claim UID, its daemon)
/// (`Checkpoint::mps_daemons`).
pub fn wanted_daemons<'a>(
    claims: impl IntoIterator<Item = (&'a str, &'a MpsDaemon)>,
) -> BTreeMap<String, WantedDaemon> {
    let mut out: BTreeMap<String, WantedDaemon> = BTreeMap::new();
    for (uid, daemon) in claims {
        out.entry(daemon.id.clone())
            .or_insert_with(|| WantedDaemon {
                daemon: daemon.clone(),
                claims: BTreeSet::new(),
            })
            .claims
            .insert(uid.to_owned());
    }
    out
}

/// The environment of the daemon (and of the `quit` command, which must find the same
/// pipe directory): its devices in order, its pipe and log directories.
pub fn daemon_env(daemon: &MpsDaemon) -> Vec<(String, String)> {
    vec![
        ("CUDA_VISIBLE_DEVICES".to_owned(), daemon.devices.join(",")),
        (
            "CUDA_MPS_PIPE_DIRECTORY".to_owned(),
            daemon.pipe_dir.clone(),
        ),
        ("CUDA_MPS_LOG_DIRECTORY".to_owned(), daemon.log_dir.clone()),
    ]
}

/// How daemons are launched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// The `nvidia-cuda-mps-control` binary, as the daemon sees it (inside the driver root when
    /// the wrapper changes root into it).
    pub control_binary: String,
    /// The `tessera-mps exec` wrapper, or `None` to run the control binary directly (then its
    /// environment must already hold the driver's files, and the daemon shares the caller's
    /// `/dev/shm`).
    pub wrapper: Option<Wrapper>,
}

/// The `tessera-mps exec` wrapper: it gives the daemon (and each control command) a private
/// mount namespace with the daemon's shm directory over `/dev/shm`, and with a driver root
/// other than `/` changes root into it ([`crate::node::mps_exec::plan`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wrapper {
    /// The wrapper binary.
    pub program: String,
    /// Where the host's driver root is, as the wrapper sees it (`/` for its own root).
    pub driver_root: String,
}

/// The subcommand of the wrapper binary that runs a program in the daemon's mount namespace.
pub const EXEC_SUBCOMMAND: &str = "exec";

fn wrapped(
    wrapper: &Wrapper,
    shm_dir: Option<&str>,
    binds: &[&str],
    program: &str,
    args: &[&str],
) -> (String, Vec<String>) {
    let mut out = vec![
        EXEC_SUBCOMMAND.to_owned(),
        "--root".to_owned(),
        wrapper.driver_root.clone(),
    ];
    if let Some(shm) = shm_dir {
        out.extend(["--shm-dir".to_owned(), shm.to_owned()]);
    }
    for dir in binds {
        out.extend(["--bind".to_owned(), (*dir).to_owned()]);
    }
    out.push("--".to_owned());
    out.push(program.to_owned());
    out.extend(args.iter().map(|a| (*a).to_owned()));
    (wrapper.program.clone(), out)
}

/// The program and arguments that start `daemon` in the foreground: the control binary with
/// `-f`, through the wrapper when there is one (its shm directory over `/dev/shm`, its pipe and
/// log directories at their own paths inside the driver root). Paths are passed as separate
/// arguments, never spliced into a shell line.
pub fn daemon_command(launch: &Launch, daemon: &MpsDaemon) -> (String, Vec<String>) {
    match &launch.wrapper {
        None => (
            launch.control_binary.clone(),
            vec![FOREGROUND_ARG.to_owned()],
        ),
        Some(wrapper) => wrapped(
            wrapper,
            Some(&daemon.shm_dir),
            &[&daemon.pipe_dir, &daemon.log_dir],
            &launch.control_binary,
            &[FOREGROUND_ARG],
        ),
    }
}

/// The program and arguments of a control command (`quit`, `get_server_list`, ...) to
/// `daemon`, written to its stdin: the control binary without arguments, through the wrapper
/// when there is one (so it finds the same pipe directory and the driver's libraries).
pub fn control_command(launch: &Launch, daemon: &MpsDaemon) -> (String, Vec<String>) {
    match &launch.wrapper {
        None => (launch.control_binary.clone(), Vec::new()),
        Some(wrapper) => wrapped(
            wrapper,
            None,
            &[&daemon.pipe_dir],
            &launch.control_binary,
            &[],
        ),
    }
}

/// What connecting to a daemon's control socket found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlSocket {
    /// No socket file: no daemon ever ran on this pipe directory (or it quit cleanly).
    Missing,
    /// A socket file nobody accepts on: the daemon died and left it behind.
    Refused,
    /// A daemon accepted the connection (on a `SOCK_SEQPACKET` socket, as the real one is).
    Answers,
}

/// What to do for a daemon a claim needs that this process does not run yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartAction {
    /// A daemon (started by an earlier run, or by another process) answers: keep it, with
    /// its clients, and never tell it to quit while a claim uses it.
    Adopt,
    /// Nothing answers: remove a dead daemon's socket (when `remove_stale`), then start one.
    Start {
        /// Whether a dead daemon's socket file is in the way.
        remove_stale: bool,
    },
}

/// Adopt a daemon that answers; start one otherwise. A daemon that answers is never stopped
/// here: it may serve running containers, and `quit` would wait for them.
pub fn start_action(socket: ControlSocket) -> StartAction {
    match socket {
        ControlSocket::Answers => StartAction::Adopt,
        ControlSocket::Refused => StartAction::Start { remove_stale: true },
        ControlSocket::Missing => StartAction::Start {
            remove_stale: false,
        },
    }
}

/// What a daemon host does to follow the checkpoint: the claims whose daemon it must make
/// sure of, and the claims it supervises that the checkpoint no longer records (released: a
/// daemon is stopped when its last claim is).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reconcile {
    /// (claim UID, its daemon) for every recorded claim with a daemon.
    pub ensure: Vec<(String, MpsDaemon)>,
    /// Claims supervised now that the checkpoint does not record.
    pub release: Vec<String>,
}

/// The daemon host's step: every recorded claim with a daemon (`claims`, as (claim UID, its
/// daemon): `Checkpoint::mps_daemons`) is ensured (idempotent), every supervised claim no
/// longer recorded is released.
pub fn reconcile<'a>(
    claims: impl IntoIterator<Item = (&'a str, &'a MpsDaemon)>,
    supervised: &BTreeSet<String>,
) -> Reconcile {
    let ensure: Vec<(String, MpsDaemon)> = claims
        .into_iter()
        .map(|(uid, d)| (uid.to_owned(), d.clone()))
        .collect();
    let release = supervised
        .iter()
        .filter(|uid| !ensure.iter().any(|(u, _)| u == *uid))
        .cloned()
        .collect();
    Reconcile { ensure, release }
}

/// The directories the supervisor creates before starting the daemon, each after the one it
/// lies in, with the mode and owner each gets:
///
/// * `<pipe dir root>/<id>`, the node's (`0755`; no container sees it, so the daemon's record
///   there is out of every tenant's reach);
/// * the pipe and shm directories side by side in it, mounted into the claims' containers:
///   `root:root` with mode `1777`, as `/tmp`, because the MPS server a daemon starts for a user
///   other than root creates its files there, as do its clients, and the sticky bit keeps anyone
///   but root from removing the root daemon's `control` socket;
/// * the log directory `<log dir root>/<id>`, which no container sees: `0755`, belonging to the
///   daemon's user (the node's when it serves root or any user).
///
/// Each keeps its root, down from which it is created through handles that never follow a link
/// (a daemon recorded with another layout gets its parent as root).
pub fn daemon_dirs(daemon: &MpsDaemon) -> Vec<HostDir> {
    let id = daemon.id.as_str();
    let below = |path: &str, relative: &str, mode: u32| -> HostDir {
        let root = path
            .strip_suffix(relative)
            .and_then(|r| r.strip_suffix('/'))
            .filter(|r| !r.is_empty());
        if let Some(root) = root {
            HostDir::at(root, relative, mode)
        } else {
            let (parent, name) = path.rsplit_once('/').unwrap_or(("", path));
            HostDir::at(if parent.is_empty() { "/" } else { parent }, name, mode)
        }
    };
    let pipe = below(&daemon.pipe_dir, &format!("{id}/pipe"), CONTAINER_DIR_MODE);
    let mut dirs = Vec::new();
    if pipe.segments().len() == 2 {
        dirs.push(HostDir::node(&pipe.root, id));
    }
    dirs.push(pipe);
    dirs.push(below(
        &daemon.shm_dir,
        &format!("{id}/shm"),
        CONTAINER_DIR_MODE,
    ));
    dirs.push(
        below(&daemon.log_dir, id, NODE_DIR_MODE).owned_by(daemon.user.filter(|&uid| uid != 0)),
    );
    dirs
}

/// The daemon's control socket path.
pub fn control_socket(daemon: &MpsDaemon) -> String {
    format!("{}/{CONTROL_SOCKET}", daemon.pipe_dir)
}

/// How long to wait before starting a daemon that died for the `failures`-th time in a row
/// (1 is the first): 1 s, doubling, at most 60 s.
pub fn restart_delay(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    FIRST_RESTART_DELAY
        .saturating_mul(1 << doublings)
        .min(MAX_RESTART_DELAY)
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::node::checkpoint::{Checkpoint, ClaimEntry, PrepareState};
    use crate::testing::mps_daemon as daemon;

    /// A record of the claims `uid → GPU set`, each with the daemon of its set (none for an
    /// empty set: a claim of whole GPUs).
    fn record(claims: &[(&str, &[&str])]) -> Checkpoint {
        let mut record = Checkpoint::new("b");
        for (uid, gpus) in claims {
            let entry = ClaimEntry {
                namespace: "ns".to_owned(),
                name: "c".to_owned(),
                state: PrepareState::PrepareCompleted,
                devices: Vec::new(),
                host_dirs: Vec::new(),
                mps_daemon: (!gpus.is_empty()).then(|| daemon(gpus)),
            };
            record.claims.insert((*uid).to_owned(), entry);
        }
        record
    }

    #[test]
    fn a_daemons_directories_are_made_from_their_roots_down_the_shared_ones_side_by_side() {
        let d = daemon(&["GPU-a"]);
        let dirs = daemon_dirs(&d);
        let shown: Vec<(&str, Vec<&str>)> = dirs
            .iter()
            .map(|h| (h.root.as_str(), h.segments()))
            .collect();
        assert_eq!(
            shown,
            [
                ("/run/tessera/mps", vec![d.id.as_str()]),
                ("/run/tessera/mps", vec![d.id.as_str(), "pipe"]),
                ("/run/tessera/mps", vec![d.id.as_str(), "shm"]),
                ("/var/log/tessera/mps", vec![d.id.as_str()]),
            ]
        );
        assert_eq!(dirs[1].path, d.pipe_dir);
        assert_eq!(dirs[2].path, d.shm_dir);
        assert_eq!(dirs[3].path, d.log_dir);
        // A daemon recorded with another layout is made below its parent.
        let odd = MpsDaemon {
            pipe_dir: "/srv/pipe-x".into(),
            ..d
        };
        assert_eq!(daemon_dirs(&odd)[0].root, "/srv");
        assert_eq!(daemon_dirs(&odd)[0].segments(), ["pipe-x"]);
    }

    #[test]
    fn a_users_daemon_shares_its_pipe_and_shm_with_the_sticky_bit_and_owns_its_logs() {
        let mut d = daemon(&["GPU-1"]);
        d.user = Some(1000);
        let dirs = daemon_dirs(&d);
        let shown: Vec<(&str, u32, Option<u32>)> = dirs
            .iter()
            .map(|h| (h.path.as_str(), h.mode, h.owner))
            .collect();
        let base = d.pipe_dir.trim_end_matches("/pipe");
        assert_eq!(
            shown,
            [
                (base, 0o755, None),
                (d.pipe_dir.as_str(), 0o1777, None),
                (d.shm_dir.as_str(), 0o1777, None),
                (d.log_dir.as_str(), 0o755, Some(1000)),
            ]
        );
        d.user = Some(0);
        assert_eq!(daemon_dirs(&d)[3].owner, None);
    }

    #[test]
    fn daemon_id_is_stable_and_order_free() {
        let a = mps_daemon_id(["GPU-b", "GPU-a"]);
        assert_eq!(a, mps_daemon_id(["GPU-a", "GPU-b", "GPU-a"]));
        assert_ne!(a, mps_daemon_id(["GPU-a"]));
        assert_eq!(a.len(), 36);
        assert!(a.starts_with("mps-"));
        assert!(a[4..].chars().all(|c| c.is_ascii_hexdigit()));
        // Pinned: daemons started by an older plugin must be found again after an upgrade.
        assert_eq!(
            mps_daemon_id(["GPU-8a0c4f7e-6f41-4b9e-9c51-1d2e3f405060"]),
            "mps-a055420bcd0a5a6e81a7c0047733ef26"
        );
    }

    #[test]
    fn claims_on_the_same_gpu_set_share_one_daemon() {
        let record = record(&[
            ("a", &["GPU-1"]),
            ("b", &["GPU-1"]),
            ("c", &["GPU-1", "GPU-2"]),
            ("whole", &[]),
        ]);
        let wanted = wanted_daemons(record.mps_daemons());
        assert_eq!(wanted.len(), 2);
        let one = &wanted[&mps_daemon_id(["GPU-1"])];
        assert_eq!(one.claims, BTreeSet::from(["a".to_owned(), "b".to_owned()]));
    }

    #[test]
    fn the_daemon_sees_its_devices_in_order_and_its_directories() {
        let d = daemon(&["GPU-2", "GPU-1"]);
        let env = daemon_env(&d);
        assert_eq!(
            env[0],
            ("CUDA_VISIBLE_DEVICES".to_owned(), "GPU-2,GPU-1".to_owned())
        );
        assert_eq!(env[1].1, d.pipe_dir);
        assert_eq!(env[2].1, d.log_dir);
        assert_eq!(control_socket(&d), format!("{}/control", d.pipe_dir));
    }

    #[test]
    fn the_daemon_runs_through_the_wrapper_with_its_directories_as_arguments() {
        let d = daemon(&["GPU-1"]);
        let direct = Launch {
            control_binary: "nvidia-cuda-mps-control".to_owned(),
            wrapper: None,
        };
        assert_eq!(
            daemon_command(&direct, &d),
            ("nvidia-cuda-mps-control".to_owned(), vec!["-f".to_owned()])
        );
        assert_eq!(
            control_command(&direct, &d),
            ("nvidia-cuda-mps-control".to_owned(), Vec::new())
        );
        let launch = Launch {
            control_binary: "/usr/bin/nvidia-cuda-mps-control".to_owned(),
            wrapper: Some(Wrapper {
                program: "/usr/local/bin/tessera-mps".to_owned(),
                driver_root: "/driver-root".to_owned(),
            }),
        };
        let (program, args) = daemon_command(&launch, &d);
        assert_eq!(program, "/usr/local/bin/tessera-mps");
        assert_eq!(
            args,
            [
                "exec",
                "--root",
                "/driver-root",
                "--shm-dir",
                &d.shm_dir,
                "--bind",
                &d.pipe_dir,
                "--bind",
                &d.log_dir,
                "--",
                "/usr/bin/nvidia-cuda-mps-control",
                "-f"
            ]
        );
        let (_, args) = control_command(&launch, &d);
        assert_eq!(
            args,
            [
                "exec",
                "--root",
                "/driver-root",
                "--bind",
                &d.pipe_dir,
                "--",
                "/usr/bin/nvidia-cuda-mps-control"
            ]
        );
    }

    #[test]
    fn a_daemon_that_answers_is_adopted_and_a_dead_ones_socket_is_cleared() {
        assert_eq!(start_action(ControlSocket::Answers), StartAction::Adopt);
        assert_eq!(
            start_action(ControlSocket::Refused),
            StartAction::Start { remove_stale: true }
        );
        assert_eq!(
            start_action(ControlSocket::Missing),
            StartAction::Start {
                remove_stale: false
            }
        );
    }

    #[test]
    fn the_host_ensures_recorded_claims_and_releases_the_rest() {
        let record = record(&[("a", &["GPU-1"]), ("whole", &[])]);
        let supervised = BTreeSet::from(["a".to_owned(), "gone".to_owned()]);
        let step = reconcile(record.mps_daemons(), &supervised);
        assert_eq!(
            step.ensure
                .iter()
                .map(|(u, _)| u.as_str())
                .collect::<Vec<_>>(),
            ["a"]
        );
        assert_eq!(step.release, ["gone"]);
        assert_eq!(
            reconcile(Checkpoint::new("b").mps_daemons(), &BTreeSet::new()),
            Reconcile::default()
        );
    }

    #[test]
    fn restarts_back_off_from_one_second_to_a_minute() {
        assert_eq!(restart_delay(1), Duration::from_secs(1));
        assert_eq!(restart_delay(2), Duration::from_secs(2));
        assert_eq!(restart_delay(4), Duration::from_secs(8));
        assert_eq!(restart_delay(7), Duration::from_mins(1));
        assert_eq!(restart_delay(u32::MAX), Duration::from_mins(1));
    }
}
