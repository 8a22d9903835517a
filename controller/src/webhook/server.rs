//! The HTTPS server: TLS with rustls (ring), HTTP/1.1 with hyper, bounded in every dimension a
//! caller controls (body size, header and handshake time, request time, connections).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt as _, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;

use super::hooks::{Admission, Hook};
use super::tls::CertStore;
use crate::error::{Error, Result};

/// The largest review body accepted (the API server's own request limit is 3 MiB, and a review
/// can carry an object and its old version).
pub const MAX_BODY_BYTES: usize = 8 * 1024 * 1024;
/// How long a client may take for the TLS handshake and for the request headers.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one request may take from its headers to the answer.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// At most this many connections are served at once; more wait to be accepted.
const MAX_CONNECTIONS: usize = 512;
/// How long in-flight connections get to finish at shutdown.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// A bound webhook server, ready to run.
#[derive(Debug)]
pub struct BoundWebhook {
    listener: TcpListener,
    certs: Arc<CertStore>,
    tls: Arc<rustls::ServerConfig>,
    admission: Arc<Admission>,
}

impl BoundWebhook {
    pub(super) fn new(
        listener: TcpListener,
        certs: Arc<CertStore>,
        tls: Arc<rustls::ServerConfig>,
        admission: Admission,
    ) -> Self {
        Self {
            listener,
            certs,
            tls,
            admission: Arc::new(admission),
        }
    }

    /// The address it listens on (useful with port 0).
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.listener
            .local_addr()
            .map_err(|e| Error::Config(format!("webhook listener address: {e}")))
    }

    /// Serves until `shutdown` completes, then lets in-flight requests finish.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<()> {
        let addr = self.local_addr()?;
        tracing::info!(%addr, "admission webhook serving");
        let (stop_tx, stop_rx) = watch::channel(false);
        let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        let mut connections = JoinSet::new();
        tokio::pin!(shutdown);
        loop {
            let permit = tokio::select! {
                () = &mut shutdown => break,
                permit = Arc::clone(&permits).acquire_owned() => match permit {
                    Ok(p) => p,
                    Err(_) => break,
                },
            };
            let accepted = tokio::select! {
                () = &mut shutdown => break,
                accepted = self.listener.accept() => accepted,
            };
            // Reap finished connection tasks so the set does not grow without bound.
            while connections.try_join_next().is_some() {}
            let (stream, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            self.certs.refresh();
            let acceptor = TlsAcceptor::from(Arc::clone(&self.tls));
            let admission = Arc::clone(&self.admission);
            let mut stop = stop_rx.clone();
            connections.spawn(async move {
                let _permit = permit;
                let tls =
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => tls,
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            tracing::debug!(%peer, "TLS handshake timed out");
                            return;
                        }
                    };
                let service = hyper::service::service_fn(move |req| {
                    let admission = Arc::clone(&admission);
                    async move { Ok::<_, Infallible>(respond(&admission, req).await) }
                });
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HANDSHAKE_TIMEOUT)
                    .serve_connection(TokioIo::new(tls), service);
                tokio::pin!(conn);
                tokio::select! {
                    result = conn.as_mut() => {
                        if let Err(e) = result {
                            tracing::debug!(%peer, error = %e, "connection ended with an error");
                        }
                    }
                    () = async { let _ = stop.wait_for(|s| *s).await.is_ok(); } => {
                        conn.as_mut().graceful_shutdown();
                        let _ = conn.await;
                    }
                }
            });
        }
        tracing::info!(%addr, "admission webhook stopping");
        let _ = stop_tx.send(true);
        let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
            while connections.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            connections.abort_all();
        }
        Ok(())
    }
}

fn plain(status: StatusCode, text: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(text.into()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

async fn respond(admission: &Admission, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let path = req.uri().path().to_owned();
    if path == "/healthz" || path == "/readyz" {
        return plain(StatusCode::OK, "ok\n");
    }
    let Some(hook) = Hook::from_path(&path) else {
        return plain(StatusCode::NOT_FOUND, format!("no hook at {path}\n"));
    };
    if req.method() != Method::POST {
        return plain(
            StatusCode::METHOD_NOT_ALLOWED,
            "admission reviews are POSTed\n",
        );
    }
    let answer = tokio::time::timeout(REQUEST_TIMEOUT, async {
        let body = match Limited::new(req.into_body(), MAX_BODY_BYTES)
            .collect()
            .await
        {
            Ok(b) => b.to_bytes(),
            Err(e) => {
                return plain(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("reading the body failed (at most {MAX_BODY_BYTES} bytes): {e}\n"),
                );
            }
        };
        match admission.review(hook, &body).await {
            Ok(review) => match serde_json::to_vec(&review) {
                Ok(json) => {
                    let mut response = Response::new(Full::new(Bytes::from(json)));
                    response.headers_mut().insert(
                        hyper::header::CONTENT_TYPE,
                        hyper::header::HeaderValue::from_static("application/json"),
                    );
                    response
                }
                Err(e) => plain(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("encoding the answer: {e}\n"),
                ),
            },
            Err(message) => plain(StatusCode::BAD_REQUEST, format!("{message}\n")),
        }
    })
    .await;
    answer.unwrap_or_else(|_| {
        plain(
            StatusCode::SERVICE_UNAVAILABLE,
            "the review took too long\n",
        )
    })
}
