//! One reconcile pass over the cluster view: release what the controller allocated for pods
//! and claims that went away, place the claims of ready gated pods and remove their gate,
//! report the pods that cannot be placed and the allocations whose pod does not bind.
//!
//! Decisions are `tessera_driver::placement::gate` and `nodefit` (pure); this module fetches, calls and
//! writes. Double booking is prevented without locks: one pass runs at a time, a placement is
//! committed to the snapshot before its first write (so the next pod sees it as used), and
//! every write carries a resourceVersion precondition. A failure half-way through a pod's
//! claims rolls back what this pass wrote for that pod.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1 as res;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use tessera_driver::names;
use tessera_driver::placement::allocator::{
    Allocator, AllocatorOptions, FailureKind, Learn, Policy, claim_key,
};
use tessera_driver::placement::gate::{self, PodPlan};
use tessera_driver::placement::nodefit::{self, Resources};
use tokio::sync::watch;
use tracing::{Instrument as _, Span, debug, info, info_span, warn};

use crate::cluster::ClusterView;
use crate::error::{Error, Result};
use crate::metrics::{Metrics, Outcome};
use crate::writer::{Eviction, Writer};

mod defrag;
mod patience;
mod preempt;
mod protocol;
#[cfg(test)]
mod tests;

pub use crate::writer::Writes;

use protocol::{Done, Job, Protocol, ViewUpdate};

/// How often one write is retried after a 409 Conflict before the pod is left for later.
const CONFLICT_RETRIES: usize = 5;
/// Event reason on a pod whose claims cannot be placed.
pub const REASON_FAILED: &str = "FailedAllocation";
/// Event reason on a pod whose claims are broken in a way only their owner can fix.
pub const REASON_REFUSED: &str = names::REASON_ALLOCATION_REFUSED;
/// Event reason on a pod whose allocation waits too long for the pod to bind.
pub const REASON_UNBOUND: &str = "AllocationNotBound";
/// Condition reason once a pod is placed.
pub const REASON_ALLOCATED: &str = "Allocated";
/// Event reason on a pod whose attempt an error on some node aborted (as kube-scheduler's).
pub const REASON_ABORTED: &str = "AllocationAborted";
/// When a pod whose attempt was aborted is tried again at the latest (kube-scheduler puts such
/// a pod back in its queue with a backoff of at most 10s).
const ABORTED_RETRY: SignedDuration = SignedDuration::from_secs(10);

/// How the reconciler behaves.
#[derive(Debug, Clone)]
pub struct ReconcilerConfig {
    /// Tessera's DRA driver name.
    pub driver_name: String,
    /// The placement policy.
    pub policy: Policy,
    /// After how long an allocation whose pod has not bound is reported.
    pub unbound_after: Duration,
    /// Whether pods on the fast path ([`tessera_driver::placement::fast_path`]) get their claims
    /// reserved for them in the allocation write.
    pub fast_path: bool,
    /// Whether an online pod that fits nowhere may evict batch pods ([`preempt`]).
    pub preemption: bool,
    /// How many batch pods defragmentation may evict per hour ([`defrag`]); 0 turns it off.
    pub defrag_per_hour: u32,
}

/// Why a pod was not placed in this pass.
#[derive(Debug)]
enum NotPlaced {
    /// No node fits now: a normal result, retried when the cluster changes.
    Unschedulable(String),
    /// Only the claim's owner can fix it: reported, retried only when the pod or cluster changes.
    Refused(String),
    /// kube-scheduler's allocator returned an error on some candidate node, which aborts the
    /// pod's attempt wherever else it would fit: reported, nothing placed or preempted, and
    /// retried when the cluster changes or after [`ABORTED_RETRY`] at the latest.
    Aborted(String),
    /// Leadership was lost: stop writing.
    NotLeader,
    /// The API server failed or the race was lost too often: retried soon.
    Transient(Error),
    /// The pod waits for something on purpose (a fragment, its victims to terminate): a
    /// Normal Event and the condition with `reason`; retried when the cluster changes, and at
    /// `until` at the latest.
    Waiting {
        reason: &'static str,
        message: String,
        until: Option<Timestamp>,
    },
}

impl From<Error> for NotPlaced {
    fn from(e: Error) -> Self {
        if e.is_invalid() {
            Self::Refused(e.to_string())
        } else {
            Self::Transient(e)
        }
    }
}

/// A pod that was not placed, and what it would take to try again: for a pod that does not
/// fit, a change of the pod or of the cluster (the view's generation); for a refused pod (a
/// failure only the owner can fix, such as a 422 from the API server), a change of the pod or
/// of one of its claims, and nothing else.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Remembered {
    generation: u64,
    pod_version: Option<String>,
    /// Set for a refusal: the resourceVersion of each of the pod's claims when it was refused.
    refused_claims: Option<Vec<Option<String>>>,
    message: String,
    /// When a waiting pod must be tried again even if nothing changed.
    until: Option<Timestamp>,
    /// The view's allocation count: a pod waiting for a fragment is tried again when a claim
    /// gets allocated (it may have made one).
    allocations: u64,
}

impl Remembered {
    /// Whether trying `pod` again now would only repeat the last answer.
    fn still_holds(&self, view: &ClusterView, pod: &Pod) -> bool {
        if self.until.is_some_and(|u| now() >= u) {
            return false;
        }
        if self.pod_version != pod.metadata.resource_version {
            return false;
        }
        match &self.refused_claims {
            Some(versions) => *versions == claim_versions(view, pod),
            None => {
                self.generation == view.generation()
                    && (self.until.is_none() || self.allocations == view.allocations())
            }
        }
    }
}

/// The resourceVersions of the pod's claims as the view has them (`None` for a missing one).
fn claim_versions(view: &ClusterView, pod: &Pod) -> Vec<Option<String>> {
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    gate::claim_names(pod)
        .unwrap_or_default()
        .iter()
        .map(|n| {
            view.claims()
                .get(&format!("{namespace}/{n}"))
                .and_then(|c| c.metadata.resource_version.clone())
        })
        .collect()
}

/// What a pass found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PassReport {
    /// Pods placed.
    pub placed: usize,
    /// Gated pods still waiting (for claims, or for room).
    pub pending: usize,
    /// Allocations released.
    pub released: usize,
    /// Whether something failed for a reason that may pass by itself (retry soon).
    pub retry_soon: bool,
    /// Whether the pass stopped because leadership was lost.
    pub lost_leadership: bool,
    /// When the next pass is due even if nothing changes (a waiting pod's patience ends).
    pub wake_in: Option<Duration>,
}

/// Runs passes; holds what must survive between them (the last failure of every pod).
/// Writes go through `W` ([`Writer`] in the service).
#[derive(Debug)]
pub struct Reconciler<W = Writer> {
    allocator: Allocator,
    /// The same allocator, placing delay-tolerant shares on fragments only ([`patience`]).
    fragments: Allocator,
    preemptions: preempt::Preemptions,
    defrags: defrag::Defrags,
    protocol: Protocol<W>,
    metrics: std::sync::Arc<Metrics>,
    config: ReconcilerConfig,
    leader: watch::Receiver<bool>,
    remembered: HashMap<String, Remembered>,
    reported_unbound: BTreeSet<String>,
    gauges_at: Option<Instant>,
    /// The view's device-use stamp the gauges were last worked out for.
    gauges_of: Option<(u64, u64)>,
    /// The view's generation when orphans were last looked for.
    released_at: Option<u64>,
    /// When unbound allocations were last looked for.
    unbound_at: Option<Instant>,
}

/// How often allocations whose pod does not bind are looked for (each look walks every pod
/// and claim; the threshold itself is minutes).
const UNBOUND_INTERVAL: Duration = Duration::from_secs(5);

/// How often at most the per-device gauges are recomputed (each time costs a walk over every
/// device); a pass that finds them stale sooner asks to be woken when the interval ends.
const GAUGE_INTERVAL: Duration = Duration::from_secs(5);

fn pod_key(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or("default"),
        pod.metadata.name.as_deref().unwrap_or_default()
    )
}

/// Why a pod was not placed, for its Event and condition, and whether its claims are invalid
/// (`Some(true)`: they fit nowhere ever), do not fit now (`Some(false)`), or an error on some
/// node aborted the attempt (`None`: the pod is placed nowhere this time).
fn why_not_placed(
    u: &tessera_driver::placement::allocator::Unsatisfiable,
    candidates: usize,
    all_nodes: usize,
    node_summary: &str,
) -> (String, Option<bool>) {
    if u.failures
        .iter()
        .any(|f| matches!(f.kind, FailureKind::Aborted { .. }))
    {
        return (u.to_string(), None);
    }
    // A malformed claim (e.g. a negative capacity request) fits nowhere ever.
    let invalid = u
        .failures
        .iter()
        .any(|f| matches!(f.kind, FailureKind::Invalid(_)));
    if candidates == 0 && !invalid {
        return (
            format!("no node can take the pod: {node_summary}"),
            Some(false),
        );
    }
    let excluded = if candidates < all_nodes {
        format!(" (nodes considered: {node_summary})")
    } else {
        String::new()
    };
    (format!("{u}{excluded}"), Some(invalid))
}

fn split_key(key: &str) -> (&str, &str) {
    key.split_once('/').unwrap_or(("default", key))
}

/// The span of one pod's work in a pass (its gate decision, its writes, what is reported), by
/// its `namespace/name` key: every line logged for the pod carries both, so one grep follows it.
fn pod_span(key: &str) -> Span {
    let (namespace, name) = split_key(key);
    info_span!("pod", namespace, name)
}

/// The span of one claim's work (its allocation written, or given back), by its
/// `namespace/name` key.
fn claim_span(key: &str) -> Span {
    let (namespace, name) = split_key(key);
    info_span!("claim", namespace, name)
}

fn now() -> Timestamp {
    Timestamp::now()
}

/// How many pods' writes may be in flight at once (each pod's own writes stay in order).
const PODS_IN_FLIGHT: usize = 32;

impl<W: Writes + Clone + 'static> Reconciler<W> {
    /// A reconciler writing through `writer` while `leader` says this replica leads.
    pub fn new(
        config: ReconcilerConfig,
        writer: W,
        metrics: std::sync::Arc<Metrics>,
        leader: watch::Receiver<bool>,
    ) -> Self {
        let options = AllocatorOptions {
            driver_name: config.driver_name.clone(),
            policy: config.policy,
            ..AllocatorOptions::default()
        };
        let allocator = Allocator::new(options.clone());
        let fragments = Allocator::new(options).fragments_only();
        Self {
            allocator,
            fragments,
            preemptions: preempt::Preemptions::default(),
            defrags: defrag::Defrags::default(),
            protocol: Protocol {
                writer,
                metrics: Arc::clone(&metrics),
                leader: leader.clone(),
            },
            metrics,
            config,
            leader,
            remembered: HashMap::new(),
            reported_unbound: BTreeSet::new(),
            gauges_at: None,
            gauges_of: None,
            released_at: None,
            unbound_at: None,
        }
    }

    fn leading(&self) -> bool {
        *self.leader.borrow()
    }

    /// One pass; see the module docs. Logged in a `reconcile` span (with the view's
    /// generation), each pod's part in a `pod` span inside it.
    #[allow(clippy::too_many_lines)] // Reason: the pass's order (release, place, report) reads best in one place.
    #[tracing::instrument(name = "reconcile", skip_all, fields(generation = view.generation()))]
    pub async fn pass(&mut self, view: &mut ClusterView) -> PassReport {
        let mut report = PassReport::default();
        if !self.leading() {
            report.lost_leadership = true;
            return report;
        }
        // A claim is orphaned only by something that bumps the generation (a pod gone or
        // finished, a claim being deleted, a resync): otherwise the walk is skipped.
        if self.released_at != Some(view.generation()) {
            self.released_at = Some(view.generation());
            self.release_orphans(view, &mut report).await;
            if report.retry_soon || report.released > 0 {
                self.released_at = None;
            }
        }
        // What pods take of each node is a walk over every pod: made only once a pod of this
        // pass is to be placed (a pass for a kubelet's status update, with nothing gated,
        // skips it).
        let mut usage: Option<BTreeMap<String, Resources>> = None;
        let mut gated: Vec<(Option<Timestamp>, String)> = view
            .pods()
            .iter()
            .filter(|(_, p)| gate::is_gated(p) && !gate::is_done(p))
            .map(|(k, p)| {
                (
                    p.metadata.creation_timestamp.as_ref().map(|t| t.0),
                    k.clone(),
                )
            })
            .collect();
        // Oldest first, as kube-scheduler's queue would take them.
        gated.sort();
        let live: BTreeSet<&String> = gated.iter().map(|(_, k)| k).collect();
        self.remembered.retain(|k, _| live.contains(k));
        self.preemptions.retain(&live);
        self.defrags.retain(&live);
        // Decide every ready pod first (each placement committed before the next pod is
        // decided), then carry out their writes side by side.
        let mut jobs = Vec::new();
        for (_, key) in gated {
            if !self.leading() {
                report.lost_leadership = true;
                break;
            }
            if let Some(job) = self
                .gate_pod(view, &key, &mut usage, &mut report)
                .instrument(pod_span(&key))
                .await
            {
                jobs.push(job);
            }
        }
        for done in self.write_all(jobs).await {
            let span = pod_span(&pod_key(&done.job.pod));
            self.apply_done(view, done, &mut report)
                .instrument(span)
                .await;
        }
        if !report.lost_leadership {
            let due = self
                .unbound_at
                .is_none_or(|at| at.elapsed() >= UNBOUND_INTERVAL);
            if due {
                self.unbound_at = Some(Instant::now());
                self.report_unbound(view).await;
            }
        }
        // The per-device gauges walk every device: worked out again only when device use
        // changed since, and at most once a GAUGE_INTERVAL (a scrape every few seconds at
        // most reads them; at thousands of devices, a walk per pass was a large part of the
        // CPU per pod).
        let stamp = view.device_use_version();
        let stale = stamp.is_some() && stamp != self.gauges_of;
        let gauges_wait = self.gauges_at.map_or(Duration::ZERO, |at| {
            GAUGE_INTERVAL.saturating_sub(at.elapsed())
        });
        let due = stale && gauges_wait.is_zero();
        let usage = if due {
            self.gauges_at = Some(Instant::now());
            self.gauges_of = stamp;
            view.snapshot().ok().map(|s| s.device_usage())
        } else {
            None
        };
        let at = now();
        report.wake_in = self
            .remembered
            .values()
            .filter_map(|r| r.until)
            // A deadline already past was tried in this pass (or the pod waits for something
            // else now); waking for it again would spin.
            .filter(|u| *u > at)
            .min()
            .map(|u| Duration::try_from(u.duration_since(at)).unwrap_or(Duration::ZERO));
        if stale && !due {
            // Stale gauges are worked out when their interval ends, even if nothing else
            // happens by then.
            report.wake_in = Some(report.wake_in.map_or(gauges_wait, |w| w.min(gauges_wait)));
        }
        self.metrics.set_state(
            report.pending,
            self.reported_unbound.len(),
            usage.as_deref(),
        );
        report
    }

    /// One gated pod's turn in a pass: skipped while what stopped it last still holds, else
    /// planned, and decided when its claims are ready; answers the writes to carry out.
    async fn gate_pod(
        &mut self,
        view: &mut ClusterView,
        key: &str,
        usage: &mut Option<BTreeMap<String, Resources>>,
        report: &mut PassReport,
    ) -> Option<Job> {
        let pod = view.pods().get(key)?;
        if let Some(r) = self.remembered.get(key)
            && r.still_holds(view, pod)
        {
            report.pending += 1;
            return None;
        }
        let pod: Pod = (**pod).clone();
        match gate::plan_pod(&pod, view.claims()) {
            PodPlan::Ignore => None,
            PodPlan::Wait(why) => {
                debug!(pod = %key, why, "waiting");
                report.pending += 1;
                None
            }
            PodPlan::Refuse(why) => {
                report.pending += 1;
                self.not_placed(view, &pod, NotPlaced::Refused(why), report)
                    .await;
                None
            }
            PodPlan::Ungate => Some(Job {
                pod,
                claims: Vec::new(),
                reserve: false,
                started: Instant::now(),
            }),
            PodPlan::Allocate {
                pending,
                allocated,
                node,
            } => match self
                .decide(view, &pod, &pending, &allocated, node, usage)
                .await
            {
                Ok(job) => Some(job),
                Err(e) => {
                    report.pending += 1;
                    self.not_placed(view, &pod, e, report).await;
                    None
                }
            },
        }
    }

    async fn not_placed(
        &mut self,
        view: &mut ClusterView,
        pod: &Pod,
        why: NotPlaced,
        report: &mut PassReport,
    ) {
        let key = pod_key(pod);
        let refused = matches!(why, NotPlaced::Refused(_));
        let mut until = None;
        let warning = !matches!(why, NotPlaced::Waiting { .. });
        let (outcome, reason, message) = match why {
            NotPlaced::Unschedulable(m) => (Outcome::Unschedulable, REASON_FAILED, m),
            NotPlaced::Refused(m) => (Outcome::Refused, REASON_REFUSED, m),
            NotPlaced::Aborted(m) => {
                until = now().checked_add(ABORTED_RETRY).ok();
                (Outcome::Error, REASON_ABORTED, m)
            }
            NotPlaced::Waiting {
                reason,
                message,
                until: u,
            } => {
                until = u;
                (Outcome::Waiting, reason, message)
            }
            NotPlaced::NotLeader => {
                report.lost_leadership = true;
                return;
            }
            NotPlaced::Transient(e) => {
                warn!(pod = %key, error = %e, "placing the pod failed; retrying soon");
                self.metrics.outcome(Outcome::Error);
                report.retry_soon = true;
                return;
            }
        };
        self.metrics.outcome(outcome);
        let unchanged = self
            .remembered
            .get(&key)
            .is_some_and(|r| r.message == message);
        let mut pod_version = pod.metadata.resource_version.clone();
        if !unchanged && self.leading() {
            info!(pod = %key, reason, message, "the pod's claims cannot be placed");
            let at = now();
            if let Err(e) = self
                .protocol
                .writer
                .event(pod, warning, names::ACTION_ALLOCATE, reason, &message)
                .await
            {
                warn!(pod = %key, error = %e, "recording the Event failed");
            }
            match self
                .protocol
                .writer
                .set_condition(pod, false, reason, &message, at)
                .await
            {
                Ok(written) => {
                    pod_version.clone_from(&written.metadata.resource_version);
                    view.put_written_pod(written);
                }
                Err(e) => warn!(pod = %key, error = %e, "setting the pod condition failed"),
            }
        }
        self.remembered.insert(
            key,
            Remembered {
                generation: view.generation(),
                pod_version,
                refused_claims: refused.then(|| claim_versions(view, pod)),
                message,
                until,
                allocations: view.allocations(),
            },
        );
    }

    /// Candidate nodes for `pod` (all nodes, or only `only`), and a summary of those refused.
    /// When every node fits, the view's shared list is handed out as is.
    fn candidates(
        view: &mut ClusterView,
        pod: &Pod,
        requests: Resources,
        only: Option<&str>,
        usage: &BTreeMap<String, Resources>,
    ) -> (Arc<Vec<Node>>, String) {
        let mut fits = Vec::with_capacity(view.nodes().len());
        let mut misfits = Vec::new();
        let mut total = 0;
        // Both in name order: walked side by side rather than looked up per node.
        let mut usage = usage.iter().peekable();
        for (name, node, allocatable) in view.nodes_allocatable() {
            if only.is_some_and(|o| o != name) {
                fits.push(false);
                continue;
            }
            total += 1;
            while usage.next_if(|(n, _)| n.as_str() < name).is_some() {}
            let used = usage
                .next_if(|(n, _)| n.as_str() == name)
                .map(|(_, u)| *u)
                .unwrap_or_default();
            match nodefit::check_on(pod, requests, node, allocatable, used) {
                Ok(()) => fits.push(true),
                Err(m) => {
                    fits.push(false);
                    misfits.push(m);
                }
            }
        }
        let summary = nodefit::summarize(total, &misfits);
        if fits.iter().all(|f| *f) {
            return (view.node_list(), summary);
        }
        let fit: Vec<Node> = view
            .nodes()
            .iter()
            .zip(&fits)
            .filter(|(_, f)| **f)
            .map(|(n, _)| n.clone())
            .collect();
        (Arc::new(fit), summary)
    }

    /// What becomes of a pod that fits nowhere: with `--preemption` an online pod may wait for
    /// batch pods it evicts; claims this controller allocated that tie it to a node no longer
    /// fitting are given back; the answer says whether it is refused or unschedulable.
    #[allow(
        clippy::too_many_arguments,
        reason = "the decision's inputs, as `decide` holds them"
    )]
    async fn fits_nowhere(
        &mut self,
        view: &mut ClusterView,
        pod: &Pod,
        refs: &[&res::ResourceClaim],
        candidates: &[Node],
        host: &tessera_driver::placement::fragmentation::HostResources,
        allocated: &[String],
        tied: bool,
        message: String,
        invalid: bool,
    ) -> NotPlaced {
        if !invalid
            && !tied
            && self.config.preemption
            && let Some(waiting) = self.preempt(view, pod, refs, candidates, host).await
        {
            return waiting;
        }
        if !invalid
            && !tied
            && let Some(waiting) = self.defragment(view, pod, refs, candidates, host).await
        {
            return waiting;
        }
        // Claims already allocated by this controller tie the pod to a node that no longer
        // fits: give them back so the next attempt may choose freely.
        if tied {
            let ours: Vec<String> = allocated
                .iter()
                .filter(|k| {
                    view.claims()
                        .get(*k)
                        .is_some_and(|c| gate::is_ours(c) && !gate::is_reserved(c))
                })
                .cloned()
                .collect();
            if ours.len() == allocated.len() {
                for k in &ours {
                    if let Err(e) = self.release(view, k).await {
                        return e;
                    }
                }
            }
        }
        if invalid {
            NotPlaced::Refused(message)
        } else {
            NotPlaced::Unschedulable(message)
        }
    }

    /// Decides where the pod's pending claims go and commits it to the snapshot; the writes
    /// are the returned job's.
    async fn decide(
        &mut self,
        view: &mut ClusterView,
        pod: &Pod,
        pending: &[String],
        allocated: &[String],
        node: Option<String>,
        usage: &mut Option<BTreeMap<String, Resources>>,
    ) -> Result<Job, NotPlaced> {
        let requests = view.checked_pod_requests(pod).map_err(NotPlaced::Refused)?;
        let usage = usage.get_or_insert_with(|| hosts_in_use(view));
        let (candidates, node_summary) =
            Self::candidates(view, pod, requests, node.as_deref(), usage);
        let candidates = self.held_candidates(view, pod, candidates);
        let claims: Vec<res::ResourceClaim> = pending
            .iter()
            .filter_map(|k| view.claims().get(k).cloned())
            .collect();
        let host = requests.host().unwrap_or_default();
        let refs: Vec<&res::ResourceClaim> = claims.iter().collect();
        let key = pod_key(pod);
        // Learn the shape once per pod, however often it is tried; commit the placement
        // (devices and host use) before the first write, so nothing placed later in this pass
        // can take the same devices.
        let learn = if view.has_learned(&key) {
            Learn::Known
        } else {
            Learn::FromClaims
        };
        let all_nodes = view.nodes().len();
        let snapshot = view.snapshot().map_err(NotPlaced::Transient)?;
        let waits_until = patience::waits_until(&self.allocator, snapshot, pod, &refs, now());
        let allocator = if waits_until.is_some() {
            &self.fragments
        } else {
            &self.allocator
        };
        let placed = allocator.place_pod(snapshot, &refs, &candidates, &host, learn);
        if let Some(shape) = placed.learned {
            view.learned(&key, shape);
        }
        let outcome = placed
            .result
            .map_err(|u| why_not_placed(&u, candidates.len(), all_nodes, &node_summary));
        let placement = match (outcome, waits_until) {
            (Ok(p), _) => p,
            (Err((message, None)), _) => return Err(NotPlaced::Aborted(message)),
            (Err((_, Some(false))), Some(until)) => return Err(patience::waiting(until)),
            (Err((message, Some(invalid))), _) => {
                return Err(self
                    .fits_nowhere(
                        view,
                        pod,
                        &refs,
                        &candidates,
                        &host,
                        allocated,
                        node.is_some(),
                        message,
                        invalid,
                    )
                    .await);
            }
        };
        let stamp = Time(now());
        let allocations: Vec<res::AllocationResult> = placement
            .allocations
            .into_iter()
            .map(|mut a| {
                a.allocation_timestamp = Some(stamp.clone());
                a
            })
            .collect();
        let entry = usage.entry(placement.node.clone()).or_default();
        *entry = entry.plus(requests);
        // The fast path reserves every claim of the pod in its allocation write, so only a
        // pod none of whose claims is allocated yet takes it.
        let reserve = self.config.fast_path
            && allocated.is_empty()
            && match view.fast_path_blocker(pod) {
                None => true,
                Some(why) => {
                    debug!(pod = %pod_key(pod), why, "kube-scheduler reserves the pod's claims");
                    false
                }
            };
        debug!(pod = %pod_key(pod), node = %placement.node, fast_path = reserve, "placed; writing");
        Ok(Job {
            pod: pod.clone(),
            claims: claims.into_iter().zip(allocations).collect(),
            reserve,
            started: Instant::now(),
        })
    }

    /// Carries out the jobs, at most [`PODS_IN_FLIGHT`] pods at a time.
    async fn write_all(&self, jobs: Vec<Job>) -> Vec<Done> {
        let mut out = Vec::with_capacity(jobs.len());
        let mut set = tokio::task::JoinSet::new();
        for job in jobs {
            while set.len() >= PODS_IN_FLIGHT {
                if let Some(done) = set.join_next().await {
                    push_done(&mut out, done);
                }
            }
            let protocol = self.protocol.clone();
            // A spawned task starts outside every span: it gets the pod's, inside this pass's.
            let span = pod_span(&pod_key(&job.pod));
            set.spawn(async move { protocol.run(job).await }.instrument(span));
        }
        while let Some(done) = set.join_next().await {
            push_done(&mut out, done);
        }
        out
    }

    /// Applies what one pod's writes did to the view, the snapshot and the report.
    async fn apply_done(&mut self, view: &mut ClusterView, done: Done, report: &mut PassReport) {
        apply_updates(view, done.updates);
        let Done {
            job,
            written,
            pod_gone,
            result,
            ..
        } = done;
        if pod_gone {
            // Its claims go back in the next pass's look for orphans.
            self.released_at = None;
            report.retry_soon = true;
        }
        match result {
            Ok(()) => {
                info!(pod = %pod_key(&job.pod), claims = job.claims.len(), "placed the pod");
                self.remembered.remove(&pod_key(&job.pod));
                self.metrics.outcome(Outcome::Allocated);
                self.metrics.latency(job.started.elapsed());
                report.placed += 1;
            }
            Err(e) => {
                // The claims not written (or rolled back) give back their reservation; what
                // the server holds for them now counts instead.
                if let Ok(snapshot) = view.snapshot() {
                    for (claim, _) in &job.claims {
                        let path = crate::cluster::claim_path(claim);
                        if written.contains(&path) {
                            continue;
                        }
                        snapshot.release(&claim_key(claim));
                    }
                }
                let current: Vec<res::ResourceClaim> = job
                    .claims
                    .iter()
                    .filter_map(|(c, _)| view.claims().get(&crate::cluster::claim_path(c)).cloned())
                    .collect();
                if let Ok(snapshot) = view.snapshot() {
                    for c in &current {
                        if let Some(a) = c.status.as_ref().and_then(|s| s.allocation.as_ref()) {
                            snapshot.commit(c, a);
                        }
                    }
                }
                if pod_gone {
                    // Nobody to tell.
                    return;
                }
                report.pending += 1;
                self.not_placed(view, &job.pod, e, report).await;
            }
        }
    }

    /// Gives back one claim this controller allocated (deallocate, then unmark), now.
    async fn release(&mut self, view: &mut ClusterView, key: &str) -> Result<(), NotPlaced> {
        let current = view.claims().get(key).cloned();
        let mut updates = Vec::new();
        let result = self
            .protocol
            .release_claim(key, current, None, &mut updates)
            .await;
        apply_updates(view, updates);
        result
    }

    async fn release_orphans(&mut self, view: &mut ClusterView, report: &mut PassReport) {
        let users = gate::claim_users(view.pod_objects());
        let releases = gate::releases(view.claims().values(), &users);
        for r in releases {
            if !self.pod_is_really_gone(view, &r).await {
                continue;
            }
            match self.release(view, &r.claim).await {
                Ok(()) => {
                    info!(claim = %r.claim, reason = %r.reason, deallocated = r.deallocate, "released the controller's claim");
                    if r.deallocate {
                        self.metrics.released();
                    }
                    report.released += 1;
                }
                Err(NotPlaced::NotLeader) => {
                    report.lost_leadership = true;
                    return;
                }
                Err(e) => {
                    warn!(claim = %r.claim, error = ?e, "releasing failed; retrying soon");
                    report.retry_soon = true;
                }
            }
        }
    }

    /// The view may have listed claims after pods: before giving back a claim for want of a
    /// pod, ask the server whether the pod the claim was allocated for still lives.
    async fn pod_is_really_gone(
        &mut self,
        view: &mut ClusterView,
        release: &gate::Release,
    ) -> bool {
        let Some(claim) = view.claims().get(&release.claim) else {
            return false;
        };
        if claim.metadata.deletion_timestamp.is_some() {
            return true;
        }
        let Some(pod) = claim
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(names::ANNOTATION_ALLOCATED_BY))
            .cloned()
        else {
            return true;
        };
        let (ns, _) = split_key(&release.claim);
        match self.protocol.writer.get_pod(ns, &pod).await {
            Ok(Some(p)) if gate::claim_users([&p]).contains_key(&release.claim) => {
                view.put_written_pod(p);
                false
            }
            Ok(_) => true,
            Err(e) => {
                debug!(claim = %release.claim, error = %e, "could not check the claim's pod; keeping it");
                false
            }
        }
    }

    async fn report_unbound(&mut self, view: &ClusterView) {
        let users = gate::claim_users(view.pod_objects());
        let max_age =
            SignedDuration::try_from(self.config.unbound_after).unwrap_or(SignedDuration::MAX);
        let found = gate::unbound(view.claims().values(), view.pods(), &users, now(), max_age);
        let keys: BTreeSet<String> = found.iter().map(|u| u.claim.clone()).collect();
        for u in found {
            if self.reported_unbound.contains(&u.claim) {
                continue;
            }
            let message = format!(
                "ResourceClaim {} was allocated {}s ago and its pod has not bound yet",
                u.claim,
                u.age.as_secs()
            );
            let span = claim_span(&u.claim);
            async {
                warn!(claim = %u.claim, pods = ?u.pods, age_seconds = u.age.as_secs(), "allocation not bound");
                for p in &u.pods {
                    if let Some(pod) = view.pods().get(p)
                        && let Err(e) = self
                            .protocol
                            .writer
                            .event(pod, true, names::ACTION_ALLOCATE, REASON_UNBOUND, &message)
                            .await
                    {
                        warn!(pod = %p, error = %e, "recording the Event failed");
                    }
                }
            }
            .instrument(span)
            .await;
        }
        self.reported_unbound = keys;
    }
}

/// Applies the server's answers a pod's writes collected.
fn apply_updates(view: &mut ClusterView, updates: Vec<ViewUpdate>) {
    for u in updates {
        match u {
            ViewUpdate::Claim(c) => view.put_written_claim(*c),
            ViewUpdate::ForgetClaim(k) => view.forget_claim(&k),
            ViewUpdate::Pod(p) => view.put_written_pod(*p),
            ViewUpdate::ForgetPod(k) => view.forget_pod(&k),
        }
    }
}

fn push_done(out: &mut Vec<Done>, joined: std::result::Result<Done, tokio::task::JoinError>) {
    match joined {
        Ok(mut done) => {
            // The server's answers wait here until every pod of the pass is written (hundreds
            // of pods when many arrive at once): keep of them only what the view will keep.
            for update in &mut done.updates {
                match update {
                    ViewUpdate::Claim(c) => crate::cluster::slim_claim(c),
                    ViewUpdate::Pod(p) => crate::cluster::slim_pod(p),
                    ViewUpdate::ForgetClaim(_) | ViewUpdate::ForgetPod(_) => {}
                }
            }
            out.push(done);
        }
        // A task only ends this way if it panicked; its pod is tried again by a later pass.
        Err(e) => warn!(error = %e, "a pod's writes ended abnormally"),
    }
}

/// What pods already take of every node ([`nodefit::node_usage`] over the view), also handed
/// to the allocator's snapshot for the placement policies.
fn hosts_in_use(view: &mut ClusterView) -> BTreeMap<String, Resources> {
    let usage = nodefit::node_usage(
        view.pod_objects(),
        |namespace, name| {
            crate::object_key::with_key(namespace, name, |key| view.claims().get(key))
                .and_then(|c| c.status.as_ref()?.allocation.as_ref())
        },
        |pod| view.pod_requests(pod),
    );
    if let Err(e) = view.track_hosts(&usage) {
        warn!(error = %e, "the allocator's snapshot cannot be built; placing this pass without host amounts");
    }
    usage
}
