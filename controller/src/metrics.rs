//! The controller's Prometheus metrics.
//!
//! Outcomes and latency are counted as pods are handled; the state gauges (pending gated
//! pods, per-GPU memory and compute allocated, unbound allocations, leadership) are set from
//! the cluster view at the end of every pass, so they say what the view says.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tessera_driver::placement::allocator::DeviceUsage;

use crate::error::{Error, Result};

/// The content type of what [`Metrics::encode`] writes: `prometheus_client` encodes the
/// `OpenMetrics` text format (it ends with `# EOF`), which Prometheus parses only when told so.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// How handling a gated pod ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Its claims were allocated and its gate removed.
    Allocated,
    /// Its claims fit nowhere now (retried when the cluster changes).
    Unschedulable,
    /// It could be placed, but waits (delay-tolerant) for a place that leaves less of the
    /// cluster fragmented.
    Waiting,
    /// Something about its claims only their owner can fix.
    Refused,
    /// The API server failed or raced us; retried soon.
    Error,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Self::Allocated => "allocated",
            Self::Unschedulable => "unschedulable",
            Self::Waiting => "waiting",
            Self::Refused => "refused",
            Self::Error => "error",
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: String,
    policy: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuLabels {
    pool: String,
    device: String,
}

/// Every metric the controller exports.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    policy: String,
    allocations: Family<OutcomeLabels, Counter>,
    latency: Histogram,
    pending: Gauge,
    unbound: Gauge,
    released: Counter,
    conflicts: Counter,
    leader: Gauge,
    gpu_memory: Family<GpuLabels, Gauge>,
    gpu_compute: Family<GpuLabels, Gauge>,
    gpus_by_mode: Family<ModeLabels, Gauge>,
    gpus_draining: Gauge,
    profile_switch: Histogram,
    profile_evictions: Counter,
    defrag_evictions: Counter,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModeLabels {
    mode: String,
}

impl Metrics {
    /// Fresh metrics for a controller running `policy`.
    pub fn new(policy: &str) -> Self {
        let mut registry = Registry::with_prefix("tessera_controller");
        let allocations = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "allocations",
            "Gated pods handled, by outcome and placement policy",
            allocations.clone(),
        );
        // 0.5 ms to about 16 s: a pod's writes take milliseconds; a slow API server seconds.
        let latency = Histogram::new(exponential_buckets(0.000_5, 2.0, 16));
        registry.register(
            "allocation_duration_seconds",
            "Time from deciding a gated pod's placement to its gate being removed",
            latency.clone(),
        );
        let pending = Gauge::default();
        registry.register(
            "pending_gated_pods",
            "Pods carrying the allocation gate that are not placed yet",
            pending.clone(),
        );
        let unbound = Gauge::default();
        registry.register(
            "unbound_allocations",
            "Allocations of this controller whose pod has not bound for longer than --unbound-after",
            unbound.clone(),
        );
        let released = Counter::default();
        registry.register(
            "released_allocations",
            "Allocations this controller gave back because their pod or claim went away",
            released.clone(),
        );
        let conflicts = Counter::default();
        registry.register(
            "write_conflicts",
            "Writes refused with 409 Conflict and retried after re-reading",
            conflicts.clone(),
        );
        let leader = Gauge::default();
        registry.register(
            "leader",
            "Whether this replica holds the leader Lease (1) or not (0)",
            leader.clone(),
        );
        let gpu_memory = Family::<GpuLabels, Gauge>::default();
        registry.register(
            "gpu_memory_allocated_bytes",
            "Memory of each device held by allocated claims (all of it when held whole)",
            gpu_memory.clone(),
        );
        let gpu_compute = Family::<GpuLabels, Gauge>::default();
        registry.register(
            "gpu_compute_allocated_percent",
            "Compute of each device held by allocated claims, in percent",
            gpu_compute.clone(),
        );
        let gpus_by_mode = Family::<ModeLabels, Gauge>::default();
        registry.register(
            "scheduled_gpus",
            "GPUs of nodes a GpuProfileSchedule selects, by the mode their slices publish",
            gpus_by_mode.clone(),
        );
        let gpus_draining = Gauge::default();
        registry.register(
            "scheduled_gpus_draining",
            "GPUs of scheduled nodes that claims still hold while their profile wants another mode",
            gpus_draining.clone(),
        );
        // 1 s to about 18 h: a free GPU switches in seconds, a drained one when its claims end.
        let profile_switch = Histogram::new(exponential_buckets(1.0, 2.0, 17));
        registry.register(
            "profile_switch_duration_seconds",
            "Time from a node's scheduled profile switch starting to every GPU being in its mode",
            profile_switch.clone(),
        );
        let (profile_evictions, defrag_evictions) = register_evictions(&mut registry);
        Self {
            registry,
            policy: policy.to_owned(),
            allocations,
            latency,
            pending,
            unbound,
            released,
            conflicts,
            leader,
            gpu_memory,
            gpu_compute,
            gpus_by_mode,
            gpus_draining,
            profile_switch,
            profile_evictions,
            defrag_evictions,
        }
    }

    /// Sets the scheduled nodes' GPUs per published mode and how many drain.
    pub fn set_profile_state(
        &self,
        by_mode: &std::collections::BTreeMap<&str, i64>,
        draining: i64,
    ) {
        for mode in ["exclusive", "shared", "mig"] {
            self.gpus_by_mode
                .get_or_create(&ModeLabels {
                    mode: mode.to_owned(),
                })
                .set(by_mode.get(mode).copied().unwrap_or(0));
        }
        self.gpus_draining.set(draining);
    }

    /// Observes one finished profile switch.
    pub fn profile_switched(&self, took: Duration) {
        self.profile_switch.observe(took.as_secs_f64());
    }

    /// Counts one eviction for a profile switch.
    pub fn profile_evicted(&self) {
        self.profile_evictions.inc();
    }

    /// Counts one eviction made by defragmentation.
    pub fn defrag_evicted(&self) {
        self.defrag_evictions.inc();
    }

    /// Counts one handled pod.
    pub fn outcome(&self, outcome: Outcome) {
        self.allocations
            .get_or_create(&OutcomeLabels {
                outcome: outcome.as_str().to_owned(),
                policy: self.policy.clone(),
            })
            .inc();
    }

    /// How many pods ended with `outcome` so far.
    pub fn outcome_count(&self, outcome: Outcome) -> u64 {
        self.allocations
            .get_or_create(&OutcomeLabels {
                outcome: outcome.as_str().to_owned(),
                policy: self.policy.clone(),
            })
            .get()
    }

    /// Observes one placement's latency.
    pub fn latency(&self, took: Duration) {
        self.latency.observe(took.as_secs_f64());
    }

    /// Counts a retried conflict.
    pub fn conflict(&self) {
        self.conflicts.inc();
    }

    /// Counts a released allocation.
    pub fn released(&self) {
        self.released.inc();
    }

    /// Sets whether this replica leads.
    pub fn set_leader(&self, leading: bool) {
        self.leader.set(i64::from(leading));
    }

    /// Sets the state gauges from the view; the per-device ones only when `usage` is given.
    pub fn set_state(&self, pending: usize, unbound: usize, usage: Option<&[DeviceUsage]>) {
        self.pending.set(i64::try_from(pending).unwrap_or(i64::MAX));
        self.unbound.set(i64::try_from(unbound).unwrap_or(i64::MAX));
        let Some(usage) = usage else { return };
        self.gpu_memory.clear();
        self.gpu_compute.clear();
        for d in usage {
            let labels = GpuLabels {
                pool: d.pool.clone(),
                device: d.device.clone(),
            };
            let memory = d.memory_used.nanos() / 1_000_000_000;
            self.gpu_memory
                .get_or_create(&labels)
                .set(i64::try_from(memory).unwrap_or(i64::MAX));
            self.gpu_compute.get_or_create(&labels).set(d.compute_used);
        }
    }

    /// The text exposition of every metric.
    pub fn encode(&self) -> Result<String> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .map_err(|e| Error::Output(format!("encoding metrics: {e}")))?;
        Ok(out)
    }
}

/// The counters of evictions the controller makes on its own: for a profile switch, and for
/// defragmentation.
fn register_evictions(registry: &mut Registry) -> (Counter, Counter) {
    let profile_evictions = Counter::default();
    registry.register(
        "profile_evictions",
        "Pods evicted because their GPU had to switch profile and the drain deadline passed",
        profile_evictions.clone(),
    );
    let defrag_evictions = Counter::default();
    registry.register(
        "defrag_evictions",
        "Batch pods evicted by defragmentation to make contiguous room for a pending pod",
        defrag_evictions.clone(),
    );
    (profile_evictions, defrag_evictions)
}

#[cfg(test)]
mod tests {

    use super::*;

    #[test]
    fn outcomes_are_counted_by_policy() {
        let m = Metrics::new("binpack");
        m.outcome(Outcome::Allocated);
        m.outcome(Outcome::Allocated);
        m.outcome(Outcome::Unschedulable);
        let text = m.encode().unwrap();
        assert!(
            text.contains(
                "tessera_controller_allocations_total{outcome=\"allocated\",policy=\"binpack\"} 2"
            ),
            "{text}"
        );
        assert_eq!(m.outcome_count(Outcome::Unschedulable), 1);
    }

    #[test]
    fn the_content_type_names_the_format_served() {
        let text = Metrics::new("binpack").encode().unwrap();
        assert!(text.ends_with("# EOF\n"), "{text}");
        assert!(CONTENT_TYPE.starts_with("application/openmetrics-text; version=1.0.0"));
    }
}
