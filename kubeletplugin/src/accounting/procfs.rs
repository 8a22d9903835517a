//! What the node reads about a process in `/proc`, and `SIGKILL`: the [`HostProcesses`] seam,
//! the real [`ProcFs`] and [`FakeHostProcesses`].
//!
//! NVML reports pids in the host's PID namespace, so the plugin must run in it (`hostPID` in the
//! chart) for `/proc/<pid>` and the kill to reach the process NVML means.

#[cfg(any(test, feature = "testing"))]
use std::collections::{BTreeMap, BTreeSet};
use std::io::Read as _;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
#[cfg(any(test, feature = "testing"))]
use std::sync::{Arc, Mutex, MutexGuard};

use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;
use rustix::process::{Pid, PidfdFlags, Signal, pidfd_open, pidfd_send_signal};
use tessera_driver::node::accounting::proc;

#[cfg(any(test, feature = "testing"))]
use super::gpu_processes::FakeGpu;
use crate::error::{Error, Result};

/// The most of one `/proc/<pid>` file read: a `stat` line is a few hundred bytes, a `cgroup`
/// file one line per hierarchy; a longer one is no process's the pass can judge.
pub const MAX_PROC_FILE: u64 = 64 * 1024;

/// What `/proc/<pid>` holds about a process, as bytes: nothing in it is UTF-8 by rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcFiles {
    /// `/proc/<pid>/stat`.
    pub stat: Vec<u8>,
    /// `/proc/<pid>/cgroup`.
    pub cgroup: Vec<u8>,
}

/// A process as `/proc` shows it.
pub trait HostProcesses: Send + Sync {
    /// The bytes of `/proc/<pid>/stat` and `/proc/<pid>/cgroup`, both of the same process;
    /// `None` when it is gone.
    fn read(&self, pid: u32) -> Result<Option<ProcFiles>>;
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

/// `ENOENT`, or `ESRCH` (the process exited while its directory was read): it is gone.
fn gone(e: Errno) -> bool {
    e == Errno::NOENT || e == Errno::SRCH
}

impl ProcFs {
    /// `/proc` mounted at `root`.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// Reads `file` of the process directory `dir`, at most [`MAX_PROC_FILE`] bytes; `None`
    /// when the process is gone.
    fn read_in(dir: &OwnedFd, path: &std::path::Path, file: &str) -> Result<Option<Vec<u8>>> {
        let fd =
            match rustix::fs::openat(dir, file, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty()) {
                Ok(fd) => fd,
                Err(e) if gone(e) => return Ok(None),
                Err(e) => return Err(Error::io("opening", path.join(file), e.into())),
            };
        let mut bytes = Vec::new();
        match std::fs::File::from(fd)
            .take(MAX_PROC_FILE + 1)
            .read_to_end(&mut bytes)
        {
            Ok(_) => {}
            Err(e)
                if e.raw_os_error()
                    .is_some_and(|n| gone(Errno::from_raw_os_error(n))) =>
            {
                return Ok(None);
            }
            Err(e) => return Err(Error::io("reading", path.join(file), e)),
        }
        if bytes.len() as u64 > MAX_PROC_FILE {
            return Err(Error::Input {
                path: path.join(file),
                message: format!("is longer than {MAX_PROC_FILE} bytes"),
            });
        }
        Ok(Some(bytes))
    }
}

impl HostProcesses for ProcFs {
    fn read(&self, pid: u32) -> Result<Option<ProcFiles>> {
        let path = self.root.join(pid.to_string());
        // One handle on the process's directory: both files are of the process it names, and
        // once that process is gone they read as gone, even if its pid is reused.
        let dir = match rustix::fs::open(
            &path,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(dir) => dir,
            Err(e) if gone(e) => return Ok(None),
            Err(e) => return Err(Error::io("opening", path, e.into())),
        };
        let Some(stat) = Self::read_in(&dir, &path, "stat")? else {
            return Ok(None);
        };
        let Some(cgroup) = Self::read_in(&dir, &path, "cgroup")? else {
            return Ok(None);
        };
        Ok(Some(ProcFiles { stat, cgroup }))
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
        let started = self
            .read(pid)?
            .and_then(|files| proc::start_ticks(&files.stat));
        if started != Some(start_ticks) {
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
/// Processes that exist as records: tests add them with their cgroup text and start time (or
/// with the raw bytes of their `/proc` files, or as unreadable); [`HostProcesses::kill`] ends
/// one and frees its GPU memory on the [`FakeGpu`].
#[derive(Debug, Clone)]
pub struct FakeHostProcesses {
    gpu: FakeGpu,
    state: Arc<Mutex<FakeProcs>>,
}

/// A fake process's `/proc` files, or `None` when reading them fails.
#[cfg(any(test, feature = "testing"))]
type FakeFiles = Option<ProcFiles>;

#[cfg(any(test, feature = "testing"))]
#[derive(Debug, Default)]
struct FakeProcs {
    processes: BTreeMap<u32, FakeFiles>,
    killed: BTreeSet<u32>,
}

/// A `stat` line as the kernel writes it for `pid`, with `comm` and `start_ticks`.
#[cfg(any(test, feature = "testing"))]
pub fn stat_line(pid: u32, comm: &[u8], start_ticks: u64) -> Vec<u8> {
    let mut out = format!("{pid} (").into_bytes();
    out.extend_from_slice(comm);
    out.extend_from_slice(
        format!(
            ") S 1 {pid} {pid} 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 {start_ticks} 1000000 200 \
             18446744073709551615\n"
        )
        .as_bytes(),
    );
    out
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
        self.spawn_raw(
            pid,
            ProcFiles {
                stat: stat_line(pid, b"fake", start_ticks),
                cgroup: cgroup.as_bytes().to_vec(),
            },
        );
    }

    /// Process `pid` whose `/proc` files hold `files`, whatever bytes they are.
    pub fn spawn_raw(&self, pid: u32, files: ProcFiles) {
        self.lock().processes.insert(pid, Some(files));
    }

    /// Process `pid` runs, but reading its `/proc` files fails.
    pub fn spawn_unreadable(&self, pid: u32) {
        self.lock().processes.insert(pid, None);
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
    fn read(&self, pid: u32) -> Result<Option<ProcFiles>> {
        match self.lock().processes.get(&pid) {
            None => Ok(None),
            Some(Some(files)) => Ok(Some(files.clone())),
            Some(None) => Err(Error::io(
                "reading",
                format!("/proc/{pid}/stat"),
                std::io::Error::from_raw_os_error(13),
            )),
        }
    }

    fn kill(&self, pid: u32, start_ticks: u64) -> Result<bool> {
        let mut state = self.lock();
        let started = state
            .processes
            .get(&pid)
            .and_then(|f| f.as_ref())
            .and_then(|f| proc::start_ticks(&f.stat));
        if started != Some(start_ticks) {
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

    fn start(procfs: &ProcFs, pid: u32) -> Option<u64> {
        procfs
            .read(pid)
            .unwrap()
            .and_then(|f| proc::start_ticks(&f.stat))
    }

    #[test]
    fn a_real_process_is_read_and_killed_only_while_it_is_the_one_judged() {
        let mut child = Command::new("sleep").arg("30").spawn().expect("sleep runs");
        let pid = child.id();
        let procfs = ProcFs::default();
        let files = procfs.read(pid).unwrap().expect("the child is listed");
        assert!(!files.cgroup.is_empty());
        let start = start(&procfs, pid).expect("its stat has a start time");
        assert!(
            !procfs.kill(pid, start + 1).unwrap(),
            "another start time is another process"
        );
        assert!(child.try_wait().unwrap().is_none(), "so it still runs");
        assert!(procfs.kill(pid, start).unwrap());
        let status = child.wait().unwrap();
        assert!(!status.success());
        // Reaped: the pid names no process now.
        assert_eq!(procfs.read(pid).unwrap(), None);
        assert!(!procfs.kill(pid, start).unwrap());
    }

    #[test]
    fn a_process_named_with_bytes_that_are_not_utf8_is_read_as_bytes() {
        // A process may rename only itself (through `/proc/self/comm` or `prctl`): the shell
        // does, with its builtin `printf`, and waits in its builtin `read`.
        let mut child = Command::new("sh")
            .args(["-c", r"printf '\377\376)x (y' > /proc/$$/comm && read line"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .expect("sh runs");
        let pid = child.id();
        let procfs = ProcFs::default();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let files = loop {
            let files = procfs.read(pid).unwrap().expect("the child is listed");
            if files.stat.windows(2).any(|w| w == b"\xff\xfe") {
                break files;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the child never renamed itself"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        assert!(std::str::from_utf8(&files.stat).is_err());
        assert!(start(&procfs, pid).is_some());
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn a_missing_process_reads_as_gone() {
        let dir = tempfile::tempdir().unwrap();
        let procfs = ProcFs::new(dir.path());
        assert_eq!(procfs.read(7).unwrap(), None);
    }

    #[test]
    fn a_proc_file_longer_than_the_limit_is_an_error_not_a_read_without_end() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("7")).unwrap();
        std::fs::write(dir.path().join("7/stat"), stat_line(7, b"x", 1)).unwrap();
        let long = vec![b'x'; usize::try_from(MAX_PROC_FILE).unwrap() + 1];
        std::fs::write(dir.path().join("7/cgroup"), long).unwrap();
        let err = ProcFs::new(dir.path()).read(7).unwrap_err();
        assert!(err.to_string().contains("longer than"), "{err}");
    }
}
