//! The operations side of the process: log format, the metrics and health endpoint, and the
//! inventory watcher, started around the plugin's sockets.

pub mod health_http;
pub mod metrics;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::ValueEnum;
use tessera_driver::node::inventory::NodeInventory;
use tokio::sync::{Notify, watch};
use tracing::info;

use crate::claims::preparer::CdiPreparer;
use crate::error::Result;
use crate::gpus::discovery::GpuDiscovery;
use crate::gpus::inventory_poller::{InventoryPoller, InventoryWatcher};
use crate::kubelet::server::RunningPlugin;
use crate::ops::health_http::{OpsServer, Readiness};
use crate::ops::metrics::Metrics;

/// How log lines are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Plain,
    /// One JSON object per line, for log collectors.
    Json,
}

/// Installs the process's log subscriber; `RUST_LOG` sets the level (default `info`).
pub fn init_logs(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Plain => builder.fmt_fields(escaped_fields()).init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// The plain format's fields, with every control character escaped (`\n`, `\u{0}`, `\u{1b}`),
/// and every format character or line separator too ([`tessera_kubeapi::text::is_hidden`]),
/// in the message and in each value: claim names and UIDs come from kubelet's calls, errors
/// quote what the API server sent, and none of them may end a line or forge one. (The JSON
/// format escapes them already.)
pub fn escaped_fields() -> impl for<'w> tracing_subscriber::fmt::FormatFields<'w> + 'static {
    use tracing_subscriber::field::MakeExt as _;
    tracing_subscriber::fmt::format::debug_fn(|writer, field, value| {
        let text = format!("{value:?}");
        let name = field.name();
        if name != "message" {
            write!(writer, "{name}=")?;
        }
        write_escaped(writer, &text)
    })
    .delimited(" ")
}

fn write_escaped(writer: &mut impl std::fmt::Write, text: &str) -> std::fmt::Result {
    for c in text.chars() {
        if tessera_kubeapi::text::is_hidden(c) {
            write!(writer, "{}", c.escape_default())?;
        } else {
            writer.write_char(c)?;
        }
    }
    Ok(())
}

/// What [`Ops::start`] runs.
#[derive(Debug, Clone, Default)]
pub struct OpsConfig {
    /// Where `/metrics`, `/healthz` and `/readyz` are served; nothing is served when absent.
    pub metrics_addr: Option<SocketAddr>,
    /// How to follow the inventory: the fake backend's file (`None` re-discovers at every
    /// poll, as NVML does) and the poll interval; `None` or a zero interval follows nothing.
    pub watch: Option<(Option<PathBuf>, Duration)>,
    /// Wakes the watcher for a discovery at once (health events, mode label changes).
    pub wake: Arc<Notify>,
    /// Where each inventory the preparer takes is handed on (the slice publisher).
    pub publish: Option<watch::Sender<NodeInventory>>,
}

/// The running operations tasks.
#[derive(Debug)]
pub struct Ops {
    http: Option<OpsServer>,
    watcher: Option<InventoryWatcher>,
    /// The inventory's sender while nothing follows the inventory: kept, not dropped, so the
    /// publisher and the health streams keep serving the inventory they have (a dropped
    /// sender ends a watch's receivers).
    held: Option<watch::Sender<NodeInventory>>,
}

impl Ops {
    /// Starts what `config` asks for, next to the serving `plugin`.
    pub async fn start(
        config: OpsConfig,
        discovery: Box<dyn GpuDiscovery>,
        preparer: Arc<CdiPreparer>,
        metrics: Arc<Metrics>,
        plugin: &RunningPlugin,
    ) -> Result<Self> {
        let http = match config.metrics_addr {
            Some(addr) => Some(
                OpsServer::start(
                    addr,
                    Arc::clone(&metrics),
                    Readiness::new(plugin.registration()),
                )
                .await?,
            ),
            None => None,
        };
        let mut held = None;
        let watcher = match config.watch {
            Some((path, interval)) if !interval.is_zero() => {
                info!(path = ?path, ?interval, "following the inventory");
                let mut poller = InventoryPoller::new(path, discovery, preparer, metrics);
                if let Some(publish) = config.publish {
                    poller = poller.publishing_to(publish);
                }
                Some(InventoryWatcher::start(poller, interval, config.wake))
            }
            _ => {
                info!("not following the inventory: the one found at start stays published");
                held = config.publish;
                None
            }
        };
        Ok(Self {
            http,
            watcher,
            held,
        })
    }

    /// The address the endpoint is bound to, when it runs.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.http.as_ref().map(OpsServer::local_addr)
    }

    /// Stops the watcher and the endpoint.
    pub async fn shutdown(self) -> Result<()> {
        drop(self.held);
        if let Some(watcher) = self.watcher {
            watcher.shutdown().await?;
        }
        if let Some(http) = self.http {
            http.shutdown().await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buffer {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_plain_log_line_cannot_be_forged_by_a_claim_name() {
        let buffer = Buffer::default();
        let out = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || out.clone())
            .with_ansi(false)
            .fmt_fields(escaped_fields())
            .finish();
        let name = "c\n2026-01-01T00:00:00Z  INFO forged: prepared\u{0}\u{1b}[31m\u{202e}\u{2028}";
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(claim = %name, uid = ?name, "claim {name} failed");
        });
        let text = String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap();
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(
            !text.contains(['\0', '\u{1b}', '\u{202e}', '\u{2028}']),
            "{text:?}"
        );
        assert!(text.contains("claim=c\\n2026"), "{text}");
        assert!(text.contains("claim c\\n2026"), "{text}");
    }
}
