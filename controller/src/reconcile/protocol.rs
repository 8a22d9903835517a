//! The gate protocol's writes for one pod — mark and allocate each claim, then remove the
//! gate — carried out without the cluster view, so several pods' writes can be in flight at
//! once while each pod's own writes keep their order. What the server answered comes back as
//! [`ViewUpdate`]s for the pass to apply; a failure half-way rolls back the claims written.
//!
//! On the fast path (a [`Job`] with `reserve`) each allocation is written with `reservedFor`
//! naming the pod in the same status write, so kube-scheduler, which binds the pod once the
//! gate is gone, has nothing left to write but the binding; see docs/controller.md.

use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1 as res;
use tessera_driver::{names, placement::gate};
use tokio::sync::watch;
use tracing::{debug, warn};

use super::{CONFLICT_RETRIES, NotPlaced, REASON_ALLOCATED, Writes, now, pod_key, split_key};
use crate::error::Error;
use crate::metrics::Metrics;

/// A change the pass applies to the view once a pod's writes are done.
#[derive(Debug)]
pub(super) enum ViewUpdate {
    /// The server's answer for a claim.
    Claim(Box<res::ResourceClaim>),
    /// A claim found gone.
    ForgetClaim(String),
    /// The server's answer for a pod.
    Pod(Box<Pod>),
    /// A pod found gone.
    ForgetPod(String),
}

/// One pod's writes, decided by the pass (its placement is committed to the snapshot).
#[derive(Debug)]
pub(super) struct Job {
    pub(super) pod: Pod,
    /// The claims to allocate, as the view had them, with their allocations.
    pub(super) claims: Vec<(res::ResourceClaim, res::AllocationResult)>,
    /// The fast path: each allocation is written with `reservedFor` naming the pod.
    pub(super) reserve: bool,
    pub(super) started: Instant,
}

/// What carrying out a [`Job`] did.
#[derive(Debug)]
pub(super) struct Done {
    pub(super) job: Job,
    pub(super) updates: Vec<ViewUpdate>,
    /// `namespace/name` of the claims whose allocation was written (and not rolled back).
    pub(super) written: Vec<String>,
    /// Whether the pod was found deleted (its claims are then released by the next pass).
    pub(super) pod_gone: bool,
    pub(super) result: Result<(), NotPlaced>,
}

/// What the writes need: the API, the metrics, and whether this replica still leads.
#[derive(Debug, Clone)]
pub(super) struct Protocol<W> {
    pub(super) writer: W,
    pub(super) metrics: Arc<Metrics>,
    pub(super) leader: watch::Receiver<bool>,
}

fn still_conflicting(action: String) -> NotPlaced {
    NotPlaced::Transient(Error::Api {
        action,
        code: Some(409),
        message: format!("still conflicting after {CONFLICT_RETRIES} retries"),
    })
}

impl<W: Writes> Protocol<W> {
    pub(super) fn leading(&self) -> bool {
        *self.leader.borrow()
    }

    /// Carries out `job`: each claim marked and allocated in order, then the gate removed; a
    /// failure on a claim rolls back the claims written before it.
    pub(super) async fn run(&self, job: Job) -> Done {
        let mut updates = Vec::new();
        let mut written: Vec<(String, res::ResourceClaim)> = Vec::new();
        let reserve_for = job.reserve.then_some(&job.pod);
        let mut failure = None;
        for (claim, allocation) in &job.claims {
            match self
                .write_claim(&job.pod, claim, allocation, reserve_for, &mut updates)
                .await
            {
                Ok(c) => written.push((crate::cluster::claim_path(claim), c)),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        if let Some(failure) = failure {
            self.roll_back(&job.pod, written, &mut updates).await;
            return Done {
                job,
                updates,
                written: Vec::new(),
                pod_gone: false,
                result: Err(failure),
            };
        }
        let mut pod_gone = false;
        let result = self.finish(&job.pod, &mut updates, &mut pod_gone).await;
        if job.reserve && pod_gone {
            // Claims reserved for a pod that is gone are nobody's to release but their
            // writer's: give them back now.
            self.roll_back(&job.pod, written, &mut updates).await;
            return Done {
                job,
                updates,
                written: Vec::new(),
                pod_gone,
                result,
            };
        }
        let written = written.into_iter().map(|(k, _)| k).collect();
        Done {
            job,
            updates,
            written,
            pod_gone,
            result,
        }
    }

    /// Rolls back the claims written for `pod` (latest first): allocation (and the pod's own
    /// reservation) cleared, then the mark removed.
    async fn roll_back(
        &self,
        pod: &Pod,
        written: Vec<(String, res::ResourceClaim)>,
        updates: &mut Vec<ViewUpdate>,
    ) {
        for (key, current) in written.into_iter().rev() {
            if let Err(e) = self
                .release_claim(&key, Some(current), pod.metadata.uid.as_deref(), updates)
                .await
            {
                warn!(claim = %key, error = ?e, "rolling back an allocation failed; it is released once the pod is gone");
            }
        }
    }

    /// Marks a claim and writes its allocation (with `reserve_for` in `reservedFor`, on the
    /// fast path), re-reading and retrying on conflicts; answers the claim as written. Logged
    /// in the claim's span.
    #[tracing::instrument(
        name = "claim",
        skip_all,
        fields(
            namespace = claim.metadata.namespace.as_deref().unwrap_or_default(),
            name = claim.metadata.name.as_deref().unwrap_or_default(),
        )
    )]
    async fn write_claim(
        &self,
        pod: &Pod,
        claim: &res::ResourceClaim,
        allocation: &res::AllocationResult,
        reserve_for: Option<&Pod>,
        updates: &mut Vec<ViewUpdate>,
    ) -> Result<res::ResourceClaim, NotPlaced> {
        let pod_name = pod.metadata.name.as_deref().unwrap_or_default();
        let key = crate::cluster::claim_path(claim);
        let mut current = claim.clone();
        for attempt in 0..=CONFLICT_RETRIES {
            if !self.leading() {
                return Err(NotPlaced::NotLeader);
            }
            if attempt > 0 {
                let (ns, name) = split_key(&key);
                let Some(c) = self.writer.get_claim(ns, name).await? else {
                    updates.push(ViewUpdate::ForgetClaim(key.clone()));
                    return Err(NotPlaced::Unschedulable(format!(
                        "ResourceClaim {key} was deleted"
                    )));
                };
                updates.push(ViewUpdate::Claim(Box::new(c.clone())));
                current = c;
                if gate::is_allocated(&current) || current.metadata.deletion_timestamp.is_some() {
                    return Err(NotPlaced::Transient(Error::Api {
                        action: format!("allocating ResourceClaim {key}"),
                        code: Some(409),
                        message: "the claim was allocated or deleted meanwhile".to_owned(),
                    }));
                }
            }
            let marked = gate::is_ours(&current)
                && current
                    .metadata
                    .finalizers
                    .iter()
                    .flatten()
                    .any(|f| f == names::CLAIM_FINALIZER);
            if !marked {
                match self.writer.mark_claim(&current, pod_name).await {
                    Ok(c) => current = c,
                    Err(e) if e.is_conflict() => {
                        self.metrics.conflict();
                        continue;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            match self
                .writer
                .write_allocation(&current, allocation, reserve_for)
                .await
            {
                Ok(c) => {
                    updates.push(ViewUpdate::Claim(Box::new(c.clone())));
                    return Ok(c);
                }
                Err(e) if e.is_conflict() => {
                    self.metrics.conflict();
                }
                Err(e) => {
                    // The claim carries our mark now; keep the view in step for the rollback.
                    updates.push(ViewUpdate::Claim(Box::new(current)));
                    return Err(e.into());
                }
            }
        }
        Err(still_conflicting(format!("allocating ResourceClaim {key}")))
    }

    /// Removes the gate (and flips the condition to placed if it said otherwise).
    async fn finish(
        &self,
        pod: &Pod,
        updates: &mut Vec<ViewUpdate>,
        pod_gone: &mut bool,
    ) -> Result<(), NotPlaced> {
        let key = pod_key(pod);
        let mut current = pod.clone();
        let mut ungated = false;
        for attempt in 0..=CONFLICT_RETRIES {
            if !self.leading() {
                return Err(NotPlaced::NotLeader);
            }
            if attempt > 0 {
                let (ns, name) = split_key(&key);
                let Some(p) = self.writer.get_pod(ns, name).await? else {
                    updates.push(ViewUpdate::ForgetPod(key.clone()));
                    *pod_gone = true;
                    return Err(NotPlaced::Unschedulable(format!("Pod {key} was deleted")));
                };
                current = p;
                if !gate::is_gated(&current) {
                    ungated = true;
                    break;
                }
            }
            match self.writer.ungate(&current).await {
                Ok(p) => {
                    current = p;
                    ungated = true;
                    break;
                }
                Err(e) if e.is_conflict() => self.metrics.conflict(),
                Err(e) if e.is_not_found() => {
                    updates.push(ViewUpdate::ForgetPod(key.clone()));
                    *pod_gone = true;
                    return Err(NotPlaced::Unschedulable(format!("Pod {key} was deleted")));
                }
                Err(e) => return Err(e.into()),
            }
        }
        if !ungated {
            return Err(still_conflicting(format!(
                "removing the scheduling gate of Pod {key}"
            )));
        }
        let failed_before = current
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| {
                c.iter()
                    .any(|c| c.type_ == names::CONDITION_ALLOCATED && c.status == "False")
            });
        if failed_before {
            match self
                .writer
                .set_condition(
                    &current,
                    true,
                    REASON_ALLOCATED,
                    "the pod's claims are allocated",
                    now(),
                )
                .await
            {
                Ok(p) => current = p,
                Err(e) => debug!(pod = %key, error = %e, "clearing the failure condition failed"),
            }
        }
        updates.push(ViewUpdate::Pod(Box::new(current)));
        Ok(())
    }

    /// Gives back one claim this controller allocated: deallocate, then unmark. `current` is
    /// the claim as last seen (`None`: nothing to do). A claim reserved for anyone is left
    /// alone, except a reservation for `own` (the UID of the pod being rolled back, whose
    /// reservation this controller wrote).
    #[tracing::instrument(
        name = "claim",
        skip_all,
        fields(namespace = split_key(key).0, name = split_key(key).1)
    )]
    pub(super) async fn release_claim(
        &self,
        key: &str,
        current: Option<res::ResourceClaim>,
        own: Option<&str>,
        updates: &mut Vec<ViewUpdate>,
    ) -> Result<(), NotPlaced> {
        let (ns, name) = split_key(key);
        let Some(mut current) = current else {
            return Ok(());
        };
        // Two steps (deallocate, unmark), each retried after a conflict; only a conflict
        // makes the copy in hand stale enough to read the claim again.
        let mut stale = false;
        for _ in 0..=CONFLICT_RETRIES + 1 {
            if !self.leading() {
                return Err(NotPlaced::NotLeader);
            }
            if stale {
                let Some(c) = self.writer.get_claim(ns, name).await? else {
                    updates.push(ViewUpdate::ForgetClaim(key.to_owned()));
                    return Ok(());
                };
                current = c;
                stale = false;
            }
            // Someone reserved it meanwhile: it is in use, not ours to take back.
            if !gate::is_ours(&current) || reserved_by_others(&current, own) {
                updates.push(ViewUpdate::Claim(Box::new(current)));
                return Ok(());
            }
            let step = if gate::is_allocated(&current) {
                self.writer.clear_allocation(&current).await
            } else {
                self.writer.unmark_claim(&current).await
            };
            match step {
                Ok(c) => {
                    let done = !gate::is_ours(&c);
                    current = c.clone();
                    updates.push(ViewUpdate::Claim(Box::new(c)));
                    if done {
                        return Ok(());
                    }
                }
                Err(e) if e.is_conflict() => {
                    self.metrics.conflict();
                    stale = true;
                }
                Err(e) if e.is_not_found() => {
                    updates.push(ViewUpdate::ForgetClaim(key.to_owned()));
                    return Ok(());
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(still_conflicting(format!("releasing ResourceClaim {key}")))
    }
}

/// Whether `claim` is reserved for any consumer but the pod with UID `own`.
fn reserved_by_others(claim: &res::ResourceClaim, own: Option<&str>) -> bool {
    claim
        .status
        .as_ref()
        .and_then(|s| s.reserved_for.as_ref())
        .into_iter()
        .flatten()
        .any(|r| own.is_none_or(|uid| r.uid != uid))
}
