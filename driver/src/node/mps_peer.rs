//! Who answers on an MPS control socket: the daemon a supervisor started, or someone else.
//!
//! The daemon's pipe directory is bound read-write into every share container of its GPU set,
//! so a tenant can unlink `control` and listen there itself (`SOCK_SEQPACKET`, as the daemon
//! does). Whoever then answers the adoption probe, `quit`, `get_server_list` or
//! `terminate_client` would be that tenant, and could answer "done" to its own termination.
//! So nothing is sent on the socket until the process at the other end is known to be the
//! daemon:
//!
//! * the supervisor that starts a daemon (the node's `tessera-mps host`, or the plugin with
//!   `--mps-daemons local`) writes a [`DaemonRecord`] beside the pipe directory, in the
//!   daemon's own directory that no container is given ([`record_path`]): its pid, the uid it
//!   runs as and its start time;
//! * before a command, the caller connects and asks the kernel for the peer's credentials
//!   (`SO_PEERCRED`: the process that listens, and its uid), reads that process's start time,
//!   and [`check_peer`] says whether it is the recorded daemon. The start time tells a pid the
//!   kernel gave to another process after the daemon died from the daemon itself.
//!
//! A mismatch is an error for that GPU set: it is logged and nothing is sent.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::node::mps::MpsDaemon;

/// The file, in the daemon's directory, that records the running daemon.
pub const RECORD_FILE: &str = "daemon.json";

/// What a supervisor knows about a daemon it started, so that it, a later supervisor and the
/// plugin can tell the daemon from anyone else listening on its socket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DaemonRecord {
    /// The daemon's id ([`MpsDaemon::id`]).
    pub daemon_id: String,
    /// The daemon's process id, in the host's PID namespace.
    pub pid: u32,
    /// The uid the daemon runs as (0 on a node; the supervisor's own).
    pub uid: u32,
    /// When the daemon started, in clock ticks since boot (`/proc/<pid>/stat`, field 22).
    pub start_ticks: u64,
}

/// The process at the other end of a unix socket, as the kernel and `/proc` tell it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketPeer {
    /// Its process id (`SO_PEERCRED`), in the reader's PID namespace.
    pub pid: u32,
    /// Its uid (`SO_PEERCRED`).
    pub uid: u32,
    /// Its start time (`/proc/<pid>/stat`); `None` when the process is gone or unreadable.
    pub start_ticks: Option<u64>,
}

/// Why the peer of a control socket is not the daemon.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerMismatch {
    /// No supervisor recorded a daemon for this GPU set: whoever listens was not started by
    /// Tessera (or by a version that wrote no record).
    NoRecord,
    /// The record is another daemon's.
    OtherDaemon {
        /// The id the record names.
        recorded: String,
    },
    /// Another process listens on the socket.
    OtherProcess {
        /// The daemon's recorded pid.
        expected: u32,
        /// The listening process.
        found: u32,
        /// Its uid.
        uid: u32,
    },
    /// The recorded process listens, but as another user.
    OtherUser {
        /// The recorded uid.
        expected: u32,
        /// The peer's uid.
        found: u32,
    },
    /// The pid is the recorded one, but the process started at another time: the daemon died
    /// and the pid now names another process.
    Restarted {
        /// The pid.
        pid: u32,
    },
}

impl fmt::Display for PeerMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoRecord => write!(
                f,
                "no daemon record: nothing Tessera started is known to listen there (a daemon \
                 started by a tessera-mps host older than this plugin writes none; restart \
                 that host)"
            ),
            Self::OtherDaemon { recorded } => {
                write!(f, "the daemon record is that of daemon {recorded:?}")
            }
            Self::OtherProcess {
                expected,
                found,
                uid,
            } => write!(
                f,
                "process {found} (uid {uid}) listens there, not the daemon (pid {expected}): \
                 the socket was replaced, most likely from a container the pipe directory is \
                 mounted into"
            ),
            Self::OtherUser { expected, found } => write!(
                f,
                "the listening process runs as uid {found}, the daemon was started as uid \
                 {expected}"
            ),
            Self::Restarted { pid } => write!(
                f,
                "pid {pid} is not the daemon any more (it started at another time): the daemon \
                 died and its pid was reused"
            ),
        }
    }
}

impl std::error::Error for PeerMismatch {}

/// Whether `peer` is the daemon `daemon_id` that `record` describes. `Ok` only when the record
/// is the daemon's, and the peer has its pid, its uid and its start time.
pub fn check_peer(
    daemon_id: &str,
    record: Option<&DaemonRecord>,
    peer: &SocketPeer,
) -> Result<(), PeerMismatch> {
    let record = record.ok_or(PeerMismatch::NoRecord)?;
    if record.daemon_id != daemon_id {
        return Err(PeerMismatch::OtherDaemon {
            recorded: record.daemon_id.clone(),
        });
    }
    if peer.pid != record.pid {
        return Err(PeerMismatch::OtherProcess {
            expected: record.pid,
            found: peer.pid,
            uid: peer.uid,
        });
    }
    if peer.uid != record.uid {
        return Err(PeerMismatch::OtherUser {
            expected: record.uid,
            found: peer.uid,
        });
    }
    if peer.start_ticks != Some(record.start_ticks) {
        return Err(PeerMismatch::Restarted { pid: peer.pid });
    }
    Ok(())
}

/// Where the record of `daemon` lives: beside its pipe directory, in the daemon's own
/// directory (`<pipeDirRoot>/<id>/daemon.json`). Containers get the pipe and shm directories
/// below it, never the directory itself, so no tenant can write the record.
pub fn record_path(daemon: &MpsDaemon) -> String {
    let pipe = daemon.pipe_dir.trim_end_matches('/');
    let parent = match pipe.rsplit_once('/') {
        Some(("", _)) | None => "",
        Some((parent, _)) => parent,
    };
    format!("{parent}/{RECORD_FILE}")
}

/// Field 22 of a `/proc/<pid>/stat` line (the start time in clock ticks since boot). The
/// command (field 2) is in parentheses and may hold spaces, parentheses and bytes that are not
/// UTF-8, so the fields are counted after the last `)`. `None` when the line is not one.
pub fn stat_start_ticks(stat: &[u8]) -> Option<u64> {
    let close = stat.iter().rposition(|&b| b == b')')?;
    let rest = std::str::from_utf8(stat.get(close + 1..)?).ok()?;
    // `rest` starts with field 3 (the state): field 22 is the 20th of it.
    rest.split_whitespace().nth(19)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::mps_daemon;

    fn record() -> DaemonRecord {
        DaemonRecord {
            daemon_id: "mps-1".to_owned(),
            pid: 4242,
            uid: 0,
            start_ticks: 987_654,
        }
    }

    fn peer(pid: u32, uid: u32, start_ticks: Option<u64>) -> SocketPeer {
        SocketPeer {
            pid,
            uid,
            start_ticks,
        }
    }

    #[test]
    fn the_recorded_daemon_is_the_peer_when_pid_uid_and_start_time_agree() {
        assert_eq!(
            check_peer("mps-1", Some(&record()), &peer(4242, 0, Some(987_654))),
            Ok(())
        );
    }

    #[test]
    fn a_tenant_listening_on_the_socket_is_not_the_daemon_even_as_root() {
        let err = check_peer("mps-1", Some(&record()), &peer(777, 0, Some(5))).unwrap_err();
        assert_eq!(
            err,
            PeerMismatch::OtherProcess {
                expected: 4242,
                found: 777,
                uid: 0
            }
        );
        assert!(err.to_string().contains("process 777 (uid 0)"), "{err}");
    }

    #[test]
    fn a_reused_pid_or_another_user_is_not_the_daemon() {
        assert_eq!(
            check_peer("mps-1", Some(&record()), &peer(4242, 0, Some(1))),
            Err(PeerMismatch::Restarted { pid: 4242 })
        );
        assert_eq!(
            check_peer("mps-1", Some(&record()), &peer(4242, 0, None)),
            Err(PeerMismatch::Restarted { pid: 4242 })
        );
        assert_eq!(
            check_peer("mps-1", Some(&record()), &peer(4242, 1000, Some(987_654))),
            Err(PeerMismatch::OtherUser {
                expected: 0,
                found: 1000
            })
        );
    }

    #[test]
    fn without_a_record_of_this_daemon_nobody_is_the_daemon() {
        let p = peer(4242, 0, Some(987_654));
        assert_eq!(check_peer("mps-1", None, &p), Err(PeerMismatch::NoRecord));
        assert_eq!(
            check_peer("mps-2", Some(&record()), &p),
            Err(PeerMismatch::OtherDaemon {
                recorded: "mps-1".to_owned()
            })
        );
    }

    #[test]
    fn the_record_lies_in_the_daemons_directory_beside_its_pipe_directory() {
        let d = mps_daemon(&["GPU-1"]);
        assert_eq!(
            record_path(&d),
            format!("/run/tessera/mps/{}/daemon.json", d.id)
        );
        assert!(!record_path(&d).starts_with(&d.pipe_dir));
        assert!(!record_path(&d).starts_with(&d.shm_dir));
    }

    #[test]
    fn the_start_time_is_counted_after_the_last_parenthesis_whatever_the_name() {
        let stat = b"4242 (a (we\xffird) name) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 \
                     1 0 987654 1000000 200 18446744073709551615";
        assert_eq!(stat_start_ticks(stat), Some(987_654));
        assert_eq!(stat_start_ticks(b"4242 (short) S 1 2"), None);
        assert_eq!(stat_start_ticks(b"no parenthesis"), None);
    }
}
