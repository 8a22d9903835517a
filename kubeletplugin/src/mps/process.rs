//! Processes as the MPS supervisor uses them: the `ProcessHost` seam, real processes
//! (`OsProcessHost`) and recorded ones (`FakeProcessHost`).

use std::collections::HashMap;
#[cfg(any(test, feature = "testing"))]
use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tessera_driver::node::host_dir::HostDir;
#[cfg(any(test, feature = "testing"))]
use tessera_driver::node::mps;
use tessera_driver::node::mps::ControlSocket;
use tessera_driver::node::mps::MpsDaemon;
use tessera_driver::node::mps_peer::{DaemonRecord, SocketPeer};
use tracing::{info, warn};

use crate::error::{Error, Result};

/// A process to run: program, arguments and the variables added to its environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessSpec {
    /// The program (a path, or a name looked up on `PATH`).
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// Variables set on top of the plugin's environment.
    pub env: Vec<(String, String)>,
}

/// The host's processes and files, as the supervisor uses them.
pub trait ProcessHost: Send + Sync + std::fmt::Debug {
    /// Starts a long-running process; returns its id.
    fn spawn(&self, spec: &ProcessSpec) -> Result<u32>;
    /// Whether the process `pid` (one [`ProcessHost::spawn`] started) has exited.
    fn has_exited(&self, pid: u32) -> Result<bool>;
    /// Waits up to `timeout` for `pid` to exit, then kills it.
    fn stop(&self, pid: u32, timeout: Duration) -> Result<()>;
    /// Runs a process to completion with `input` on its stdin, killing it after `timeout`;
    /// returns what it wrote to stdout.
    fn run(&self, spec: &ProcessSpec, input: &str, timeout: Duration) -> Result<String>;
    /// What connecting to the MPS control socket `path` finds (`SOCK_SEQPACKET`).
    fn probe(&self, path: &Path) -> ControlSocket;
    /// The process listening on the control socket `path` (`SO_PEERCRED`, and its start time).
    fn peer(&self, path: &Path) -> Result<SocketPeer>;
    /// The record of the daemon started for `daemon` (`None`: none).
    fn record(&self, daemon: &MpsDaemon) -> Result<Option<DaemonRecord>>;
    /// Records the process `pid` just started as `daemon`; with `None`, removes the record (the
    /// daemon was stopped).
    fn set_record(&self, daemon: &MpsDaemon, pid: Option<u32>) -> Result<()>;
    /// Removes a file; a missing one is fine.
    fn remove_file(&self, path: &Path) -> Result<()>;
    /// Creates a host directory with its mode, from its root down, never following a link
    /// ([`super::host_dirs::create`]).
    fn create_dir(&self, dir: &HostDir) -> Result<()>;
}

/// Real processes (`std::process`), reaped by [`ProcessHost::has_exited`] and
/// [`ProcessHost::stop`].
#[derive(Debug, Default)]
pub struct OsProcessHost {
    children: Mutex<HashMap<u32, Child>>,
}

impl OsProcessHost {
    /// A host with no children yet.
    pub fn new() -> Self {
        Self::default()
    }

    fn children(&self) -> Result<MutexGuard<'_, HashMap<u32, Child>>> {
        self.children
            .lock()
            .map_err(|_| Error::Task("a thread panicked holding the MPS children".to_owned()))
    }
}

fn command(spec: &ProcessSpec) -> Command {
    let mut command = Command::new(&spec.program);
    command
        .args(&spec.args)
        .envs(spec.env.iter().map(|(k, v)| (k, v)));
    command
}

/// Polls `done` every 20 ms until it says true or `timeout` passes; returns whether it did.
pub(super) fn poll_until(
    timeout: Duration,
    mut done: impl FnMut() -> Result<bool>,
) -> Result<bool> {
    let deadline = Instant::now() + timeout;
    loop {
        if done()? {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn wait_child(child: &mut Child, program: &Path, timeout: Duration) -> Result<()> {
    let exited = poll_until(timeout, || {
        child
            .try_wait()
            .map(|s| s.is_some())
            .map_err(|e| Error::io("waiting for", program, e))
    })?;
    if !exited {
        warn!(pid = child.id(), program = %program.display(), ?timeout, "process did not exit in time; killing it");
        let _ = child.kill();
        let _ = child.wait();
    }
    Ok(())
}

impl ProcessHost for OsProcessHost {
    fn spawn(&self, spec: &ProcessSpec) -> Result<u32> {
        let child = command(spec)
            .stdin(Stdio::null())
            .spawn()
            .map_err(|e| Error::io("starting", &spec.program, e))?;
        let pid = child.id();
        self.children()?.insert(pid, child);
        Ok(pid)
    }

    fn has_exited(&self, pid: u32) -> Result<bool> {
        let mut children = self.children()?;
        let Some(child) = children.get_mut(&pid) else {
            return Ok(true);
        };
        match child.try_wait() {
            Ok(Some(status)) => {
                info!(pid, %status, "MPS control daemon exited");
                children.remove(&pid);
                Ok(true)
            }
            Ok(None) => Ok(false),
            Err(e) => Err(Error::io("waiting for", format!("process {pid}"), e)),
        }
    }

    fn stop(&self, pid: u32, timeout: Duration) -> Result<()> {
        let child = self.children()?.remove(&pid);
        if let Some(mut child) = child {
            wait_child(&mut child, Path::new("MPS control daemon"), timeout)?;
        }
        Ok(())
    }

    fn run(&self, spec: &ProcessSpec, input: &str, timeout: Duration) -> Result<String> {
        let mut child = command(spec)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| Error::io("starting", &spec.program, e))?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(input.as_bytes())
                .map_err(|e| Error::io("writing to", &spec.program, e))?;
        }
        // Control replies are short: they fit the pipe while the command runs.
        wait_child(&mut child, &spec.program, timeout)?;
        let mut out = String::new();
        if let Some(mut stdout) = child.stdout.take() {
            stdout
                .read_to_string(&mut out)
                .map_err(|e| Error::io("reading from", &spec.program, e))?;
        }
        Ok(out)
    }

    fn probe(&self, path: &Path) -> ControlSocket {
        super::socket::probe(path)
    }

    fn peer(&self, path: &Path) -> Result<SocketPeer> {
        super::socket::peer(path)
    }

    fn record(&self, daemon: &MpsDaemon) -> Result<Option<DaemonRecord>> {
        super::record::read(daemon)
    }

    fn set_record(&self, daemon: &MpsDaemon, pid: Option<u32>) -> Result<()> {
        match pid {
            Some(pid) => super::record::write(daemon, &super::record::of_child(daemon, pid)?),
            None => super::record::remove(daemon),
        }
    }

    fn remove_file(&self, path: &Path) -> Result<()> {
        match std::fs::remove_file(path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io("removing", path, e)),
        }
    }

    fn create_dir(&self, dir: &HostDir) -> Result<()> {
        super::host_dirs::create(dir)
    }
}

#[cfg(any(test, feature = "testing"))]
/// A call the supervisor made on a [`FakeProcessHost`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostCall {
    /// A process was started; it got this id.
    Spawn(ProcessSpec, u32),
    /// A process was waited for and stopped.
    Stop(u32),
    /// A process was run to completion with this input.
    Run(ProcessSpec, String),
    /// A directory was created.
    CreateDir(PathBuf),
    /// A file was removed.
    RemoveFile(PathBuf),
    /// A daemon's record was written (`Some`: the recorded pid) or removed (`None`).
    Record(String, Option<u32>),
}

#[cfg(any(test, feature = "testing"))]
/// Processes that exist only as records: spawned processes get ids from 100 up and answer on
/// the daemon's control socket at once (unless told not to); [`FakeProcessHost::kill`] ends
/// one and leaves its socket file behind, refusing connections, as a real crash does. Every
/// process runs as uid 0 and started at tick `10 × pid`; [`FakeProcessHost::impostor`] puts
/// another process on a daemon's socket, as a tenant that replaced it.
#[derive(Debug, Default)]
pub struct FakeProcessHost {
    state: Mutex<FakeState>,
}

#[cfg(any(test, feature = "testing"))]
#[derive(Debug, Default)]
struct FakeState {
    calls: Vec<HostCall>,
    next_pid: u32,
    alive: BTreeSet<u32>,
    /// Control sockets by path, with the daemon listening on each (`None`: a dead one's file).
    sockets: BTreeMap<PathBuf, Option<u32>>,
    /// Daemon records by daemon id: the recorded pid.
    records: BTreeMap<String, u32>,
    never_ready: bool,
    fail_spawn: bool,
}

/// The fake's start time of process `pid`.
#[cfg(any(test, feature = "testing"))]
fn fake_start(pid: u32) -> u64 {
    u64::from(pid) * 10
}

#[cfg(any(test, feature = "testing"))]
fn control_of(spec: &ProcessSpec) -> Option<PathBuf> {
    spec.env
        .iter()
        .find(|(k, _)| k == "CUDA_MPS_PIPE_DIRECTORY")
        .map(|(_, pipe)| PathBuf::from(format!("{pipe}/{}", mps::CONTROL_SOCKET)))
}

#[cfg(any(test, feature = "testing"))]
impl FakeProcessHost {
    /// A host where every spawned daemon becomes ready at once.
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> MutexGuard<'_, FakeState> {
        // A panicking test thread poisons the lock; the records are still worth reading.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The calls so far.
    pub fn calls(&self) -> Vec<HostCall> {
        self.state().calls.clone()
    }

    /// Ends process `pid` as if it crashed: its control socket stays, refusing connections.
    pub fn kill(&self, pid: u32) {
        let mut s = self.state();
        s.alive.remove(&pid);
        for owner in s.sockets.values_mut() {
            if *owner == Some(pid) {
                *owner = None;
            }
        }
    }

    /// Makes later spawned daemons never create their control socket.
    pub fn never_ready(&self) {
        self.state().never_ready = true;
    }

    /// Leaves `daemon` from an earlier run, as process 1 with its record: its control socket
    /// exists and, when `answering`, accepts connections (a daemon that is not this host's
    /// child).
    pub fn leftover_daemon(&self, daemon: &MpsDaemon, answering: bool) {
        let mut s = self.state();
        let pid = 1;
        if answering {
            s.alive.insert(pid);
        }
        s.records.insert(daemon.id.clone(), pid);
        s.sockets.insert(
            PathBuf::from(mps::control_socket(daemon)),
            answering.then_some(pid),
        );
    }

    /// Process `pid` (a tenant's) unlinked `daemon`'s control socket and listens there itself;
    /// a control command run there reaches it (and it answers "done").
    pub fn impostor(&self, daemon: &MpsDaemon, pid: u32) {
        self.state()
            .sockets
            .insert(PathBuf::from(mps::control_socket(daemon)), Some(pid));
    }

    /// The control commands run so far: what was written to each.
    pub fn commands(&self) -> Vec<String> {
        self.calls()
            .into_iter()
            .filter_map(|c| match c {
                HostCall::Run(_, input) => Some(input),
                _ => None,
            })
            .collect()
    }

    /// Makes later spawns fail (a missing binary).
    pub fn fail_spawns(&self, fail: bool) {
        self.state().fail_spawn = fail;
    }

    /// The processes running now.
    pub fn alive(&self) -> BTreeSet<u32> {
        self.state().alive.clone()
    }
}

#[cfg(any(test, feature = "testing"))]
impl ProcessHost for FakeProcessHost {
    fn spawn(&self, spec: &ProcessSpec) -> Result<u32> {
        let mut s = self.state();
        if s.fail_spawn {
            return Err(Error::io(
                "starting",
                &spec.program,
                std::io::Error::from(std::io::ErrorKind::NotFound),
            ));
        }
        let pid = 100 + s.next_pid;
        s.next_pid += 1;
        s.alive.insert(pid);
        if !s.never_ready
            && let Some(control) = control_of(spec)
        {
            s.sockets.insert(control, Some(pid));
        }
        s.calls.push(HostCall::Spawn(spec.clone(), pid));
        Ok(pid)
    }

    fn has_exited(&self, pid: u32) -> Result<bool> {
        Ok(!self.state().alive.contains(&pid))
    }

    fn stop(&self, pid: u32, _timeout: Duration) -> Result<()> {
        let mut s = self.state();
        s.alive.remove(&pid);
        s.calls.push(HostCall::Stop(pid));
        Ok(())
    }

    fn run(&self, spec: &ProcessSpec, input: &str, _timeout: Duration) -> Result<String> {
        let mut s = self.state();
        s.calls.push(HostCall::Run(spec.clone(), input.to_owned()));
        let Some(control) = control_of(spec) else {
            return Ok(String::new());
        };
        let Some(Some(pid)) = s.sockets.get(&control).copied() else {
            return Err(Error::Mps(format!(
                "no MPS control daemon answers on {}",
                control.display()
            )));
        };
        if input == mps::QUIT_COMMAND {
            s.sockets.remove(&control);
            s.alive.remove(&pid);
        }
        Ok(String::new())
    }

    fn probe(&self, path: &Path) -> ControlSocket {
        match self.state().sockets.get(path) {
            None => ControlSocket::Missing,
            Some(None) => ControlSocket::Refused,
            Some(Some(_)) => ControlSocket::Answers,
        }
    }

    fn peer(&self, path: &Path) -> Result<SocketPeer> {
        match self.state().sockets.get(path) {
            Some(Some(pid)) => Ok(SocketPeer {
                pid: *pid,
                uid: 0,
                start_ticks: Some(fake_start(*pid)),
            }),
            _ => Err(Error::io(
                "connecting to",
                path,
                std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
            )),
        }
    }

    fn record(&self, daemon: &MpsDaemon) -> Result<Option<DaemonRecord>> {
        Ok(self
            .state()
            .records
            .get(&daemon.id)
            .map(|&pid| DaemonRecord {
                daemon_id: daemon.id.clone(),
                pid,
                uid: 0,
                start_ticks: fake_start(pid),
            }))
    }

    fn set_record(&self, daemon: &MpsDaemon, pid: Option<u32>) -> Result<()> {
        let mut s = self.state();
        match pid {
            Some(pid) => s.records.insert(daemon.id.clone(), pid),
            None => s.records.remove(&daemon.id),
        };
        s.calls.push(HostCall::Record(daemon.id.clone(), pid));
        Ok(())
    }

    fn remove_file(&self, path: &Path) -> Result<()> {
        let mut s = self.state();
        s.sockets.remove(path);
        s.calls.push(HostCall::RemoveFile(path.to_owned()));
        Ok(())
    }

    fn create_dir(&self, dir: &HostDir) -> Result<()> {
        self.state()
            .calls
            .push(HostCall::CreateDir(PathBuf::from(&dir.path)));
        Ok(())
    }
}
