//! The operations endpoint: `/metrics`, `/healthz` and `/readyz` over plain HTTP/1.1, served
//! by hyper (request parsing, keep-alive and limits are hyper's; a slow client gets the
//! header-read timeout). `/readyz` is ready once every reflector has listed its resource (a
//! standby replica is ready too: it only waits for the Lease).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Method, Response};
use hyper_util::rt::TokioTimer;
use tessera_kubeapi::probes;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::info;

use crate::error::{Error, Result};
use crate::metrics::{self, Metrics};

/// How long a client may take to send its request head.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

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
        let mut http = hyper::server::conn::http1::Builder::new();
        http.timer(TokioTimer::new())
            .header_read_timeout(READ_TIMEOUT);
        let task = tokio::spawn(probes::serve(listener, http, move |method, path| {
            respond(method, path, &metrics, &synced)
        }));
        info!(%addr, "serving /metrics, /healthz and /readyz");
        Ok(Self { addr, task })
    }

    /// The bound address (the system picks the port when it was 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

/// The answer to a request for `path` with `method`.
fn respond(
    method: &Method,
    path: &str,
    metrics: &Metrics,
    synced: &watch::Receiver<bool>,
) -> Response<Full<Bytes>> {
    probes::respond(
        method,
        path,
        metrics::CONTENT_TYPE,
        || metrics.encode().map_err(|e| e.to_string()),
        || {
            if *synced.borrow() {
                Ok(())
            } else {
                Err("the cluster view is not synced yet".to_owned())
            }
        },
    )
}
