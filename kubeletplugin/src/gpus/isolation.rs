//! Proving the node's share isolation before it offers shares (`tessera_driver::node::isolation`
//! decides; this module runs the probes and applies the verdicts).
//!
//! [`Verified`] wraps the node's discovery: at every discovery it probes each shared GPU that
//! [`isolation::due`] names (at start, when the driver version or the backend changed, and
//! again with a growing wait after a probe that could not run or timed out),
//! through an [`IsolationProbe`], the GPUs side by side (up to [`PARALLEL_PROBES`] at once),
//! then stamps each shared GPU's `isolation` into the inventory so the slices, the preparer and
//! the health stream all see it. A verdict that changes is
//! logged once (with its reason) and exported as `tessera_gpu_isolation`.
//!
//! The probe is host behaviour behind [`IsolationProbe`]: [`ChildProbe`] runs the plugin's own
//! binary as a child in the claim environment (`runner`), whose `isolation-probe` mode
//! (`child`) allocates through the CUDA driver API; [`FakeProbe`] answers what the fake
//! inventory file states, for tests and demos.

mod child;
mod runner;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tessera_driver::node::inventory::{Gpu, Isolation, NodeInventory};
use tessera_driver::node::isolation::{self, ProbeOutcome, ProbeRecord, Verdict};
use tracing::{info, warn};

use crate::error::{Error, Result};
use crate::gpus::discovery::GpuDiscovery;
use crate::ops::metrics::Metrics;

pub use child::{SUBCOMMAND, run_child};
pub use runner::ChildProbe;

/// Runs one isolation probe on one GPU of a node. Blocking and bounded in time.
pub trait IsolationProbe: Send + Sync {
    /// What a probe of `gpu` (a shared GPU of `node`) finds.
    fn probe(&self, node: &NodeInventory, gpu: &Gpu) -> ProbeOutcome;
}

/// Answers what the fake inventory file states for each GPU (`isolation: verified`, the
/// default, holds; `isolation: unverified` serves an allocation past the limit, as HAMi-core
/// did on driver 580), and counts its probes.
#[derive(Debug, Default)]
pub struct FakeProbe {
    probes: Mutex<Vec<String>>,
}

impl FakeProbe {
    /// A probe that has probed nothing yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The GPUs probed so far (device names), in the order their probes started (the GPUs of
    /// one discovery are probed side by side, in no fixed order).
    pub fn probed(&self) -> Vec<String> {
        self.probes.lock().map(|p| p.clone()).unwrap_or_default()
    }
}

impl IsolationProbe for FakeProbe {
    fn probe(&self, _node: &NodeInventory, gpu: &Gpu) -> ProbeOutcome {
        if let Ok(mut probes) = self.probes.lock() {
            probes.push(gpu.device_name());
        }
        if gpu.isolation == Isolation::Verified {
            ProbeOutcome::Held
        } else {
            ProbeOutcome::failed(
                isolation::REASON_LIMIT_NOT_ENFORCED,
                "an allocation past the limit was served (the fake inventory says this GPU's \
                 limits do not hold)",
            )
        }
    }
}

/// How many probes run at once: a node's GPUs are probed side by side (each probe is a child
/// process, mostly waiting on its GPU), so a node's start costs about one probe's time.
pub const PARALLEL_PROBES: usize = 8;

/// Probes `gpus` of `node`, up to [`PARALLEL_PROBES`] at once, each on a thread of its own
/// (scoped: all are done when this returns); the outcomes in `gpus`' order. A probe that
/// panicked did not run, and its GPU stays unverified.
fn probe_all(
    probe: &dyn IsolationProbe,
    node: &NodeInventory,
    gpus: &[Gpu],
    backend: &str,
) -> Vec<ProbeOutcome> {
    let next = AtomicUsize::new(0);
    let slots: Vec<Mutex<Option<ProbeOutcome>>> = gpus.iter().map(|_| Mutex::new(None)).collect();
    let worker = || {
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let (Some(gpu), Some(slot)) = (gpus.get(i), slots.get(i)) else {
                break;
            };
            info!(gpu = %gpu.device_name(), backend = %backend, driver = %gpu.driver_version, "probing share isolation");
            let outcome = probe.probe(node, gpu);
            if let Ok(mut slot) = slot.lock() {
                *slot = Some(outcome);
            }
        }
    };
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..gpus.len().min(PARALLEL_PROBES))
            .map(|_| scope.spawn(worker))
            .collect();
        for w in workers {
            // Joined here, a panic stays this worker's: its GPU's slot stays empty.
            let _ = w.join();
        }
    });
    slots
        .into_iter()
        .map(|slot| {
            slot.into_inner().ok().flatten().unwrap_or_else(|| {
                ProbeOutcome::failed(isolation::REASON_DID_NOT_RUN, "the probe panicked")
            })
        })
        .collect()
}

#[derive(Debug, Default)]
struct State {
    records: BTreeMap<String, ProbeRecord>,
    reported: BTreeMap<String, Verdict>,
}

/// The node's discovery with each shared GPU's isolation proven (or not) and stamped in.
pub struct Verified {
    inner: Arc<dyn GpuDiscovery>,
    probe: Arc<dyn IsolationProbe>,
    backend: String,
    accept_unverified: bool,
    metrics: Option<Arc<Metrics>>,
    state: Mutex<State>,
    /// The probe records' monotonic clock: time since this discovery was made.
    clock: Arc<dyn Fn() -> Duration + Send + Sync>,
}

impl std::fmt::Debug for Verified {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Verified")
            .field("backend", &self.backend)
            .field("accept_unverified", &self.accept_unverified)
            .finish_non_exhaustive()
    }
}

impl Verified {
    /// `inner`'s GPUs, each shared one probed with `probe` under the node's enforcement
    /// `backend` (`mps`, `hami-core`, `none`); `accept_unverified` is the admin's explicit
    /// acceptance of unverified isolation.
    pub fn new(
        inner: Arc<dyn GpuDiscovery>,
        probe: Arc<dyn IsolationProbe>,
        backend: impl Into<String>,
        accept_unverified: bool,
    ) -> Self {
        Self {
            inner,
            probe,
            backend: backend.into(),
            accept_unverified,
            metrics: None,
            state: Mutex::new(State::default()),
            clock: {
                let start = Instant::now();
                Arc::new(move || start.elapsed())
            },
        }
    }

    /// Reads the time for the probe records from `clock` instead of the monotonic clock.
    #[must_use]
    pub fn with_clock(mut self, clock: Arc<dyn Fn() -> Duration + Send + Sync>) -> Self {
        self.clock = clock;
        self
    }

    /// Exports each verdict to `metrics` too.
    #[must_use]
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// The current verdict of each shared GPU, by device name.
    pub fn verdicts(&self) -> BTreeMap<String, Verdict> {
        self.state
            .lock()
            .map(|s| s.reported.clone())
            .unwrap_or_default()
    }
}

impl GpuDiscovery for Verified {
    #[tracing::instrument(name = "probe_pass", skip_all)]
    fn discover(&self) -> Result<NodeInventory> {
        let mut node = self.inner.discover()?;
        let mut state = self
            .state
            .lock()
            .map_err(|_| Error::Task("a thread panicked holding the isolation probes".into()))?;
        let now = (self.clock)();
        let due: Vec<Gpu> = isolation::due(&node, &self.backend, &state.records, now)
            .into_iter()
            .cloned()
            .collect();
        let outcomes = probe_all(self.probe.as_ref(), &node, &due, &self.backend);
        for (gpu, outcome) in due.iter().zip(outcomes) {
            let record = ProbeRecord::new(
                gpu,
                &self.backend,
                outcome,
                now,
                state.records.get(&gpu.uuid),
            );
            if let Some(at) = record.retry_at() {
                info!(gpu = %gpu.device_name(), failed_runs = record.failed_runs, retry_in_seconds = at.saturating_sub(now).as_secs(), "the isolation probe did not run; trying again later");
            }
            state.records.insert(gpu.uuid.clone(), record);
        }
        let verdicts = isolation::apply(
            &mut node,
            &self.backend,
            &state.records,
            self.accept_unverified,
        );
        for (device, verdict) in &verdicts {
            if state.reported.get(device) == Some(verdict) {
                continue;
            }
            if verdict.isolation == Isolation::Verified {
                info!(gpu = %device, isolation = %verdict.isolation, reason = verdict.code, detail = %verdict.reason, "share isolation");
            } else {
                warn!(gpu = %device, isolation = %verdict.isolation, reason = verdict.code, detail = %verdict.reason, "share isolation not verified");
            }
        }
        if state.reported != verdicts {
            if let Some(metrics) = &self.metrics {
                metrics.observe_isolation(&node, &verdicts);
            }
            state.reported = verdicts;
        }
        Ok(node)
    }
}

#[cfg(test)]
mod tests;
