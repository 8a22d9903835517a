//! The HTTPS server: TLS with rustls (ring), HTTP/1.1 with hyper, bounded in every dimension a
//! caller controls (body size, handshake, header, idle and request time, connections).
//!
//! A connection goes through two stages ([`super::stage`]), and the accept loop never waits
//! for either. In the handshake stage (by default at most [`MAX_HANDSHAKES`] connections) it
//! must finish its TLS handshake within [`HANDSHAKE_TIMEOUT`]. Then it is served (by default at
//! most [`MAX_CONNECTIONS`] at once): it must send each request's headers within [`IDLE_TIMEOUT`]
//! of being ready for it (so an idle keep-alive connection is closed after that long) and its
//! body within [`BODY_TIMEOUT`]. In both stages a connection that waits on its peer (for the
//! handshake, a request's head or its body) is evicted when a new connection needs its place:
//! one peer address may have only so many connections waiting (a new one evicts its own
//! oldest), and at a full stage the oldest waiting of any peer goes; only a connection
//! answering a complete request keeps its place. So peers that hold connections open and
//! dribble or say nothing never make the API server's connection wait for a place. Every limit
//! is well under the API server's webhook timeout (10 s in the chart).

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
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use super::hooks::{Admission, Hook};
use super::stage::{Entry, Evicted, Place, Stage};
use super::tls::CertStore;
use crate::error::{Error, Result};

/// The largest review body accepted (the API server's own request limit is 3 MiB, and a review
/// can carry an object and its old version).
pub const MAX_BODY_BYTES: usize = 8 * 1024 * 1024;
/// How long an accepted connection may take to finish its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a served connection may wait before the headers of its next request are in (the
/// first request's, and each later one's on a kept-alive connection).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the body of a request may take once its headers are in.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(2);
/// How long one review may take from its body to the answer (the lookups have their own,
/// shorter timeout; this is the backstop).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// By default, at most this many connections are served at once (past the handshake).
pub const MAX_CONNECTIONS: usize = 512;
/// By default, at most this many connections are in the handshake stage at once.
pub const MAX_HANDSHAKES: usize = 1024;
/// By default, one peer address may have at most this share of each stage's places waiting
/// on it (1/4: a quarter of the served places, a quarter of the handshake stage).
const PER_PEER_DIVISOR: usize = 4;

pub use super::stage::Bounds;

/// How many connections each stage holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    /// Connections served at once (past their TLS handshake).
    pub served: Bounds,
    /// Connections in their TLS handshake at once.
    pub handshakes: Bounds,
}

impl Default for Capacity {
    fn default() -> Self {
        Self::of(MAX_CONNECTIONS, MAX_HANDSHAKES)
    }
}

impl Capacity {
    /// `served` and `handshakes` places, a quarter of each for one peer's waiting connections.
    pub fn of(served: usize, handshakes: usize) -> Self {
        let bounds = |capacity: usize| Bounds {
            capacity,
            per_peer: (capacity / PER_PEER_DIVISOR).max(1),
        };
        Self {
            served: bounds(served),
            handshakes: bounds(handshakes),
        }
    }
}
/// How long in-flight connections get to finish at shutdown.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// A bound webhook server, ready to run.
#[derive(Debug)]
pub struct BoundWebhook {
    listener: TcpListener,
    certs: Arc<CertStore>,
    tls: Arc<rustls::ServerConfig>,
    admission: Arc<Admission>,
    capacity: Capacity,
}

impl BoundWebhook {
    pub(super) fn new(
        listener: TcpListener,
        certs: Arc<CertStore>,
        tls: Arc<rustls::ServerConfig>,
        admission: Admission,
        capacity: Capacity,
    ) -> Self {
        Self {
            listener,
            certs,
            tls,
            admission: Arc::new(admission),
            capacity,
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
        let handshakes = Stage::new(self.capacity.handshakes);
        let served = Stage::new(self.capacity.served);
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
            // Every place of the handshake stage waits on its peer: entering always succeeds.
            let Some(place) = placed(handshakes.enter(peer.ip()), peer, "handshake") else {
                continue;
            };
            self.certs.refresh();
            let connection = Connection {
                acceptor: TlsAcceptor::from(Arc::clone(&self.tls)),
                admission: Arc::clone(&self.admission),
                served: served.clone(),
                stop: stop_rx.clone(),
                peer,
            };
            connections.spawn(connection.run(stream, place));
        }
        tracing::info!(%addr, "admission webhook stopping");
        // Connections waiting on their peer give up; those answering a review finish.
        handshakes.evict_waiting();
        served.evict_waiting();
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

/// The place `entry` gave a connection from `peer` in the `stage` named, logged.
fn placed(entry: Entry, peer: SocketAddr, stage: &str) -> Option<Place> {
    match entry {
        Entry::Placed { place, evicted } => {
            match evicted {
                Evicted::Nobody => {}
                Evicted::OwnOldest => {
                    tracing::debug!(%peer, stage, "the peer has its most connections waiting; closed its own that waited longest");
                }
                Evicted::Oldest => {
                    tracing::debug!(%peer, stage, "stage full; closed the connection that waited longest on its peer");
                }
            }
            Some(place)
        }
        Entry::Full => {
            tracing::warn!(%peer, stage, "every place is busy answering a review; connection closed");
            None
        }
    }
}

/// One accepted connection and what it needs to be served.
struct Connection {
    acceptor: TlsAcceptor,
    admission: Arc<Admission>,
    served: Stage,
    stop: watch::Receiver<bool>,
    peer: SocketAddr,
}

impl Connection {
    async fn run(self, stream: TcpStream, place: Place) {
        let peer = self.peer;
        let Some(tls) = self.handshake(stream, place).await else {
            return;
        };
        let Some(place) = placed(self.served.enter(peer.ip()), peer, "served") else {
            return;
        };
        self.serve(tls, place).await;
        tracing::trace!(%peer, "connection closed");
    }

    /// The handshake stage: TLS within [`HANDSHAKE_TIMEOUT`]; `None` when the connection
    /// timed out, failed or was evicted. Leaving this function (the place dropped) takes the
    /// connection out of the stage.
    async fn handshake(&self, stream: TcpStream, place: Place) -> Option<TlsStream<TcpStream>> {
        let peer = self.peer;
        tokio::select! {
            () = place.evicted() => {
                tracing::debug!(%peer, "evicted from the handshake stage");
                None
            }
            done = tokio::time::timeout(HANDSHAKE_TIMEOUT, self.acceptor.accept(stream)) => match done {
                Ok(Ok(tls)) => Some(tls),
                Ok(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    None
                }
                Err(_) => {
                    tracing::debug!(%peer, timeout = ?HANDSHAKE_TIMEOUT, "TLS handshake timed out");
                    None
                }
            },
        }
    }

    /// Serves HTTP/1.1 on the connection until the client closes it, it idles past
    /// [`IDLE_TIMEOUT`], it is evicted while it waits on its peer, or the server stops.
    async fn serve(self, tls: TlsStream<TcpStream>, place: Place) {
        let Self {
            admission,
            mut stop,
            peer,
            ..
        } = self;
        let place = Arc::new(place);
        let service = hyper::service::service_fn({
            let place = Arc::clone(&place);
            move |req| {
                let admission = Arc::clone(&admission);
                let place = Arc::clone(&place);
                async move { Ok::<_, Infallible>(respond(&admission, &place, req).await) }
            }
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
            () = place.evicted() => {
                tracing::debug!(%peer, "evicted while waiting on its peer");
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

async fn respond(
    admission: &Admission,
    place: &Place,
    req: Request<Incoming>,
) -> Response<Full<Bytes>> {
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
    // The request is complete: the connection is busy (never evicted) until it is answered.
    let Some(_busy) = place.busy() else {
        return plain(
            StatusCode::SERVICE_UNAVAILABLE,
            "the connection was closed to make room for another\n",
        );
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
