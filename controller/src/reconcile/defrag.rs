//! Defragmentation's edge (docs/controller.md, "Defragmentation"): with
//! `--defrag-evictions-per-hour` above zero, a pod that fits nowhere for lack of contiguous
//! room may have a few batch pods moved out of its way.
//!
//! The plan is [`tessera_driver::placement::defrag::plan`]'s (pure): the smallest set of
//! movable pods (batch by their tier, owned by a controller that re-creates them) on one node
//! whose going lets the pod fit there while each of them fits on another node, within the
//! budget left. This module asks the API server:
//! * a dry run of every move's eviction first, so a `PodDisruptionBudget` that forbids one (a
//!   429) is known before anything is evicted: that pod is left out and the plan made again;
//! * then the node's record (`gpu.tessera.dev/defrag`: whom the room is for, the evictions of
//!   the last hour) with the node's resourceVersion as a precondition, *before* any eviction,
//!   so a restart or a new leader counts them against the budget even if it stopped half-way;
//! * then the evictions, each with an Event on the pod and one on the node.
//!
//! While the record holds ([`record::HOLD`]) the pending pod is placed only on that node and
//! no other pod is placed there, so the room goes to the pod it was made for. Nothing is
//! evicted for a pod while a pod evicted for it still exists.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1 as res;
use tessera_driver::names;
use tessera_driver::placement::defrag::{self, DefragPlan, Evictable, record::DefragRecord};
use tessera_driver::placement::fragmentation::HostResources;
use tracing::{info, warn};

use super::{Eviction, NotPlaced, Reconciler, Writes, now, pod_key};
use crate::cluster::ClusterView;
use crate::error::Error;

/// The records the controller has written and the ones on the nodes, the later of each.
#[derive(Debug, Default)]
pub(super) struct Defrags {
    /// Records this replica wrote, by node: the view may not show them yet.
    written: BTreeMap<String, DefragRecord>,
    /// Pods whose eviction a disruption budget refused, by the pod they were to make room for.
    blocked: BTreeMap<String, BTreeSet<String>>,
}

/// Every node's record (the later of the view's and the one written here), or an error for a
/// record that does not parse.
fn records(
    view: &ClusterView,
    written: &BTreeMap<String, DefragRecord>,
) -> Result<BTreeMap<String, DefragRecord>, String> {
    let mut out = written.clone();
    for node in view.nodes() {
        let name = node.metadata.name.clone().unwrap_or_default();
        match DefragRecord::of(node) {
            Ok(Some(r)) => {
                if out.get(&name).is_none_or(|w| w.at < r.at) {
                    out.insert(name, r);
                }
            }
            Ok(None) => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(out)
}

impl Defrags {
    /// Forgets what concerns pods that are no longer waiting.
    pub(super) fn retain(&mut self, live: &BTreeSet<&String>) {
        self.blocked.retain(|k, _| live.contains(k));
    }
}

/// Where the room held for `pod` is, and the nodes held for other pods still waiting, at `now`.
struct Holds {
    /// The node held for this pod.
    mine: Option<String>,
    /// Nodes held for other pods.
    others: BTreeSet<String>,
}

fn exists(view: &ClusterView, key: &str, uid: Option<&String>) -> bool {
    view.pods()
        .get(key)
        .is_some_and(|p| p.metadata.uid.as_ref() == uid)
}

impl<W: Writes + Clone + 'static> Reconciler<W> {
    /// The holds that concern `pod` (empty when defragmentation is off). A record that cannot
    /// be read holds nothing (it also stops defragmentation: see [`Self::defragment`]).
    fn holds(&self, view: &ClusterView, pod: &Pod) -> Holds {
        let mut holds = Holds {
            mine: None,
            others: BTreeSet::new(),
        };
        if self.config.defrag_per_hour == 0 {
            return holds;
        }
        let Ok(records) = records(view, &self.defrags.written) else {
            return holds;
        };
        let at = now();
        let key = pod_key(pod);
        for (node, r) in records {
            if r.holds_for(&key, pod.metadata.uid.as_deref(), at) {
                holds.mine = Some(node);
            } else if r.holding(at)
                && view.pods().get(&r.room_for).is_some_and(|p| {
                    p.metadata.uid == r.room_for_uid && tessera_driver::placement::gate::is_gated(p)
                })
            {
                holds.others.insert(node);
            }
        }
        holds
    }

    /// `candidates` less what defragmentation holds: room it made goes to the pod it was made
    /// for, which is placed only there while it is held, and no other pod is placed there.
    pub(super) fn held_candidates(
        &self,
        view: &ClusterView,
        pod: &Pod,
        candidates: Arc<Vec<Node>>,
    ) -> Arc<Vec<Node>> {
        let holds = self.holds(view, pod);
        if holds.mine.is_none() && holds.others.is_empty() {
            return candidates;
        }
        let kept: Vec<Node> = candidates
            .iter()
            .filter(|n| {
                let name = n.metadata.name.as_deref().unwrap_or_default();
                holds
                    .mine
                    .as_deref()
                    .map_or_else(|| !holds.others.contains(name), |mine| mine == name)
            })
            .cloned()
            .collect();
        Arc::new(kept)
    }

    /// Tries to make contiguous room for `pod` by moving batch pods; `Some` is what to tell the
    /// pod (waiting for the room, or a transient failure), `None` when defragmentation cannot
    /// help (or is off, or its budget is spent).
    pub(super) async fn defragment(
        &mut self,
        view: &mut ClusterView,
        pod: &Pod,
        claims: &[&res::ResourceClaim],
        candidates: &[Node],
        host: &HostResources,
    ) -> Option<NotPlaced> {
        if self.config.defrag_per_hour == 0 {
            return None;
        }
        if !self.leading() {
            return Some(NotPlaced::NotLeader);
        }
        let key = pod_key(pod);
        let at = now();
        let records = match records(view, &self.defrags.written) {
            Ok(r) => r,
            Err(e) => {
                // Fail closed: evictions that cannot be counted spend the whole budget.
                warn!(pod = %key, error = %e, "a defragmentation record cannot be read; no defragmentation");
                return None;
            }
        };
        // Room already made for this pod: wait for the pods evicted for it to go.
        if let Some((node, r)) = records
            .iter()
            .find(|(_, r)| r.holds_for(&key, pod.metadata.uid.as_deref(), at))
        {
            let leaving: Vec<&str> = r
                .evicted
                .iter()
                .filter(|e| e.at == r.at && exists(view, &e.pod, e.uid.as_ref()))
                .map(|e| e.pod.as_str())
                .collect();
            if !leaving.is_empty() {
                return Some(waiting(
                    format!(
                        "defragmenting: waits for {} to leave node {node}, evicted to make room for it",
                        leaving.join(", ")
                    ),
                    r,
                ));
            }
        }
        let list: Vec<DefragRecord> = records.values().cloned().collect();
        let done = defrag::record::evictions(&list, at);
        let budget = defrag::budget_left(self.config.defrag_per_hour, &done, at);
        if budget == 0 {
            info!(pod = %key, evictions = done.len(), "the defragmentation budget of this hour is spent");
            return None;
        }
        // A pod evicted by defragmentation that still exists is not moved again.
        let in_flight: BTreeSet<&str> = list
            .iter()
            .flat_map(|r| &r.evicted)
            .filter(|e| exists(view, &e.pod, e.uid.as_ref()))
            .map(|e| e.pod.as_str())
            .collect();
        let blocked = self.defrags.blocked.get(&key).cloned().unwrap_or_default();
        // Budgets are the API server's to decide (each move is tried as a dry run first).
        let movable: Vec<Evictable> = defrag::movable(
            &self.config.driver_name,
            view.pod_objects(),
            view.claims(),
            &[],
        )
        .into_iter()
        .filter(|e| !blocked.contains(&e.pod) && !in_flight.contains(e.pod.as_str()))
        .collect();
        let plan = match self
            .vetted_plan(view, &key, claims, candidates, host, movable, budget)
            .await
        {
            Ok(Some(p)) => p,
            Ok(None) => return None,
            Err(e) => return Some(NotPlaced::Transient(e)),
        };
        match self
            .carry_out(view, pod, &key, &plan, records.get(&plan.node))
            .await
        {
            Ok(record) => Some(waiting(
                format!(
                    "defragmenting: evicted {} from node {} to make contiguous room for it; waits for them to leave",
                    plan.moves
                        .iter()
                        .map(|m| m.pod.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                    plan.node
                ),
                &record,
            )),
            Err(e) => Some(NotPlaced::Transient(e)),
        }
    }

    /// The plan, each move's eviction tried as a dry run first; a pod a budget protects is
    /// remembered and left out, and the plan made again (each round leaves one more out, so
    /// the rounds end). `None` when no plan makes room.
    #[allow(
        clippy::too_many_arguments,
        reason = "the plan's inputs and this pod's key"
    )]
    async fn vetted_plan(
        &mut self,
        view: &mut ClusterView,
        key: &str,
        claims: &[&res::ResourceClaim],
        candidates: &[Node],
        host: &HostResources,
        mut movable: Vec<Evictable>,
        budget: usize,
    ) -> Result<Option<DefragPlan>, Error> {
        loop {
            let Ok(snapshot) = view.snapshot() else {
                return Ok(None);
            };
            let Some(plan) = defrag::plan(
                &self.allocator,
                snapshot,
                claims,
                host,
                candidates,
                &movable,
                budget,
            ) else {
                return Ok(None);
            };
            let mut refused = None;
            for m in &plan.moves {
                let Some(pod) = view.pods().get(&m.pod).cloned() else {
                    continue;
                };
                match self.protocol.writer.evict(&pod, true).await? {
                    Eviction::Evicted | Eviction::Gone => {}
                    Eviction::Blocked(why) => {
                        info!(pod = %key, moved = %m.pod, why, "a disruption budget keeps the pod in place");
                        refused = Some(m.pod.clone());
                        break;
                    }
                }
            }
            match refused {
                Some(p) => {
                    self.defrags
                        .blocked
                        .entry(key.to_owned())
                        .or_default()
                        .insert(p.clone());
                    movable.retain(|e| e.pod != p);
                }
                None => return Ok(Some(plan)),
            }
        }
    }

    /// Records the plan on its node, then evicts its pods with an Event on each and on the
    /// node; answers the record written. Stops at the first eviction the server refuses (the
    /// record already counts the rest against the budget: fail closed).
    async fn carry_out(
        &mut self,
        view: &ClusterView,
        pod: &Pod,
        key: &str,
        plan: &DefragPlan,
        previous: Option<&DefragRecord>,
    ) -> Result<DefragRecord, Error> {
        let node = view.node(&plan.node).cloned().ok_or_else(|| Error::Api {
            action: format!("making room on Node {}", plan.node),
            code: None,
            message: "the node is gone".to_owned(),
        })?;
        let evicting: Vec<(String, Option<String>)> = plan
            .moves
            .iter()
            .map(|m| (m.pod.clone(), m.uid.clone()))
            .collect();
        let record =
            DefragRecord::made(previous, key, pod.metadata.uid.as_deref(), &evicting, now());
        let written = self
            .protocol
            .writer
            .annotate_node(&node, names::ANNOTATION_DEFRAG, &record.to_annotation())
            .await?;
        self.defrags
            .written
            .insert(plan.node.clone(), record.clone());
        for m in &plan.moves {
            if !self.leading() {
                break;
            }
            let Some(moved) = view.pods().get(&m.pod).cloned() else {
                continue;
            };
            match self.protocol.writer.evict(&moved, false).await {
                Ok(Eviction::Evicted) => {
                    info!(pod = %key, moved = %m.pod, from = %m.from, to = %m.to, "evicted a batch pod to defragment");
                    self.metrics.defrag_evicted();
                    let message = format!(
                        "evicted by {} to make contiguous room on node {} for pending pod {key}: {}",
                        names::CONTROLLER_COMPONENT,
                        plan.node,
                        m.reason
                    );
                    if let Err(e) = self
                        .protocol
                        .writer
                        .event(
                            &moved,
                            false,
                            names::ACTION_DEFRAGMENT,
                            names::REASON_DEFRAGMENTED,
                            &message,
                        )
                        .await
                    {
                        warn!(pod = %m.pod, error = %e, "recording the Event failed");
                    }
                    if let Err(e) = self
                        .protocol
                        .writer
                        .node_event(
                            &written,
                            false,
                            names::ACTION_DEFRAGMENT,
                            names::REASON_DEFRAGMENTED,
                            &message,
                        )
                        .await
                    {
                        warn!(node = %plan.node, error = %e, "recording the Event failed");
                    }
                }
                Ok(Eviction::Gone) => {}
                Ok(Eviction::Blocked(why)) => {
                    info!(pod = %key, moved = %m.pod, why, "a disruption budget keeps the pod in place");
                    self.defrags
                        .blocked
                        .entry(key.to_owned())
                        .or_default()
                        .insert(m.pod.clone());
                    break;
                }
                Err(e) => {
                    warn!(pod = %key, moved = %m.pod, error = %e, "evicting failed");
                    break;
                }
            }
        }
        Ok(record)
    }
}

fn waiting(message: String, record: &DefragRecord) -> NotPlaced {
    NotPlaced::Waiting {
        reason: names::REASON_DEFRAGMENTING,
        message,
        until: record.at.checked_add(defrag::record::HOLD).ok(),
    }
}
