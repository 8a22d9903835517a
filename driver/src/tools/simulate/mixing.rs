//! Mixing online and batch work in a replay (`tessera simulate --mixing`, shared/DESIGN.md
//! §8): the trace's best-effort tasks (`qos` `BE`) go to a batch class, every other task stays
//! online. Besides the usual figures a mixing replay measures, at the arrival where arrived
//! demand first reaches 100 % of capacity, how much of the online and of the batch demand
//! arrived so far was placed and how much batch demand is over-committed, and over the whole
//! replay how often an online task that found no room would have fit had batch work been
//! evicted for it (it is not: the count is what preemption would have to do).
//!
//! "Would fit with batch evicted" is decided exactly: a second snapshot holds only the online
//! tasks placed so far (their GPUs, CPU and memory), and the failed online task is allocated
//! there, uncommitted. Evicting batch only frees room, so a task that fits with every batch
//! task gone is exactly one that fits after evicting some of them.

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1 as res;
use serde::Serialize;

use super::cluster::Cluster;
use super::trace::TracePod;
use crate::error::{Error, Result};
use crate::placement::allocator::{Allocator, Placement, Snapshot};
use crate::placement::fragmentation::WHOLE_GPU;

/// How a replay mixes tiers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mixing {
    /// The DeviceClass of best-effort tasks (its `TierPolicy` says batch and carries the
    /// over-commit factors); the other tasks use Tessera's share class.
    pub batch_class: String,
}

/// What one mixing replay measured.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct MixingResult {
    /// Online milli-GPU arrived when arrived demand first reached 100 %.
    pub online_arrived_milli_at_100: u64,
    /// Of it, placed.
    pub online_placed_milli_at_100: u64,
    /// Batch milli-GPU arrived when arrived demand first reached 100 %.
    pub batch_arrived_milli_at_100: u64,
    /// Of it, placed.
    pub batch_placed_milli_at_100: u64,
    /// `online_placed / online_arrived`, in percent.
    pub online_placed_pct_at_100: f64,
    /// `batch_placed / batch_arrived`, in percent.
    pub batch_placed_pct_at_100: f64,
    /// Placed milli-GPU (online and batch) in percent of the cluster's GPU capacity; above
    /// 100 only where batch over-commits.
    pub placed_pct_of_capacity_at_100: f64,
    /// Milli-GPU booked by batch shares beyond their guarantee, in percent of capacity.
    pub batch_overcommitted_pct_at_100: f64,
    /// Online tasks with GPUs that arrived before arrived demand passed 100 %.
    pub online_gpu_tasks_before_100: usize,
    /// Of them, not placed.
    pub online_failed_before_100: usize,
    /// Of those, the ones that would have fit with batch evicted.
    pub online_would_preempt_before_100: usize,
    /// Online tasks with GPUs over the whole replay (to 130 %).
    pub online_gpu_tasks: usize,
    /// Of them, not placed.
    pub online_failed: usize,
    /// Of those, the ones that would have fit with batch evicted.
    pub online_would_preempt: usize,
}

/// The mean of [`MixingResult`]s over seeds (the percentages; counts as means too).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct MixingSummary {
    /// Mean `online_placed_pct_at_100`.
    pub online_placed_pct_at_100: f64,
    /// Mean `batch_placed_pct_at_100`.
    pub batch_placed_pct_at_100: f64,
    /// Mean `placed_pct_of_capacity_at_100`.
    pub placed_pct_of_capacity_at_100: f64,
    /// Mean `batch_overcommitted_pct_at_100`.
    pub batch_overcommitted_pct_at_100: f64,
    /// Mean `online_would_preempt_before_100` in percent of `online_gpu_tasks_before_100`.
    pub online_preempt_pct_before_100: f64,
    /// Mean `online_would_preempt` in percent of `online_gpu_tasks`.
    pub online_preempt_pct: f64,
    /// Mean `online_would_preempt` (tasks per seed).
    pub online_would_preempt: f64,
}

#[allow(clippy::cast_precision_loss)] // Reason: milli-GPU totals and task counts, far below 2^52.
fn pct(part: u64, whole: u64) -> f64 {
    part as f64 * 100.0 / whole.max(1) as f64
}

fn count(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

impl MixingSummary {
    /// The mean of `results` (none: all zero).
    pub fn new<'a>(results: impl IntoIterator<Item = &'a MixingResult>) -> Self {
        let results: Vec<&MixingResult> = results.into_iter().collect();
        #[allow(clippy::cast_precision_loss)] // Reason: a handful of seeds.
        let n = results.len().max(1) as f64;
        let mean = |f: &dyn Fn(&MixingResult) -> f64| results.iter().map(|r| f(r)).sum::<f64>() / n;
        Self {
            online_placed_pct_at_100: mean(&|r| r.online_placed_pct_at_100),
            batch_placed_pct_at_100: mean(&|r| r.batch_placed_pct_at_100),
            placed_pct_of_capacity_at_100: mean(&|r| r.placed_pct_of_capacity_at_100),
            batch_overcommitted_pct_at_100: mean(&|r| r.batch_overcommitted_pct_at_100),
            online_preempt_pct_before_100: mean(&|r| {
                pct(
                    count(r.online_would_preempt_before_100),
                    count(r.online_gpu_tasks_before_100),
                )
            }),
            online_preempt_pct: mean(&|r| {
                pct(count(r.online_would_preempt), count(r.online_gpu_tasks))
            }),
            #[allow(clippy::cast_precision_loss)] // Reason: task counts.
            online_would_preempt: mean(&|r| r.online_would_preempt as f64),
        }
    }
}

/// Milli-GPU booked beyond guarantees on every GPU of `snap`: per GPU the larger of its
/// over-committed memory (in milli of its memory) and compute (percent × 10).
pub fn overcommitted_milli(snap: &Snapshot) -> u64 {
    snap.device_usage()
        .iter()
        .map(|d| {
            let total = d.memory_total.nanos();
            let by_memory = if total > 0 {
                d.memory_overcommitted
                    .nanos()
                    .saturating_mul(i128::from(WHOLE_GPU))
                    / total
            } else {
                0
            };
            let by_compute = i128::from(d.compute_overcommitted) * 10;
            u64::try_from(by_memory.max(by_compute)).unwrap_or(0)
        })
        .sum()
}

/// A replay's mixing bookkeeping.
#[derive(Debug)]
pub(super) struct Tracker {
    mixing: Mixing,
    /// Only the online tasks placed so far.
    online: Snapshot,
    online_arrived: u64,
    online_placed: u64,
    batch_arrived: u64,
    batch_placed: u64,
    pub(super) result: MixingResult,
}

impl Tracker {
    /// Bookkeeping for `pods` on `cluster`; every task needs a `qos`.
    pub(super) fn new(mixing: &Mixing, cluster: &Cluster, pods: &[TracePod]) -> Result<Self> {
        if let Some(p) = pods.iter().find(|p| p.best_effort.is_none()) {
            return Err(Error::invalid(
                format!("task {}", p.name),
                "qos",
                "mixing needs each task's qos (BE is batch, anything else online); this pod \
                 list has no qos column",
            ));
        }
        Ok(Self {
            mixing: mixing.clone(),
            online: cluster.snapshot()?,
            online_arrived: 0,
            online_placed: 0,
            batch_arrived: 0,
            batch_placed: 0,
            result: MixingResult::default(),
        })
    }

    /// The class of `pod`'s claim: the batch class for best-effort tasks.
    pub(super) fn class_of<'a>(&'a self, pod: &TracePod, online: &'a str) -> &'a str {
        if pod.best_effort == Some(true) {
            &self.mixing.batch_class
        } else {
            online
        }
    }

    /// Counts an arrival and its outcome. For an online task, a placement is mirrored into
    /// the online-only snapshot, and a failure is retried there (uncommitted).
    #[allow(clippy::too_many_arguments)] // Reason: one arrival's whole context, read in one place.
    pub(super) fn arrival(
        &mut self,
        allocator: &Allocator,
        pod: &TracePod,
        claims: &[&res::ResourceClaim],
        candidates: &[Node],
        placed: Option<&Placement>,
        before_100: bool,
    ) {
        let demand = pod.gpu_demand();
        let batch = pod.best_effort == Some(true);
        if batch {
            self.batch_arrived += demand;
            if placed.is_some() {
                self.batch_placed += demand;
            }
            return;
        }
        self.online_arrived += demand;
        if let Some(p) = placed {
            self.online_placed += demand;
            for (claim, allocation) in claims.iter().zip(&p.allocations) {
                self.online.commit(claim, allocation);
            }
            self.online.add_host_use(&p.node, &pod.host);
        }
        if pod.num_gpu == 0 {
            return;
        }
        let r = &mut self.result;
        r.online_gpu_tasks += 1;
        if before_100 {
            r.online_gpu_tasks_before_100 += 1;
        }
        if placed.is_some() {
            return;
        }
        r.online_failed += 1;
        if before_100 {
            r.online_failed_before_100 += 1;
        }
        if allocator
            .allocate_pod(&self.online, claims, candidates, &pod.host)
            .is_ok()
        {
            r.online_would_preempt += 1;
            if before_100 {
                r.online_would_preempt_before_100 += 1;
            }
        }
    }

    /// Takes the figures at the arrival where arrived demand first reached 100 %.
    pub(super) fn at_100(&mut self, snap: &Snapshot, capacity: u64) {
        let r = &mut self.result;
        r.online_arrived_milli_at_100 = self.online_arrived;
        r.online_placed_milli_at_100 = self.online_placed;
        r.batch_arrived_milli_at_100 = self.batch_arrived;
        r.batch_placed_milli_at_100 = self.batch_placed;
        r.online_placed_pct_at_100 = pct(self.online_placed, self.online_arrived);
        r.batch_placed_pct_at_100 = pct(self.batch_placed, self.batch_arrived);
        r.placed_pct_of_capacity_at_100 = pct(self.online_placed + self.batch_placed, capacity);
        r.batch_overcommitted_pct_at_100 = pct(overcommitted_milli(snap), capacity);
    }
}
