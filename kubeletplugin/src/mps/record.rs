//! The daemon record on disk (`tessera_driver::node::mps_peer`): written by the supervisor that
//! starts a daemon, read by whoever is about to speak to it, so that nothing is sent on a
//! control socket a tenant took over.
//!
//! The record lies in the daemon's directory (`<pipeDirRoot>/<id>/daemon.json`), which the
//! node's `tessera-mps host` and the plugin both see at the same path and no container is given.
//! It is small and read as such: a regular file (never through a symbolic link) of at most
//! [`MAX_RECORD_BYTES`], checked before a byte is read; it is replaced by a rename, so a reader
//! sees the old record or the new one.

use std::io::{Read as _, Write as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use tessera_driver::node::mps::MpsDaemon;
use tessera_driver::node::mps::{self, ControlSocket};
use tessera_driver::node::mps_peer::{self, DaemonRecord};
use tracing::error;

use super::socket;
use crate::error::{Error, Result};

/// The largest daemon record read.
pub const MAX_RECORD_BYTES: u64 = 4096;

fn path_of(daemon: &MpsDaemon) -> PathBuf {
    PathBuf::from(mps_peer::record_path(daemon))
}

fn split(path: &Path) -> Result<(&Path, &str)> {
    match (path.parent(), path.file_name().and_then(|n| n.to_str())) {
        (Some(dir), Some(name)) => Ok((dir, name)),
        _ => Err(Error::Config(format!(
            "the MPS daemon record {} has no directory",
            path.display()
        ))),
    }
}

/// The record of the daemon that was just started as process `pid`: its start time from
/// `/proc`, and this process's uid (the child's, which it inherits).
pub fn of_child(daemon: &MpsDaemon, pid: u32) -> Result<DaemonRecord> {
    let stat = format!("/proc/{pid}/stat");
    let bytes = std::fs::read(&stat).map_err(|e| Error::io("reading", &stat, e))?;
    let start_ticks = mps_peer::stat_start_ticks(&bytes).ok_or_else(|| {
        Error::io(
            "parsing",
            &stat,
            std::io::Error::other("field 22 (starttime) is missing"),
        )
    })?;
    Ok(DaemonRecord {
        daemon_id: daemon.id.clone(),
        pid,
        uid: rustix::process::geteuid().as_raw(),
        start_ticks,
    })
}

/// Writes `record` for `daemon`: a temporary file beside it, renamed over it.
pub fn write(daemon: &MpsDaemon, record: &DaemonRecord) -> Result<()> {
    let path = path_of(daemon);
    let (dir, name) = split(&path)?;
    let bytes = serde_json::to_vec(record)
        .map_err(|e| Error::Mps(format!("encoding the record of daemon {}: {e}", daemon.id)))?;
    let temp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_file(&temp);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits().cast_signed())
        .open(&temp)
        .map_err(|e| Error::io("creating", &temp, e))?;
    file.write_all(&bytes)
        .map_err(|e| Error::io("writing", &temp, e))?;
    drop(file);
    std::fs::rename(&temp, &path).map_err(|e| Error::io("renaming into", &path, e))
}

/// The record of `daemon`; `None` when there is none. A record that is not a regular file of at
/// most [`MAX_RECORD_BYTES`] (a symbolic link included), or that does not decode, is an error
/// naming the file.
pub fn read(daemon: &MpsDaemon) -> Result<Option<DaemonRecord>> {
    let path = path_of(daemon);
    let bad = |message: String| Error::Input {
        path: path.clone(),
        message,
    };
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(
            (rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::NONBLOCK)
                .bits()
                .cast_signed(),
        )
        .open(&path)
    {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(rustix::io::Errno::LOOP.raw_os_error()) => {
            return Err(bad(
                "the MPS daemon record must be a regular file, and this is a symbolic link"
                    .to_owned(),
            ));
        }
        Err(e) => return Err(Error::io("opening", &path, e)),
    };
    let meta = file
        .metadata()
        .map_err(|e| Error::io("reading the type of", &path, e))?;
    if !meta.is_file() || meta.len() > MAX_RECORD_BYTES {
        return Err(bad(format!(
            "the MPS daemon record must be a regular file of at most {MAX_RECORD_BYTES} bytes"
        )));
    }
    let mut bytes = Vec::new();
    file.take(MAX_RECORD_BYTES)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::io("reading", &path, e))?;
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| bad(format!("the MPS daemon record does not decode: {e}")))
}

/// Removes the record of `daemon` (a daemon that was stopped); a missing one is fine.
pub fn remove(daemon: &MpsDaemon) -> Result<()> {
    let path = path_of(daemon);
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io("removing", &path, e)),
    }
}

/// Checks that the process listening on `daemon`'s control socket is the recorded daemon
/// before anything is sent to it: `Ok` only then. A mismatch is [`Error::MpsPeer`], logged here
/// at `error` with the daemon and socket (a tenant may have replaced the socket).
pub fn check(daemon: &MpsDaemon) -> Result<()> {
    let control = PathBuf::from(mps::control_socket(daemon));
    let peer = socket::peer(&control)?;
    let record = read(daemon)?;
    mps_peer::check_peer(&daemon.id, record.as_ref(), &peer).map_err(|mismatch| {
        error!(daemon = %daemon.id, socket = %control.display(), peer_pid = peer.pid, peer_uid = peer.uid, reason = %mismatch, "the MPS control socket is not answered by its daemon; nothing is sent to it");
        Error::MpsPeer {
            daemon: daemon.id.clone(),
            socket: control,
            mismatch,
        }
    })
}

/// What connecting to `daemon`'s control socket finds, where a socket that answers counts only
/// when the recorded daemon answers it: [`ControlSocket::Answers`] then, and an error when
/// someone else does.
pub fn probe_checked(daemon: &MpsDaemon) -> Result<ControlSocket> {
    match socket::probe(Path::new(&mps::control_socket(daemon))) {
        ControlSocket::Answers => check(daemon).map(|()| ControlSocket::Answers),
        other => Ok(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn daemon(dir: &Path) -> MpsDaemon {
        let base = dir.join("mps-test");
        std::fs::create_dir_all(base.join("pipe")).unwrap();
        MpsDaemon {
            id: "mps-test".to_owned(),
            devices: vec!["GPU-1".to_owned()],
            pipe_dir: base.join("pipe").display().to_string(),
            shm_dir: base.join("shm").display().to_string(),
            log_dir: dir.join("log").display().to_string(),
            user: None,
        }
    }

    #[test]
    fn a_record_is_written_beside_the_pipe_directory_read_back_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let d = daemon(dir.path());
        assert_eq!(read(&d).unwrap(), None);
        let me = of_child(&d, std::process::id()).unwrap();
        write(&d, &me).unwrap();
        assert!(dir.path().join("mps-test/daemon.json").is_file());
        assert_eq!(read(&d).unwrap(), Some(me));
        remove(&d).unwrap();
        assert_eq!(read(&d).unwrap(), None);
    }

    #[test]
    fn the_recorded_listener_passes_the_check_and_a_stranger_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let d = daemon(dir.path());
        let control = PathBuf::from(mps::control_socket(&d));
        let _listener = socket::listen_at(&control).unwrap();
        assert!(matches!(
            check(&d),
            Err(Error::MpsPeer {
                mismatch: mps_peer::PeerMismatch::NoRecord,
                ..
            })
        ));
        let mut me = of_child(&d, std::process::id()).unwrap();
        write(&d, &me).unwrap();
        check(&d).unwrap();
        assert_eq!(probe_checked(&d).unwrap(), ControlSocket::Answers);
        me.pid += 1;
        write(&d, &me).unwrap();
        let err = probe_checked(&d).unwrap_err().to_string();
        assert!(err.contains("not the daemon"), "{err}");
        assert!(err.contains("nothing was sent"), "{err}");
    }

    #[test]
    fn a_record_that_is_a_link_or_a_device_is_refused_before_it_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let d = daemon(dir.path());
        let record = dir.path().join("mps-test/daemon.json");
        std::os::unix::fs::symlink("/dev/zero", &record).unwrap();
        let err = read(&d).unwrap_err().to_string();
        assert!(err.contains("this is a symbolic link"), "{err}");
        std::fs::remove_file(&record).unwrap();
        rustix::fs::mkfifoat(rustix::fs::CWD, &record, rustix::fs::Mode::RUSR).unwrap();
        let err = read(&d).unwrap_err().to_string();
        assert!(
            err.contains("must be a regular file of at most 4096 bytes"),
            "{err}"
        );
    }
}
