//! The operations endpoint both binaries serve, the same in each: `GET /metrics` (the metrics
//! text), `GET /healthz` (the process serves), `GET /readyz` (ready, or why not); any other
//! path is 404 and any other method 405. Each binary runs its own server through [`serve`],
//! with its own limits, readiness and shutdown, and answers through [`respond`].

use std::convert::Infallible;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tracing::{debug, warn};

/// The content type of every answer but the metrics.
pub const TEXT: &str = "text/plain; charset=utf-8";

/// The answer to a request for `path` with `method`. `metrics` encodes the metrics text (of
/// type `metrics_type`) and runs only for `GET /metrics`; `ready` says whether the process is
/// ready, or why not, and runs only for `GET /readyz`.
pub fn respond(
    method: &Method,
    path: &str,
    metrics_type: &'static str,
    metrics: impl FnOnce() -> Result<String, String>,
    ready: impl FnOnce() -> Result<(), String>,
) -> Response<Full<Bytes>> {
    let (status, content_type, body) = if method == Method::GET {
        match path {
            "/metrics" => match metrics() {
                Ok(text) => (StatusCode::OK, metrics_type, text),
                Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, TEXT, format!("{e}\n")),
            },
            "/healthz" => (StatusCode::OK, TEXT, "ok\n".to_owned()),
            "/readyz" => match ready() {
                Ok(()) => (StatusCode::OK, TEXT, "ok\n".to_owned()),
                Err(why) => (StatusCode::SERVICE_UNAVAILABLE, TEXT, format!("{why}\n")),
            },
            _ => (StatusCode::NOT_FOUND, TEXT, "not found\n".to_owned()),
        }
    } else {
        (
            StatusCode::METHOD_NOT_ALLOWED,
            TEXT,
            "only GET is served\n".to_owned(),
        )
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(content_type),
    );
    response
}

/// Serves the connections `listener` accepts, each on a task of its own, with `http` (the
/// binary's limits: request head timeout and size, keep-alive), answering each request with
/// `answer(method, path)`. Runs until dropped; a failed accept is logged and the next one
/// waits 100 ms.
pub async fn serve<A>(listener: TcpListener, http: http1::Builder, answer: A)
where
    A: Fn(&Method, &str) -> Response<Full<Bytes>> + Clone + Send + Sync + 'static,
{
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let answer = answer.clone();
                let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let response = answer(req.method(), req.uri().path());
                    async move { Ok::<_, Infallible>(response) }
                });
                let conn = http.serve_connection(TokioIo::new(stream), service);
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        debug!(%peer, error = %e, "operations connection ended with an error");
                    }
                });
            }
            Err(e) => {
                warn!(error = %e, "accepting an operations connection failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}
