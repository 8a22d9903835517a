//! Prometheus metrics of the plugin, and `MeteredPreparer`, which feeds them.
//!
//! Calls (count, errors, latency) are counted around the preparer; the state gauges (prepared
//! claims, per-GPU allocated memory and compute) are recomputed from the checkpoint after
//! every call, so they always say what the node's record says.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tessera_driver::node::checkpoint::{Checkpoint, PrepareState};
use tessera_driver::node::inventory::{GpuMode, NodeInventory};
use tracing::warn;

use crate::claims::ClaimRef;
use crate::claims::cancel::Cancel;
use crate::claims::preparer::{CdiPreparer, ClaimPreparer, KubeletDevice};
use crate::error::{Error, Result};

/// The content type of what `/metrics` serves: `prometheus_client` writes the text format of
/// `OpenMetrics` 1.0 (it ends with `# EOF`), not the Prometheus 0.0.4 text format.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    operation: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    operation: String,
    retryable: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuLabels {
    gpu: String,
    uuid: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClaimGpuLabels {
    namespace: String,
    claim: String,
    uuid: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UuidLabels {
    uuid: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StopLabels {
    means: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SkipLabels {
    reason: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct IsolationLabels {
    gpu: String,
    uuid: String,
    isolation: String,
    reason: String,
}

type HistogramFamily = Family<CallLabels, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    // 0.25 ms to about 4 s: a prepare with its fsyncs takes a few milliseconds, an API-server
    // fetch can take seconds.
    Histogram::new(exponential_buckets(0.000_25, 2.0, 15))
}

/// What the claims of the checkpoint take of one GPU.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GpuAllocation {
    /// Bytes of memory held (whole GPU, MIG instance, or share limit).
    pub memory_bytes: u64,
    /// Percent of compute held (whole GPU 100, MIG instance its slice, share its limit).
    pub compute_percent: i64,
}

/// What each GPU of `node` (by device name, `gpu-<index>`, with its UUID) has allocated to
/// the claims `record` holds; every GPU of the node is listed, idle ones with zero. Claims
/// being unprepared still count: they hold their devices until they are gone.
pub fn allocated_by_gpu(
    node: &NodeInventory,
    record: &Checkpoint,
) -> BTreeMap<(String, String), GpuAllocation> {
    let mut out: BTreeMap<(String, String), GpuAllocation> = node
        .gpus
        .iter()
        .map(|g| ((g.device_name(), g.uuid.clone()), GpuAllocation::default()))
        .collect();
    for entry in record.claims.values() {
        for held in &entry.devices {
            let Some(gpu) = node.gpus.iter().find(|g| g.uuid == held.gpu_uuid) else {
                continue;
            };
            let (memory, compute) = if let Some(memory) = held.share_memory_bytes {
                (memory, held.share_compute_percent.unwrap_or(0))
            } else if held.mig {
                gpu.mig_instances
                    .iter()
                    .find(|m| m.device_name(gpu.index) == held.device)
                    .map_or((0, 0), |m| (m.memory_bytes, i64::from(m.compute_percent)))
            } else {
                (gpu.memory_bytes, 100)
            };
            if let Some(slot) = out.get_mut(&(gpu.device_name(), gpu.uuid.clone())) {
                slot.memory_bytes = slot.memory_bytes.saturating_add(memory);
                slot.compute_percent = slot.compute_percent.saturating_add(compute);
            }
        }
    }
    out
}

/// How many devices the node offers: a MIG-mode GPU offers its instances, any other GPU
/// itself.
pub fn offered_devices(node: &NodeInventory) -> usize {
    node.gpus
        .iter()
        .map(|g| {
            if g.mode == GpuMode::Mig {
                g.mig_instances.len()
            } else {
                1
            }
        })
        .sum()
}

fn gauge_value(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The plugin's metrics registry.
pub struct Metrics {
    registry: Registry,
    calls: Family<CallLabels, Counter>,
    errors: Family<ErrorLabels, Counter>,
    latency: HistogramFamily,
    prepared_claims: Gauge,
    published_devices: Gauge,
    gpu_memory: Family<GpuLabels, Gauge>,
    gpu_compute: Family<GpuLabels, Gauge>,
    inventory_reloads: Counter,
    mode_changes_refused: Family<GpuLabels, Counter>,
    gpu_healthy: Family<GpuLabels, Gauge>,
    accounting_stops: Family<StopLabels, Counter>,
    accounting_skips: Family<SkipLabels, Counter>,
    gpu_isolation: Family<IsolationLabels, Gauge>,
    use_gauges: UseGauges,
}

/// The gauges of each claim's measured use (`Metrics::observe_use`).
struct UseGauges {
    claim_memory_used: Family<ClaimGpuLabels, Gauge>,
    claim_memory_booked: Family<ClaimGpuLabels, Gauge>,
    claim_compute_booked: Family<ClaimGpuLabels, Gauge>,
    gpu_memory_used: Family<UuidLabels, Gauge>,
}

impl UseGauges {
    fn register(registry: &mut Registry) -> Self {
        let claim_memory_used = Family::<ClaimGpuLabels, Gauge>::default();
        registry.register(
            "claim_gpu_memory_used_bytes",
            "GPU memory the processes of each share claim hold on each GPU it books, as the last \
             accounting pass measured it (claims one pod uses on the same GPU are measured \
             together and each reports their sum)",
            claim_memory_used.clone(),
        );
        let claim_memory_booked = Family::<ClaimGpuLabels, Gauge>::default();
        registry.register(
            "claim_gpu_memory_booked_bytes",
            "GPU memory each share claim booked on each GPU, beside its measured use",
            claim_memory_booked.clone(),
        );
        let claim_compute_booked = Family::<ClaimGpuLabels, Gauge>::default();
        registry.register(
            "claim_gpu_compute_booked_percent",
            "Compute each share claim booked on each GPU, in percent (0: not isolated)",
            claim_compute_booked.clone(),
        );
        let gpu_memory_used = Family::<UuidLabels, Gauge>::default();
        registry.register(
            "gpu_memory_used_bytes",
            "GPU memory all processes hold on each GPU that share claims book, as the last \
             accounting pass listed them (claims' processes and others)",
            gpu_memory_used.clone(),
        );
        Self {
            claim_memory_used,
            claim_memory_booked,
            claim_compute_booked,
            gpu_memory_used,
        }
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// All metrics registered under the `tessera_kubelet_plugin` prefix, at zero.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("tessera_kubelet_plugin");
        let calls = Family::<CallLabels, Counter>::default();
        let errors = Family::<ErrorLabels, Counter>::default();
        let latency: HistogramFamily = Family::new_with_constructor(latency_histogram);
        let prepared_claims = Gauge::default();
        let published_devices = Gauge::default();
        let gpu_memory = Family::<GpuLabels, Gauge>::default();
        let gpu_compute = Family::<GpuLabels, Gauge>::default();
        let inventory_reloads = Counter::default();
        let mode_changes_refused = Family::<GpuLabels, Counter>::default();
        let gpu_healthy = Family::<GpuLabels, Gauge>::default();
        let accounting_stops = Family::<StopLabels, Counter>::default();
        registry.register(
            "accounting_stopped_processes",
            "Processes stopped because their claim's processes together used more GPU memory \
             than it booked, by means (mps_terminate, kill; failed: an attempt that failed)",
            accounting_stops.clone(),
        );
        let accounting_skips = Family::<SkipLabels, Counter>::default();
        registry.register(
            "accounting_skipped_processes",
            "GPU processes an accounting pass left out, by reason (unreadable: /proc could not \
             be read; bad_stat: no start time in its stat; pods_disagree: its cgroup lines name \
             different pods); the pass goes on for the others",
            accounting_skips.clone(),
        );
        let gpu_isolation = Family::<IsolationLabels, Gauge>::default();
        registry.register(
            "gpu_isolation",
            "1 for each shared GPU with its isolation (verified, unverified, unverified-accepted) \
             and the reason code; a GPU offers shares only when verified or accepted",
            gpu_isolation.clone(),
        );
        registry.register(
            "gpu_healthy",
            "1 while the GPU is healthy, 0 while its devices are published with the unhealthy taint",
            gpu_healthy.clone(),
        );
        registry.register(
            "calls",
            "NodePrepareResources and NodeUnprepareResources calls, per claim",
            calls.clone(),
        );
        registry.register(
            "errors",
            "Claims whose prepare or unprepare failed",
            errors.clone(),
        );
        registry.register(
            "call_duration_seconds",
            "Time to prepare or unprepare one claim",
            latency.clone(),
        );
        registry.register(
            "prepared_claims",
            "Claims the checkpoint records as prepared",
            prepared_claims.clone(),
        );
        registry.register(
            "published_devices",
            "Devices the node offers (GPUs, or MIG instances of MIG-mode GPUs)",
            published_devices.clone(),
        );
        registry.register(
            "gpu_allocated_memory_bytes",
            "Memory of each GPU held by prepared claims",
            gpu_memory.clone(),
        );
        registry.register(
            "gpu_allocated_compute_percent",
            "Compute of each GPU held by prepared claims, in percent",
            gpu_compute.clone(),
        );
        registry.register(
            "inventory_reloads",
            "Inventory changes handed to the preparer",
            inventory_reloads.clone(),
        );
        registry.register(
            "gpu_mode_changes_refused",
            "Inventory changes of a GPU's mode refused because claims hold the GPU",
            mode_changes_refused.clone(),
        );
        Self {
            use_gauges: UseGauges::register(&mut registry),
            registry,
            calls,
            errors,
            latency,
            prepared_claims,
            published_devices,
            gpu_memory,
            gpu_compute,
            inventory_reloads,
            mode_changes_refused,
            gpu_healthy,
            accounting_stops,
            accounting_skips,
            gpu_isolation,
        }
    }

    /// Sets the per-claim use gauges from one accounting pass: each claim's `measured` use and
    /// booking per GPU, and each listed GPU's total. Every series of the last pass goes first,
    /// so a claim that ended (or a GPU no claim books any more) leaves no series behind.
    pub fn observe_use(
        &self,
        record: &Checkpoint,
        measured: &tessera_driver::node::accounting::Usage,
        observed: &[tessera_driver::node::accounting::GpuProcess],
    ) {
        self.use_gauges.claim_memory_used.clear();
        self.use_gauges.claim_memory_booked.clear();
        self.use_gauges.claim_compute_booked.clear();
        self.use_gauges.gpu_memory_used.clear();
        for (uid, gpus) in measured {
            let Some(entry) = record.claims.get(uid) else {
                continue;
            };
            for (uuid, used) in gpus {
                let labels = ClaimGpuLabels {
                    namespace: entry.namespace.clone(),
                    claim: entry.name.clone(),
                    uuid: uuid.clone(),
                };
                let (booked, compute) = entry
                    .devices
                    .iter()
                    .filter(|d| d.gpu_uuid == *uuid && !d.mig)
                    .fold((0u64, 0i64), |(m, c), d| {
                        (
                            m.saturating_add(d.share_memory_bytes.unwrap_or(0)),
                            c.saturating_add(d.share_compute_percent.unwrap_or(0)),
                        )
                    });
                self.use_gauges
                    .claim_memory_used
                    .get_or_create(&labels)
                    .set(gauge_value(used.used_bytes));
                self.use_gauges
                    .claim_memory_booked
                    .get_or_create(&labels)
                    .set(gauge_value(booked));
                self.use_gauges
                    .claim_compute_booked
                    .get_or_create(&labels)
                    .set(compute);
            }
        }
        let mut per_gpu: BTreeMap<&str, BTreeMap<u32, u64>> = measured
            .values()
            .flat_map(BTreeMap::keys)
            .map(|uuid| (uuid.as_str(), BTreeMap::new()))
            .collect();
        for p in observed {
            let slot = per_gpu
                .entry(p.gpu_uuid.as_str())
                .or_default()
                .entry(p.pid)
                .or_default();
            *slot = (*slot).max(p.used_bytes);
        }
        for (uuid, pids) in per_gpu {
            let total = pids.values().fold(0u64, |sum, b| sum.saturating_add(*b));
            self.use_gauges
                .gpu_memory_used
                .get_or_create(&UuidLabels {
                    uuid: uuid.to_owned(),
                })
                .set(gauge_value(total));
        }
    }

    /// Sets `tessera_kubelet_plugin_gpu_isolation` to the `verdicts` of `node`'s shared GPUs
    /// (by device name), forgetting earlier ones.
    pub fn observe_isolation(
        &self,
        node: &NodeInventory,
        verdicts: &BTreeMap<String, tessera_driver::node::isolation::Verdict>,
    ) {
        self.gpu_isolation.clear();
        for gpu in &node.gpus {
            if let Some(v) = verdicts.get(&gpu.device_name()) {
                self.gpu_isolation
                    .get_or_create(&IsolationLabels {
                        gpu: gpu.device_name(),
                        uuid: gpu.uuid.clone(),
                        isolation: v.isolation.as_str().to_owned(),
                        reason: v.code.to_owned(),
                    })
                    .set(1);
            }
        }
    }

    /// Counts one claim's call of `operation` ("prepare" or "unprepare").
    pub fn observe_call(&self, operation: &str, took: Duration, error: Option<&Error>) {
        let labels = CallLabels {
            operation: operation.to_owned(),
        };
        self.calls.get_or_create(&labels).inc();
        self.latency
            .get_or_create(&labels)
            .observe(took.as_secs_f64());
        if let Some(error) = error {
            self.errors
                .get_or_create(&ErrorLabels {
                    operation: operation.to_owned(),
                    retryable: error.is_retryable().to_string(),
                })
                .inc();
        }
    }

    /// Sets the state gauges from the node's inventory and checkpoint.
    pub fn observe_state(&self, node: &NodeInventory, record: &Checkpoint) {
        let prepared = record
            .claims
            .values()
            .filter(|e| e.state == PrepareState::PrepareCompleted)
            .count();
        self.prepared_claims
            .set(gauge_value(u64::try_from(prepared).unwrap_or(u64::MAX)));
        self.published_devices.set(gauge_value(
            u64::try_from(offered_devices(node)).unwrap_or(u64::MAX),
        ));
        // GPUs that left the inventory must not linger with their last value.
        self.gpu_memory.clear();
        self.gpu_compute.clear();
        self.gpu_healthy.clear();
        for gpu in &node.gpus {
            self.gpu_healthy
                .get_or_create(&GpuLabels {
                    gpu: gpu.device_name(),
                    uuid: gpu.uuid.clone(),
                })
                .set(i64::from(gpu.healthy));
        }
        for ((gpu, uuid), allocation) in allocated_by_gpu(node, record) {
            let labels = GpuLabels { gpu, uuid };
            self.gpu_memory
                .get_or_create(&labels)
                .set(gauge_value(allocation.memory_bytes));
            self.gpu_compute
                .get_or_create(&labels)
                .set(allocation.compute_percent);
        }
    }

    /// Counts an inventory change handed to the preparer.
    pub fn observe_inventory_reload(&self) {
        self.inventory_reloads.inc();
    }

    /// Counts a refused mode change of the GPU `gpu` (device name) with `uuid`.
    pub fn observe_mode_change_refused(&self, gpu: &str, uuid: &str) {
        self.mode_changes_refused
            .get_or_create(&GpuLabels {
                gpu: gpu.to_owned(),
                uuid: uuid.to_owned(),
            })
            .inc();
    }

    /// Counts a process the accounting stopped by `means` (or `failed` to).
    pub fn observe_accounting_stop(&self, means: &str) {
        self.accounting_stops
            .get_or_create(&StopLabels {
                means: means.to_owned(),
            })
            .inc();
    }

    /// Counts a GPU process an accounting pass left out, by `reason`.
    pub fn observe_accounting_skip(&self, reason: &str) {
        self.accounting_skips
            .get_or_create(&SkipLabels {
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// The metrics in the Prometheus text format.
    pub fn encode(&self) -> Result<String> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .map_err(|e| Error::Metrics(e.to_string()))?;
        Ok(out)
    }
}

/// A [`CdiPreparer`] whose calls and state are measured.
pub struct MeteredPreparer {
    inner: Arc<CdiPreparer>,
    metrics: Arc<Metrics>,
}

impl MeteredPreparer {
    /// Measures `inner` into `metrics`, starting with the state `inner` loaded.
    pub fn new(inner: Arc<CdiPreparer>, metrics: Arc<Metrics>) -> Self {
        let metered = Self { inner, metrics };
        metered.refresh();
        metered
    }

    /// Recomputes the state gauges from the preparer's inventory and checkpoint.
    pub fn refresh(&self) {
        match (self.inner.inventory(), self.inner.record()) {
            (Ok(node), Ok(record)) => self.metrics.observe_state(&node, &record),
            (Err(e), _) | (_, Err(e)) => warn!(error = %e, "cannot refresh the metrics"),
        }
    }

    /// Counts each claim of a call with the call's latency, then refreshes the gauges once.
    async fn measure_all<T>(
        self: Arc<Self>,
        operation: &'static str,
        call: impl std::future::Future<Output = Vec<Result<T>>>,
    ) -> Vec<Result<T>> {
        let start = Instant::now();
        let results = call.await;
        let took = start.elapsed();
        for result in &results {
            self.metrics
                .observe_call(operation, took, result.as_ref().err());
        }
        // The checkpoint's lock is held while the record is written: never wait for it on an
        // async worker.
        let me = Arc::clone(&self);
        if let Err(e) = tokio::task::spawn_blocking(move || me.refresh()).await {
            warn!(error = %e, "cannot refresh the metrics");
        }
        results
    }
}

#[tonic::async_trait]
impl ClaimPreparer for MeteredPreparer {
    async fn prepare_all(
        self: Arc<Self>,
        claims: Vec<ClaimRef>,
        cancel: Cancel,
    ) -> Vec<Result<Vec<KubeletDevice>>> {
        let inner = Arc::clone(&self.inner);
        self.measure_all("prepare", inner.prepare_all(claims, cancel))
            .await
    }

    async fn unprepare_all(
        self: Arc<Self>,
        claims: Vec<ClaimRef>,
        cancel: Cancel,
    ) -> Vec<Result<()>> {
        let inner = Arc::clone(&self.inner);
        self.measure_all("unprepare", inner.unprepare_all(claims, cancel))
            .await
    }
}

#[cfg(test)]
mod tests {

    use tessera_driver::node::checkpoint::{ClaimEntry, HeldDevice};
    use tessera_driver::node::inventory::Inventory;

    use super::*;

    const YAML: &str = "nodes:\n- name: n\n  gpus:\n  - model: a100-80g\n  - model: a100-80g\n    mig:\n    - profile: 1g.10gb\n      count: 7\n  - model: a100-80g\n    mode: shared\n";

    fn held(
        node: &NodeInventory,
        gpu: usize,
        device: &str,
        share: Option<(u64, i64)>,
    ) -> HeldDevice {
        HeldDevice {
            request: "gpu".to_owned(),
            pool: "n".to_owned(),
            device: device.to_owned(),
            gpu_uuid: node.gpus[gpu].uuid.clone(),
            mig: device.contains("-mig-"),
            exclusive: share.is_none(),
            cdi_ids: Vec::new(),
            share_memory_bytes: share.map(|s| s.0),
            share_compute_percent: share.map(|s| s.1),
            share_id: None,
            share_tier: None,
        }
    }

    fn record(devices: Vec<HeldDevice>) -> Checkpoint {
        let mut record = Checkpoint::new("b");
        for (i, d) in devices.into_iter().enumerate() {
            record.claims.insert(
                format!("u{i}"),
                ClaimEntry {
                    namespace: "ns".to_owned(),
                    name: format!("c{i}"),
                    state: PrepareState::PrepareCompleted,
                    devices: vec![d],
                    host_dirs: Vec::new(),
                    mps_daemon: None,
                },
            );
        }
        record
    }

    #[test]
    fn allocation_counts_whole_gpus_mig_instances_and_shares() {
        let node = Inventory::from_yaml(YAML)
            .unwrap()
            .node("n")
            .cloned()
            .unwrap();
        let mig = node.gpus[1].mig_instances[0].device_name(node.gpus[1].index);
        let record = record(vec![
            held(&node, 0, "gpu-0", None),
            held(&node, 1, &mig, None),
            held(&node, 2, "gpu-2", Some((4 << 30, 25))),
            held(&node, 2, "gpu-2", Some((8 << 30, 50))),
        ]);
        let by_gpu = allocated_by_gpu(&node, &record);
        let get = |i: usize| by_gpu[&(format!("gpu-{i}"), node.gpus[i].uuid.clone())];
        assert_eq!(get(0).memory_bytes, node.gpus[0].memory_bytes);
        assert_eq!(get(0).compute_percent, 100);
        assert_eq!(
            get(1).memory_bytes,
            node.gpus[1].mig_instances[0].memory_bytes
        );
        assert_eq!(
            get(1).compute_percent,
            i64::from(node.gpus[1].mig_instances[0].compute_percent)
        );
        assert_eq!(get(2).memory_bytes, 12 << 30);
        assert_eq!(get(2).compute_percent, 75);
        assert_eq!(offered_devices(&node), 1 + 7 + 1);
    }

    #[test]
    fn text_format_lists_every_family() {
        let node = Inventory::from_yaml(YAML)
            .unwrap()
            .node("n")
            .cloned()
            .unwrap();
        let metrics = Metrics::new();
        let mut node = node;
        node.gpus[1].healthy = false;
        metrics.observe_state(&node, &record(vec![held(&node, 0, "gpu-0", None)]));
        metrics.observe_call("prepare", Duration::from_millis(2), None);
        metrics.observe_call(
            "prepare",
            Duration::from_millis(3),
            Some(&Error::BadRequest("x".to_owned())),
        );
        let text = metrics.encode().unwrap();
        for line in [
            "tessera_kubelet_plugin_calls_total{operation=\"prepare\"} 2",
            "tessera_kubelet_plugin_errors_total{operation=\"prepare\",retryable=\"false\"} 1",
            "tessera_kubelet_plugin_prepared_claims 1",
            "tessera_kubelet_plugin_published_devices 9",
            format!(
                "tessera_kubelet_plugin_gpu_healthy{{gpu=\"gpu-0\",uuid=\"{}\"}} 1",
                node.gpus[0].uuid
            )
            .as_str(),
            format!(
                "tessera_kubelet_plugin_gpu_healthy{{gpu=\"gpu-1\",uuid=\"{}\"}} 0",
                node.gpus[1].uuid
            )
            .as_str(),
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        assert!(text.contains("# TYPE tessera_kubelet_plugin_call_duration_seconds histogram"));
    }

    #[test]
    fn the_content_type_names_the_format_served() {
        let text = Metrics::new().encode().unwrap();
        assert!(text.ends_with("# EOF\n"), "{text}");
        assert!(CONTENT_TYPE.starts_with("application/openmetrics-text; version=1.0.0"));
    }
}
