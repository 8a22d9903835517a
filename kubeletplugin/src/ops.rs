//! The operations wing: the process's logs ([`init_logs`]), its Prometheus metrics ([`metrics`],
//! fed around the preparer) and the `/metrics`, `/healthz`, `/readyz` endpoint
//! ([`health_http`]). The tasks that run them next to the plugin's sockets are started by
//! `cli::ops_tasks`.
//!
//! May import: `kubelet` (readiness follows kubelet's registration verdict), `claims` (the
//! preparer the metrics wrap) and `error`. Nothing here imports `gpus`, `accounting`,
//! `publisher` or `cli`.

pub mod health_http;
pub mod metrics;

/// How log lines are written to stderr (the one setting of every Tessera binary).
pub use tessera_kubeapi::logs::LogFormat;

/// Installs the process's log subscriber on stderr (escaped plain lines, colour only on a
/// terminal: [`tessera_kubeapi::logs`]); `RUST_LOG` sets the level (default `info`).
pub fn init_logs(format: LogFormat) {
    tessera_kubeapi::logs::init(format, tessera_kubeapi::logs::Stream::Stderr);
}
