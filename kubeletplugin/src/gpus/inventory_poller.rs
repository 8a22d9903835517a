//! Following the node's inventory: re-discovered at every poll (the fake backend only when its
//! file's content changed; the file is polled, no file-notification dependency), and at once
//! when woken (an NVML health event, a changed mode label); every change is handed to the
//! preparer, which refuses mode changes of GPUs that prepared claims hold (they drain: published
//! with the draining taint), and on to the slice publisher and the health stream. An unprepare
//! that frees a draining GPU wakes the watcher ([`WakeOnRelease`]), so the GPU switches at once.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tessera_driver::node::inventory::NodeInventory;
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::claims::ClaimRef;
use crate::claims::cancel::Cancel;
use crate::claims::preparer::{CdiPreparer, ClaimPreparer, KubeletDevice};
use crate::error::{Error, Result};
use crate::gpus::discovery::GpuDiscovery;
use crate::ops::metrics::Metrics;

/// A running watcher.
#[derive(Debug)]
pub struct InventoryWatcher {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

/// What one poll found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Poll {
    /// The file is as last seen.
    Unchanged,
    /// The file changed and the new inventory was taken, with this many refused GPU changes.
    Reloaded {
        /// Refused changes of held GPUs.
        refused: usize,
    },
    /// The file changed but could not be read or parsed; the previous inventory stays.
    Failed(String),
}

/// Re-discovers and applies the changes; the state between polls is the last file content
/// (fake backend) or the last inventory discovered.
pub struct InventoryPoller {
    path: Option<PathBuf>,
    discovery: Box<dyn GpuDiscovery>,
    preparer: Arc<CdiPreparer>,
    metrics: Arc<Metrics>,
    last: Option<Vec<u8>>,
    last_node: Option<NodeInventory>,
    publish: Option<watch::Sender<NodeInventory>>,
}

impl InventoryPoller {
    /// A poller of `discovery`; with `path` (the fake backend's file) discovery runs only when
    /// the file's content changed, and its current content counts as seen (the preparer was
    /// built from it).
    pub fn new(
        path: Option<PathBuf>,
        discovery: Box<dyn GpuDiscovery>,
        preparer: Arc<CdiPreparer>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let last = path
            .as_ref()
            .and_then(|p| crate::claims::input_file::read(p, "the inventory file").ok());
        let last_node = preparer.inventory().ok();
        Self {
            path,
            discovery,
            preparer,
            metrics,
            last,
            last_node,
            publish: None,
        }
    }

    /// Makes the next poll discover and apply even if nothing it watches changed (the mode
    /// choice or a GPU's health did).
    pub fn invalidate(&mut self) {
        self.last = None;
        self.last_node = None;
    }

    fn source(&self) -> String {
        self.path
            .as_ref()
            .map_or_else(|| "NVML".to_owned(), |p| p.display().to_string())
    }

    /// Hands every inventory the preparer takes (refused GPU changes left out) to `publish`,
    /// which the ResourceSlice publisher follows.
    #[must_use]
    pub fn publishing_to(mut self, publish: watch::Sender<NodeInventory>) -> Self {
        self.publish = Some(publish);
        self
    }

    /// Re-discovers (with a file: only when its content changed) and, when the inventory
    /// changed, reconfigures. Blocking (file reads, NVML calls).
    #[tracing::instrument(name = "discovery_pass", skip_all, fields(source = %self.source()))]
    pub fn poll(&mut self) -> Poll {
        if let Some(path) = &self.path {
            // Content, not the modification time: an edit within the file system's timestamp
            // granularity, or a copy that keeps the time, is still seen.
            let content = match crate::claims::input_file::read(path, "the inventory file") {
                Ok(c) => c,
                Err(e) => return self.failed(&e),
            };
            if self.last.as_ref() == Some(&content) {
                return Poll::Unchanged;
            }
            self.last = Some(content);
        }
        let discovered = match self.discovery.discover() {
            Ok(node) => node,
            Err(e) => return self.failed(&e),
        };
        if self.path.is_none() && self.last_node.as_ref() == Some(&discovered) {
            return Poll::Unchanged;
        }
        self.last_node = Some(discovered.clone());
        let refusals = match self.preparer.reconfigure(&discovered) {
            Ok(r) => r,
            Err(e) => return self.failed(&e),
        };
        if !refusals.is_empty() {
            // Forget what was seen so the next poll tries again: once the holding claims are
            // unprepared the change is taken without another edit of the file.
            self.invalidate();
        }
        for refusal in &refusals {
            warn!(%refusal, "inventory change refused");
            self.metrics
                .observe_mode_change_refused(&refusal.gpu, &refusal.uuid);
        }
        self.metrics.observe_inventory_reload();
        if let (Ok(node), Ok(record)) = (self.preparer.inventory(), self.preparer.record()) {
            self.metrics.observe_state(&node, &record);
            if let Some(publish) = &self.publish {
                // What the preparer holds, not the file: a refused mode change stays
                // unpublished until it is taken.
                publish.send_if_modified(|published| {
                    let changed = *published != node;
                    if changed {
                        *published = node;
                    }
                    changed
                });
            }
        }
        info!(source = %self.source(), refused = refusals.len(), "inventory reloaded");
        Poll::Reloaded {
            refused: refusals.len(),
        }
    }

    fn failed(&self, e: &Error) -> Poll {
        warn!(source = %self.source(), error = %e, "inventory change not taken; keeping the previous inventory");
        Poll::Failed(e.to_string())
    }
}

/// A preparer that wakes the inventory watcher after an unprepare that leaves a draining GPU
/// without claims, so its mode change is taken now rather than at the next poll.
pub struct WakeOnRelease {
    inner: Arc<dyn ClaimPreparer>,
    state: Arc<CdiPreparer>,
    wake: Arc<Notify>,
}

impl WakeOnRelease {
    /// Calls go to `inner`; `state` holds the inventory and the checkpoint; `wake` is the
    /// watcher's.
    pub fn new(inner: Arc<dyn ClaimPreparer>, state: Arc<CdiPreparer>, wake: Arc<Notify>) -> Self {
        Self { inner, state, wake }
    }
}

impl WakeOnRelease {
    /// Wakes the watcher when a draining GPU has no claim left. Blocking (reads the record).
    fn wake_if_released(&self) -> Result<()> {
        let node = self.state.inventory()?;
        if node.gpus.iter().any(|g| g.draining_to.is_some()) {
            let released =
                tessera_driver::node::reconfigure::released(&node, &self.state.record()?);
            if !released.is_empty() {
                info!(gpus = ?released, "draining GPUs released; switching them now");
                self.wake.notify_one();
            }
        }
        Ok(())
    }
}

#[tonic::async_trait]
impl ClaimPreparer for WakeOnRelease {
    async fn prepare_all(
        self: Arc<Self>,
        claims: Vec<ClaimRef>,
        cancel: Cancel,
    ) -> Vec<Result<Vec<KubeletDevice>>> {
        Arc::clone(&self.inner).prepare_all(claims, cancel).await
    }

    async fn unprepare_all(
        self: Arc<Self>,
        claims: Vec<ClaimRef>,
        cancel: Cancel,
    ) -> Vec<Result<()>> {
        let results = Arc::clone(&self.inner).unprepare_all(claims, cancel).await;
        if results.iter().any(Result::is_ok) {
            let me = Arc::clone(&self);
            match tokio::task::spawn_blocking(move || me.wake_if_released()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => warn!(error = %e, "cannot check for released GPUs"),
                Err(e) => warn!(error = %e, "cannot check for released GPUs"),
            }
        }
        results
    }
}

impl InventoryWatcher {
    /// Polls every `interval` on a blocking worker, and at once (discovering even if nothing
    /// it watches changed) whenever `wake` is notified, until [`InventoryWatcher::shutdown`].
    pub fn start(poller: InventoryPoller, interval: Duration, wake: Arc<Notify>) -> Self {
        let (stop, mut stopped) = watch::channel(false);
        let poller = Arc::new(std::sync::Mutex::new(poller));
        let task = tokio::spawn(async move {
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticker.tick().await;
            loop {
                let forced = tokio::select! {
                    _ = stopped.changed() => break,
                    _ = ticker.tick() => false,
                    () = wake.notified() => true,
                };
                let poller = Arc::clone(&poller);
                let outcome = tokio::task::spawn_blocking(move || {
                    poller
                        .lock()
                        .map(|mut p| {
                            if forced {
                                p.invalidate();
                            }
                            p.poll()
                        })
                        .ok()
                })
                .await;
                if !matches!(outcome, Ok(Some(_))) {
                    warn!("inventory poll failed; stopping the watcher");
                    break;
                }
            }
        });
        Self { stop, task }
    }

    /// Stops polling.
    pub async fn shutdown(self) -> Result<()> {
        self.stop.send_replace(true);
        self.task.await.map_err(|e| Error::Task(e.to_string()))
    }
}

#[cfg(test)]
mod tests {

    use tessera_driver::node::cdi::Enforcement;
    use tessera_driver::node::inventory::GpuMode;

    use super::*;
    use crate::claims::FakeClaimSource;
    use crate::claims::preparer::CdiPreparerConfig;
    use crate::gpus::discovery::FakeDiscovery;

    const ONE: &str = "nodes:\n- name: n\n  gpus:\n  - model: a100-80g\n";
    const SHARED: &str = "nodes:\n- name: n\n  gpus:\n  - model: a100-80g\n    mode: shared\n";

    /// A poller of the inventory file `dir/inventory.yaml`, holding [`ONE`], over a preparer
    /// for what it lists and `claims`, keeping its files under `dir`; and the file and the
    /// preparer.
    fn poller(
        dir: &std::path::Path,
        claims: FakeClaimSource,
        metrics: Arc<Metrics>,
    ) -> (PathBuf, Arc<CdiPreparer>, InventoryPoller) {
        let file = dir.join("inventory.yaml");
        std::fs::write(&file, ONE).unwrap();
        let discovery = FakeDiscovery::new(&file, "n");
        let preparer = Arc::new(
            CdiPreparer::new(
                CdiPreparerConfig {
                    driver_name: "gpu.tessera.dev".to_owned(),
                    cdi_dir: dir.join("cdi"),
                    state_dir: dir.join("state"),
                    enforcement: Enforcement::None,
                    boot_id: "b".to_owned(),
                },
                discovery.discover().unwrap(),
                Arc::new(claims),
            )
            .unwrap(),
        );
        let poller = InventoryPoller::new(
            Some(file.clone()),
            Box::new(discovery),
            Arc::clone(&preparer),
            metrics,
        );
        (file, preparer, poller)
    }

    #[test]
    fn poll_takes_changes_and_keeps_the_inventory_on_bad_files() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = Arc::new(Metrics::new());
        let (file, preparer, mut poller) =
            poller(dir.path(), FakeClaimSource::new(), Arc::clone(&metrics));
        assert_eq!(poller.poll(), Poll::Unchanged);

        std::fs::write(&file, "nodes: [").unwrap();
        assert!(matches!(poller.poll(), Poll::Failed(_)));
        assert_eq!(
            preparer.inventory().unwrap().gpus[0].mode,
            GpuMode::Exclusive
        );

        std::fs::write(&file, SHARED).unwrap();
        assert_eq!(poller.poll(), Poll::Reloaded { refused: 0 });
        assert_eq!(preparer.inventory().unwrap().gpus[0].mode, GpuMode::Shared);
        assert_eq!(poller.poll(), Poll::Unchanged);
        assert!(
            metrics
                .encode()
                .unwrap()
                .contains("tessera_kubelet_plugin_inventory_reloads_total 1")
        );

        std::fs::remove_file(&file).unwrap();
        assert!(matches!(poller.poll(), Poll::Failed(_)));
        assert_eq!(preparer.inventory().unwrap().gpus[0].mode, GpuMode::Shared);
    }

    const WHOLE_GPU_0: &str = "apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: c, namespace: ns, uid: u1}
spec:
  devices:
    requests: [{name: gpu, exactly: {deviceClassName: gpu.tessera.dev}}]
status:
  allocation:
    devices:
      results: [{request: gpu, driver: gpu.tessera.dev, pool: n, device: gpu-0}]
    nodeSelector:
      nodeSelectorTerms: [{matchFields: [{key: metadata.name, operator: In, values: [n]}]}]
";

    #[test]
    fn an_unprepare_that_frees_a_draining_gpu_wakes_the_watcher() {
        let dir = tempfile::tempdir().unwrap();
        let (file, preparer, mut poller) = poller(
            dir.path(),
            FakeClaimSource::from_yaml(WHOLE_GPU_0, "claims").unwrap(),
            Arc::new(Metrics::new()),
        );
        let wake = Arc::new(Notify::new());
        let plugin = Arc::new(WakeOnRelease::new(
            Arc::clone(&preparer) as Arc<dyn ClaimPreparer>,
            Arc::clone(&preparer),
            Arc::clone(&wake),
        ));
        let calls = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .build()
            .unwrap();
        let woken = || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .unwrap();
            // A stored wake-up completes at the first poll, before any time passes.
            rt.block_on(async {
                tokio::time::timeout(Duration::ZERO, wake.notified())
                    .await
                    .is_ok()
            })
        };
        let claim = ClaimRef::new("ns", "c", "u1");

        calls
            .block_on(Arc::clone(&plugin).prepare(claim.clone()))
            .unwrap();
        std::fs::write(&file, SHARED).unwrap();
        assert_eq!(poller.poll(), Poll::Reloaded { refused: 1 });
        let gpu = &preparer.inventory().unwrap().gpus[0];
        assert_eq!(
            (gpu.mode, gpu.draining_to),
            (GpuMode::Exclusive, Some(GpuMode::Shared))
        );

        calls
            .block_on(Arc::clone(&plugin).unprepare(claim.clone()))
            .unwrap();
        assert!(woken());
        assert_eq!(poller.poll(), Poll::Reloaded { refused: 0 });
        let gpu = &preparer.inventory().unwrap().gpus[0];
        assert_eq!((gpu.mode, gpu.draining_to), (GpuMode::Shared, None));

        // Nothing draining: an unprepare wakes nobody.
        calls
            .block_on(Arc::clone(&plugin).unprepare(claim.clone()))
            .unwrap();
        assert!(!woken());
    }
}
