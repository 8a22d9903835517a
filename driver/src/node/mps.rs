//! MPS control daemons as the kubelet plugin runs them: which daemons the recorded claims need,
//! the command line and environment of each, and how soon one that died is started again.
//!
//! The plugin runs `nvidia-cuda-mps-control -f` (foreground) as its own child rather than
//! `-d`: with `-d` the binary forks and the parent exits at once, so the plugin would have no
//! process to watch and would learn of a dead daemon only when a client failed. As a child the
//! daemon's exit is seen at the next check and it is restarted with backoff. It is stopped the
//! way NVIDIA documents, by writing `quit` to `nvidia-cuda-mps-control` run without arguments
//! against the same pipe directory.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::node::cdi::MpsDaemon;
use crate::node::checkpoint::Checkpoint;

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

/// A daemon the recorded claims need, with the claims that use it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WantedDaemon {
    /// The daemon.
    pub daemon: MpsDaemon,
    /// UIDs of the claims that use it.
    pub claims: BTreeSet<String>,
}

/// The daemons `record`'s claims need, by daemon id: what a restarted plugin starts again.
pub fn wanted_daemons(record: &Checkpoint) -> BTreeMap<String, WantedDaemon> {
    let mut out: BTreeMap<String, WantedDaemon> = BTreeMap::new();
    for (uid, entry) in &record.claims {
        if let Some(daemon) = &entry.mps_daemon {
            out.entry(daemon.id.clone())
                .or_insert_with(|| WantedDaemon {
                    daemon: daemon.clone(),
                    claims: BTreeSet::new(),
                })
                .claims
                .insert(uid.clone());
        }
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

/// The program and arguments that start `daemon` with the control binary `binary` in the
/// foreground. With `shm_namespace`, the daemon runs in a mount namespace of its own where its
/// shm directory is bind-mounted over `/dev/shm` (`unshare` and `mount` from util-linux, and
/// `CAP_SYS_ADMIN`), so it shares `/dev/shm` with its clients, whose containers get the same
/// directory there; the paths are passed as arguments, never spliced into the script.
pub fn daemon_command(
    binary: &str,
    daemon: &MpsDaemon,
    shm_namespace: bool,
) -> (String, Vec<String>) {
    if !shm_namespace {
        return (binary.to_owned(), vec![FOREGROUND_ARG.to_owned()]);
    }
    let args = [
        "--mount",
        "--propagation",
        "private",
        "--",
        "/bin/sh",
        "-c",
        "mount --bind \"$1\" /dev/shm && exec \"$2\" \"$3\"",
        "tessera-mps",
        &daemon.shm_dir,
        binary,
        FOREGROUND_ARG,
    ];
    (
        "unshare".to_owned(),
        args.iter().map(|a| (*a).to_owned()).collect(),
    )
}

/// The directories the plugin creates before starting the daemon.
pub fn daemon_dirs(daemon: &MpsDaemon) -> [&str; 3] {
    [&daemon.pipe_dir, &daemon.shm_dir, &daemon.log_dir]
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
    use crate::node::checkpoint::{ClaimEntry, PrepareState};

    fn daemon(uuids: &[&str]) -> MpsDaemon {
        let id = crate::node::cdi::mps_daemon_id(uuids);
        MpsDaemon {
            pipe_dir: format!("/run/tessera/mps/{id}/pipe"),
            shm_dir: format!("/run/tessera/mps/{id}/shm"),
            log_dir: format!("/var/log/tessera/mps/{id}"),
            id,
            devices: uuids.iter().map(|u| (*u).to_owned()).collect(),
        }
    }

    fn entry(daemon: Option<MpsDaemon>) -> ClaimEntry {
        ClaimEntry {
            namespace: "ns".to_owned(),
            name: "c".to_owned(),
            state: PrepareState::PrepareCompleted,
            devices: Vec::new(),
            host_dirs: Vec::new(),
            mps_daemon: daemon,
        }
    }

    #[test]
    fn claims_on_the_same_gpu_set_share_one_daemon() {
        let mut record = Checkpoint::new("b");
        record
            .claims
            .insert("a".to_owned(), entry(Some(daemon(&["GPU-1"]))));
        record
            .claims
            .insert("b".to_owned(), entry(Some(daemon(&["GPU-1"]))));
        record
            .claims
            .insert("c".to_owned(), entry(Some(daemon(&["GPU-1", "GPU-2"]))));
        record.claims.insert("whole".to_owned(), entry(None));
        let wanted = wanted_daemons(&record);
        assert_eq!(wanted.len(), 2);
        let one = &wanted[&crate::node::cdi::mps_daemon_id(["GPU-1"])];
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
    fn the_daemon_can_get_its_shm_directory_as_dev_shm() {
        let d = daemon(&["GPU-1"]);
        assert_eq!(
            daemon_command("nvidia-cuda-mps-control", &d, false),
            ("nvidia-cuda-mps-control".to_owned(), vec!["-f".to_owned()])
        );
        let (program, args) = daemon_command("/usr/bin/nvidia-cuda-mps-control", &d, true);
        assert_eq!(program, "unshare");
        assert_eq!(args[..4], ["--mount", "--propagation", "private", "--"]);
        assert_eq!(
            args[args.len() - 3..],
            [
                d.shm_dir.clone(),
                "/usr/bin/nvidia-cuda-mps-control".to_owned(),
                "-f".to_owned()
            ]
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
