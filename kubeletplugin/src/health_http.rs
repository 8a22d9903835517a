//! The operations endpoint: `/metrics`, `/healthz` and `/readyz` over plain HTTP/1.1.
//!
//! Three fixed GET routes do not need an HTTP framework: each connection carries one request
//! and is closed after the answer. Requests are bounded (size and time) so a stuck or hostile
//! client cannot hold the plugin's memory.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use crate::error::{Error, Result};
use crate::metrics::{self, Metrics};
use crate::registration::KubeletVerdict;

/// Longest request head read; anything longer is refused.
const MAX_REQUEST_BYTES: usize = 8 * 1024;
/// How long a client may take to send its request.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// What `/readyz` answers from: the plugin serves its sockets once this exists, and is ready
/// when kubelet's last verdict registered it.
#[derive(Debug, Clone)]
pub struct Readiness {
    registration: watch::Receiver<Option<KubeletVerdict>>,
}

impl Readiness {
    /// Readiness from kubelet's verdicts (`RunningPlugin::registration`).
    pub fn new(registration: watch::Receiver<Option<KubeletVerdict>>) -> Self {
        Self { registration }
    }

    /// `Ok` when ready, else why not.
    pub fn check(&self) -> std::result::Result<(), String> {
        match self.registration.borrow().as_ref() {
            Some(v) if v.registered => Ok(()),
            Some(v) => Err(format!("kubelet refused the registration: {}", v.error)),
            None => Err("kubelet has not registered the plugin yet".to_owned()),
        }
    }
}

/// The running endpoint.
#[derive(Debug)]
pub struct OpsServer {
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl OpsServer {
    /// Binds `addr` and serves until [`OpsServer::shutdown`].
    pub async fn start(
        addr: SocketAddr,
        metrics: Arc<Metrics>,
        readiness: Readiness,
    ) -> Result<Self> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| Error::io("binding", addr.to_string(), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io("binding", addr.to_string(), e))?;
        let (stop, mut stopped) = watch::channel(false);
        let task = tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = stopped.changed() => break,
                    accepted = listener.accept() => match accepted {
                        Ok((stream, peer)) => {
                            let metrics = Arc::clone(&metrics);
                            let readiness = readiness.clone();
                            tokio::spawn(async move {
                                if let Err(e) = handle(stream, &metrics, &readiness).await {
                                    debug!(%peer, error = %e, "operations request failed");
                                }
                            });
                        }
                        Err(e) => {
                            warn!(error = %e, "accepting an operations connection failed");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    },
                }
            }
        });
        info!(%addr, "serving /metrics, /healthz and /readyz");
        Ok(Self { addr, stop, task })
    }

    /// The bound address (the port is chosen by the system when `addr` had port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting connections.
    pub async fn shutdown(self) -> Result<()> {
        self.stop.send_replace(true);
        self.task.await.map_err(|e| Error::Task(e.to_string()))
    }
}

/// The route a request head asks for, or the status to refuse it with.
fn route(head: &str) -> std::result::Result<&str, (u16, &'static str)> {
    let line = head.lines().next().unwrap_or_default();
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version)) = (parts.next(), parts.next(), parts.next())
    else {
        return Err((400, "Bad Request"));
    };
    if !version.starts_with("HTTP/1.") {
        return Err((400, "Bad Request"));
    }
    if method != "GET" {
        return Err((405, "Method Not Allowed"));
    }
    Ok(target.split('?').next().unwrap_or(target))
}

async fn handle(mut stream: TcpStream, metrics: &Metrics, readiness: &Readiness) -> Result<()> {
    let io = |e| Error::io("serving", "operations endpoint", e);
    let mut head = Vec::with_capacity(512);
    let mut buf = [0_u8; 1024];
    let read = tokio::time::timeout(READ_TIMEOUT, async {
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            if head.len() > MAX_REQUEST_BYTES {
                return Ok(false);
            }
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                return Ok(false);
            }
            head.extend_from_slice(&buf[..n]);
        }
        Ok::<_, std::io::Error>(true)
    })
    .await;
    let complete = match read {
        Ok(result) => result.map_err(io)?,
        Err(_) => false,
    };
    let head = String::from_utf8_lossy(&head);
    let (status, reason, content_type, body) = if complete {
        match route(&head) {
            Ok("/metrics") => match metrics.encode() {
                Ok(text) => (200, "OK", metrics::CONTENT_TYPE, text),
                Err(e) => (500, "Internal Server Error", TEXT, format!("{e}\n")),
            },
            Ok("/healthz") => (200, "OK", TEXT, "ok\n".to_owned()),
            Ok("/readyz") => match readiness.check() {
                Ok(()) => (200, "OK", TEXT, "ok\n".to_owned()),
                Err(why) => (503, "Service Unavailable", TEXT, format!("{why}\n")),
            },
            Ok(_) => (404, "Not Found", TEXT, "not found\n".to_owned()),
            Err((status, reason)) => (status, reason, TEXT, format!("{reason}\n")),
        }
    } else {
        (400, "Bad Request", TEXT, "incomplete request\n".to_owned())
    };
    let response = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await.map_err(io)?;
    stream.shutdown().await.map_err(io)
}

const TEXT: &str = "text/plain; charset=utf-8";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_get_requests_only() {
        assert_eq!(route("GET /metrics HTTP/1.1\r\n\r\n"), Ok("/metrics"));
        assert_eq!(route("GET /readyz?verbose HTTP/1.0\r\n\r\n"), Ok("/readyz"));
        assert_eq!(route("POST /metrics HTTP/1.1\r\n").unwrap_err().0, 405);
        assert_eq!(route("GET /metrics SPDY/3\r\n").unwrap_err().0, 400);
        assert_eq!(route("nonsense").unwrap_err().0, 400);
    }
}
