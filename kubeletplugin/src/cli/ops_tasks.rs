//! The operations tasks started around the plugin's sockets: the metrics and health endpoint,
//! and the inventory watcher.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

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
