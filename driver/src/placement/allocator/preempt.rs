//! Preemption (shared/DESIGN.md §8): which batch pods an online pod that fits nowhere may
//! evict.
//!
//! * Only *evictable* pods are victims ([`evictable`]): placed, not finishing, every device of
//!   Tessera's driver they hold is a share whose `AllocatedShares` record says `batch`, and no
//!   other pod uses their claims. A pod holding an online share or a whole GPU is never one.
//! * Only an online pod preempts ([`Allocator::is_online`]: none of its requests is batch).
//! * [`Allocator::choose_victims`] tries each candidate node that has evictable pods: it
//!   orders them lowest priority first (larger holdings first among equals, then by name),
//!   takes the shortest prefix of that order whose removal lets the pod fit on the node, then
//!   drops every victim (highest priority first) the pod fits without. Among nodes it takes
//!   the fewest victims, then the lowest highest priority, then the lowest sum of priorities,
//!   then the candidate order. Each trial is one allocation on one node, with the victims'
//!   claims released from the snapshot and committed back afterwards, so the snapshot ends as
//!   it began. At most [`MAX_VICTIMS`] pods per node are considered.
//!
//! What this does not weigh: the victims' CPU and memory (a node must already have room for
//! the pod's host resources to be a candidate), and pods of other drivers.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1 as res;

use super::request;
use super::{Allocator, Snapshot, claim_key};
use crate::placement::fragmentation::HostResources;
use crate::placement::gate;
use crate::rules::config::{self, TesseraConfig, Tier};

/// The most evictable pods considered on one node.
pub const MAX_VICTIMS: usize = 16;

/// A pod preemption may evict.
#[derive(Debug, Clone, PartialEq)]
pub struct Evictable {
    /// `namespace/name`.
    pub pod: String,
    /// Its UID (evictions name it as a precondition).
    pub uid: Option<String>,
    /// `spec.priority` (0 when unset).
    pub priority: i32,
    /// The node its claims are allocated on.
    pub node: String,
    /// Bytes of GPU memory its shares hold (a larger holding goes first among equals).
    pub memory_bytes: u64,
    /// Its claims, with their allocations.
    pub claims: Vec<res::ResourceClaim>,
}

/// The pods to evict so that a pod fits, all on one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Victims {
    /// The node the pod would fit on once they are gone.
    pub node: String,
    /// `namespace/name` of each victim, lowest priority first.
    pub pods: Vec<String>,
}

/// The tier of every device of `driver` in an allocation's `AllocatedShares` records, by
/// (request, pool, device); devices without a record are absent.
fn recorded_tiers(
    driver: &str,
    allocation: &res::AllocationResult,
) -> BTreeMap<(String, String, String), (Tier, u64)> {
    let mut out = BTreeMap::new();
    let configs = allocation.devices.as_ref().and_then(|d| d.config.as_ref());
    for cfg in configs.into_iter().flatten() {
        let Some(opaque) = cfg.opaque.as_ref().filter(|o| o.driver == driver) else {
            continue;
        };
        if let Ok(TesseraConfig::AllocatedShares(record)) =
            config::decode(&opaque.parameters.0, "allocation")
        {
            for d in record.devices {
                let bytes = d.memory.as_units().and_then(|v| u64::try_from(v).ok());
                out.insert((d.request, d.pool, d.device), (d.tier, bytes.unwrap_or(0)));
            }
        }
    }
    out
}

/// Whether `claim` holds only batch shares of `driver` (at least one), and how much memory.
fn batch_holding(driver: &str, claim: &res::ResourceClaim) -> Option<u64> {
    let allocation = claim.status.as_ref()?.allocation.as_ref()?;
    let tiers = recorded_tiers(driver, allocation);
    let mut bytes = 0u64;
    let mut shares = 0;
    for result in allocation
        .devices
        .as_ref()
        .and_then(|d| d.results.as_ref())
        .into_iter()
        .flatten()
        .filter(|r| r.driver == driver)
    {
        let key = (
            result.request.clone(),
            result.pool.clone(),
            result.device.clone(),
        );
        match tiers.get(&key) {
            Some((Tier::Batch, b)) => {
                shares += 1;
                bytes = bytes.saturating_add(*b);
            }
            _ => return None,
        }
    }
    (shares > 0).then_some(bytes)
}

/// The pods among `pods` that preemption may evict (see the module docs); `claims` by
/// `namespace/name`.
pub fn evictable<'a>(
    driver: &str,
    pods: impl IntoIterator<Item = &'a Pod> + Clone,
    claims: &BTreeMap<String, res::ResourceClaim>,
) -> Vec<Evictable> {
    let users = gate::claim_users(pods.clone());
    let mut out = Vec::new();
    for pod in pods {
        if gate::is_gated(pod) || gate::is_done(pod) {
            continue;
        }
        let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
        let key = format!(
            "{namespace}/{}",
            pod.metadata.name.as_deref().unwrap_or_default()
        );
        let Ok(names) = gate::claim_names(pod) else {
            continue;
        };
        if names.is_empty() {
            continue;
        }
        let mut held = Vec::new();
        let mut nodes = BTreeSet::new();
        let mut bytes = 0u64;
        let ok = names.iter().all(|n| {
            let claim_path = format!("{namespace}/{n}");
            let Some(claim) = claims.get(&claim_path) else {
                return false;
            };
            let alone = users
                .get(&claim_path)
                .is_some_and(|u| u.as_slice() == std::slice::from_ref(&key));
            let reserved_by_others = claim
                .status
                .as_ref()
                .and_then(|s| s.reserved_for.as_ref())
                .into_iter()
                .flatten()
                .any(|r| r.uid != pod.metadata.uid.clone().unwrap_or_default());
            let Some(b) = batch_holding(driver, claim) else {
                return false;
            };
            let node = claim
                .status
                .as_ref()
                .and_then(|s| s.allocation.as_ref())
                .and_then(gate::allocation_node);
            nodes.insert(node);
            bytes = bytes.saturating_add(b);
            held.push(claim.clone());
            alone && !reserved_by_others
        });
        if !ok || nodes.len() != 1 {
            continue;
        }
        let Some(Some(node)) = nodes.into_iter().next() else {
            continue;
        };
        out.push(Evictable {
            pod: key,
            uid: pod.metadata.uid.clone(),
            priority: pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0),
            node,
            memory_bytes: bytes,
            claims: held,
        });
    }
    out
}

impl Allocator {
    /// Whether a pod with `claims` is online: every request resolves to the online tier
    /// (whole GPUs included). A malformed claim makes it not online: it preempts nothing.
    pub fn is_online(&self, snapshot: &Snapshot, claims: &[&res::ResourceClaim]) -> bool {
        let mut cache = snapshot.selectors();
        claims.iter().all(|claim| {
            request::prepare_claim(snapshot, &mut cache, &self.options.driver_name, claim)
                .is_ok_and(|spec| {
                    spec.requests
                        .iter()
                        .flatten()
                        .all(|r| r.tier == Tier::Online)
                })
        })
    }

    /// The fewest, lowest-priority pods among `evictable` whose removal lets the pod with
    /// `claims` and `host` fit on one of `candidates`, or `None` when no such set exists (see
    /// the module docs). The snapshot is left as it was given.
    pub fn choose_victims(
        &self,
        snapshot: &mut Snapshot,
        claims: &[&res::ResourceClaim],
        candidates: &[Node],
        host: &HostResources,
        evictable: &[Evictable],
    ) -> Option<Victims> {
        let mut by_node: BTreeMap<&str, Vec<&Evictable>> = BTreeMap::new();
        for e in evictable {
            by_node.entry(e.node.as_str()).or_default().push(e);
        }
        let mut best: Option<((usize, i32, i64, usize), Victims)> = None;
        for (position, node) in candidates.iter().enumerate() {
            let name = node.metadata.name.as_deref().unwrap_or_default();
            let Some(list) = by_node.get_mut(name) else {
                continue;
            };
            list.sort_by_key(|e| (e.priority, Reverse(e.memory_bytes), e.pod.clone()));
            list.truncate(MAX_VICTIMS);
            let node_only = std::slice::from_ref(node);
            let mut fits =
                |set: &[&Evictable]| self.fits_without(snapshot, claims, node_only, host, set);
            if !fits(&list[..]) {
                continue;
            }
            let chosen = fewest_that_fit(&list[..], &mut fits);
            if chosen.is_empty() {
                continue;
            }
            let score = (
                chosen.len(),
                chosen.iter().map(|e| e.priority).max().unwrap_or(0),
                chosen.iter().map(|e| i64::from(e.priority)).sum(),
                position,
            );
            if best.as_ref().is_none_or(|(s, _)| score < *s) {
                best = Some((
                    score,
                    Victims {
                        node: name.to_owned(),
                        pods: chosen.iter().map(|e| e.pod.clone()).collect(),
                    },
                ));
            }
        }
        best.map(|(_, v)| v)
    }

    /// Whether the pod fits on `node` once `victims` are gone; the snapshot ends unchanged.
    fn fits_without(
        &self,
        snapshot: &mut Snapshot,
        claims: &[&res::ResourceClaim],
        node: &[Node],
        host: &HostResources,
        victims: &[&Evictable],
    ) -> bool {
        for c in victims.iter().flat_map(|v| &v.claims) {
            snapshot.release(&claim_key(c));
        }
        let fits = self.allocate_pod(snapshot, claims, node, host).is_ok();
        for c in victims.iter().flat_map(|v| &v.claims) {
            if let Some(a) = c.status.as_ref().and_then(|s| s.allocation.as_ref()) {
                snapshot.commit(c, a);
            }
        }
        fits
    }
}

/// The fewest of `list` (ordered by preference, every one of them together making room) whose
/// removal still makes room: the shortest prefix that does (more removed never takes room
/// away), then each member dropped again from the last that is not needed. Preemption and
/// defragmentation both choose their pods so.
pub(crate) fn fewest_that_fit<'a>(
    list: &[&'a Evictable],
    fits: &mut impl FnMut(&[&'a Evictable]) -> bool,
) -> Vec<&'a Evictable> {
    let (mut lo, mut hi) = (0, list.len());
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if fits(&list[..mid]) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    let mut chosen: Vec<&Evictable> = list[..lo].to_vec();
    for i in (0..chosen.len()).rev() {
        let mut without = chosen.clone();
        without.remove(i);
        if fits(&without) {
            chosen = without;
        }
    }
    chosen
}

#[cfg(test)]
mod tests;
