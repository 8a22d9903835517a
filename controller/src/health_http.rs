//! The operations endpoint: `/metrics`, `/healthz` and `/readyz` over plain HTTP/1.1.
//!
//! Three GET routes need no HTTP framework: each connection carries one request, bounded in
//! size and time, and is closed after the answer. `/readyz` is ready once every reflector has
//! listed its resource (a standby replica is ready too: it only waits for the Lease).

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

/// The largest request head accepted.
const MAX_REQUEST_BYTES: usize = 8 * 1024;
/// How long a client may take to send its request.
const READ_TIMEOUT: Duration = Duration::from_secs(5);
const TEXT: &str = "text/plain; charset=utf-8";

/// The running endpoint; stops when dropped.
#[derive(Debug)]
pub struct OpsServer {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Drop for OpsServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl OpsServer {
    /// Binds `addr` and serves; `synced` says whether the cluster view is complete.
    pub async fn start(
        addr: SocketAddr,
        metrics: Arc<Metrics>,
        synced: watch::Receiver<bool>,
    ) -> Result<Self> {
        let bind_error = |e: std::io::Error| Error::Config(format!("binding {addr}: {e}"));
        let listener = TcpListener::bind(addr).await.map_err(bind_error)?;
        let addr = listener.local_addr().map_err(bind_error)?;
        let task = tokio::spawn(async move {
            loop {
                match listener.accept().await {
                    Ok((stream, peer)) => {
                        let metrics = Arc::clone(&metrics);
                        let synced = synced.clone();
                        tokio::spawn(async move {
                            if let Err(e) = handle(stream, &metrics, &synced).await {
                                debug!(%peer, error = %e, "operations request failed");
                            }
                        });
                    }
                    Err(e) => {
                        warn!(error = %e, "accepting an operations connection failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        });
        info!(%addr, "serving /metrics, /healthz and /readyz");
        Ok(Self { addr, task })
    }

    /// The bound address (the system picks the port when it was 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

/// The path a request head asks for, or the status to refuse it with.
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

async fn read_head(stream: &mut TcpStream) -> std::io::Result<Option<Vec<u8>>> {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0_u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        if head.len() > MAX_REQUEST_BYTES {
            return Ok(None);
        }
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Ok(None);
        }
        head.extend_from_slice(&buf[..n]);
    }
    Ok(Some(head))
}

async fn handle(
    mut stream: TcpStream,
    metrics: &Metrics,
    synced: &watch::Receiver<bool>,
) -> std::io::Result<()> {
    let head = tokio::time::timeout(READ_TIMEOUT, read_head(&mut stream))
        .await
        .unwrap_or(Ok(None))?;
    let (status, reason, content_type, body) = match head {
        None => (400, "Bad Request", TEXT, "incomplete request\n".to_owned()),
        Some(head) => match route(&String::from_utf8_lossy(&head)) {
            Ok("/metrics") => match metrics.encode() {
                Ok(text) => (200, "OK", metrics::CONTENT_TYPE, text),
                Err(e) => (500, "Internal Server Error", TEXT, format!("{e}\n")),
            },
            Ok("/healthz") => (200, "OK", TEXT, "ok\n".to_owned()),
            Ok("/readyz") if *synced.borrow() => (200, "OK", TEXT, "ok\n".to_owned()),
            Ok("/readyz") => (
                503,
                "Service Unavailable",
                TEXT,
                "the cluster view is not synced yet\n".to_owned(),
            ),
            Ok(_) => (404, "Not Found", TEXT, "not found\n".to_owned()),
            Err((status, reason)) => (status, reason, TEXT, format!("{reason}\n")),
        },
    };
    let response = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_get_requests_are_routed() {
        assert_eq!(route("GET /readyz?verbose HTTP/1.1\r\n\r\n"), Ok("/readyz"));
        assert_eq!(
            route("PUT /metrics HTTP/1.1\r\n").map_err(|e| e.0),
            Err(405)
        );
        assert_eq!(route("GET /metrics SPDY/3\r\n").map_err(|e| e.0), Err(400));
    }
}
