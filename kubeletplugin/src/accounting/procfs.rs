//! What the node reads about a process in `/proc`, and `SIGKILL`: the [`HostProcesses`] seam,
//! the real [`ProcFs`] and [`FakeHostProcesses`].
//!
//! NVML reports pids in the host's PID namespace, so the plugin must run in it (`hostPID` in the
//! chart) for `/proc/<pid>` and the kill to reach the process NVML means.

#[cfg(any(test, feature = "testing"))]
use std::collections::{BTreeMap, BTreeSet};
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
#[cfg(any(test, feature = "testing"))]
use std::sync::{Arc, Mutex, MutexGuard};

use rustix::io::Errno;
use rustix::process::{Pid, PidfdFlags, Signal, pidfd_open, pidfd_send_signal};

#[cfg(any(test, feature = "testing"))]
use super::gpu_processes::FakeGpu;
use crate::error::{Error, Result};

/// A process as `/proc` shows it.
pub trait HostProcesses: Send + Sync {
    /// The text of `/proc/<pid>/cgroup`; `None` when the process is gone.
    fn cgroup(&self, pid: u32) -> Result<Option<String>>;
    /// Its start time in clock ticks since boot (`/proc/<pid>/stat`, field 22); `None` when
    /// it is gone.
    fn start_ticks(&self, pid: u32) -> Result<Option<u64>>;
    /// Sends `SIGKILL` to `pid` if it is still the process that started at `start_ticks`;
    /// whether it was.
    fn kill(&self, pid: u32, start_ticks: u64) -> Result<bool>;
}

/// The real `/proc` (of the plugin's PID namespace, which must be the host's).
#[derive(Debug, Clone)]
pub struct ProcFs {
    root: PathBuf,
}

impl Default for ProcFs {
    fn default() -> Self {
        Self::new("/proc")
    }
}

impl ProcFs {
    /// `/proc` mounted at `root`.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    fn read(&self, pid: u32, file: &str) -> Result<Option<String>> {
        let path = self.root.join(pid.to_string()).join(file);
        match std::fs::read_to_string(&path) {
            Ok(text) => Ok(Some(text)),
            // ESRCH: the process exited while its directory was read.
            Err(e) if e.kind() == ErrorKind::NotFound || e.raw_os_error() == Some(3) => Ok(None),
            Err(e) => Err(Error::io("reading", path, e)),
        }
    }
}

/// Field 22 of a `/proc/<pid>/stat` line. The command (field 2) is in parentheses and may
/// hold spaces and parentheses itself, so the fields are counted after the last `)`.
fn start_ticks_of(stat: &str, path: &Path) -> Result<u64> {
    let bad = |why: &str| Error::io("parsing", path, std::io::Error::other(why.to_owned()));
    let (_, rest) = stat
        .rsplit_once(')')
        .ok_or_else(|| bad("no `)` after the command"))?;
    // `rest` starts with field 3 (the state): field 22 is the 20th of it.
    rest.split_whitespace()
        .nth(19)
        .ok_or_else(|| bad("fewer than 22 fields"))?
        .parse()
        .map_err(|_| bad("field 22 (starttime) is not a number"))
}

impl HostProcesses for ProcFs {
    fn cgroup(&self, pid: u32) -> Result<Option<String>> {
        self.read(pid, "cgroup")
    }

    fn start_ticks(&self, pid: u32) -> Result<Option<u64>> {
        let path = self.root.join(pid.to_string()).join("stat");
        self.read(pid, "stat")?
            .map(|stat| start_ticks_of(&stat, &path))
            .transpose()
    }

    fn kill(&self, pid: u32, start_ticks: u64) -> Result<bool> {
        let target = i32::try_from(pid)
            .ok()
            .and_then(Pid::from_raw)
            .ok_or_else(|| Error::BadRequest(format!("pid {pid} is not a process id")))?;
        // The pidfd pins the process: once it is open, a check of its start time holds until
        // the signal is sent, and a pid reused before it was opened fails that check.
        let fd = match pidfd_open(target, PidfdFlags::empty()) {
            Ok(fd) => fd,
            Err(Errno::SRCH) => return Ok(false),
            Err(e) => {
                return Err(Error::io(
                    "opening a pidfd for",
                    format!("process {pid}"),
                    e.into(),
                ));
            }
        };
        if self.start_ticks(pid)? != Some(start_ticks) {
            return Ok(false);
        }
        match pidfd_send_signal(&fd, Signal::KILL) {
            Ok(()) => Ok(true),
            Err(Errno::SRCH) => Ok(false),
            Err(e) => Err(Error::io("killing", format!("process {pid}"), e.into())),
        }
    }
}

#[cfg(any(test, feature = "testing"))]
/// Processes that exist as records: tests add them with their cgroup text and start time;
/// [`HostProcesses::kill`] ends one and frees its GPU memory on the [`FakeGpu`].
#[derive(Debug, Clone)]
pub struct FakeHostProcesses {
    gpu: FakeGpu,
    state: Arc<Mutex<FakeProcs>>,
}

#[cfg(any(test, feature = "testing"))]
#[derive(Debug, Default)]
struct FakeProcs {
    processes: BTreeMap<u32, (String, u64)>,
    killed: BTreeSet<u32>,
}

#[cfg(any(test, feature = "testing"))]
impl FakeHostProcesses {
    /// No processes; kills end processes on `gpu`.
    pub fn new(gpu: FakeGpu) -> Self {
        Self {
            gpu,
            state: Arc::new(Mutex::new(FakeProcs::default())),
        }
    }

    fn lock(&self) -> MutexGuard<'_, FakeProcs> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Process `pid` runs in `cgroup` (the text of its `/proc/<pid>/cgroup`), started at
    /// `start_ticks`.
    pub fn spawn(&self, pid: u32, cgroup: &str, start_ticks: u64) {
        self.lock()
            .processes
            .insert(pid, (cgroup.to_owned(), start_ticks));
    }

    /// Process `pid` exited.
    pub fn exit(&self, pid: u32) {
        self.lock().processes.remove(&pid);
        self.gpu.end(pid);
    }

    /// The processes killed so far.
    pub fn killed(&self) -> BTreeSet<u32> {
        self.lock().killed.clone()
    }
}

#[cfg(any(test, feature = "testing"))]
impl HostProcesses for FakeHostProcesses {
    fn cgroup(&self, pid: u32) -> Result<Option<String>> {
        Ok(self.lock().processes.get(&pid).map(|(c, _)| c.clone()))
    }

    fn start_ticks(&self, pid: u32) -> Result<Option<u64>> {
        Ok(self.lock().processes.get(&pid).map(|(_, s)| *s))
    }

    fn kill(&self, pid: u32, start_ticks: u64) -> Result<bool> {
        let mut state = self.lock();
        if state.processes.get(&pid).map(|(_, s)| *s) != Some(start_ticks) {
            return Ok(false);
        }
        state.processes.remove(&pid);
        state.killed.insert(pid);
        drop(state);
        self.gpu.end(pid);
        Ok(true)
    }
}

#[cfg(test)]
mod tests {

    use std::process::Command;

    use super::*;

    #[test]
    fn the_start_time_is_counted_after_the_last_parenthesis() {
        let stat = "4242 (a (weird) name) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 \
                    987654 1000000 200 18446744073709551615";
        assert_eq!(start_ticks_of(stat, Path::new("x")).unwrap(), 987_654);
        assert!(start_ticks_of("4242 (short) S 1 2", Path::new("x")).is_err());
        assert!(start_ticks_of("no parenthesis", Path::new("x")).is_err());
    }

    #[test]
    fn a_real_process_is_read_and_killed_only_while_it_is_the_one_judged() {
        let mut child = Command::new("sleep").arg("30").spawn().expect("sleep runs");
        let pid = child.id();
        let procfs = ProcFs::default();
        let start = procfs
            .start_ticks(pid)
            .unwrap()
            .expect("the child is listed");
        assert!(procfs.cgroup(pid).unwrap().is_some_and(|c| !c.is_empty()));
        assert!(
            !procfs.kill(pid, start + 1).unwrap(),
            "another start time is another process"
        );
        assert!(child.try_wait().unwrap().is_none(), "so it still runs");
        assert!(procfs.kill(pid, start).unwrap());
        let status = child.wait().unwrap();
        assert!(!status.success());
        // Reaped: the pid names no process now.
        assert_eq!(procfs.start_ticks(pid).unwrap(), None);
        assert!(!procfs.kill(pid, start).unwrap());
    }

    #[test]
    fn a_missing_process_reads_as_gone() {
        let dir = tempfile::tempdir().unwrap();
        let procfs = ProcFs::new(dir.path());
        assert_eq!(procfs.cgroup(7).unwrap(), None);
        assert_eq!(procfs.start_ticks(7).unwrap(), None);
    }
}
