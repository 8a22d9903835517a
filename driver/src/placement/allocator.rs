//! Structured allocation with Tessera's shares and placement policies.
//!
//! The allocator is pure: it reads a [`Snapshot`] (devices and their use) and returns where a
//! pod's claims go, or why they cannot go anywhere.
//!
//! ```text
//! let mut snapshot = Snapshot::new(&slices, &classes, &allocated_claims)?;      // or for_driver
//! let allocator = Allocator::new(AllocatorOptions { policy: Policy::Binpack, ..Default::default() });
//! match allocator.allocate(&snapshot, &[&claim_a, &claim_b], &candidate_nodes) {
//!     Ok(placement) => {                         // placement.node, placement.allocations[i]
//!         for (claim, a) in claims.iter().zip(&placement.allocations) { snapshot.commit(claim, a) }
//!     }
//!     Err(unsatisfiable) => { /* a normal result: unsatisfiable.to_string() says why */ }
//! }
//! snapshot.release(&claim_key(&claim));          // when a claim is deallocated
//! ```
//!
//! Kubernetes semantics, as kube-scheduler's structured allocator implements them: class and
//! request CEL selectors, `exactly` with `count` or `allocationMode: All`, `firstAvailable`
//! (results named `request/subrequest`), `adminAccess` (consumes nothing), `matchAttribute`
//! and `distinctAttribute` constraints (list-typed attributes as sets: a match needs a value
//! common to all devices, distinct needs pairwise disjoint sets), device taints (`NoSchedule`/`NoExecute` need a
//! toleration), class then claim config propagation, the result's node selector, consumable
//! capacity (`allowMultipleAllocations`, request policies, `consumedCapacity`, `shareID`) and
//! partitionable devices (shared counters). The search is kube-scheduler's depth-first
//! backtracking in its device order, bounded by a step budget.
//!
//! Tessera adds shares: a request is a share when a `GpuShare` opaque config for Tessera's
//! driver applies to it (class or claim config) or when its `capacity.requests` land on a
//! Tessera device; [`crate::rules::validation::request_share`] is the one place that decides it
//! (static validation uses the same function with the list of share classes). A share needs `count` distinct `sharing=shared` GPUs on one node, each
//! with the free memory and compute of its per-card share. The result records the resolved
//! share as `consumedCapacity` (+ `shareID`) where the device allows multiple allocations,
//! and always as an `AllocatedShares` config entry for Tessera's driver.
//!
//! Placement: all claims of one pod land on one node. The [`Policy`] orders candidate nodes
//! and devices: first-fit keeps kube-scheduler's order; binpack and spread prefer the fullest
//! and the emptiest, and for multi-device requests one `NVLink` island, then one NUMA node.
//!
//! Nodes are looked up by id (candidate lists are cached per snapshot) and policy order is
//! handed out lazily, so a decision touches each candidate once and searches only until the
//! first node that fits.
//!
//! A claim that does not fit is an [`Unsatisfiable`] result naming the claim, the request,
//! the rule and device counts (needed and found, or the constraint no node can meet); only
//! inconsistent snapshot input is an [`Error`](crate::Error).

mod booking;
mod capacity;
mod delay;

mod place;
mod policy;
pub mod preempt;

mod reason;
mod request;
mod search;
mod snapshot;
mod usage;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

use k8s_openapi::api::core::v1::{Node, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm};
use k8s_openapi::api::resource::v1 as res;
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;

pub use place::{Learn, PodPlacement};
pub use policy::{DeviceView, NodeView, PlacementPolicy, PodAsk, Policy, ScoreInput};

pub use reason::{ClaimFailure, DeviceCounts, FailureKind, Unsatisfiable, Wanted};
pub use snapshot::{Snapshot, claim_key, claim_name};
pub use usage::DeviceUsage;

use crate::names;
use crate::placement::fragmentation::{HostResources, TaskShape, WHOLE_GPU};
use crate::rules::config::{AllocatedShares, DeviceShare};
use crate::rules::nodeselect::{FIELD_NODE_NAME, NodeScope};
use crate::rules::quantity::Quantity;
use request::{ClaimSpec, ReqSpec, SpecError};
use search::{Abort, Outcome, Pick, Search};

/// Source of a config copied from a `DeviceClass`.
const SOURCE_CLASS: &str = "FromClass";
/// Source of a config copied from the claim.
const SOURCE_CLAIM: &str = "FromClaim";
/// Default step budget of one allocation call.
pub const DEFAULT_MAX_STEPS: u64 = 200_000;

/// How the allocator behaves.
#[derive(Debug, Clone)]
pub struct AllocatorOptions {
    /// Tessera's DRA driver name (the owner of shares and `AllocatedShares` records).
    pub driver_name: String,
    /// How nodes and devices are chosen among those that fit.
    pub policy: Policy,
    /// Search steps one [`Allocator::allocate`] call may take before giving up.
    pub max_steps: u64,
}

impl Default for AllocatorOptions {
    fn default() -> Self {
        Self {
            driver_name: names::DEFAULT_DRIVER_NAME.to_owned(),
            policy: Policy::FirstFit,
            max_steps: DEFAULT_MAX_STEPS,
        }
    }
}

/// Where a pod's claims go.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    /// The chosen node.
    pub node: String,
    /// One allocation per claim, in the order given (no `allocationTimestamp`: the writer sets it).
    pub allocations: Vec<res::AllocationResult>,
}

/// The allocator; cheap to share, holds no cluster state.
#[derive(Debug)]
pub struct Allocator {
    options: AllocatorOptions,
    policy: Box<dyn PlacementPolicy>,
    explain: bool,
    /// Delay-tolerant shares take fragments only ([`Allocator::fragments_only`]).
    fragments_only: bool,
}

impl Allocator {
    /// An allocator with one of the built-in policies.
    pub fn new(options: AllocatorOptions) -> Self {
        let policy = Box::new(options.policy);
        Self {
            options,
            policy,
            explain: true,
            fragments_only: false,
        }
    }

    /// The same allocator, but a pod that fits nowhere gets the short reason "no candidate
    /// node fits" instead of a per-request diagnosis, which costs a pass over every device
    /// (simulations place thousands of pods that do not fit and never read why).
    #[must_use]
    pub fn without_explanations(mut self) -> Self {
        self.explain = false;
        self
    }

    /// An allocator with a custom placement policy (`options.policy` is then ignored).
    pub fn with_policy(options: AllocatorOptions, policy: Box<dyn PlacementPolicy>) -> Self {
        Self {
            options,
            policy,
            explain: true,
            fragments_only: false,
        }
    }

    /// The options in use.
    pub fn options(&self) -> &AllocatorOptions {
        &self.options
    }

    /// Places all `claims` of one pod together on one of `candidates`, or says why not.
    pub fn allocate(
        &self,
        snapshot: &Snapshot,
        claims: &[&res::ResourceClaim],
        candidates: &[Node],
    ) -> Result<Placement, Unsatisfiable> {
        self.allocate_pod(snapshot, claims, candidates, &HostResources::default())
    }

    /// The task shape of a pod that requests `host` CPU and memory and has `claims`, as
    /// fragmentation-aware policies learn it ([`Snapshot::observe`]); `None` when a claim is
    /// malformed (it is refused when allocated, and teaches the policy nothing).
    pub fn task_shape(
        &self,
        snapshot: &Snapshot,
        claims: &[&res::ResourceClaim],
        host: &HostResources,
    ) -> Option<TaskShape> {
        let mut cache = snapshot.selectors();
        let specs = claims
            .iter()
            .map(|c| request::prepare_claim(snapshot, &mut cache, &self.options.driver_name, c))
            .collect::<Result<Vec<_>, _>>()
            .ok()?;
        let ask = pod_ask(&specs, host);
        let models = (ask.cards > 0)
            .then(|| accepted_models(snapshot, &mut cache, &specs))
            .flatten();
        Some(TaskShape {
            host: ask.host,
            gpus: ask.cards,
            gpu_milli: if ask.cards == 0 { 0 } else { ask.gpu_milli },
            models,
        })
    }

    /// Places a pod that requests `host` CPU and memory and has `claims` (possibly none) on
    /// one of `candidates`: only nodes with that much free (where the snapshot tracks it,
    /// [`Snapshot::set_host`]) are considered. Nothing is committed: callers that place pods
    /// one after another use [`Allocator::place_pod`], which does.
    /// (Preparing the claims here; ordering, searching and building in `place_specs`.)
    pub fn allocate_pod(
        &self,
        snapshot: &Snapshot,
        claims: &[&res::ResourceClaim],
        candidates: &[Node],
        host: &HostResources,
    ) -> Result<Placement, Unsatisfiable> {
        let mut cache = snapshot.selectors();
        let mut specs = Vec::with_capacity(claims.len());
        for claim in claims {
            match request::prepare_claim(snapshot, &mut cache, &self.options.driver_name, claim) {
                Ok(s) => specs.push(s),
                Err(SpecError { request, message }) => {
                    return Err(single(
                        claim_name(claim),
                        request,
                        FailureKind::Invalid(message),
                    ));
                }
            }
        }
        if self.fragments_only {
            delay::restrict(&mut specs);
        }
        // Batch is over-committed only where it fits nowhere without: a pod with over-commit
        // allowed is placed as if it had none first ([`crate::rules::overcommit`]).
        if specs
            .iter()
            .any(|s| s.requests.iter().flatten().any(|r| r.overcommit.any()))
        {
            let strict: Vec<ClaimSpec> = specs
                .iter()
                .cloned()
                .map(request::without_overcommit)
                .collect();
            if let Ok(p) = self.place_specs(
                snapshot, &mut cache, claims, &strict, candidates, host, false,
            ) {
                return Ok(p);
            }
        }
        self.place_specs(
            snapshot,
            &mut cache,
            claims,
            &specs,
            candidates,
            host,
            self.explain,
        )
    }

    /// Places prepared claims; `explain` diagnoses a pod that fits nowhere.
    #[allow(clippy::too_many_lines, clippy::too_many_arguments)] // Reason: the whole decision in one place: order, search, build.
    fn place_specs(
        &self,
        snapshot: &Snapshot,
        cache: &mut snapshot::SelectorCache,
        claims: &[&res::ResourceClaim],
        specs: &[ClaimSpec],
        candidates: &[Node],
        host: &HostResources,
        explain: bool,
    ) -> Result<Placement, Unsatisfiable> {
        let first = specs.first().map(|s| s.name.clone()).unwrap_or_default();
        if candidates.is_empty() {
            return Err(single(first, None, FailureKind::NoNodes));
        }
        let need = quick_need(snapshot, cache, specs);
        // Policies that order nodes look at every candidate, so the cached id list is made
        // exact first; first-fit usually stops early and checks only the nodes it visits.
        let ids = snapshot.candidate_ids(cache, candidates, self.policy.orders_nodes());
        let id_of = |pos: usize| ids.get(snapshot, candidates, pos);
        let empty = snapshot::NodeSummary::default();
        let summary = |pos: usize| id_of(pos).map_or(&empty, |id| &snapshot.summaries[id]);
        let host_of = |pos: usize| id_of(pos).and_then(|id| snapshot.hosts[id]);
        let host_fits = |pos: usize| host_of(pos).is_none_or(|h| h.free().holds(host));
        let may_fit = |pos: usize| {
            host_fits(pos) && (!snapshot.global.is_empty() || need.may_fit(summary(pos)))
        };
        let ask = pod_ask(specs, host);
        // CPU-only pods take no GPU and hold nothing back; where their CPU goes is the
        // policies' concern (stranded GPU).
        let held_back = snapshot
            .model_free
            .held_back(u64::from(ask.cards) * u64::from(ask.gpu_milli), |m| {
                snapshot.workload.model_pressure(Some(m))
            });
        let input = ScoreInput {
            ask: &ask,
            workload: &snapshot.workload,
            model_shares: &snapshot.model_shares,
            gaps: &snapshot.gaps,
            held_back: &held_back,
        };
        let view = |pos: usize| {
            let s = summary(pos);
            let h = host_of(pos);
            NodeView {
                name: candidates[pos].metadata.name.as_deref().unwrap_or_default(),
                position: pos,
                devices: s.devices,
                used_permille: s.used_permille,
                gpu_free: &s.gpu_free,
                model: s.model.as_deref(),
                host_free: h.map(|h| h.free()),
                host_total: h.map(|h| h.allocatable),
            }
        };
        // Policy order is (score, position); a heap hands out only the nodes actually tried.
        let positions: Box<dyn Iterator<Item = usize>> = if self.policy.orders_nodes() {
            let memo = &mut cache.scores;
            let cacheable = self.policy.cacheable();
            if cacheable
                && (memo.policy != self.policy.name()
                    || memo.workload != snapshot.workload.version()
                    || memo.nodes.len() != snapshot.summaries.len())
            {
                self.policy.name().clone_into(&mut memo.policy);
                memo.workload = snapshot.workload.version();
                memo.nodes = vec![(u64::MAX, Vec::new()); snapshot.summaries.len()];
            }
            let mut scored: Vec<Reverse<((i64, i64), usize)>> =
                Vec::with_capacity(candidates.len());
            for pos in (0..candidates.len()).filter(|&pos| may_fit(pos)) {
                let id = id_of(pos).filter(|_| cacheable);
                let cached = id.and_then(|id| {
                    let (version, entries) = &memo.nodes[id];
                    (*version == snapshot.node_versions[id])
                        .then(|| entries.iter().find(|(a, _)| *a == ask).map(|e| e.1))
                        .flatten()
                });
                let score = cached.unwrap_or_else(|| {
                    let score = self.policy.node_score(&view(pos), &input);
                    if let Some(id) = id {
                        let slot = &mut memo.nodes[id];
                        if slot.0 != snapshot.node_versions[id]
                            || slot.1.len() >= snapshot::MEMO_PER_NODE
                        {
                            *slot = (snapshot.node_versions[id], Vec::new());
                        }
                        slot.1.push((ask.clone(), score));
                    }
                    score
                });
                let rank = self.policy.node_rank(&view(pos), &input);
                scored.push(Reverse(((rank, score), pos)));
            }
            let mut heap = BinaryHeap::from(scored);
            Box::new(std::iter::from_fn(move || {
                heap.pop().map(|Reverse((_, pos))| pos)
            }))
        } else {
            Box::new((0..candidates.len()).filter(move |&pos| may_fit(pos)))
        };
        let mut budget = self.options.max_steps;
        for pos in positions {
            let node = &candidates[pos];
            let devices = node_devices(snapshot, node, id_of(pos));
            let node_view = view(pos);
            let scoring = search::Scoring {
                node: &node_view,
                input: &input,
                gpu_devices: &summary(pos).gpu_devices,
            };
            let mut search = Search::new(
                snapshot,
                cache,
                specs,
                self.policy.as_ref(),
                node,
                devices,
                budget,
                scoring,
            );
            let outcome = search.run();
            budget = budget.saturating_sub(search.steps);
            match outcome {
                Ok(true) => {
                    let node_name = node.metadata.name.clone().unwrap_or_default();
                    let allocations = specs
                        .iter()
                        .zip(claims)
                        .enumerate()
                        .map(|(i, (spec, claim))| {
                            self.build(
                                snapshot,
                                spec,
                                claim,
                                &search.picks[i],
                                &search.selected[i],
                                &node_name,
                            )
                        })
                        .collect();
                    return Ok(Placement {
                        node: node_name,
                        allocations,
                    });
                }
                Ok(false) => {}
                Err(Abort::Budget) => {
                    return Err(single(
                        first,
                        None,
                        FailureKind::SearchLimit(self.options.max_steps),
                    ));
                }
                Err(Abort::Cel(e)) => {
                    return Err(single(first, None, FailureKind::CelRuntime(e.to_string())));
                }
                Err(Abort::Fatal(m)) => return Err(single(first, None, FailureKind::Invalid(m))),
            }
        }
        let without_room = (0..candidates.len()).filter(|&pos| !host_fits(pos)).count();
        if specs.is_empty() || without_room == candidates.len() {
            let nodes = u32::try_from(without_room).unwrap_or(u32::MAX);
            return Err(single(first, None, FailureKind::HostResources { nodes }));
        }
        if !explain {
            return Err(single(first, None, FailureKind::Unexplained));
        }
        let ids = snapshot.candidate_ids(cache, candidates, true);
        Err(diagnose(snapshot, cache, specs, candidates, &ids))
    }

    fn build(
        &self,
        snap: &Snapshot,
        spec: &ClaimSpec,
        claim: &res::ResourceClaim,
        picks: &[Pick],
        selected: &[usize],
        node: &str,
    ) -> res::AllocationResult {
        let driver = &self.options.driver_name;
        let mut results = Vec::with_capacity(picks.len());
        let mut shares = Vec::new();
        let mut share_requests: Vec<String> = Vec::new();
        for (i, pick) in picks.iter().enumerate() {
            let req = &spec.requests[pick.req][pick.alt];
            let entry = &snap.devices[pick.device];
            let consumed = pick.consumed.as_ref().map(|c| {
                c.iter()
                    .map(|(k, v)| (status_name(entry, k), v.to_k8s()))
                    .collect::<BTreeMap<_, _>>()
            });
            // kube-scheduler leaves the field out when nothing was consumed.
            let consumed = consumed.filter(|c| !c.is_empty());
            let share_id = (entry.multi && !req.admin).then(|| {
                let name = format!("{}/{}/{}/{i}", spec.uid, req.full, entry.id());
                uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_URL, name.as_bytes()).to_string()
            });
            results.push(res::DeviceRequestAllocationResult {
                request: req.full.clone(),
                driver: entry.driver.clone(),
                pool: entry.pool.clone(),
                device: entry.device().name.clone(),
                admin_access: req.admin.then_some(true),
                tolerations: (!req.tolerations.is_empty()).then(|| req.tolerations.clone()),
                share_id,
                consumed_capacity: consumed,
                binding_conditions: entry.device().binding_conditions.clone(),
                binding_failure_conditions: entry.device().binding_failure_conditions.clone(),
            });
            if let Some(per) = pick.share.filter(|_| entry.tessera_shared && !req.admin) {
                let (over_memory, over_compute) = pick.over.unwrap_or_default();
                shares.push(DeviceShare {
                    request: req.full.clone(),
                    pool: entry.pool.clone(),
                    device: entry.device().name.clone(),
                    memory: Quantity::from_bytes(per.memory_bytes),
                    compute: per.compute_percent,
                    tier: req.tier,
                    guaranteed_memory: (over_memory > 0).then(|| {
                        Quantity::from_bytes(per.memory_bytes.saturating_sub(over_memory))
                    }),
                    guaranteed_compute: (over_compute > 0)
                        .then(|| per.compute_percent.saturating_sub(over_compute)),
                });
                if !share_requests.contains(&req.full) {
                    share_requests.push(req.full.clone());
                }
            }
        }
        let mut config = config_for(snap, spec, claim, selected);
        if !shares.is_empty()
            && let Ok(parameters) = serde_json::to_value(AllocatedShares::new(shares))
        {
            config.push(res::DeviceAllocationConfiguration {
                source: SOURCE_CLAIM.to_owned(),
                requests: Some(share_requests),
                opaque: Some(res::OpaqueDeviceConfiguration {
                    driver: driver.clone(),
                    parameters: RawExtension(parameters),
                }),
            });
        }
        res::AllocationResult {
            allocation_timestamp: None,
            devices: Some(res::DeviceAllocationResult {
                config: (!config.is_empty()).then_some(config),
                results: Some(results),
            }),
            node_selector: result_node_selector(snap, picks, node),
        }
    }
}

fn single(claim: String, request: Option<String>, kind: FailureKind) -> Unsatisfiable {
    Unsatisfiable {
        failures: vec![ClaimFailure {
            claim,
            request,
            kind,
            counts: DeviceCounts::default(),
            notes: Vec::new(),
        }],
    }
}

/// The capacity name to write in a result: as the device spells it.
fn status_name(entry: &snapshot::DeviceEntry, fq: &str) -> String {
    if entry.device().has_capacity(fq) {
        return fq.to_owned();
    }
    fq.strip_prefix(&format!("{}/", entry.driver))
        .unwrap_or(fq)
        .to_owned()
}

/// Class configs once per class (naming the requests that use it), then claim configs that
/// apply to an allocated request or subrequest, as kube-scheduler writes them.
fn config_for(
    snap: &Snapshot,
    spec: &ClaimSpec,
    claim: &res::ResourceClaim,
    selected: &[usize],
) -> Vec<res::DeviceAllocationConfiguration> {
    let mut out: Vec<res::DeviceAllocationConfiguration> = Vec::new();
    let mut class_ranges: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    let chosen: Vec<&ReqSpec> = spec
        .requests
        .iter()
        .zip(selected)
        .filter_map(|(alts, &a)| alts.get(a))
        .collect();
    for req in &chosen {
        if let Some(&(start, end)) = class_ranges.get(req.class.as_str()) {
            for cfg in &mut out[start..end] {
                cfg.requests
                    .get_or_insert_with(Vec::new)
                    .push(req.full.clone());
            }
            continue;
        }
        let start = out.len();
        if let Some(class) = snap.classes.get(&req.class) {
            for cfg in class.spec.config.iter().flatten() {
                out.push(res::DeviceAllocationConfiguration {
                    source: SOURCE_CLASS.to_owned(),
                    requests: Some(vec![req.full.clone()]),
                    opaque: cfg.opaque.clone(),
                });
            }
        }
        class_ranges.insert(req.class.as_str(), (start, out.len()));
    }
    let devices = claim.spec.devices.as_ref();
    for cfg in devices
        .and_then(|d| d.config.as_ref())
        .into_iter()
        .flatten()
    {
        let names = cfg.requests.as_deref().unwrap_or_default();
        let entry = || res::DeviceAllocationConfiguration {
            source: SOURCE_CLAIM.to_owned(),
            requests: cfg.requests.clone(),
            opaque: cfg.opaque.clone(),
        };
        if names.is_empty() {
            out.push(entry());
            continue;
        }
        for req in &chosen {
            if names.contains(&req.base) || (req.sub.is_some() && names.contains(&req.full)) {
                out.push(entry());
            }
        }
    }
    out
}

/// The node selector of an allocation: the node when any device is local to it; else the
/// requirements of node-selector slices; none for devices every node reaches.
fn result_node_selector(snap: &Snapshot, picks: &[Pick], node: &str) -> Option<NodeSelector> {
    let mut fields: Vec<NodeSelectorRequirement> = Vec::new();
    let mut exprs: Vec<NodeSelectorRequirement> = Vec::new();
    for pick in picks {
        let entry = &snap.devices[pick.device];
        if matches!(entry.scope, NodeScope::Node(_)) || entry.device().binds_to_node == Some(true) {
            return Some(NodeSelector {
                node_selector_terms: vec![NodeSelectorTerm {
                    match_expressions: None,
                    match_fields: Some(vec![NodeSelectorRequirement {
                        key: FIELD_NODE_NAME.to_owned(),
                        operator: "In".to_owned(),
                        values: Some(vec![node.to_owned()]),
                    }]),
                }],
            });
        }
        if let NodeScope::Selector(s) = &entry.scope
            && let [term] = s.node_selector_terms.as_slice()
        {
            for r in term.match_fields.iter().flatten() {
                if !fields.contains(r) {
                    fields.push(r.clone());
                }
            }
            for r in term.match_expressions.iter().flatten() {
                if !exprs.contains(r) {
                    exprs.push(r.clone());
                }
            }
        }
    }
    if fields.is_empty() && exprs.is_empty() {
        return None;
    }
    Some(NodeSelector {
        node_selector_terms: vec![NodeSelectorTerm {
            match_expressions: (!exprs.is_empty()).then_some(exprs),
            match_fields: (!fields.is_empty()).then_some(fields),
        }],
    })
}

/// The devices a node can use, in kube-scheduler's order (`id`: the node's id, if it has
/// local devices).
fn node_devices(snap: &Snapshot, node: &Node, id: Option<usize>) -> Vec<usize> {
    let local = id.map(|i| snap.local[i].as_slice()).unwrap_or_default();
    if snap.global.is_empty() {
        return local.to_vec();
    }
    let mut all: Vec<usize> = local
        .iter()
        .copied()
        .chain(
            snap.global
                .iter()
                .copied()
                .filter(|&d| snap.devices[d].scope.matches(node)),
        )
        .collect();
    all.sort_unstable();
    all
}

/// What the pod asks for, as placement scores see it: its cards (whole devices and share
/// cards over all claims) and the milli-GPU of each (the largest among its requests).
fn pod_ask(specs: &[ClaimSpec], host: &HostResources) -> PodAsk {
    let mut ask = PodAsk {
        cards: 0,
        gpu_milli: 0,
        host: *host,
    };
    for claim in specs {
        for alts in &claim.requests {
            let Some(req) = alts.first() else { continue };
            if req.admin {
                continue;
            }
            let share = req
                .share
                .as_ref()
                .or_else(|| req.capacity_share.as_ref().and_then(|r| r.as_ref().ok()));
            let (cards, milli) = match share {
                Some(s) => {
                    let by_memory = match s.memory {
                        crate::rules::share::MemoryAsk::Percent(p) => u32::from(p) * 10,
                        crate::rules::share::MemoryAsk::Bytes(_) => 0,
                    };
                    let by_compute = u32::try_from(s.compute.clamp(0, 100)).unwrap_or(0) * 10;
                    (s.cards, by_memory.max(by_compute).max(1))
                }
                None => (u32::try_from(req.count).unwrap_or(u32::MAX), WHOLE_GPU),
            };
            ask.cards = ask.cards.saturating_add(cards);
            ask.gpu_milli = ask.gpu_milli.max(milli);
        }
    }
    ask
}

/// The GPU models a pod's GPU requests accept, when their class and selectors leave out some
/// of the cluster's models (`None`: any model, or none matches at all). Each model is judged on
/// the devices the selectors are evaluated on, not guessed from the expressions' text.
fn accepted_models(
    snap: &Snapshot,
    cache: &mut snapshot::SelectorCache,
    specs: &[ClaimSpec],
) -> Option<std::sync::Arc<[String]>> {
    // The cluster's models, each once (computed when the snapshot was built).
    let all = snap.model_shares.len();
    let mut accepted: BTreeSet<&str> = snap.model_shares.iter().map(|(m, _)| m.as_str()).collect();
    for claim in specs {
        for alts in &claim.requests {
            let Some(req) = alts.first().filter(|r| !r.admin) else {
                continue;
            };
            let models = request_models(snap, cache, req);
            accepted.retain(|m| models.iter().any(|a| a == m));
        }
    }
    (!accepted.is_empty() && accepted.len() < all).then(|| {
        accepted
            .into_iter()
            .map(str::to_owned)
            .collect::<Vec<_>>()
            .into()
    })
}

/// The models of the devices a request's class and selectors select, found once per class and
/// selectors on a snapshot (devices never change in one), not once per pod.
fn request_models(
    snap: &Snapshot,
    cache: &mut snapshot::SelectorCache,
    req: &ReqSpec,
) -> std::sync::Arc<Vec<String>> {
    let key = (req.class.clone(), req.selectors.clone());
    if let Some(models) = cache.request_models.get(&key) {
        return std::sync::Arc::clone(models);
    }
    let mut models: Vec<String> = Vec::new();
    for &dev in class_devices(snap, cache, req).iter() {
        let Some(model) = snap.devices[dev].gpu_model.as_ref() else {
            continue;
        };
        if models.contains(model) {
            continue;
        }
        if req
            .selectors
            .iter()
            .all(|&e| snap.eval(cache, e, dev).unwrap_or(false))
        {
            models.push(model.clone());
        }
    }
    let models = std::sync::Arc::new(models);
    cache
        .request_models
        .insert(key, std::sync::Arc::clone(&models));
    models
}

/// A sound lower bound of what a pod needs of one node, to skip nodes without searching.
#[derive(Debug, Default)]
struct QuickNeed {
    plain: u32,
    share_cards: u32,
    share_memory: u64,
    /// The largest `memoryPercent` of a share (0: none).
    share_percent: u8,
}

impl QuickNeed {
    fn may_fit(&self, s: &snapshot::NodeSummary) -> bool {
        s.free_plain >= self.plain
            && (self.share_cards == 0
                || (s.share_avail >= self.share_cards
                    && s.share_max_free >= self.share_memory
                    && (self.share_percent == 0
                        || s.share_free
                            .iter()
                            .filter(|&&(free, total)| {
                                crate::rules::share::percent_bytes(total, self.share_percent)
                                    <= free
                            })
                            .count()
                            >= self.share_cards as usize)))
    }
}

fn quick_need(
    snap: &Snapshot,
    cache: &mut snapshot::SelectorCache,
    specs: &[ClaimSpec],
) -> QuickNeed {
    let mut need = QuickNeed::default();
    for claim in specs {
        for (alts, &fa) in claim.requests.iter().zip(&claim.first_available) {
            let [req] = alts.as_slice() else { continue };
            if fa || req.admin || req.all {
                continue;
            }
            let count = u32::try_from(req.count).unwrap_or(u32::MAX);
            // Over-committed memory may fit where no memory is free: no sound bound.
            if req.share.is_some() && req.overcommit.memory.overcommits() {
                continue;
            }
            if let Some(share) = &req.share {
                need.share_cards = need.share_cards.max(share.cards);
                match share.memory {
                    crate::rules::share::MemoryAsk::Bytes(b) => {
                        need.share_memory = need.share_memory.max(b);
                    }
                    crate::rules::share::MemoryAsk::Percent(p) => {
                        need.share_percent = need.share_percent.max(p);
                    }
                }
            } else if req.capacity.is_none() && !class_matches_multi(snap, cache, req) {
                need.plain += count;
            }
        }
    }
    need
}

/// Whether a request's class selects any device with `allowMultipleAllocations` (cached).
fn class_matches_multi(
    snap: &Snapshot,
    cache: &mut snapshot::SelectorCache,
    req: &ReqSpec,
) -> bool {
    if let Some(&hit) = cache.class_matches_multi.get(&req.class) {
        return hit;
    }
    let mut hit = false;
    for (idx, d) in snap.devices.iter().enumerate() {
        if !(d.multi || d.tessera_shared) {
            continue;
        }
        let mut all = true;
        for &e in &req.class_selectors {
            match snap.eval(cache, e, idx) {
                Ok(true) => {}
                Ok(false) => {
                    all = false;
                    break;
                }
                Err(_) => break,
            }
        }
        if all {
            hit = true;
            break;
        }
    }
    cache.class_matches_multi.insert(req.class.clone(), hit);
    hit
}

fn wanted(req: &ReqSpec) -> Wanted {
    match req
        .share
        .as_ref()
        .or_else(|| req.capacity_share.as_ref().and_then(|r| r.as_ref().ok()))
    {
        Some(share) => {
            let memory = match share.memory {
                crate::rules::share::MemoryAsk::Bytes(b) => {
                    format!("{} free", Quantity::from_bytes(b))
                }
                crate::rules::share::MemoryAsk::Percent(p) => format!("{p}% of its memory free"),
            };
            let room = if share.compute > 0 {
                format!("with {memory} and {}% compute", share.compute)
            } else {
                format!("with {memory}")
            };
            Wanted::Gpu { room }
        }
        None => Wanted::Device,
    }
}

/// The devices a request's class selects (cached per class for the snapshot's life).
fn class_devices(
    snap: &Snapshot,
    cache: &mut snapshot::SelectorCache,
    req: &ReqSpec,
) -> std::sync::Arc<Vec<usize>> {
    if let Some(list) = cache.class_devices.get(&req.class) {
        return std::sync::Arc::clone(list);
    }
    let mut list = Vec::new();
    'devices: for dev in 0..snap.devices.len() {
        for &e in &req.class_selectors {
            match snap.eval(cache, e, dev) {
                Ok(true) => {}
                Ok(false) => continue 'devices,
                // Kept: the error is reported only if the device is reachable.
                Err(_) => break,
            }
        }
        list.push(dev);
    }
    let list = std::sync::Arc::new(list);
    cache
        .class_devices
        .insert(req.class.clone(), std::sync::Arc::clone(&list));
    list
}

/// How one request fares on the reachable devices: the counts, and the devices that fit alone.
fn tally(
    snap: &Snapshot,
    cache: &mut snapshot::SelectorCache,
    req: &ReqSpec,
    reachable: &[bool],
    reachable_count: u32,
) -> Result<(DeviceCounts, Vec<usize>, Option<String>), FailureKind> {
    let abort = |a: Abort| match a {
        Abort::Cel(e) => FailureKind::CelRuntime(e.to_string()),
        Abort::Fatal(m) => FailureKind::Invalid(m),
        Abort::Budget => FailureKind::SearchLimit(0),
    };
    let selected = class_devices(snap, cache, req);
    let mut counts = DeviceCounts {
        considered: reachable_count,
        class_mismatch: reachable_count,
        ..DeviceCounts::default()
    };
    let mut fitting = Vec::new();
    let mut share_error = None;
    for &dev in selected.iter().filter(|&&d| reachable[d]) {
        counts.class_mismatch -= 1;
        let outcome = search::classify(snap, cache, req, dev).map_err(abort)?;
        if outcome == Outcome::NotShared
            && let Some(Err(e)) = req.share_on(snap.devices[dev].tessera)
        {
            share_error = Some(e.to_string());
        }
        match outcome {
            Outcome::ClassMismatch => {}
            Outcome::SelectorMismatch => counts.selector_mismatch += 1,
            Outcome::NotShared => counts.not_shared += 1,
            Outcome::Tainted => counts.tainted += 1,
            Outcome::InUse => counts.in_use += 1,
            Outcome::TooFull => counts.too_full += 1,
            Outcome::TooSmall => counts.too_small += 1,
            Outcome::Counters => counts.counters_exhausted += 1,
            Outcome::Fits => {
                counts.fit += 1;
                fitting.push(dev);
            }
        }
    }
    Ok((counts, fitting, share_error))
}

/// A constraint no candidate node can meet even with every device that fits on its own:
/// `(attribute, distinct, needed, best)`.
fn unmeetable_constraint(
    snap: &Snapshot,
    claim: &ClaimSpec,
    fitting: &[Option<Vec<usize>>],
    candidates: &[Node],
    ids: &snapshot::CandidateIds,
) -> Option<(String, bool, u32, u32)> {
    for k in &claim.constraints {
        let mut needed = 0usize;
        let mut devices: Vec<usize> = Vec::new();
        let mut bounded = true;
        for ((alts, &fa), fit) in claim
            .requests
            .iter()
            .zip(&claim.first_available)
            .zip(fitting)
        {
            let Some(req) = alts.first() else { continue };
            if !k.applies(&req.base, &req.full) {
                continue;
            }
            match (fa, req.all, fit) {
                (false, false, Some(list)) => {
                    needed += req.count;
                    devices.extend(list);
                }
                _ => bounded = false,
            }
        }
        // A device allowing several allocations may serve several picks: no sound bound.
        if !bounded || needed < 2 || devices.iter().any(|&d| snap.devices[d].multi) {
            continue;
        }
        devices.sort_unstable();
        devices.dedup();
        let mut best = 0usize;
        for (pos, node) in candidates.iter().enumerate() {
            let id = ids.get(snap, candidates, pos);
            let mut per_value: BTreeMap<String, usize> = BTreeMap::new();
            let mut on_node = 0usize;
            for d in node_devices(snap, node, id) {
                if devices.binary_search(&d).is_err() {
                    continue;
                }
                let Some(values) = search::lookup_attr(snap, d, &k.attribute) else {
                    continue;
                };
                on_node += 1;
                for key in values.keys() {
                    *per_value.entry(key).or_default() += 1;
                }
            }
            // Devices sharing one value, or (distinct) at most one device per value.
            let offer = if k.distinct {
                on_node.min(per_value.len())
            } else {
                per_value.values().copied().max().unwrap_or(0)
            };
            best = best.max(offer);
            if best >= needed {
                break;
            }
        }
        if best < needed {
            let attribute = k
                .attribute
                .rsplit_once('/')
                .map_or(k.attribute.as_str(), |(_, id)| id)
                .to_owned();
            let as_u32 = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
            return Some((attribute, k.distinct, as_u32(needed), as_u32(best)));
        }
    }
    None
}

/// Which devices the candidates reach, and how many.
fn reachable(
    snap: &Snapshot,
    candidates: &[Node],
    ids: &snapshot::CandidateIds,
) -> (Vec<bool>, u32) {
    let mut reachable = vec![false; snap.devices.len()];
    let mut count = 0u32;
    let mut mark = |d: usize| {
        if !reachable[d] {
            reachable[d] = true;
            count += 1;
        }
    };
    for (pos, node) in candidates.iter().enumerate() {
        let id = ids.get(snap, candidates, pos);
        for &d in id.map(|i| snap.local[i].as_slice()).unwrap_or_default() {
            mark(d);
        }
        for &d in &snap.global {
            if snap.devices[d].scope.matches(node) {
                mark(d);
            }
        }
    }
    (reachable, count)
}

/// Explains a failure: per request, how the reachable devices its class selects fare on
/// their own; when each request fits alone, whether a constraint is what cannot be met.
fn diagnose(
    snap: &Snapshot,
    cache: &mut snapshot::SelectorCache,
    specs: &[ClaimSpec],
    candidates: &[Node],
    ids: &snapshot::CandidateIds,
) -> Unsatisfiable {
    let (reachable, reachable_count) = reachable(snap, candidates, ids);
    let notes: Vec<String> = snap
        .pools
        .iter()
        .filter(|p| {
            p.unusable.is_some()
                && p.scopes
                    .iter()
                    .any(|s| candidates.iter().any(|n| s.matches(n)))
        })
        .filter_map(|p| p.unusable.clone())
        .collect();
    let mut failures = Vec::new();
    for claim in specs {
        let mut fallback = None;
        let mut failure = None;
        let mut fitting: Vec<Option<Vec<usize>>> = Vec::with_capacity(claim.requests.len());
        for alts in &claim.requests {
            let Some(req) = alts.last() else {
                fitting.push(None);
                continue;
            };
            let (counts, fits, share_error) =
                match tally(snap, cache, req, &reachable, reachable_count) {
                    Ok(t) => t,
                    Err(kind) => {
                        failure = Some((req, kind, DeviceCounts::default()));
                        break;
                    }
                };
            if let Some(m) = share_error.filter(|_| counts.fit == 0) {
                failure = Some((req, FailureKind::Invalid(m), counts));
                break;
            }
            let needed = if req.all {
                1
            } else {
                u32::try_from(req.count).unwrap_or(u32::MAX)
            };
            if counts.fit < needed {
                failure = Some((
                    req,
                    FailureKind::NoDevice {
                        wanted: wanted(req),
                        needed,
                    },
                    counts,
                ));
                break;
            }
            if fallback.is_none() {
                fallback = Some((req, counts));
            }
            fitting.push(Some(fits));
        }
        let (request, kind, counts) = match (failure, fallback) {
            (Some((req, kind, counts)), _) => (Some(req.base.clone()), kind, counts),
            (None, Some((req, counts))) => {
                let kind = match unmeetable_constraint(snap, claim, &fitting, candidates, ids) {
                    Some((attribute, distinct, needed, best)) => FailureKind::Constraint {
                        attribute,
                        distinct,
                        needed,
                        best,
                    },
                    None => FailureKind::NotTogether,
                };
                (Some(req.base.clone()), kind, counts)
            }
            (None, None) => (None, FailureKind::NotTogether, DeviceCounts::default()),
        };
        failures.push(ClaimFailure {
            claim: claim.name.clone(),
            request,
            kind,
            counts,
            notes: notes.clone(),
        });
    }
    if failures.iter().any(|f| f.kind != FailureKind::NotTogether) {
        failures.retain(|f| f.kind != FailureKind::NotTogether);
    }
    Unsatisfiable { failures }
}

#[cfg(test)]
mod tests;
