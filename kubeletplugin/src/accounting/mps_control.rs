//! Asking an MPS control daemon about its clients and ending one: the [`MpsControl`] seam.
//!
//! The real daemon is driven the way NVIDIA documents it, by writing commands to
//! `nvidia-cuda-mps-control` run without arguments against the daemon's pipe directory
//! ([`BinaryMpsControl`]); the binary talks to the daemon over the control socket, which is a
//! `SOCK_SEQPACKET` unix socket (a stream socket is refused with `EPROTOTYPE`). Before each
//! command the socket's peer is checked against the daemon's record (`crate::mps::record`):
//! a tenant that replaced the socket is never asked, and its "done" never believed. The commands:
//! `get_server_list` (the server pids, one a line), `get_client_list <server>` (its client pids,
//! one a line) and `terminate_client <server> <client>` (ends that client's GPU work, frees its
//! memory, and leaves the server's other clients running; seen on an H200, driver 580).
//!
//! [`FakeMpsDaemon`] serves a real `SOCK_SEQPACKET` socket at `<pipe>/control` (through
//! `crate::mps::socket`, as the MPS fakes of the daemons' tests do) and answers those
//! commands from its records, one message per command and one per answer; [`FakeMpsControl`]
//! is the control binary's side of it.

#[cfg(any(test, feature = "testing"))]
use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read as _, Write as _};
#[cfg(any(test, feature = "testing"))]
use std::os::fd::OwnedFd;
#[cfg(any(test, feature = "testing"))]
use std::path::Path;
use std::path::PathBuf;
use std::process::{Command, Stdio};
#[cfg(any(test, feature = "testing"))]
use std::sync::atomic::{AtomicBool, Ordering};
#[cfg(any(test, feature = "testing"))]
use std::sync::{Arc, Mutex, MutexGuard};
#[cfg(any(test, feature = "testing"))]
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[cfg(any(test, feature = "testing"))]
use nix::sys::socket::{setsockopt, sockopt};
#[cfg(any(test, feature = "testing"))]
use nix::sys::time::TimeVal;
use tessera_driver::node::mps;
use tessera_driver::node::mps::MpsDaemon;

#[cfg(any(test, feature = "testing"))]
use super::gpu_processes::FakeGpu;
use crate::error::{Error, Result};
#[cfg(any(test, feature = "testing"))]
use crate::mps::socket;

/// The longest answer read from the control binary or the fake daemon.
const MAX_ANSWER: usize = 64 * 1024;

/// An MPS control daemon's view of its servers and clients.
pub trait MpsControl: Send + Sync {
    /// The pids of `daemon`'s servers.
    fn servers(&self, daemon: &MpsDaemon) -> Result<Vec<u32>>;
    /// The pids of `server`'s clients.
    fn clients(&self, daemon: &MpsDaemon, server: u32) -> Result<Vec<u32>>;
    /// Ends `client`'s GPU work through `server`.
    fn terminate(&self, daemon: &MpsDaemon, server: u32, client: u32) -> Result<()>;
}

/// Pids, one a line; anything else in an answer is an error that quotes it.
fn parse_pids(command: &str, answer: &str) -> Result<Vec<u32>> {
    answer
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|l| {
            l.parse().map_err(|_| {
                Error::Mps(format!(
                    "`{command}` answered {l:?} where a pid was expected"
                ))
            })
        })
        .collect()
}

/// Runs `nvidia-cuda-mps-control` once per command (through `tessera-mps exec` when the
/// launch has a wrapper, so it finds the driver root's libraries and the daemon's pipe
/// directory as the daemon does: `tessera_driver::node::mps::control_command`).
#[derive(Debug, Clone)]
pub struct BinaryMpsControl {
    launch: mps::Launch,
    timeout: Duration,
}

impl BinaryMpsControl {
    /// Commands through `binary` run directly, each given `timeout` to answer.
    pub fn new(binary: impl Into<PathBuf>, timeout: Duration) -> Self {
        Self::with_launch(
            mps::Launch {
                control_binary: binary.into().display().to_string(),
                wrapper: None,
            },
            timeout,
        )
    }

    /// Commands the way `launch` runs the control binary.
    pub fn with_launch(launch: mps::Launch, timeout: Duration) -> Self {
        Self { launch, timeout }
    }

    fn ask(&self, daemon: &MpsDaemon, command: &str) -> Result<String> {
        crate::mps::record::check(daemon)?;
        let (program, args) = mps::control_command(&self.launch, daemon);
        let binary = PathBuf::from(program);
        let mut child = Command::new(&binary)
            .args(&args)
            .envs(mps::daemon_env(daemon))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| Error::io("starting", &binary, e))?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(format!("{command}\n").as_bytes())
                .map_err(|e| Error::io("writing to", &binary, e))?;
        }
        let deadline = Instant::now() + self.timeout;
        let status = loop {
            if let Some(status) = child
                .try_wait()
                .map_err(|e| Error::io("waiting for", &binary, e))?
            {
                break status;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Error::Mps(format!(
                    "`{command}` through {} did not answer within {:?} (pipe directory {})",
                    binary.display(),
                    self.timeout,
                    daemon.pipe_dir
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let mut out = String::new();
        let mut err = String::new();
        if let Some(stdout) = child.stdout.take() {
            let _ = stdout.take(MAX_ANSWER as u64).read_to_string(&mut out);
        }
        if let Some(stderr) = child.stderr.take() {
            let _ = stderr.take(MAX_ANSWER as u64).read_to_string(&mut err);
        }
        if !status.success() {
            return Err(Error::Mps(format!(
                "`{command}` through {} failed ({status}): {}{}",
                binary.display(),
                out.trim(),
                err.trim()
            )));
        }
        Ok(out)
    }
}

impl MpsControl for BinaryMpsControl {
    fn servers(&self, daemon: &MpsDaemon) -> Result<Vec<u32>> {
        parse_pids("get_server_list", &self.ask(daemon, "get_server_list")?)
    }

    fn clients(&self, daemon: &MpsDaemon, server: u32) -> Result<Vec<u32>> {
        let command = format!("get_client_list {server}");
        parse_pids(&command, &self.ask(daemon, &command)?)
    }

    fn terminate(&self, daemon: &MpsDaemon, server: u32, client: u32) -> Result<()> {
        self.ask(daemon, &format!("terminate_client {server} {client}"))
            .map(|_| ())
    }
}

#[cfg(any(test, feature = "testing"))]
/// Sets how long a receive (and, on a listening socket, an accept) on `fd` may wait.
fn receive_timeout(fd: &OwnedFd, timeout: Duration, path: &Path) -> Result<()> {
    let micros = i64::try_from(timeout.as_micros()).unwrap_or(i64::MAX);
    setsockopt(
        fd,
        sockopt::ReceiveTimeout,
        &TimeVal::new(micros / 1_000_000, micros % 1_000_000),
    )
    .map_err(|e| Error::io("setting a timeout on", path, e.into()))
}

#[cfg(any(test, feature = "testing"))]
/// Sends one message and reads the one answer (the fake protocol's round trip).
fn round_trip(path: &Path, message: &str, timeout: Duration) -> Result<String> {
    let fd = socket::connect_to(path)?;
    receive_timeout(&fd, timeout, path)?;
    socket::send_message(&fd, message.as_bytes(), path)?;
    let answer = String::from_utf8_lossy(&socket::receive_message(&fd, path)?).into_owned();
    Ok(answer.strip_suffix('\n').unwrap_or(&answer).to_owned())
}

#[cfg(any(test, feature = "testing"))]
/// The control binary's side of [`FakeMpsDaemon`]: one `SOCK_SEQPACKET` connection per command.
#[derive(Debug, Clone)]
pub struct FakeMpsControl {
    timeout: Duration,
}

#[cfg(any(test, feature = "testing"))]
impl Default for FakeMpsControl {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(5),
        }
    }
}

#[cfg(any(test, feature = "testing"))]
impl FakeMpsControl {
    /// Commands that wait up to 5 s for their answer.
    pub fn new() -> Self {
        Self::default()
    }

    fn ask(daemon: &MpsDaemon, command: &str, timeout: Duration) -> Result<String> {
        round_trip(Path::new(&mps::control_socket(daemon)), command, timeout)
    }
}

#[cfg(any(test, feature = "testing"))]
impl MpsControl for FakeMpsControl {
    fn servers(&self, daemon: &MpsDaemon) -> Result<Vec<u32>> {
        parse_pids(
            "get_server_list",
            &Self::ask(daemon, "get_server_list", self.timeout)?,
        )
    }

    fn clients(&self, daemon: &MpsDaemon, server: u32) -> Result<Vec<u32>> {
        let command = format!("get_client_list {server}");
        parse_pids(&command, &Self::ask(daemon, &command, self.timeout)?)
    }

    fn terminate(&self, daemon: &MpsDaemon, server: u32, client: u32) -> Result<()> {
        let command = format!("terminate_client {server} {client}");
        let answer = Self::ask(daemon, &command, self.timeout)?;
        if answer.is_empty() {
            Ok(())
        } else {
            Err(Error::Mps(format!("`{command}`: {answer}")))
        }
    }
}

#[cfg(any(test, feature = "testing"))]
#[derive(Debug, Default)]
struct FakeMps {
    servers: BTreeMap<u32, BTreeSet<u32>>,
    terminated: Vec<(u32, u32)>,
    commands: Vec<String>,
}

#[cfg(any(test, feature = "testing"))]
/// A stand-in MPS control daemon on a real `SOCK_SEQPACKET` socket at `<pipe>/control`. Its
/// servers and clients are what the test says; `terminate_client` ends the client on the
/// [`FakeGpu`] (its memory is freed) and leaves the other clients alone. Stops when dropped.
#[derive(Debug)]
pub struct FakeMpsDaemon {
    path: PathBuf,
    state: Arc<Mutex<FakeMps>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

#[cfg(any(test, feature = "testing"))]
fn lock(state: &Mutex<FakeMps>) -> MutexGuard<'_, FakeMps> {
    state
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(any(test, feature = "testing"))]
/// Pids, one a line.
fn lines<'a>(pids: impl Iterator<Item = &'a u32>) -> String {
    pids.map(|p| format!("{p}\n")).collect::<Vec<_>>().concat()
}

#[cfg(any(test, feature = "testing"))]
fn answer(state: &Mutex<FakeMps>, gpu: &FakeGpu, command: &str) -> String {
    let mut s = lock(state);
    s.commands.push(command.to_owned());
    let words: Vec<&str> = command.split_whitespace().collect();
    let pid = |i: usize| words.get(i).and_then(|w| w.parse::<u32>().ok());
    match (words.first().copied(), words.len()) {
        (Some("get_server_list"), 1) => lines(s.servers.keys()),
        (Some("get_client_list"), 2) => match pid(1).and_then(|p| s.servers.get(&p)) {
            Some(clients) => lines(clients.iter()),
            None => format!("Error: no server {}\n", words[1]),
        },
        (Some("terminate_client"), 3) => match (pid(1), pid(2)) {
            (Some(server), Some(client))
                if s.servers
                    .get_mut(&server)
                    .is_some_and(|c| c.remove(&client)) =>
            {
                s.terminated.push((server, client));
                gpu.end(client);
                String::new()
            }
            _ => format!("Error: {} is not a client of {}\n", words[2], words[1]),
        },
        _ => format!("Error: unknown command {command:?}\n"),
    }
}

#[cfg(any(test, feature = "testing"))]
fn serve(
    listener: &OwnedFd,
    path: &Path,
    state: &Mutex<FakeMps>,
    gpu: &FakeGpu,
    stop: &AtomicBool,
) {
    while !stop.load(Ordering::Relaxed) {
        let Ok(conn) = socket::accept_on(listener, path) else {
            // The accept timeout: look at the stop flag again.
            continue;
        };
        let _ = receive_timeout(&conn, Duration::from_secs(1), path);
        loop {
            let message = match socket::receive_message(&conn, path) {
                Ok(m) if !m.is_empty() => m,
                _ => break,
            };
            let command = String::from_utf8_lossy(&message).trim().to_owned();
            // Every answer ends with a newline, so that none is an empty message (which reads
            // as the peer's close).
            let text = format!("{}\n", answer(state, gpu, &command));
            if socket::send_message(&conn, text.as_bytes(), path).is_err() {
                break;
            }
        }
    }
}

#[cfg(any(test, feature = "testing"))]
impl FakeMpsDaemon {
    /// Serves the control socket in `pipe_dir` (created if missing).
    pub fn start(pipe_dir: &Path, gpu: FakeGpu) -> Result<Self> {
        std::fs::create_dir_all(pipe_dir).map_err(|e| Error::io("creating", pipe_dir, e))?;
        let path = pipe_dir.join(mps::CONTROL_SOCKET);
        let listener = socket::listen_at(&path)?;
        // accept(2) honours SO_RCVTIMEO: the thread looks at its stop flag every 50 ms.
        receive_timeout(&listener, Duration::from_millis(50), &path)?;
        let state = Arc::new(Mutex::new(FakeMps::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (state, stop, at) = (Arc::clone(&state), Arc::clone(&stop), path.clone());
            std::thread::Builder::new()
                .name("fake-mps-daemon".to_owned())
                .spawn(move || serve(&listener, &at, &state, &gpu, &stop))
                .map_err(|e| Error::Task(format!("starting the fake MPS daemon: {e}")))?
        };
        Ok(Self {
            path,
            state,
            stop,
            thread: Some(thread),
        })
    }

    /// The control socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Process `client` is a client of the server `server` (which exists from then on).
    pub fn add_client(&self, server: u32, client: u32) {
        lock(&self.state)
            .servers
            .entry(server)
            .or_default()
            .insert(client);
    }

    /// The `(server, client)` pairs terminated so far.
    pub fn terminated(&self) -> Vec<(u32, u32)> {
        lock(&self.state).terminated.clone()
    }

    /// The commands received so far.
    pub fn commands(&self) -> Vec<String> {
        lock(&self.state).commands.clone()
    }
}

#[cfg(any(test, feature = "testing"))]
impl Drop for FakeMpsDaemon {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {

    use super::*;

    fn daemon(pipe: &Path) -> MpsDaemon {
        MpsDaemon {
            id: "mps-test".to_owned(),
            devices: vec!["GPU-1".to_owned()],
            pipe_dir: pipe.display().to_string(),
            shm_dir: pipe.join("shm").display().to_string(),
            log_dir: pipe.join("log").display().to_string(),
            user: None,
        }
    }

    #[test]
    fn the_fake_control_socket_refuses_a_stream_client_as_the_real_one_does() {
        let dir = tempfile::tempdir().unwrap();
        let fake = FakeMpsDaemon::start(dir.path(), FakeGpu::new()).unwrap();
        let err = std::os::unix::net::UnixStream::connect(fake.path()).unwrap_err();
        assert_eq!(
            err.raw_os_error(),
            Some(nix::errno::Errno::EPROTOTYPE as i32)
        );
    }

    #[test]
    fn terminate_client_ends_one_client_and_frees_its_memory() {
        let dir = tempfile::tempdir().unwrap();
        let gpu = FakeGpu::new();
        gpu.run(11, "GPU-1", 1 << 30);
        gpu.run(12, "GPU-1", 1 << 30);
        let fake = FakeMpsDaemon::start(dir.path(), gpu.clone()).unwrap();
        fake.add_client(7, 11);
        fake.add_client(7, 12);
        let d = daemon(dir.path());
        let control = FakeMpsControl::new();
        assert_eq!(control.servers(&d).unwrap(), [7]);
        assert_eq!(control.clients(&d, 7).unwrap(), [11, 12]);
        control.terminate(&d, 7, 12).unwrap();
        assert_eq!(control.clients(&d, 7).unwrap(), [11]);
        assert_eq!(gpu.pids(), BTreeSet::from([11]), "the other client runs on");
        assert!(
            control.terminate(&d, 7, 12).is_err(),
            "not a client any more"
        );
        assert!(control.clients(&d, 8).is_err());
        assert_eq!(fake.terminated(), [(7, 12)]);
    }

    /// Listens on `d`'s control socket as its recorded daemon (this process), as the daemon a
    /// supervisor started does; stops listening when dropped.
    fn as_the_daemon(d: &MpsDaemon) -> OwnedFd {
        std::fs::create_dir_all(&d.pipe_dir).unwrap();
        let listener = socket::listen_at(Path::new(&mps::control_socket(d))).unwrap();
        let me = crate::mps::record::of_child(d, std::process::id()).unwrap();
        crate::mps::record::write(d, &me).unwrap();
        listener
    }

    /// Runs `f` again while the freshly written script is still busy (`ETXTBSY`: another
    /// test thread forked while the file was open for writing).
    fn unless_busy<T>(mut f: impl FnMut() -> Result<T>) -> Result<T> {
        for _ in 0..50 {
            match f() {
                Err(Error::Io { source, .. }) if source.raw_os_error() == Some(26) => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                other => return other,
            }
        }
        f()
    }

    #[test]
    fn the_control_binary_is_asked_on_stdin_against_the_daemons_pipe_directory() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("nvidia-cuda-mps-control");
        let log = dir.path().join("asked");
        std::fs::write(
            &script,
            format!(
                "#!/bin/sh\nread -r cmd\necho \"$CUDA_MPS_PIPE_DIRECTORY $cmd\" >> {}\n\
                 case \"$cmd\" in\n  get_server_list) echo 41; echo 42 ;;\n  \
                 get_client_list*) echo 100 ;;\n  terminate_client*) ;;\n  \
                 *) echo 'unknown' >&2; exit 1 ;;\nesac\n",
                log.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let control = BinaryMpsControl::new(&script, Duration::from_secs(10));
        let d = daemon(&dir.path().join("pipe"));
        let _daemon = as_the_daemon(&d);
        assert_eq!(unless_busy(|| control.servers(&d)).unwrap(), [41, 42]);
        assert_eq!(control.clients(&d, 41).unwrap(), [100]);
        control.terminate(&d, 41, 100).unwrap();
        let asked = std::fs::read_to_string(&log).unwrap();
        let pipe = &d.pipe_dir;
        assert_eq!(
            asked,
            format!(
                "{pipe} get_server_list\n{pipe} get_client_list 41\n{pipe} terminate_client 41 100\n"
            )
        );
    }

    #[test]
    fn an_answer_that_is_not_pids_is_an_error_that_quotes_it() {
        let err =
            parse_pids("get_server_list", "41\nCannot find MPS control daemon\n").unwrap_err();
        assert!(err.to_string().contains("Cannot find MPS"), "{err}");
        assert_eq!(parse_pids("x", "\n 5 \n").unwrap(), [5]);
    }

    #[test]
    fn a_control_binary_that_hangs_is_killed_after_its_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("hang");
        std::fs::write(&script, "#!/bin/sh\nexec sleep 30\n").unwrap();
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let control = BinaryMpsControl::new(&script, Duration::from_millis(200));
        let d = daemon(&dir.path().join("pipe"));
        let _daemon = as_the_daemon(&d);
        let err = unless_busy(|| control.servers(&d)).unwrap_err();
        assert!(err.to_string().contains("did not answer"), "{err}");
    }

    #[test]
    fn the_control_binary_is_not_run_against_a_socket_its_daemon_does_not_answer() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("nvidia-cuda-mps-control");
        let ran = dir.path().join("ran");
        std::fs::write(
            &script,
            format!(
                "#!/bin/sh
touch {}
echo 41
",
                ran.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let control = BinaryMpsControl::new(&script, Duration::from_secs(10));
        let d = daemon(&dir.path().join("pipe"));
        // The daemon was recorded as another process (this test's parent); this process, a
        // tenant, listens on its socket.
        std::fs::create_dir_all(&d.pipe_dir).unwrap();
        let daemon_pid = std::os::unix::process::parent_id();
        let recorded = crate::mps::record::of_child(&d, daemon_pid).unwrap();
        crate::mps::record::write(&d, &recorded).unwrap();
        let _tenant = socket::listen_at(Path::new(&mps::control_socket(&d))).unwrap();
        let err = unless_busy(|| control.terminate(&d, 41, 100)).unwrap_err();
        assert!(matches!(err, Error::MpsPeer { .. }), "{err}");
        assert!(!ran.exists(), "the control binary never ran");
    }
}
