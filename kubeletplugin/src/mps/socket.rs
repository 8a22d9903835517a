//! The MPS control socket as it is on a real node: a unix `SOCK_SEQPACKET` socket named
//! `control` in the daemon's pipe directory. A stream socket cannot connect to it (the kernel
//! answers `EPROTOTYPE`), so finding a live daemon means connecting with the same type.

use std::os::fd::{AsRawFd as _, OwnedFd};
use std::path::Path;

use nix::errno::Errno;
use nix::sys::socket::{
    AddressFamily, Backlog, MsgFlags, SockFlag, SockType, UnixAddr, accept, bind, connect,
    getsockopt, listen, recv, send, socket, sockopt,
};
use tessera_driver::node::mps::ControlSocket;
use tessera_driver::node::mps_peer::{self, SocketPeer};

use crate::error::{Error, Result};

/// The largest message either side sends.
pub const MAX_MESSAGE: usize = 64 * 1024;

fn io(action: &'static str, path: &Path, errno: Errno) -> Error {
    Error::io(action, path, std::io::Error::from(errno))
}

fn new_socket(path: &Path) -> Result<(OwnedFd, UnixAddr)> {
    let fd = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(|e| io("creating a socket for", path, e))?;
    let addr = UnixAddr::new(path).map_err(|e| io("naming", path, e))?;
    Ok((fd, addr))
}

/// Connects to the control socket at `path`.
pub fn connect_to(path: &Path) -> Result<OwnedFd> {
    let (fd, addr) = new_socket(path)?;
    connect(fd.as_raw_fd(), &addr).map_err(|e| io("connecting to", path, e))?;
    Ok(fd)
}

/// What connecting to `path` finds: nothing, a dead daemon's socket file, or a daemon.
pub fn probe(path: &Path) -> ControlSocket {
    let Ok((fd, addr)) = new_socket(path) else {
        return ControlSocket::Refused;
    };
    match connect(fd.as_raw_fd(), &addr) {
        Ok(()) => ControlSocket::Answers,
        Err(Errno::ENOENT | Errno::ENOTDIR) => ControlSocket::Missing,
        // ECONNREFUSED: a socket file nobody listens on; EPROTOTYPE: not a control socket.
        Err(_) => ControlSocket::Refused,
    }
}

/// Who listens on the control socket at `path`: connects (sending nothing), asks the kernel for
/// the listening process's pid and uid (`SO_PEERCRED`), and reads that process's start time
/// from `/proc`, so that [`mps_peer::check_peer`] can tell the daemon from anyone else.
pub fn peer(path: &Path) -> Result<SocketPeer> {
    let fd = connect_to(path)?;
    let cred = getsockopt(&fd, sockopt::PeerCredentials)
        .map_err(|e| io("reading the peer of", path, e))?;
    // A pid of 0: the listener is outside this process's PID namespace (never the daemon).
    let pid = u32::try_from(cred.pid()).unwrap_or(0);
    let start_ticks = if pid == 0 {
        None
    } else {
        std::fs::read(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|stat| mps_peer::stat_start_ticks(&stat))
    };
    Ok(SocketPeer {
        pid,
        uid: cred.uid(),
        start_ticks,
    })
}

/// Listens on a new control socket at `path` (the fake daemon's side).
pub fn listen_at(path: &Path) -> Result<OwnedFd> {
    let (fd, addr) = new_socket(path)?;
    bind(fd.as_raw_fd(), &addr).map_err(|e| io("binding", path, e))?;
    let backlog = Backlog::new(64).map_err(|e| io("listening on", path, e))?;
    listen(&fd, backlog).map_err(|e| io("listening on", path, e))?;
    Ok(fd)
}

/// Accepts the next connection on `listener`.
pub fn accept_on(listener: &OwnedFd, path: &Path) -> Result<OwnedFd> {
    accept(listener).map_err(|e| io("accepting on", path, e))
}

/// Sends one message.
pub fn send_message(fd: &OwnedFd, message: &[u8], path: &Path) -> Result<()> {
    send(fd.as_raw_fd(), message, MsgFlags::MSG_NOSIGNAL)
        .map(|_| ())
        .map_err(|e| io("sending to", path, e))
}

/// Receives one message; an empty one means the peer closed the connection.
pub fn receive_message(fd: &OwnedFd, path: &Path) -> Result<Vec<u8>> {
    let mut buf = vec![0; MAX_MESSAGE];
    let n = recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty())
        .map_err(|e| io("receiving from", path, e))?;
    buf.truncate(n);
    Ok(buf)
}

#[cfg(test)]
mod tests {

    use super::*;

    #[test]
    fn only_a_listening_seqpacket_socket_answers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("control");
        assert_eq!(probe(&path), ControlSocket::Missing);

        // A stream socket at the path is not a control socket (EPROTOTYPE), as on a real node.
        let stream = std::os::unix::net::UnixListener::bind(&path).unwrap();
        assert_eq!(probe(&path), ControlSocket::Refused);
        drop(stream);
        std::fs::remove_file(&path).unwrap();

        let listener = listen_at(&path).unwrap();
        assert_eq!(probe(&path), ControlSocket::Answers);
        drop(listener);
        assert_eq!(
            probe(&path),
            ControlSocket::Refused,
            "the file of a daemon that died"
        );
    }

    #[test]
    fn the_peer_of_a_control_socket_is_the_process_that_listens_with_its_start_time() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("control");
        let _listener = listen_at(&path).unwrap();
        let me = peer(&path).unwrap();
        assert_eq!(me.pid, std::process::id());
        assert_eq!(me.uid, rustix::process::geteuid().as_raw());
        let stat = std::fs::read("/proc/self/stat").unwrap();
        assert_eq!(me.start_ticks, mps_peer::stat_start_ticks(&stat));
        assert!(me.start_ticks.is_some());
    }

    #[test]
    fn messages_keep_their_boundaries() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("control");
        let listener = listen_at(&path).unwrap();
        let client = connect_to(&path).unwrap();
        let server = accept_on(&listener, &path).unwrap();
        send_message(&client, b"get_server_list", &path).unwrap();
        send_message(&client, b"quit", &path).unwrap();
        assert_eq!(receive_message(&server, &path).unwrap(), b"get_server_list");
        assert_eq!(receive_message(&server, &path).unwrap(), b"quit");
        drop(client);
        assert!(receive_message(&server, &path).unwrap().is_empty());
    }
}
