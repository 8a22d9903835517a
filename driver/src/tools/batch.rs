//! Allocating a batch of claims offline, in input order, the way `tessera allocate` does.
//!
//! Claims that already carry `status.allocation` count as used. Pending claims are allocated
//! one after another in input order; the claims of one pod (named by the pod's
//! `spec.resourceClaims[].resourceClaimName`) are allocated together, all on one node or not at
//! all, at the position of the pod's first pending claim. Each success is committed to the
//! snapshot before the next claim is tried, so later claims see earlier ones as used.
//!
//! Placement policies see what the cluster view offers them in a controller: each Node's
//! `status.allocatable` CPU and memory less what the pods bound to it (`spec.nodeName`), the
//! unbound pods whose allocated claims name it, and the pods placed earlier in the batch
//! request ([`crate::placement::nodefit::node_usage`], the controller's rule), and the task shapes of the
//! pods seen so far, each learned as its turn comes (never a pod still to come). Each pod is
//! placed by [`Allocator::place_pod`], as in the controller and the trace replay.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::resource::v1 as res;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Serialize;

use crate::error::Result;
use crate::names;
use crate::placement::allocator::{Allocator, AllocatorOptions, Learn, Policy, Snapshot};
use crate::placement::nodefit::{self, Resources};

/// What happened to one pending claim.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimOutcome {
    /// The claim's namespace.
    pub namespace: String,
    /// The claim's name.
    pub name: String,
    /// Whether it was allocated.
    pub allocated: bool,
    /// The allocation, when allocated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allocation: Option<res::AllocationResult>,
    /// Why not, when not allocated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The node the claim's devices are on, when they are node-local.
    #[serde(skip)]
    pub node: Option<String>,
}

/// Everything the batch reads.
#[derive(Debug, Clone, Copy)]
pub struct BatchInput<'a> {
    /// DeviceClasses.
    pub classes: &'a [res::DeviceClass],
    /// ResourceSlices.
    pub slices: &'a [res::ResourceSlice],
    /// ResourceClaims, allocated and pending, in input order.
    pub claims: &'a [res::ResourceClaim],
    /// Nodes (optional: nodes named by slices are used when absent).
    pub nodes: &'a [core::Node],
    /// Pods, whose claims are allocated together.
    pub pods: &'a [core::Pod],
}

/// How the batch allocates.
#[derive(Debug, Clone)]
pub struct BatchOptions {
    /// The Tessera driver name (for shares).
    pub driver_name: String,
    /// The placement policy.
    pub policy: Policy,
    /// Restrict to devices available on this node.
    pub node: Option<String>,
}

fn key(meta: &ObjectMeta) -> (String, String) {
    (
        meta.namespace
            .clone()
            .unwrap_or_else(|| "default".to_owned()),
        meta.name.clone().unwrap_or_default(),
    )
}

/// A Node object with just a name and the hostname label, for nodes that only slices name.
pub fn bare_node(name: &str) -> core::Node {
    core::Node {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(BTreeMap::from([(
                names::LABEL_HOSTNAME.to_owned(),
                name.to_owned(),
            )])),
            ..ObjectMeta::default()
        },
        ..core::Node::default()
    }
}

/// The candidate nodes: the given Node objects, plus a bare node for every node a slice names
/// that has no Node object; sorted by name so results do not depend on file order.
pub(crate) fn candidate_nodes(input: &BatchInput<'_>, only: Option<&str>) -> Vec<core::Node> {
    let mut by_name: BTreeMap<String, core::Node> = BTreeMap::new();
    for node in input.nodes {
        if let Some(name) = &node.metadata.name {
            by_name.entry(name.clone()).or_insert_with(|| node.clone());
        }
    }
    for slice in input.slices {
        if let Some(name) = &slice.spec.node_name {
            by_name
                .entry(name.clone())
                .or_insert_with(|| bare_node(name));
        }
    }
    if let Some(only) = only {
        return vec![by_name.remove(only).unwrap_or_else(|| bare_node(only))];
    }
    by_name.into_values().collect()
}

/// Whether `pod` may run on `node`, as far as the offline view can tell: `spec.nodeName` and
/// `spec.nodeSelector`.
pub(crate) fn pod_fits_node(pod: &core::Pod, node: &core::Node) -> bool {
    let Some(spec) = &pod.spec else { return true };
    if let Some(name) = &spec.node_name
        && node.metadata.name.as_ref() != Some(name)
    {
        return false;
    }
    let labels = node.metadata.labels.clone().unwrap_or_default();
    spec.node_selector
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v))
}

/// Which pod (index into `input.pods`) owns each pending claim, by the pod's
/// `spec.resourceClaims[].resourceClaimName`; the first pod naming a claim wins.
fn pod_owners(
    input: &BatchInput<'_>,
    pending: &BTreeSet<(String, String)>,
) -> BTreeMap<(String, String), usize> {
    let mut owner = BTreeMap::new();
    for (i, pod) in input.pods.iter().enumerate() {
        let ns = pod
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".to_owned());
        let names = pod
            .spec
            .iter()
            .flat_map(|s| s.resource_claims.iter().flatten())
            .filter_map(|rc| rc.resource_claim_name.clone());
        for name in names {
            let k = (ns.clone(), name);
            if pending.contains(&k) {
                owner.entry(k).or_insert(i);
            }
        }
    }
    owner
}

/// The outcome of one claim of a group that was placed together (or not at all).
fn outcome(
    claim: &res::ResourceClaim,
    result: std::result::Result<(&str, res::AllocationResult), &str>,
) -> ClaimOutcome {
    let (namespace, name) = key(&claim.metadata);
    match result {
        Ok((node, allocation)) => ClaimOutcome {
            namespace,
            name,
            allocated: true,
            allocation: Some(allocation),
            reason: None,
            node: Some(node.to_owned()),
        },
        Err(reason) => ClaimOutcome {
            namespace,
            name,
            allocated: false,
            allocation: None,
            reason: Some(reason.to_owned()),
            node: None,
        },
    }
}

/// Allocates every pending claim of `input`, returning one outcome per pending claim in input
/// order.
pub fn allocate_batch(input: &BatchInput<'_>, options: &BatchOptions) -> Result<Vec<ClaimOutcome>> {
    let (allocated, pending): (Vec<&res::ResourceClaim>, Vec<&res::ResourceClaim>) = input
        .claims
        .iter()
        .partition(|c| c.status.as_ref().is_some_and(|s| s.allocation.is_some()));
    let allocated: Vec<res::ResourceClaim> = allocated.into_iter().cloned().collect();
    let mut snapshot = Snapshot::for_driver(
        &options.driver_name,
        input.slices,
        input.classes,
        &allocated,
    )?;
    let by_key: BTreeMap<(String, String), &res::AllocationResult> = allocated
        .iter()
        .filter_map(|c| Some((key(&c.metadata), c.status.as_ref()?.allocation.as_ref()?)))
        .collect();
    let usage = nodefit::node_usage(
        input.pods,
        |namespace, name| {
            by_key
                .get(&(namespace.to_owned(), name.to_owned()))
                .copied()
        },
        |pod| nodefit::pod_requests(pod).ok(),
    );
    snapshot.track_hosts(input.nodes, &usage);
    let allocator = Allocator::new(AllocatorOptions {
        driver_name: options.driver_name.clone(),
        policy: options.policy,
        ..AllocatorOptions::default()
    });
    let nodes = candidate_nodes(input, options.node.as_deref());
    let owner = pod_owners(input, &pending.iter().map(|c| key(&c.metadata)).collect());

    let mut outcomes: BTreeMap<(String, String), ClaimOutcome> = BTreeMap::new();
    for claim in &pending {
        let k = key(&claim.metadata);
        if outcomes.contains_key(&k) {
            continue;
        }
        let pod = owner.get(&k).copied();
        let group: Vec<&res::ResourceClaim> = match pod {
            Some(p) => pending
                .iter()
                .copied()
                .filter(|c| owner.get(&key(&c.metadata)) == Some(&p))
                .collect(),
            None => vec![*claim],
        };
        let pod = pod.and_then(|p| input.pods.get(p));
        let candidates: Vec<core::Node> = nodes
            .iter()
            .filter(|n| pod.is_none_or(|p| pod_fits_node(p, n)))
            .cloned()
            .collect();
        let host = match pod.map(nodefit::pod_requests).transpose() {
            Ok(r) => r.and_then(Resources::host).unwrap_or_default(),
            Err(e) => {
                let reason = e.to_string();
                for c in &group {
                    outcomes.insert(key(&c.metadata), outcome(c, Err(&reason)));
                }
                continue;
            }
        };
        let placed =
            allocator.place_pod(&mut snapshot, &group, &candidates, &host, Learn::FromClaims);
        match placed.result {
            Ok(placement) => {
                for (c, result) in group.iter().zip(placement.allocations) {
                    outcomes.insert(key(&c.metadata), outcome(c, Ok((&placement.node, result))));
                }
            }
            Err(unsatisfiable) => {
                let reason = unsatisfiable.to_string();
                for c in &group {
                    outcomes.insert(key(&c.metadata), outcome(c, Err(&reason)));
                }
            }
        }
    }
    Ok(pending
        .iter()
        .filter_map(|c| outcomes.remove(&key(&c.metadata)))
        .collect())
}
