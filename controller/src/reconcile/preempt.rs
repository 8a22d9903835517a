//! Preemption's edge (shared/DESIGN.md §8, docs/controller.md): with `--preemption`, an online
//! pod that fits nowhere may evict batch pods.
//!
//! The victims are [`Allocator::choose_victims`]'s (pure). This module asks the API server:
//! first a dry run of every victim's eviction, so a `PodDisruptionBudget` that forbids one (a
//! 429) is known before anything is evicted — that victim is left out and the choice made
//! again —, then the evictions themselves, each with an Event on the victim naming the pod it
//! made room for.
//!
//! It never loops:
//! * per preempting pod (by UID) it remembers whom it evicted and evicts nothing more while one
//!   of them still exists; a pod evicted for anybody is no victim again while it exists;
//! * a pod preempts at most [`MAX_ATTEMPTS`] times, and a victim whose eviction was refused is
//!   not tried again for that pod;
//! * the records go with the pod (the pass keeps those of gated pods only).

use std::collections::{BTreeSet, HashMap};

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1 as res;
use tessera_driver::names;
use tessera_driver::placement::allocator::preempt;
use tessera_driver::placement::fragmentation::HostResources;
use tracing::{info, warn};

use super::{Eviction, NotPlaced, Reconciler, Writes, pod_key};
use crate::cluster::ClusterView;
use crate::error::Error;

/// How often one pod may preempt before it just waits like any pod that does not fit.
pub(super) const MAX_ATTEMPTS: u32 = 3;

/// What the controller remembers of one preempting pod.
#[derive(Debug, Default)]
struct Record {
    uid: Option<String>,
    attempts: u32,
    /// `namespace/name` and UID of every pod evicted for it.
    evicted: Vec<(String, Option<String>)>,
    /// Pods whose eviction the server refused for it.
    blocked: BTreeSet<String>,
}

/// The preempting pods' records.
#[derive(Debug, Default)]
pub(super) struct Preemptions {
    by_pod: HashMap<String, Record>,
}

impl Preemptions {
    /// Forgets the records of pods that are no longer waiting.
    pub(super) fn retain(&mut self, live: &BTreeSet<&String>) {
        self.by_pod.retain(|k, _| live.contains(k));
    }

    /// Evicted pods (for any preemptor) that still exist in the view.
    fn in_flight(&self, view: &ClusterView) -> BTreeSet<String> {
        self.by_pod
            .values()
            .flat_map(|r| &r.evicted)
            .filter(|(k, uid)| exists(view, k, uid.as_ref()))
            .map(|(k, _)| k.clone())
            .collect()
    }
}

fn exists(view: &ClusterView, key: &str, uid: Option<&String>) -> bool {
    view.pods()
        .get(key)
        .is_some_and(|p| p.metadata.uid.as_ref() == uid)
}

impl<W: Writes + Clone + 'static> Reconciler<W> {
    /// Tries to make room for `pod` by evicting batch pods; `Some` is what to tell the pod
    /// (waiting for its victims, or a transient failure), `None` when preemption cannot help.
    pub(super) async fn preempt(
        &mut self,
        view: &mut ClusterView,
        pod: &Pod,
        claims: &[&res::ResourceClaim],
        candidates: &[Node],
        host: &HostResources,
    ) -> Option<NotPlaced> {
        if !self.leading() {
            return Some(NotPlaced::NotLeader);
        }
        let key = pod_key(pod);
        let in_flight = self.preemptions.in_flight(view);
        let record = self.preemptions.by_pod.entry(key.clone()).or_default();
        if record.uid != pod.metadata.uid {
            *record = Record {
                uid: pod.metadata.uid.clone(),
                ..Record::default()
            };
        }
        let terminating: Vec<String> = record
            .evicted
            .iter()
            .filter(|(k, uid)| exists(view, k, uid.as_ref()))
            .map(|(k, _)| k.clone())
            .collect();
        if !terminating.is_empty() {
            return Some(waiting(&format!(
                "preempting: waits for the batch pods evicted to make room for it to terminate: {}",
                terminating.join(", ")
            )));
        }
        if record.attempts >= MAX_ATTEMPTS {
            return None;
        }
        let blocked = record.blocked.clone();
        let snapshot = view.snapshot().ok()?;
        if !self.allocator.is_online(snapshot, claims) {
            return None;
        }
        let evictable: Vec<preempt::Evictable> =
            preempt::evictable(&self.config.driver_name, view.pod_objects(), view.claims())
                .into_iter()
                .filter(|e| !blocked.contains(&e.pod) && !in_flight.contains(&e.pod))
                .collect();
        let victims = match self
            .vetted_victims(view, &key, claims, candidates, host, evictable)
            .await
        {
            Ok(Some(v)) => v,
            Ok(None) => return None,
            Err(e) => return Some(NotPlaced::Transient(e)),
        };
        if let Some(r) = self.preemptions.by_pod.get_mut(&key) {
            r.attempts += 1;
        }
        let evicted = self.evict_all(view, &key, &victims).await;
        if evicted.is_empty() {
            return None;
        }
        Some(waiting(&format!(
            "preempting: evicted batch pods {} on node {} to make room for it; waits for them to \
             terminate",
            evicted.join(", "),
            victims.node
        )))
    }

    /// The victims, each eviction tried as a dry run first; a victim a budget protects is
    /// remembered and left out, and the choice made again. `None` when nothing makes room.
    async fn vetted_victims(
        &mut self,
        view: &mut ClusterView,
        key: &str,
        claims: &[&res::ResourceClaim],
        candidates: &[Node],
        host: &HostResources,
        mut evictable: Vec<preempt::Evictable>,
    ) -> Result<Option<preempt::Victims>, Error> {
        // Dry runs first: a victim a budget protects is left out and the choice made again
        // (each round leaves one more out, so the rounds end).
        loop {
            let Ok(snapshot) = view.snapshot() else {
                return Ok(None);
            };
            let Some(victims) = self
                .allocator
                .choose_victims(snapshot, claims, candidates, host, &evictable)
            else {
                return Ok(None);
            };
            let mut refused = None;
            for v in &victims.pods {
                let Some(victim) = view.pods().get(v).cloned() else {
                    continue;
                };
                match self.protocol.writer.evict(&victim, true).await {
                    Ok(Eviction::Evicted | Eviction::Gone) => {}
                    Ok(Eviction::Blocked(why)) => {
                        info!(pod = %key, victim = %v, why, "a disruption budget protects the victim");
                        refused = Some(v.clone());
                        break;
                    }
                    Err(e) => return Err(e),
                }
            }
            match refused {
                Some(v) => {
                    self.remember_blocked(key, &v);
                    evictable.retain(|e| e.pod != v);
                }
                None => return Ok(Some(victims)),
            }
        }
    }

    /// Evicts the victims in order, each with an Event naming the pod it makes room for;
    /// stops at the first the server refuses. Answers those evicted.
    async fn evict_all(
        &mut self,
        view: &ClusterView,
        key: &str,
        victims: &preempt::Victims,
    ) -> Vec<String> {
        let mut evicted = Vec::new();
        for v in &victims.pods {
            // Only the leader writes; it checks before every eviction.
            if !self.leading() {
                break;
            }
            let Some(victim) = view.pods().get(v).cloned() else {
                continue;
            };
            match self.protocol.writer.evict(&victim, false).await {
                Ok(Eviction::Evicted) => {
                    info!(pod = %key, victim = %v, node = %victims.node, "evicted a batch pod to make room");
                    let message = format!(
                        "evicted by {} to make room for online pod {key} on node {}",
                        names::CONTROLLER_COMPONENT,
                        victims.node
                    );
                    if let Err(e) = self
                        .protocol
                        .writer
                        .event(
                            &victim,
                            false,
                            names::ACTION_PREEMPT,
                            names::REASON_PREEMPTED,
                            &message,
                        )
                        .await
                    {
                        warn!(pod = %v, error = %e, "recording the Event failed");
                    }
                    if let Some(r) = self.preemptions.by_pod.get_mut(key) {
                        r.evicted.push((v.clone(), victim.metadata.uid.clone()));
                    }
                    evicted.push(v.clone());
                }
                Ok(Eviction::Gone) => {}
                Ok(Eviction::Blocked(why)) => {
                    info!(pod = %key, victim = %v, why, "a disruption budget protects the victim");
                    self.remember_blocked(key, v);
                    break;
                }
                Err(e) => {
                    warn!(pod = %key, victim = %v, error = %e, "evicting failed");
                    break;
                }
            }
        }
        evicted
    }

    fn remember_blocked(&mut self, key: &str, victim: &str) {
        if let Some(r) = self.preemptions.by_pod.get_mut(key) {
            r.blocked.insert(victim.to_owned());
        }
    }
}

fn waiting(message: &str) -> NotPlaced {
    NotPlaced::Waiting {
        reason: names::REASON_PREEMPTING,
        message: message.to_owned(),
        until: None,
    }
}
