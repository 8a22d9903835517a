//! The operations endpoint: `/metrics`, `/healthz` and `/readyz` over plain HTTP/1.1, served
//! by hyper (request parsing and limits are hyper's). Each connection carries one request and
//! is closed after the answer; the request head is bounded in size and time and no request
//! body is read, so a stuck or hostile client cannot hold the plugin's memory.

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
use crate::kubelet::registration::KubeletVerdict;
use crate::ops::metrics::{self, Metrics};

/// Largest read buffer for a request head (hyper's smallest allowed); a longer head is refused.
const MAX_REQUEST_BYTES: usize = 8 * 1024;
/// How long a client may take to send its request head.
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
        let mut http = hyper::server::conn::http1::Builder::new();
        http.timer(TokioTimer::new())
            .header_read_timeout(READ_TIMEOUT)
            .max_buf_size(MAX_REQUEST_BYTES)
            .keep_alive(false);
        let serve = probes::serve(listener, http, move |method, path| {
            respond(method, path, &metrics, &readiness)
        });
        let task = tokio::spawn(async move {
            tokio::select! {
                _ = stopped.changed() => {}
                () = serve => {}
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

/// The answer to a request for `path` with `method`.
fn respond(
    method: &Method,
    path: &str,
    metrics: &Metrics,
    readiness: &Readiness,
) -> Response<Full<Bytes>> {
    probes::respond(
        method,
        path,
        metrics::CONTENT_TYPE,
        || metrics.encode().map_err(|e| e.to_string()),
        || readiness.check(),
    )
}

#[cfg(test)]
mod tests {
    use hyper::StatusCode;
    use tessera_kubeapi::probes::TEXT;

    use super::*;

    fn status_and_type(method: &Method, path: &str, readiness: &Readiness) -> (StatusCode, String) {
        let response = respond(method, path, &Metrics::new(), readiness);
        let content_type = response.headers()[hyper::header::CONTENT_TYPE]
            .to_str()
            .unwrap()
            .to_owned();
        (response.status(), content_type)
    }

    #[test]
    fn routes_get_requests_only() {
        let (verdict, registration) = watch::channel(None);
        let readiness = Readiness::new(registration);
        assert_eq!(
            status_and_type(&Method::GET, "/metrics", &readiness),
            (StatusCode::OK, metrics::CONTENT_TYPE.to_owned())
        );
        assert_eq!(
            status_and_type(&Method::GET, "/healthz", &readiness),
            (StatusCode::OK, TEXT.to_owned())
        );
        assert_eq!(
            status_and_type(&Method::GET, "/readyz", &readiness).0,
            StatusCode::SERVICE_UNAVAILABLE
        );
        verdict.send_replace(Some(KubeletVerdict {
            registered: true,
            error: String::new(),
        }));
        assert_eq!(
            status_and_type(&Method::GET, "/readyz", &readiness).0,
            StatusCode::OK
        );
        assert_eq!(
            status_and_type(&Method::GET, "/nope", &readiness).0,
            StatusCode::NOT_FOUND
        );
        assert_eq!(
            status_and_type(&Method::POST, "/metrics", &readiness).0,
            StatusCode::METHOD_NOT_ALLOWED
        );
    }
}
