//! The fake backend's `nvidia-cuda-mps-control` (binary `tessera-fake-mps-control`), with the
//! real one's observable behaviour as Tessera uses it:
//!
//! * `-f` runs a control daemon in the foreground on a `SOCK_SEQPACKET` socket named
//!   `control` in `CUDA_MPS_PIPE_DIRECTORY` (a second daemon on a directory where one answers
//!   refuses to start), and writes `control.log` in `CUDA_MPS_LOG_DIRECTORY`, one line per
//!   start and per command;
//! * without arguments it is the control client: each line of stdin is one command
//!   (`get_server_list`, `quit`, ...), sent to the daemon, its answer printed; with no daemon
//!   it fails;
//! * `quit` waits until the daemon has no clients, then the daemon removes its socket and
//!   exits, as MPS waits for its clients;
//! * `client` is a CUDA process of the fake: it connects to the daemon and stays its client
//!   until it is killed or the daemon goes. The daemon serves one Unix user at a time, as MPS
//!   documents: a client whose uid (`SO_PEERCRED`) is not the running server's waits ("client
//!   queued" in the log) until every client of that user has left, and only then attaches. The
//!   socket is open to every user (mode `0777`), as a daemon that serves any user's clients.
//!   While it has clients the daemon lists one server
//!   (its own pid) in `get_server_list`, and the clients' pids in `get_client_list <server>`;
//!   `terminate_client <server> <pid>` ends that client alone, which exits with code
//!   [`TERMINATED_EXIT`] as a CUDA process exits on `cudaErrorMpsClientTerminated`.

use std::collections::BTreeMap;
use std::io::{BufRead as _, Write as _};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tessera_driver::node::mps::{CONTROL_SOCKET, ControlSocket};

use super::socket;
use crate::error::{Error, Result};

/// The line a client sends first (followed by its pid).
pub const CLIENT_HELLO: &str = "client";
/// What the daemon sends a client it terminates, before it closes the connection.
const TERMINATED: &[u8] = b"terminated";
/// The exit code of a fake client terminated through `terminate_client`.
pub const TERMINATED_EXIT: i32 = 3;

fn env_dir(name: &str) -> Result<PathBuf> {
    std::env::var_os(name)
        .map(PathBuf::from)
        .ok_or_else(|| Error::Config(format!("{name} must be set")))
}

fn control_path() -> Result<PathBuf> {
    Ok(env_dir("CUDA_MPS_PIPE_DIRECTORY")?.join(CONTROL_SOCKET))
}

/// Runs the fake with `args` (without the program name); returns the exit code.
pub fn run(args: &[String]) -> Result<i32> {
    match args.first().map(String::as_str) {
        Some("-f") => daemon(),
        Some(CLIENT_HELLO) => client(),
        None => control_client(),
        Some(other) => Err(Error::Config(format!(
            "tessera-fake-mps-control: unknown argument {other:?} (use -f, client, or none)"
        ))),
    }
}

struct Daemon {
    path: PathBuf,
    log: Mutex<Option<std::fs::File>>,
    clients: AtomicUsize,
    /// The uid the running server serves (while it has clients).
    server_user: Mutex<Option<u32>>,
    /// The clients that said their pid, with a handle on their connection.
    pids: Mutex<BTreeMap<u32, OwnedFd>>,
}

impl Daemon {
    fn log(&self, line: &str) {
        if let Ok(mut log) = self.log.lock()
            && let Some(file) = log.as_mut()
        {
            let _ = writeln!(file, "{line}");
        }
    }
}

fn daemon() -> Result<i32> {
    let path = control_path()?;
    match socket::probe(&path) {
        ControlSocket::Answers => {
            return Err(Error::Mps(format!(
                "an MPS control daemon already answers on {}",
                path.display()
            )));
        }
        ControlSocket::Refused => {
            std::fs::remove_file(&path).map_err(|e| Error::io("removing", &path, e))?;
        }
        ControlSocket::Missing => {}
    }
    let log = match std::env::var_os("CUDA_MPS_LOG_DIRECTORY") {
        Some(dir) => {
            let file = Path::new(&dir).join("control.log");
            Some(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&file)
                    .map_err(|e| Error::io("opening", &file, e))?,
            )
        }
        None => None,
    };
    let listener = socket::listen_at(&path)?;
    // Clients of any user connect (connect(2) needs write permission on the socket).
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o777))
        .map_err(|e| Error::io("setting the mode of", &path, e))?;
    let daemon = Arc::new(Daemon {
        path,
        log: Mutex::new(log),
        clients: AtomicUsize::new(0),
        server_user: Mutex::new(None),
        pids: Mutex::new(BTreeMap::new()),
    });
    daemon.log(&format!(
        "start pid={} visible={}",
        std::process::id(),
        std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default()
    ));
    loop {
        let conn = socket::accept_on(&listener, &daemon.path)?;
        let daemon = Arc::clone(&daemon);
        std::thread::spawn(move || serve(&daemon, &conn));
    }
}

fn serve(daemon: &Daemon, conn: &OwnedFd) {
    // A connection closed without a command (a liveness probe) is no command.
    let Ok(message) = socket::receive_message(conn, &daemon.path) else {
        return;
    };
    if message.is_empty() {
        return;
    }
    let command = String::from_utf8_lossy(&message).trim().to_owned();
    if let Some(rest) = command.strip_prefix(CLIENT_HELLO)
        && (rest.is_empty() || rest.starts_with(' '))
    {
        let pid = rest.trim().parse::<u32>().ok();
        let uid = nix::sys::socket::getsockopt(conn, nix::sys::socket::sockopt::PeerCredentials)
            .map(|c| c.uid())
            .unwrap_or_default();
        attach(daemon, uid);
        if let (Some(pid), Ok(handle)) = (pid, conn.try_clone()) {
            lock(&daemon.pids).insert(pid, handle);
        }
        daemon.log(&format!("client connected uid={uid}"));
        let _ = socket::send_message(conn, b"ok", &daemon.path);
        // A client stays until its connection closes.
        while matches!(socket::receive_message(conn, &daemon.path), Ok(m) if !m.is_empty()) {}
        if let Some(pid) = pid {
            lock(&daemon.pids).remove(&pid);
        }
        {
            let mut server = lock(&daemon.server_user);
            if daemon.clients.fetch_sub(1, Ordering::SeqCst) == 1 {
                *server = None;
            }
        }
        daemon.log(&format!("client disconnected uid={uid}"));
        return;
    }
    daemon.log(&format!("command {command}"));
    let reply = match command.as_str() {
        "get_server_list" => {
            if daemon.clients.load(Ordering::SeqCst) > 0 {
                std::process::id().to_string()
            } else {
                String::new()
            }
        }
        "quit" => {
            while daemon.clients.load(Ordering::SeqCst) > 0 {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = std::fs::remove_file(&daemon.path);
            daemon.log("exit");
            let _ = socket::send_message(conn, b"", &daemon.path);
            std::process::exit(0);
        }
        other => client_command(daemon, other),
    };
    let _ = socket::send_message(conn, reply.as_bytes(), &daemon.path);
}

/// Makes a client of `uid` one of the server's clients: at once when the server serves `uid`
/// (or nobody); else, as MPS queues a client of another user, once every client of the
/// server's user has left.
fn attach(daemon: &Daemon, uid: u32) {
    let mut logged = false;
    loop {
        {
            let mut server = lock(&daemon.server_user);
            if server.is_none_or(|u| u == uid) {
                *server = Some(uid);
                daemon.clients.fetch_add(1, Ordering::SeqCst);
                return;
            }
        }
        if !logged {
            daemon.log(&format!("client queued uid={uid}"));
            logged = true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// `get_client_list <server>` and `terminate_client <server> <pid>`; anything else is unknown.
fn client_command(daemon: &Daemon, command: &str) -> String {
    let words: Vec<&str> = command.split_whitespace().collect();
    let me = std::process::id().to_string();
    match words.as_slice() {
        ["get_client_list", server] if *server == me => lock(&daemon.pids)
            .keys()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join("\n"),
        ["terminate_client", server, pid] if *server == me => {
            let handle = pid
                .parse::<u32>()
                .ok()
                .and_then(|p| lock(&daemon.pids).remove(&p));
            match handle {
                Some(fd) => {
                    daemon.log(&format!("terminate_client {pid}"));
                    let _ = socket::send_message(&fd, TERMINATED, &daemon.path);
                    let _ = nix::sys::socket::shutdown(
                        std::os::fd::AsRawFd::as_raw_fd(&fd),
                        nix::sys::socket::Shutdown::Both,
                    );
                    String::new()
                }
                None => format!("{pid} is not a client of server {server}"),
            }
        }
        ["get_client_list" | "terminate_client", server, ..] => format!("no server {server}"),
        _ => format!("unknown command {command}"),
    }
}

fn control_client() -> Result<i32> {
    let path = control_path()?;
    let stdout = std::io::stdout();
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|e| Error::io("reading", "stdin", e))?;
        let command = line.trim();
        if command.is_empty() {
            continue;
        }
        let conn = socket::connect_to(&path)
            .map_err(|e| Error::Mps(format!("cannot find the MPS control daemon: {e}")))?;
        socket::send_message(&conn, command.as_bytes(), &path)?;
        let reply = socket::receive_message(&conn, &path)?;
        let mut out = stdout.lock();
        out.write_all(&reply)
            .and_then(|()| out.write_all(b"\n"))
            .map_err(|e| Error::io("writing", "stdout", e))?;
    }
    Ok(0)
}

fn client() -> Result<i32> {
    let path = control_path()?;
    let conn = socket::connect_to(&path)?;
    let hello = format!("{CLIENT_HELLO} {}", std::process::id());
    socket::send_message(&conn, hello.as_bytes(), &path)?;
    let _ = socket::receive_message(&conn, &path)?;
    // Stay a client until the daemon goes, terminates this client, or this process is killed.
    while let Ok(m) = socket::receive_message(&conn, &path) {
        if m == TERMINATED {
            return Ok(TERMINATED_EXIT);
        }
        if m.is_empty() {
            break;
        }
    }
    Ok(0)
}
