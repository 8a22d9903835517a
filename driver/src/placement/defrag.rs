//! Defragmentation: making contiguous room for a claim by moving a few pods elsewhere.
//!
//! A pod whose claims fit on no node as the cluster is may fit on a node once some pods there
//! move to other nodes: a whole GPU, or four GPUs of one `NVLink` island, held by a few small
//! shares that could share GPUs elsewhere. [`plan`] finds such a move, and only one that
//! leaves every moved pod a place:
//!
//! * Only *movable* pods move ([`movable`]): preemptible by their tier (every share they hold
//!   is recorded batch, [`crate::placement::allocator::preempt::evictable`]), owned by a
//!   controller that re-creates them elsewhere (a `ReplicaSet`, `Job`, `StatefulSet`…; not a
//!   `DaemonSet`, whose pods belong to their node, nor a bare pod), and not blocked by a
//!   `PodDisruptionBudget` (one that selects the pod and allows no disruption now).
//! * For each candidate node holding movable pods, the pods are ordered largest GPU memory
//!   first (fewer moves), the shortest prefix whose removal lets the claim fit is taken, and
//!   every pod the claim fits without is dropped again: the set is minimal (no move in it can
//!   be left out). The pending pod is then committed to the node, and every moved pod must be
//!   placed on another node (in the same snapshot, one after another, largest first); a node
//!   where one cannot is not chosen.
//! * Among nodes: the fewest moves, then the least memory moved, then the candidate order. A
//!   plan never has more moves than the budget left ([`budget_left`]: an admin's evictions per
//!   hour, zero by default, which turns defragmentation off).
//!
//! The snapshot ends as it was given. The plan's `placement` is where the pending pod goes
//! once the moved pods are gone; the controller evicts them, waits for their claims to be
//! released, and places the pod, where room was made.

pub mod record;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};

use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::resource::v1 as res;
use serde::Serialize;

use crate::placement::allocator::preempt;
pub use crate::placement::allocator::preempt::Evictable;
use crate::placement::allocator::{Allocator, Placement, Snapshot, claim_key, claim_name};
use crate::placement::fragmentation::HostResources;
use crate::rules::labelselect::Selector;

/// The most movable pods considered on one node.
pub const MAX_MOVES_CONSIDERED: usize = 16;

/// One pod to move.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Move {
    /// `namespace/name`.
    pub pod: String,
    /// Its UID (an eviction names it as a precondition).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    /// The node it leaves.
    pub from: String,
    /// The node it would be placed on (its controller re-creates it; the scheduler decides).
    pub to: String,
    /// Bytes of GPU memory it holds.
    pub memory_bytes: u64,
    /// Why it moves, in words.
    pub reason: String,
}

/// A defragmentation plan for one pending pod.
#[derive(Debug, Clone, PartialEq)]
pub struct DefragPlan {
    /// The node where room is made.
    pub node: String,
    /// The pods to move, largest first.
    pub moves: Vec<Move>,
    /// Where the pending pod's claims go once the moves are done.
    pub placement: Placement,
}

/// Whether `pod` is owned by a controller that re-creates it on another node.
pub fn recreated_elsewhere(pod: &Pod) -> bool {
    pod.metadata
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.controller == Some(true) && o.kind != "DaemonSet" && o.kind != "Node")
}

/// Whether a `PodDisruptionBudget` among `pdbs` selects `pod` (same namespace, selector
/// matches its labels) and allows no disruption now (`status.disruptionsAllowed` below 1, or
/// no status yet: the disruption controller has not counted it). A PDB with a malformed or
/// empty selector is taken as the API server's eviction handling takes it: it selects
/// nothing (policy/v1).
pub fn blocked_by_pdb(pod: &Pod, pdbs: &[PodDisruptionBudget]) -> bool {
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    let empty = BTreeMap::new();
    let labels = pod.metadata.labels.as_ref().unwrap_or(&empty);
    pdbs.iter().any(|pdb| {
        if pdb.metadata.namespace.as_deref().unwrap_or("default") != namespace {
            return false;
        }
        let Some(spec_selector) = pdb.spec.as_ref().and_then(|s| s.selector.as_ref()) else {
            return false;
        };
        let empty_selector = spec_selector
            .match_labels
            .as_ref()
            .is_none_or(BTreeMap::is_empty)
            && spec_selector
                .match_expressions
                .as_ref()
                .is_none_or(Vec::is_empty);
        if empty_selector {
            return false;
        }
        let Ok(selector) = Selector::from_spec(spec_selector, "spec.selector") else {
            return false;
        };
        selector.matches(labels)
            && pdb
                .status
                .as_ref()
                .is_none_or(|s| s.disruptions_allowed.unwrap_or(0) < 1)
    })
}

/// The pods among `pods` that defragmentation may move (see the module docs); `claims` by
/// `namespace/name`.
pub fn movable<'a>(
    driver: &str,
    pods: impl IntoIterator<Item = &'a Pod> + Clone,
    claims: &BTreeMap<String, res::ResourceClaim>,
    pdbs: &[PodDisruptionBudget],
) -> Vec<Evictable> {
    let by_key: BTreeMap<String, &Pod> = pods
        .clone()
        .into_iter()
        .map(|p| {
            (
                format!(
                    "{}/{}",
                    p.metadata.namespace.as_deref().unwrap_or("default"),
                    p.metadata.name.as_deref().unwrap_or_default()
                ),
                p,
            )
        })
        .collect();
    preempt::evictable(driver, pods, claims)
        .into_iter()
        .filter(|e| {
            by_key
                .get(&e.pod)
                .is_some_and(|p| recreated_elsewhere(p) && !blocked_by_pdb(p, pdbs))
        })
        .collect()
}

/// How many evictions the budget still allows now: `per_hour` less the evictions made in the
/// hour before `now` (`done`, their times). Zero when `per_hour` is zero (off).
pub fn budget_left(per_hour: u32, done: &[Timestamp], now: Timestamp) -> usize {
    let hour_ago = now
        .checked_sub(jiff::SignedDuration::from_hours(1))
        .unwrap_or(Timestamp::MIN);
    let recent = done.iter().filter(|t| **t > hour_ago && **t <= now).count();
    usize::try_from(per_hour)
        .unwrap_or(usize::MAX)
        .saturating_sub(recent)
}

fn gib(bytes: u64) -> String {
    #[allow(clippy::cast_precision_loss)] // Reason: a message; GiB to one decimal.
    let g = bytes as f64 / f64::from(1u32 << 30);
    format!("{g:.1}Gi")
}

/// Releases the claims of `pods` from `snapshot`.
fn release(snapshot: &mut Snapshot, pods: &[&Evictable]) {
    for c in pods.iter().flat_map(|p| &p.claims) {
        snapshot.release(&claim_key(c));
    }
}

/// Commits the claims of `pods` back with their original allocations.
fn restore(snapshot: &mut Snapshot, pods: &[&Evictable]) {
    for c in pods.iter().flat_map(|p| &p.claims) {
        if let Some(a) = c.status.as_ref().and_then(|s| s.allocation.as_ref()) {
            snapshot.commit(c, a);
        }
    }
}

/// A plan to place the pod with `claims` and `host` on one of `candidates` by moving at most
/// `budget` of `movable` pods to other candidates, or `None` (see the module docs). A pod
/// that fits as the cluster is needs no plan: `None`.
pub fn plan(
    allocator: &Allocator,
    snapshot: &mut Snapshot,
    claims: &[&res::ResourceClaim],
    host: &HostResources,
    candidates: &[Node],
    movable: &[Evictable],
    budget: usize,
) -> Option<DefragPlan> {
    if budget == 0
        || allocator
            .allocate_pod(snapshot, claims, candidates, host)
            .is_ok()
    {
        return None;
    }
    let pending = claims
        .iter()
        .map(|c| claim_name(c))
        .collect::<Vec<_>>()
        .join(", ");
    let mut by_node: BTreeMap<&str, Vec<&Evictable>> = BTreeMap::new();
    for e in movable {
        by_node.entry(e.node.as_str()).or_default().push(e);
    }
    let mut best: Option<((usize, u64, usize), DefragPlan)> = None;
    for (position, node) in candidates.iter().enumerate() {
        let name = node.metadata.name.as_deref().unwrap_or_default();
        let Some(list) = by_node.get_mut(name) else {
            continue;
        };
        list.sort_by_key(|e| (Reverse(e.memory_bytes), e.pod.clone()));
        list.truncate(MAX_MOVES_CONSIDERED);
        let node_only = std::slice::from_ref(node);
        let mut fits = |set: &[&Evictable]| {
            release(snapshot, set);
            let ok = allocator
                .allocate_pod(snapshot, claims, node_only, host)
                .is_ok();
            restore(snapshot, set);
            ok
        };
        if !fits(&list[..]) {
            continue;
        }
        let chosen = preempt::fewest_that_fit(&list[..], &mut fits);
        if chosen.is_empty() || chosen.len() > budget {
            continue;
        }
        let bytes: u64 = chosen.iter().map(|e| e.memory_bytes).sum();
        let score = (chosen.len(), bytes, position);
        if best.as_ref().is_some_and(|(s, _)| *s <= score) {
            continue;
        }
        let others: Vec<Node> = candidates
            .iter()
            .filter(|n| n.metadata.name.as_deref() != Some(name))
            .cloned()
            .collect();
        if let Some(p) = relocate(
            allocator, snapshot, claims, host, node, &others, &chosen, &pending,
        ) {
            best = Some((score, p));
        }
    }
    best.map(|(_, p)| p)
}

/// Commits the pending pod to `node` with `chosen` gone, and places every chosen pod on one of
/// `others`; the plan, or `None` when one of them fits nowhere. The snapshot ends as it began.
#[allow(clippy::too_many_arguments)] // Reason: one private step of `plan`, with its state.
fn relocate(
    allocator: &Allocator,
    snapshot: &mut Snapshot,
    claims: &[&res::ResourceClaim],
    host: &HostResources,
    node: &Node,
    others: &[Node],
    chosen: &[&Evictable],
    pending: &str,
) -> Option<DefragPlan> {
    let name = node.metadata.name.clone().unwrap_or_default();
    release(snapshot, chosen);
    let mut committed: Vec<String> = Vec::new();
    let outcome = (|| {
        let placement = allocator
            .allocate_pod(snapshot, claims, std::slice::from_ref(node), host)
            .ok()?;
        for (c, a) in claims.iter().zip(&placement.allocations) {
            snapshot.commit(c, a);
            committed.push(claim_key(c));
        }
        let mut moves = Vec::with_capacity(chosen.len());
        for e in chosen {
            let refs: Vec<&res::ResourceClaim> = e.claims.iter().collect();
            let to = allocator
                .allocate_pod(snapshot, &refs, others, &HostResources::default())
                .ok()?;
            for (c, a) in refs.iter().zip(&to.allocations) {
                snapshot.commit(c, a);
                committed.push(claim_key(c));
            }
            moves.push(Move {
                pod: e.pod.clone(),
                uid: e.uid.clone(),
                from: name.clone(),
                to: to.node.clone(),
                memory_bytes: e.memory_bytes,
                reason: format!(
                    "{} holds {} of batch GPU memory on {name}; it fits on {}, and with it gone \
                     {pending} fits on {name}",
                    e.pod,
                    gib(e.memory_bytes),
                    to.node
                ),
            });
        }
        Some(DefragPlan {
            node: name.clone(),
            moves,
            placement,
        })
    })();
    for key in &committed {
        snapshot.release(key);
    }
    restore(snapshot, chosen);
    outcome
}

/// The pods of `plan` by `namespace/name`.
pub fn moved_pods(plan: &DefragPlan) -> BTreeSet<&str> {
    plan.moves.iter().map(|m| m.pod.as_str()).collect()
}

#[cfg(test)]
mod tests;
