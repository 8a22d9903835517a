//! Replaying a GPU cluster trace through the allocator (`tessera simulate`).
//!
//! The method is the one of Weng et al., "Beware of Fragmentation" (USENIX ATC '23), on
//! Alibaba's "openb" trace: the trace's tasks arrive in a seeded random order, random copies
//! are appended up to 130 % of the cluster's GPU capacity, and each task is placed once (no
//! departures, no retries) with CPU and memory enforced per node. Nodes become fake
//! inventories and `ResourceSlices`, tasks become `ResourceClaims`, and every decision is the
//! allocator's, through the same [`crate::placement::allocator::Allocator`] the controller uses.
//!
//! * [`trace`]: the CSV formats.
//! * [`order`]: the seeded arrival order.
//! * [`cluster`]: the trace as Kubernetes objects (and the milli-GPU to share mapping).
//! * [`replay`]: one seed's replay and its curves; [`Summary`] the mean over seeds.
//! * [`mixing`]: best-effort tasks as batch shares, and what mixing tiers measures.
//! * [`tidal`]: the replay in time (`--time`): arrivals and departures at the trace's times,
//!   a day/night `GpuProfileSchedule`, and defragmentation.

pub mod cluster;
pub mod mixing;
pub mod order;
pub mod replay;
pub mod tidal;
pub mod trace;

use serde::Serialize;

pub use cluster::Cluster;
pub use mixing::{Mixing, MixingResult, MixingSummary};
pub use replay::{IdleByKind, ReplayOptions, SeedResult, replay};
pub use tidal::{TimeOptions, TimeResult, replay_time};
pub use trace::{Qos, TimedPod, TraceNode, TracePod, parse_nodes, parse_pods, parse_timed_pods};

use crate::placement::fragmentation::Workload;

/// The mean over seeds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    /// The policy.
    pub policy: String,
    /// One result per seed.
    pub seeds: Vec<SeedResult>,
    /// Mean of the seeds' `unallocated_pct_at_100`.
    pub unallocated_pct_at_100: f64,
    /// Mean of the seeds' `fragmentation_pct_at_100`.
    pub fragmentation_pct_at_100: f64,
    /// Mean failed tasks per seed.
    pub failed_pods: f64,
    /// Mean allocation curve.
    pub allocation_curve: Vec<Option<f64>>,
    /// Mean fragmentation curve.
    pub fragmentation_curve: Vec<Option<f64>>,
    /// Mean mixing figures, when the seeds mixed tiers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mixing: Option<MixingSummary>,
}

fn mean_curve(curves: &[&[Option<f64>]]) -> Vec<Option<f64>> {
    let len = curves.iter().map(|c| c.len()).max().unwrap_or(0);
    (0..len)
        .map(|x| {
            let values: Vec<f64> = curves
                .iter()
                .filter_map(|c| c.get(x).copied().flatten())
                .collect();
            #[allow(clippy::cast_precision_loss)] // Reason: a handful of seeds.
            let n = values.len() as f64;
            (!values.is_empty()).then(|| values.iter().sum::<f64>() / n)
        })
        .collect()
}

impl Summary {
    /// The mean of `seeds` (run with `policy`).
    pub fn new(policy: &str, seeds: Vec<SeedResult>) -> Self {
        #[allow(clippy::cast_precision_loss)] // Reason: a handful of seeds.
        let n = seeds.len().max(1) as f64;
        let mean = |f: &dyn Fn(&SeedResult) -> f64| seeds.iter().map(f).sum::<f64>() / n;
        #[allow(clippy::cast_precision_loss)] // Reason: task counts.
        let failed = mean(&|s| s.failed_pods as f64);
        let alloc: Vec<&[Option<f64>]> = seeds
            .iter()
            .map(|s| s.allocation_curve.as_slice())
            .collect();
        let frag: Vec<&[Option<f64>]> = seeds
            .iter()
            .map(|s| s.fragmentation_curve.as_slice())
            .collect();
        Self {
            policy: policy.to_owned(),
            unallocated_pct_at_100: mean(&|s| s.unallocated_pct_at_100),
            fragmentation_pct_at_100: mean(&|s| s.fragmentation_pct_at_100),
            failed_pods: failed,
            allocation_curve: mean_curve(&alloc),
            fragmentation_curve: mean_curve(&frag),
            mixing: seeds
                .iter()
                .any(|s| s.mixing.is_some())
                .then(|| MixingSummary::new(seeds.iter().filter_map(|s| s.mixing.as_ref()))),
            seeds,
        }
    }
}

/// The typical shapes of a task list: the prior of the fragmentation report, and what
/// `--history` gives a policy.
pub fn workload_of(pods: &[TracePod]) -> Workload {
    Workload::from_shapes(pods.iter().map(TracePod::shape))
}

#[cfg(test)]
mod tests;
