//! Placement policies: which node, and which devices on it, a claim gets among those that fit.
//!
//! A policy only orders candidates; feasibility is the allocator's. Policies are pluggable
//! through [`PlacementPolicy`]. Each sees what one node has free (GPU by GPU, in milli-GPU, and
//! its CPU and memory where the caller tracks them), what the pod asks for ([`PodAsk`]) and the
//! workload's typical task shapes ([`Workload`]), so fragmentation-aware policies need no
//! change to the search. docs/placement.md compares them on the Alibaba GPU trace.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};
use crate::placement::fragmentation::{
    HostPerGpu, HostResources, NodeState, Typical, WHOLE_GPU, Workload, node_fragmentation,
    stranded,
};
use crate::placement::packing::GapCounts;

/// What a policy sees of one candidate node.
#[derive(Debug, Clone, Copy)]
pub struct NodeView<'a> {
    /// The node's name.
    pub name: &'a str,
    /// The node's position in the candidate list the caller gave.
    pub position: usize,
    /// Devices on the node.
    pub devices: u32,
    /// Sum over its devices of their fullness in permille (1000 = full).
    pub used_permille: u64,
    /// Free milli-GPU of each of the node's Tessera GPUs (1000 = untouched), in device order.
    pub gpu_free: &'a [u32],
    /// The `model` of the node's Tessera GPUs, if it has any.
    pub model: Option<&'a str>,
    /// Free CPU and memory, where the caller tracks them.
    pub host_free: Option<HostResources>,
    /// Allocatable CPU and memory, where the caller tracks them.
    pub host_total: Option<HostResources>,
}

impl NodeView<'_> {
    fn state(&self) -> NodeState<'_> {
        NodeState {
            model: self.model,
            host_free: self.host_free,
            gpu_free: self.gpu_free,
        }
    }
}

/// What a policy sees of one candidate device.
#[derive(Debug, Clone, Copy)]
pub struct DeviceView {
    /// The device's position in kube-scheduler's order on this node.
    pub position: usize,
    /// Fullness in permille (1000 = held whole).
    pub used_permille: u64,
    /// Its index in [`NodeView::gpu_free`], when it is one of the node's Tessera GPUs.
    pub gpu: Option<usize>,
}

/// What the pod being placed asks for, as far as placement scores need it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct PodAsk {
    /// GPUs (cards) over all its claims' requests.
    pub cards: u32,
    /// Milli-GPU on each card (1000 for whole GPUs).
    pub gpu_milli: u32,
    /// CPU and memory it requests of the node.
    pub host: HostResources,
}

/// Everything a score depends on besides the node.
#[derive(Debug, Clone, Copy)]
pub struct ScoreInput<'a> {
    /// The pod being placed.
    pub ask: &'a PodAsk,
    /// The task shapes seen so far.
    pub workload: &'a Workload,
    /// Each GPU model's share of the cluster's Tessera GPUs.
    pub model_shares: &'a [(String, f64)],
    /// Partly used GPUs by free milli-GPU, over the whole cluster.
    pub gaps: &'a GapCounts,
    /// The models whose free GPU the pod would take from tasks that need them
    /// ([`crate::placement::packing::ModelFree::held_back`]), computed once per pod.
    pub held_back: &'a [String],
}

impl ScoreInput<'_> {
    /// The share of `model`'s GPUs that model-restricted typical tasks need (0..=1): the
    /// restricted demand for the model over the model's share of all GPUs.
    pub fn reserved(&self, model: Option<&str>) -> f64 {
        let need = self.workload.model_pressure(model);
        if need <= 0.0 {
            return 0.0;
        }
        let share = model
            .and_then(|m| self.model_shares.iter().find(|(name, _)| name == m))
            .map_or(0.0, |(_, s)| *s);
        if share <= 0.0 {
            1.0
        } else {
            (need / share).min(1.0)
        }
    }
}

/// Orders candidate nodes and devices. Lower scores are tried first; equal scores keep
/// kube-scheduler's order.
pub trait PlacementPolicy: fmt::Debug + Send + Sync {
    /// The policy's name.
    fn name(&self) -> &str;
    /// The score of a node.
    fn node_score(&self, node: &NodeView<'_>, input: &ScoreInput<'_>) -> i64;
    /// A rank that orders nodes before their score, from cluster-wide state that changes with
    /// every placement (so it is never cached; keep it cheap). Lower is tried first.
    fn node_rank(&self, _node: &NodeView<'_>, _input: &ScoreInput<'_>) -> i64 {
        0
    }
    /// The score of a device on the node the search is on.
    fn device_score(&self, device: &DeviceView, node: &NodeView<'_>, input: &ScoreInput<'_>)
    -> i64;
    /// Whether the policy reorders nodes at all; when not, nodes are tried lazily in the
    /// caller's order and the search stops at the first that fits.
    fn orders_nodes(&self) -> bool {
        true
    }
    /// Whether multi-device requests prefer one `NVLink` island, then one NUMA node.
    fn prefers_topology(&self) -> bool;
    /// Whether a node's score depends only on what the node has free, the pod's ask and the
    /// workload (not on its name or position), so it may be cached until one of them changes.
    fn cacheable(&self) -> bool {
        false
    }
}

/// The built-in policies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    /// kube-scheduler's order: nodes as given, devices as published.
    FirstFit,
    /// The fullest node and device that fit, to keep whole GPUs free.
    Binpack,
    /// The emptiest node and device, to spread load.
    Spread,
    /// The node left with the least GPU, CPU and memory (normalized sum), the fullest GPU.
    BestFit,
    /// Fragmentation gradient descent (Weng et al., ATC '23): the node and GPU whose
    /// expected fragmentation, over the typical task shapes by frequency, grows least.
    Fgd,
    /// Tessera's own: fragmentation gradient descent weighted by what a failure costs (each
    /// typical shape by its GPU demand, not its task count) plus GPU stranded by CPU or memory,
    /// ties to the fuller node; a model's free GPU held back for the tasks that need that
    /// model; shares packed by the Sum-of-Squares rule over the cluster's gaps.
    #[default]
    DemandFgd,
}

impl Policy {
    /// Every built-in policy.
    pub const ALL: [Self; 6] = [
        Self::FirstFit,
        Self::Binpack,
        Self::Spread,
        Self::BestFit,
        Self::Fgd,
        Self::DemandFgd,
    ];

    /// The names, for messages and help.
    pub fn names() -> String {
        Self::ALL
            .iter()
            .map(PlacementPolicy::name)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

fn fullness(node: &NodeView<'_>) -> i64 {
    let per_device = node.used_permille / u64::from(node.devices.max(1));
    i64::try_from(per_device).unwrap_or(i64::MAX)
}

/// Scores beyond this are "cannot fit as far as the view tells" and are tried last.
const UNFIT: i64 = i64::MAX / 4;
/// Scale of fragmentation deltas (milli-GPU) into integer scores.
const SCALE: f64 = 1000.0;

/// Ranks a node that would eat into a model's reserve after every node that would not; far
/// above any Sum-of-Squares growth (at most a few times the cluster's GPU count).
const RESERVE_RANK: i64 = 1 << 48;

/// Device scores of fragmentation deltas stay far below this, so a rank times it comes first.
const RANK_SCALE: i64 = 1 << 40;

/// Whether the pod is one share of one GPU, the item that Sum-of-Squares packing places.
fn is_share(ask: &PodAsk) -> bool {
    ask.cards == 1 && ask.gpu_milli < WHOLE_GPU
}

/// The Sum-of-Squares growth of putting the pod's share on a GPU with `free` milli free.
fn packing_growth(input: &ScoreInput<'_>, free: u32) -> Option<i64> {
    input
        .gaps
        .growth(free, input.ask.gpu_milli, input.workload.smallest_share())
}

/// Where a pod's GPUs would go on a node: the indices into `gpu_free` it would take.
fn choices(node: &NodeView<'_>, ask: &PodAsk) -> Vec<Vec<usize>> {
    if ask.cards == 0 {
        return vec![Vec::new()];
    }
    let fits: Vec<usize> = (0..node.gpu_free.len())
        .filter(|&i| node.gpu_free[i] >= ask.gpu_milli)
        .collect();
    if fits.len() < ask.cards as usize {
        return Vec::new();
    }
    if ask.cards == 1 {
        // GPUs with the same free amount are interchangeable: one choice per amount.
        let mut seen: Vec<u32> = Vec::new();
        return fits
            .into_iter()
            .filter(|&i| {
                let f = node.gpu_free[i];
                let new = !seen.contains(&f);
                seen.push(f);
                new
            })
            .map(|i| vec![i])
            .collect();
    }
    // Several cards: the fullest that fit, so whole free GPUs stay whole where they can.
    let mut by_free = fits;
    by_free.sort_by_key(|&i| (node.gpu_free[i], i));
    vec![by_free.into_iter().take(ask.cards as usize).collect()]
}

/// The state after the pod takes `taken` on the node.
fn after(node: &NodeView<'_>, ask: &PodAsk, taken: &[usize]) -> (Vec<u32>, Option<HostResources>) {
    let mut free = node.gpu_free.to_vec();
    for &i in taken {
        free[i] = free[i].saturating_sub(ask.gpu_milli);
    }
    (free, node.host_free.map(|h| h.minus(&ask.host)))
}

/// The least growth of expected fragmentation over the pod's GPU choices on the node, and the
/// choice that gives it; `None` when the view shows no room.
fn best_delta(
    node: &NodeView<'_>,
    ask: &PodAsk,
    measure: &dyn Fn(&NodeState<'_>) -> f64,
) -> Option<(f64, Vec<usize>)> {
    let before = measure(&node.state());
    let mut best: Option<(f64, Vec<usize>)> = None;
    for taken in choices(node, ask) {
        let (free, host_free) = after(node, ask, &taken);
        let state = NodeState {
            model: node.model,
            host_free,
            gpu_free: &free,
        };
        let delta = measure(&state) - before;
        if best.as_ref().is_none_or(|(d, _)| delta < *d - 1e-9) {
            best = Some((delta, taken));
        }
    }
    best
}

/// Demand-fgd's measure: fragmentation over the typical shapes weighted by demand, plus the
/// idle GPU that the node's free CPU and memory cannot back.
fn demand_measure(state: &NodeState<'_>, typical: &[Typical], per_gpu: &HostPerGpu) -> f64 {
    node_fragmentation(state, typical) + stranded(state, per_gpu)
}

#[allow(clippy::cast_possible_truncation)] // Reason: deltas are bounded by a node's milli-GPU.
fn scaled(x: f64) -> i64 {
    (x * SCALE).round() as i64
}

/// Fraction of the node left free after the pod, summed over GPU, CPU and memory (best-fit).
fn remaining(node: &NodeView<'_>, ask: &PodAsk) -> i64 {
    let gpus = node.gpu_free.len().max(1);
    let gpu_free: u64 = node.gpu_free.iter().map(|&f| u64::from(f)).sum();
    let gpu_after = gpu_free.saturating_sub(u64::from(ask.cards) * u64::from(ask.gpu_milli));
    #[allow(clippy::cast_precision_loss)] // Reason: ratios for ordering only.
    let mut left = gpu_after as f64 / (gpus as f64 * f64::from(WHOLE_GPU));
    if let (Some(free), Some(total)) = (node.host_free, node.host_total) {
        let after = free.minus(&ask.host);
        #[allow(clippy::cast_precision_loss)] // Reason: ratios for ordering only.
        let ratio = |a: u64, t: u64| if t == 0 { 0.0 } else { a as f64 / t as f64 };
        left += ratio(after.cpu_milli, total.cpu_milli);
        left += ratio(after.memory_bytes, total.memory_bytes);
    }
    scaled(left)
}

impl PlacementPolicy for Policy {
    fn name(&self) -> &str {
        match self {
            Self::FirstFit => "first-fit",
            Self::Binpack => "binpack",
            Self::Spread => "spread",
            Self::BestFit => "best-fit",
            Self::Fgd => "fgd",
            Self::DemandFgd => "demand-fgd",
        }
    }

    fn node_score(&self, node: &NodeView<'_>, input: &ScoreInput<'_>) -> i64 {
        match self {
            Self::FirstFit => 0,
            Self::Binpack => -fullness(node),
            Self::Spread => fullness(node),
            Self::BestFit => remaining(node, input.ask),
            Self::Fgd => {
                let typical = input.workload.typical();
                best_delta(node, input.ask, &|s| node_fragmentation(s, typical))
                    .map_or(UNFIT, |(d, _)| scaled(d))
            }
            Self::DemandFgd => {
                let typical = input.workload.typical_by_demand();
                let per_gpu = input.workload.host_per_gpu();
                let measure = |s: &NodeState<'_>| demand_measure(s, typical, &per_gpu);
                best_delta(node, input.ask, &measure).map_or(UNFIT, |(d, _)| {
                    // GPUs of a model that model-restricted tasks need cost what those tasks
                    // would lose; equal scores: the fuller node, so empty nodes stay empty.
                    #[allow(clippy::cast_precision_loss)] // Reason: one pod's milli-GPU.
                    let demand = f64::from(input.ask.cards) * f64::from(input.ask.gpu_milli);
                    let reserved = demand * input.reserved(node.model);
                    scaled(d + reserved) * 1024 - fullness(node)
                })
            }
        }
    }

    fn node_rank(&self, node: &NodeView<'_>, input: &ScoreInput<'_>) -> i64 {
        if *self != Self::DemandFgd {
            return 0;
        }
        // First: do not take what tasks that need this node's model will need.
        let reserve = node
            .model
            .is_some_and(|m| input.held_back.iter().any(|h| h == m));
        let packing = if is_share(input.ask) {
            node.gpu_free
                .iter()
                .filter_map(|&free| packing_growth(input, free))
                .min()
                .unwrap_or(0)
        } else {
            0
        };
        i64::from(reserve) * RESERVE_RANK + packing
    }

    fn device_score(
        &self,
        device: &DeviceView,
        node: &NodeView<'_>,
        input: &ScoreInput<'_>,
    ) -> i64 {
        let used = i64::try_from(device.used_permille).unwrap_or(i64::MAX);
        match self {
            Self::FirstFit => 0,
            Self::Binpack | Self::BestFit => -used,
            Self::Spread => used,
            Self::Fgd | Self::DemandFgd => {
                let Some(gpu) = device.gpu.filter(|_| input.ask.cards == 1) else {
                    return -used;
                };
                let measure = |s: &NodeState<'_>| {
                    if *self == Self::Fgd {
                        node_fragmentation(s, input.workload.typical())
                    } else {
                        let per_gpu = input.workload.host_per_gpu();
                        demand_measure(s, input.workload.typical_by_demand(), &per_gpu)
                    }
                };
                let before = measure(&node.state());
                if node
                    .gpu_free
                    .get(gpu)
                    .is_none_or(|&f| f < input.ask.gpu_milli)
                {
                    return UNFIT;
                }
                let (free, host_free) = after(node, input.ask, &[gpu]);
                let state = NodeState {
                    model: node.model,
                    host_free,
                    gpu_free: &free,
                };
                // Equal growth: the fuller GPU.
                let score = scaled(measure(&state) - before) * 1024 - used;
                if *self == Self::DemandFgd && is_share(input.ask) {
                    let free = node.gpu_free.get(gpu).copied().unwrap_or(0);
                    let rank = packing_growth(input, free).unwrap_or(0);
                    return rank.saturating_mul(RANK_SCALE).saturating_add(score);
                }
                score
            }
        }
    }

    fn orders_nodes(&self) -> bool {
        !matches!(self, Self::FirstFit)
    }

    fn prefers_topology(&self) -> bool {
        !matches!(self, Self::FirstFit)
    }

    fn cacheable(&self) -> bool {
        true
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Policy {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                Error::invalid(
                    "allocator options",
                    "policy",
                    format!("unknown policy {s:?}; expected one of {}", Self::names()),
                )
            })
    }
}

#[cfg(test)]
mod tests;
