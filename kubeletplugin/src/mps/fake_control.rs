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
//!   until it is killed or the daemon goes. While it has clients the daemon lists one server
//!   (its own pid) in `get_server_list`.

use std::io::{BufRead as _, Write as _};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tessera_driver::node::mps::{CONTROL_SOCKET, ControlSocket};

use super::socket;
use crate::error::{Error, Result};

/// The line a client sends first.
pub const CLIENT_HELLO: &str = "client";

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
    let daemon = Arc::new(Daemon {
        path,
        log: Mutex::new(log),
        clients: AtomicUsize::new(0),
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
    let Ok(message) = socket::receive_message(conn, &daemon.path) else {
        return;
    };
    let command = String::from_utf8_lossy(&message).trim().to_owned();
    if command == CLIENT_HELLO {
        daemon.clients.fetch_add(1, Ordering::SeqCst);
        daemon.log("client connected");
        let _ = socket::send_message(conn, b"ok", &daemon.path);
        // A client stays until its connection closes.
        while matches!(socket::receive_message(conn, &daemon.path), Ok(m) if !m.is_empty()) {}
        daemon.clients.fetch_sub(1, Ordering::SeqCst);
        daemon.log("client disconnected");
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
        other => format!("unknown command {other}"),
    };
    let _ = socket::send_message(conn, reply.as_bytes(), &daemon.path);
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
    socket::send_message(&conn, CLIENT_HELLO.as_bytes(), &path)?;
    let _ = socket::receive_message(&conn, &path)?;
    // Stay a client until the daemon goes (or this process is killed).
    while matches!(socket::receive_message(&conn, &path), Ok(m) if !m.is_empty()) {}
    Ok(0)
}
