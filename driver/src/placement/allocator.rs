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
//!
//! The files: the public API here; [`nodes`] the node loop (pre-filter, policy order, search);
//! [`result`] building a claim's allocation; [`diagnose`] explaining a pod that fits nowhere;
//! [`ask`] what a pod asks as policies see it; [`reach`] which devices a node or class reaches.

mod abort;
mod ask;
mod booking;
mod capacity;
mod delay;
mod diagnose;
mod nodes;
mod place;
mod policy;
pub mod preempt;
mod reach;
mod reason;
mod request;
mod result;
mod search;
mod snapshot;
mod usage;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1 as res;

pub use place::{Learn, PodPlacement};
pub use policy::{DeviceView, NodeView, PlacementPolicy, PodAsk, Policy, ScoreInput};
pub use reason::{ClaimFailure, DeviceCounts, FailureKind, Unsatisfiable, Wanted};
pub use snapshot::{Snapshot, claim_key, claim_name};
pub use usage::DeviceUsage;

use crate::names;
use crate::placement::fragmentation::{HostResources, TaskShape};
use request::{ClaimSpec, SpecError};

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
        let ask = ask::pod_ask(&specs, host);
        let models = (ask.cards > 0)
            .then(|| ask::accepted_models(snapshot, &mut cache, &specs))
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
                    return Err(Unsatisfiable::single(
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
}

#[cfg(test)]
mod tests;
