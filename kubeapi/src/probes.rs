//! The answers of the operations endpoint both binaries serve, the same in each: `GET /metrics`
//! (the metrics text), `GET /healthz` (the process serves), `GET /readyz` (ready, or why not);
//! any other path is 404 and any other method 405. Each binary runs its own server (its own
//! limits, readiness and shutdown) and answers through [`respond`].

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Method, Response, StatusCode};

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
