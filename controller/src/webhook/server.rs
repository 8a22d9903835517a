//! The HTTPS server: TLS with rustls (ring), HTTP/1.1 with hyper, bounded in every dimension a
//! caller controls (body size, handshake, header, idle and request time, connections).
//!
//! A connection goes through two stages. In the handshake stage ([`super::handshakes`]) it
//! must finish its TLS handshake and get a serving slot within [`HANDSHAKE_TIMEOUT`]; the
//! stage holds at most [`MAX_HANDSHAKES`] connections and drops the one that waited longest
//! when a new one arrives at a full stage, and the accept loop never waits for either stage.
//! Served connections ([`MAX_CONNECTIONS`] at once) must send each request's headers within
//! [`IDLE_TIMEOUT`] of being ready for it (so an idle keep-alive connection is closed after
//! that long) and its body within [`BODY_TIMEOUT`]. Every limit is well under the API
//! server's webhook timeout (10 s in the chart), so idle connections cannot delay a review
//! into a denial.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt as _, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use super::handshakes::{Eviction, HandshakeStage};
use super::hooks::{Admission, Hook};
use super::tls::CertStore;
use crate::error::{Error, Result};

/// The largest review body accepted (the API server's own request limit is 3 MiB, and a review
/// can carry an object and its old version).
pub const MAX_BODY_BYTES: usize = 8 * 1024 * 1024;
/// How long an accepted connection may take to finish its TLS handshake and get a serving slot.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a served connection may wait before the headers of its next request are in (the
/// first request's, and each later one's on a kept-alive connection).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the body of a request may take once its headers are in.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(2);
/// How long one review may take from its body to the answer (the lookups have their own,
/// shorter timeout; this is the backstop).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// At most this many connections are served at once.
pub const MAX_CONNECTIONS: usize = 512;
/// At most this many connections are in the handshake stage at once.
pub const MAX_HANDSHAKES: usize = 1024;
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
        let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        let mut stage = HandshakeStage::new(MAX_HANDSHAKES);
        let mut connections = JoinSet::new();
        tokio::pin!(shutdown);
        loop {
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
            let (eviction, evicted) = stage.admit();
            if evicted {
                tracing::debug!(%peer, "handshake stage full; dropped the connection that waited longest");
            }
            self.certs.refresh();
            let connection = Connection {
                acceptor: TlsAcceptor::from(Arc::clone(&self.tls)),
                admission: Arc::clone(&self.admission),
                slots: Arc::clone(&slots),
                stop: stop_rx.clone(),
                peer,
            };
            connections.spawn(connection.run(stream, eviction));
        }
        tracing::info!(%addr, "admission webhook stopping");
        // Connections still in the handshake stage give up; served ones finish gracefully.
        drop(stage);
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

/// One accepted connection and what it needs to be served.
struct Connection {
    acceptor: TlsAcceptor,
    admission: Arc<Admission>,
    slots: Arc<Semaphore>,
    stop: watch::Receiver<bool>,
    peer: SocketAddr,
}

impl Connection {
    async fn run(self, stream: TcpStream, eviction: Eviction) {
        let peer = self.peer;
        let Some((tls, slot)) = self.handshake(stream, eviction).await else {
            return;
        };
        self.serve(tls, slot).await;
        tracing::trace!(%peer, "connection closed");
    }

    /// The handshake stage: TLS, then a serving slot, within [`HANDSHAKE_TIMEOUT`]; `None`
    /// when the connection timed out, failed or was evicted. Leaving this function (the
    /// eviction receiver dropped) takes the connection out of the stage.
    async fn handshake(
        &self,
        stream: TcpStream,
        eviction: Eviction,
    ) -> Option<(TlsStream<TcpStream>, OwnedSemaphorePermit)> {
        let peer = self.peer;
        let ready = async {
            let tls = self.acceptor.accept(stream).await.map_err(|e| {
                tracing::debug!(%peer, error = %e, "TLS handshake failed");
            })?;
            let slot = Arc::clone(&self.slots)
                .acquire_owned()
                .await
                .map_err(|_| ())?;
            Ok::<_, ()>((tls, slot))
        };
        tokio::select! {
            _ = eviction => {
                tracing::debug!(%peer, "evicted from the handshake stage");
                None
            }
            done = tokio::time::timeout(HANDSHAKE_TIMEOUT, ready) => match done {
                Ok(Ok(ready)) => Some(ready),
                Ok(Err(())) => None,
                Err(_) => {
                    tracing::debug!(%peer, timeout = ?HANDSHAKE_TIMEOUT, "TLS handshake or serving slot timed out");
                    None
                }
            },
        }
    }

    /// Serves HTTP/1.1 on the connection until the client closes it, it idles past
    /// [`IDLE_TIMEOUT`], or the server stops.
    async fn serve(self, tls: TlsStream<TcpStream>, slot: OwnedSemaphorePermit) {
        let _slot = slot;
        let Self {
            admission,
            mut stop,
            peer,
            ..
        } = self;
        let service = hyper::service::service_fn(move |req| {
            let admission = Arc::clone(&admission);
            async move { Ok::<_, Infallible>(respond(&admission, req).await) }
        });
        // hyper's header read timeout runs whenever the connection waits for a request head,
        // the first one and each one after a kept-alive answer: it is the idle timeout too.
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(IDLE_TIMEOUT)
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
    let body = tokio::time::timeout(
        BODY_TIMEOUT,
        Limited::new(req.into_body(), MAX_BODY_BYTES).collect(),
    )
    .await;
    let body = match body {
        Ok(Ok(b)) => b.to_bytes(),
        Ok(Err(e)) => {
            return plain(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("reading the body failed (at most {MAX_BODY_BYTES} bytes): {e}\n"),
            );
        }
        Err(_) => {
            return plain(
                StatusCode::REQUEST_TIMEOUT,
                format!("the body did not arrive within {BODY_TIMEOUT:?}\n"),
            );
        }
    };
    let answer = tokio::time::timeout(REQUEST_TIMEOUT, async {
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
