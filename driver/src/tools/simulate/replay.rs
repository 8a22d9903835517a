//! One replay of a trace with one seed: tasks arrive one at a time, each is placed through
//! the allocator or fails for good, and the bookkeeping after every arrival feeds the curves.

use serde::Serialize;

use super::cluster::{Cluster, claim_in};
use super::mixing::{Mixing, MixingResult, Tracker};
use super::order::arrival_order;
use super::trace::TracePod;
use crate::error::{Error, Result};
use crate::placement::allocator::{
    Allocator, AllocatorOptions, DEFAULT_MAX_STEPS, Learn, Policy, Snapshot,
};
use crate::placement::fragmentation::{
    HostResources, NodeState, Typical, WHOLE_GPU, Workload, node_fragmentation,
};

/// The x-axis ends here: arrived demand in percent of the cluster's GPU capacity.
pub const MAX_ARRIVED_PERCENT: u64 = 130;
/// The headline is read at this arrived demand.
pub const HEADLINE_PERCENT: usize = 100;
/// [`HEADLINE_PERCENT`] as a milli-GPU multiplier.
const HEADLINE_X: u64 = 100;

/// How one replay runs.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    /// The placement policy.
    pub policy: Policy,
    /// The seed of the arrival order.
    pub seed: u64,
    /// What the policy knows of the workload before the first arrival (e.g. a history file);
    /// arrivals are added to it as they come.
    pub history: Option<Workload>,
    /// Best-effort tasks to a batch class, and the mixing figures measured ([`Mixing`]).
    pub mixing: Option<Mixing>,
}

/// What one replay measured. Curves are indexed by arrived demand in percent (0..=130) and
/// hold the mean over the arrivals at that percent (`None` where none landed).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SeedResult {
    /// The seed.
    pub seed: u64,
    /// Tasks that arrived (the trace plus its random copies).
    pub pods: usize,
    /// Tasks that could not be placed.
    pub failed_pods: usize,
    /// Tasks with GPUs that could not be placed.
    pub failed_gpu_pods: usize,
    /// Milli-GPU of the tasks that could not be placed.
    pub failed_gpu_milli: u64,
    /// Tasks whose milli-GPU was rounded up to a whole percent.
    pub rounded_pods: usize,
    /// Milli-GPU of the tasks that failed before arrived demand reached 100 %, by kind: what
    /// the headline is made of.
    pub failed_before_100: FailedByKind,
    /// Idle milli-GPU when arrived demand first reached 100 %, by where it is: what the
    /// headline is made of, seen from the cluster's side.
    pub idle_at_100: IdleByKind,
    /// 100 minus the allocation ratio at 100 % arrived demand: the headline (lower is better).
    pub unallocated_pct_at_100: f64,
    /// Fragmented GPU in percent of capacity at 100 % arrived demand.
    pub fragmentation_pct_at_100: f64,
    /// Allocated GPU in percent of capacity, by arrived demand.
    pub allocation_curve: Vec<Option<f64>>,
    /// Fragmented GPU in percent of capacity, by arrived demand.
    pub fragmentation_curve: Vec<Option<f64>>,
    /// The mixing figures, when the replay mixed tiers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mixing: Option<MixingResult>,
}

/// Failed milli-GPU by kind of task.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct FailedByKind {
    /// Shares of one GPU.
    pub shares: u64,
    /// One whole GPU.
    pub whole: u64,
    /// Several whole GPUs.
    pub multi: u64,
}

/// Idle milli-GPU by kind of GPU.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct IdleByKind {
    /// On GPUs that hold shares: gaps that only shares can fill.
    pub partly_used: u64,
    /// On untouched GPUs whose node has CPU and memory left for the smallest GPU task seen.
    pub untouched: u64,
    /// On untouched GPUs whose node has too little CPU or memory left for any GPU task seen.
    pub stranded: u64,
}

impl IdleByKind {
    /// Counts the idle GPU of `snap` now; `smallest` is the least CPU and memory a GPU task
    /// arrived with.
    pub fn count(snap: &Snapshot, smallest: HostResources) -> Self {
        let mut idle = Self::default();
        for (name, _, free) in snap.gpu_free_by_node() {
            let starved = snap.host_free(name).is_some_and(|h| !h.holds(&smallest));
            for &f in free {
                let f = u64::from(f);
                if f < u64::from(WHOLE_GPU) {
                    idle.partly_used += f;
                } else if starved {
                    idle.stranded += f;
                } else {
                    idle.untouched += f;
                }
            }
        }
        idle
    }
}

/// Running bookkeeping of one replay: allocated milli-GPU and each node's fragmentation.
#[derive(Debug)]
pub struct Ledger {
    /// Milli-GPU of the tasks placed so far.
    pub allocated: u64,
    /// Milli-GPU of the tasks arrived so far (failed ones included).
    pub arrived: u64,
    /// Per node (cluster order), its fragmentation under the measure's shapes.
    pub node_frag: Vec<f64>,
    /// Sum of `node_frag`.
    pub total_frag: f64,
}

impl Ledger {
    fn new(cluster: &Cluster, snap: &Snapshot, measure: &[Typical]) -> Self {
        let node_frag: Vec<f64> = cluster
            .nodes
            .iter()
            .map(|n| fragmentation_of(snap, &n.name, measure))
            .collect();
        let total_frag = node_frag.iter().sum();
        Self {
            allocated: 0,
            arrived: 0,
            node_frag,
            total_frag,
        }
    }

    fn update_node(&mut self, idx: usize, value: f64) {
        self.total_frag += value - self.node_frag[idx];
        self.node_frag[idx] = value;
    }
}

/// A node's fragmentation as it is now in the snapshot.
pub fn fragmentation_of(snap: &Snapshot, node: &str, measure: &[Typical]) -> f64 {
    let Some((model, free)) = snap.node_gpu_free(node) else {
        return 0.0;
    };
    let state = NodeState {
        model,
        host_free: snap.host_free(node),
        gpu_free: free,
    };
    node_fragmentation(&state, measure)
}

/// Mean per bucket of (bucket, value) samples.
struct Curve {
    sums: Vec<f64>,
    counts: Vec<u32>,
}

impl Curve {
    fn new() -> Self {
        let n = usize::try_from(MAX_ARRIVED_PERCENT).unwrap_or(130) + 1;
        Self {
            sums: vec![0.0; n],
            counts: vec![0; n],
        }
    }

    fn add(&mut self, bucket: usize, value: f64) {
        if bucket < self.sums.len() {
            self.sums[bucket] += value;
            self.counts[bucket] += 1;
        }
    }

    fn means(&self) -> Vec<Option<f64>> {
        self.sums
            .iter()
            .zip(&self.counts)
            .map(|(&s, &c)| (c > 0).then(|| s / f64::from(c)))
            .collect()
    }
}

/// The value at `x`, else at the nearest x below it that has one.
pub fn at_or_below(curve: &[Option<f64>], x: usize) -> f64 {
    curve
        .iter()
        .take(x + 1)
        .rev()
        .find_map(|v| *v)
        .unwrap_or(0.0)
}

#[allow(clippy::cast_precision_loss)] // Reason: milli-GPU totals of a cluster, far below 2^52.
fn percent(part: u64, whole: u64) -> f64 {
    part as f64 * 100.0 / whole.max(1) as f64
}

#[allow(clippy::cast_precision_loss)] // Reason: as above.
fn percent_f(part: f64, whole: u64) -> f64 {
    part * 100.0 / whole.max(1) as f64
}

/// Counts a task that could not be placed; `before_100` when arrived demand had not passed 100 %.
fn record_failure(result: &mut SeedResult, pod: &TracePod, before_100: bool) {
    result.failed_pods += 1;
    if pod.num_gpu == 0 {
        return;
    }
    result.failed_gpu_pods += 1;
    result.failed_gpu_milli += pod.gpu_demand();
    if before_100 {
        let f = &mut result.failed_before_100;
        match (pod.num_gpu, pod.gpu_milli) {
            (1, m) if m < WHOLE_GPU => f.shares += pod.gpu_demand(),
            (1, _) => f.whole += pod.gpu_demand(),
            _ => f.multi += pod.gpu_demand(),
        }
    }
}

/// Refuses a cluster without GPUs, and a trace with no GPU demand: the replay draws copies until the arrived demand
/// reaches its target, which such a trace never does.
fn require_gpu_demand(capacity: u64, demands: &[u64]) -> Result<()> {
    if capacity == 0 {
        return Err(Error::invalid(
            "simulation",
            "nodes",
            "the cluster has no GPUs",
        ));
    }
    if demands.iter().any(|d| *d > 0) {
        return Ok(());
    }
    Err(Error::invalid(
        "simulation",
        "pods",
        format!(
            "none of the {} tasks asks for a GPU (num_gpu 0 everywhere); the replay measures \
             GPU allocation and has nothing to place",
            demands.len()
        ),
    ))
}

/// Replays `pods` on `cluster` by the paper's method. `measure` holds the typical shapes of
/// the fragmentation report (not the policy's knowledge); `progress` is told
/// `(arrived, total)` now and then.
#[allow(clippy::too_many_lines)] // Reason: one arrival loop, its bookkeeping read top to bottom.
pub fn replay(
    cluster: &Cluster,
    pods: &[TracePod],
    measure: &Workload,
    opts: &ReplayOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<SeedResult> {
    let capacity = cluster.capacity_milli();
    let demands: Vec<u64> = pods.iter().map(TracePod::gpu_demand).collect();
    require_gpu_demand(capacity, &demands)?;
    let order = arrival_order(&demands, opts.seed, capacity * MAX_ARRIVED_PERCENT / 100);
    let mut snap = cluster.snapshot()?;
    let mut tracker = opts
        .mixing
        .as_ref()
        .map(|m| Tracker::new(m, cluster, pods))
        .transpose()?;
    if let Some(h) = &opts.history {
        snap.set_workload(h.clone());
    }
    let allocator = Allocator::new(AllocatorOptions {
        driver_name: cluster.driver_name.clone(),
        policy: opts.policy,
        max_steps: DEFAULT_MAX_STEPS,
    })
    .without_explanations();
    let node_index: std::collections::HashMap<&str, usize> = cluster
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| (n.name.as_str(), i))
        .collect();
    let mut ledger = Ledger::new(cluster, &snap, measure.typical());
    let mut alloc_curve = Curve::new();
    let mut frag_curve = Curve::new();
    let mut result = SeedResult {
        seed: opts.seed,
        pods: order.len(),
        failed_pods: 0,
        failed_gpu_pods: 0,
        failed_gpu_milli: 0,
        rounded_pods: 0,
        failed_before_100: FailedByKind::default(),
        idle_at_100: IdleByKind::default(),
        unallocated_pct_at_100: 0.0,
        fragmentation_pct_at_100: 0.0,
        allocation_curve: Vec::new(),
        fragmentation_curve: Vec::new(),
        mixing: None,
    };
    let step = (order.len() / 200).max(1);
    let mut idle_counted = false;
    // The least CPU and memory a GPU task arrived with, each on its own.
    let mut smallest: Option<HostResources> = None;
    for (seq, &i) in order.iter().enumerate() {
        if seq % step == 0 {
            progress(seq, order.len());
        }
        let pod = &pods[i];
        ledger.arrived += pod.gpu_demand();
        if pod.num_gpu > 0 {
            smallest = Some(smallest.map_or(pod.host, |s| HostResources {
                cpu_milli: s.cpu_milli.min(pod.host.cpu_milli),
                memory_bytes: s.memory_bytes.min(pod.host.memory_bytes),
            }));
        }
        let class = tracker
            .as_ref()
            .map_or(crate::names::CLASS_SHARED_GPU, |t| {
                t.class_of(pod, crate::names::CLASS_SHARED_GPU)
            });
        let claim = claim_in(pod, seq, &cluster.driver_name, class);
        if claim.as_ref().is_some_and(|(_, rounded)| *rounded) {
            result.rounded_pods += 1;
        }
        let claims: Vec<&_> = claim.iter().map(|(c, _)| c).collect();
        // The policy learns the task as it arrives: never a task still to come.
        let placed = allocator.place_pod(
            &mut snap,
            &claims,
            &cluster.candidates,
            &pod.host,
            Learn::Shape(pod.shape()),
        );
        let before_100 = ledger.arrived * 100 <= capacity * HEADLINE_X;
        if let Some(t) = tracker.as_mut() {
            let placement = placed.result.as_ref().ok();
            t.arrival(
                &allocator,
                pod,
                &claims,
                &cluster.candidates,
                placement,
                before_100,
            );
        }
        if let Ok(placement) = placed.result {
            ledger.allocated += pod.gpu_demand();
            if let Some(&idx) = node_index.get(placement.node.as_str()) {
                let value = fragmentation_of(&snap, &placement.node, measure.typical());
                ledger.update_node(idx, value);
            }
        } else {
            record_failure(&mut result, pod, before_100);
        }
        if !idle_counted && ledger.arrived * 100 >= capacity * HEADLINE_X {
            idle_counted = true;
            result.idle_at_100 = IdleByKind::count(&snap, smallest.unwrap_or_default());
            if let Some(t) = tracker.as_mut() {
                t.at_100(&snap, capacity);
            }
        }
        let x = (percent(ledger.arrived, capacity)).round();
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // Reason: 0..=130.
        let bucket = x as usize;
        alloc_curve.add(bucket, percent(ledger.allocated, capacity));
        frag_curve.add(bucket, percent_f(ledger.total_frag, capacity));
    }
    progress(order.len(), order.len());
    result.allocation_curve = alloc_curve.means();
    result.fragmentation_curve = frag_curve.means();
    result.unallocated_pct_at_100 = 100.0 - at_or_below(&result.allocation_curve, HEADLINE_PERCENT);
    result.fragmentation_pct_at_100 = at_or_below(&result.fragmentation_curve, HEADLINE_PERCENT);
    result.mixing = tracker.map(|t| t.result);
    Ok(result)
}
