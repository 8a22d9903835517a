//! `tessera defrag`: the defragmentation plans of a cluster snapshot, offline.
//!
//! The input is what `tessera allocate` reads: DeviceClasses, ResourceSlices, ResourceClaims
//! (allocated ones in use), Nodes and Pods. Each pending pod (its pending claims, as
//! [`crate::tools::batch`] groups them) is tried in input order: one that fits as the cluster is
//! is placed (no plan needed); one that does not gets [`crate::placement::defrag::plan`]'s
//! plan, the same one the controller would make, within what is left of the budget. A plan is
//! carried out in the snapshot (the moved pods' claims placed where the plan says, the pending
//! pod where room was made), so later pods see the cluster as it would then be.
//!
//! A snapshot holds no `PodDisruptionBudgets`: offline, every movable pod counts as allowed to
//! move (live, the controller reads the budgets, and the Eviction API enforces them).

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::resource::v1 as res;
use serde::Serialize;

use crate::error::Result;
use crate::placement::allocator::{Allocator, AllocatorOptions, Policy, Snapshot, claim_key};
use crate::placement::defrag::{self, Move};
use crate::placement::fragmentation::HostResources;
use crate::placement::nodefit;
use crate::tools::batch::{BatchInput, candidate_nodes, pod_fits_node};

/// What happened to one pending pod (or lone pending claim).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DefragOutcome {
    /// `namespace/name` of the pod, or of the claim when no pod names it.
    pub pending: String,
    /// Its pending claims, `namespace/name`.
    pub claims: Vec<String>,
    /// The node it goes to, when it fits (as it is, or after the moves).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// The moves that make room for it (empty when it fits as it is).
    pub moves: Vec<Move>,
    /// Why it has no place, when it has none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

fn key(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> String {
    format!(
        "{}/{}",
        meta.namespace.as_deref().unwrap_or("default"),
        meta.name.as_deref().unwrap_or_default()
    )
}

/// The plans for every pending pod of `input`, moving at most `budget` pods in all.
#[allow(clippy::too_many_lines)] // Reason: the batch's grouping, then try, plan and carry out, in one loop.
pub fn defrag_batch(
    input: &BatchInput<'_>,
    driver: &str,
    policy: Policy,
    budget: usize,
) -> Result<Vec<DefragOutcome>> {
    let (allocated, pending): (Vec<&res::ResourceClaim>, Vec<&res::ResourceClaim>) = input
        .claims
        .iter()
        .partition(|c| c.status.as_ref().is_some_and(|s| s.allocation.is_some()));
    let mut claims: BTreeMap<String, res::ResourceClaim> = allocated
        .iter()
        .map(|c| (key(&c.metadata), (*c).clone()))
        .collect();
    let allocated: Vec<res::ResourceClaim> = allocated.into_iter().cloned().collect();
    let mut snapshot = Snapshot::for_driver(driver, input.slices, input.classes, &allocated)?;
    let allocator = Allocator::new(AllocatorOptions {
        driver_name: driver.to_owned(),
        policy,
        ..AllocatorOptions::default()
    })
    .without_explanations();
    let nodes = candidate_nodes(input, None);
    let pending_keys: BTreeSet<String> = pending.iter().map(|c| key(&c.metadata)).collect();
    // Each pending claim's pod (the first naming it), as the batch groups them.
    let mut owner: BTreeMap<String, usize> = BTreeMap::new();
    for (i, pod) in input.pods.iter().enumerate() {
        let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
        for rc in pod
            .spec
            .iter()
            .flat_map(|s| s.resource_claims.iter().flatten())
        {
            if let Some(name) = &rc.resource_claim_name {
                let k = format!("{ns}/{name}");
                if pending_keys.contains(&k) {
                    owner.entry(k).or_insert(i);
                }
            }
        }
    }
    let mut pods: Vec<core::Pod> = input.pods.to_vec();
    let mut left = budget;
    let mut done: BTreeSet<String> = BTreeSet::new();
    let mut outcomes = Vec::new();
    for claim in &pending {
        let k = key(&claim.metadata);
        if done.contains(&k) {
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
        done.extend(group.iter().map(|c| key(&c.metadata)));
        let pod_ref = pod.and_then(|p| input.pods.get(p));
        let candidates: Vec<core::Node> = nodes
            .iter()
            .filter(|n| pod_ref.is_none_or(|p| pod_fits_node(p, n)))
            .cloned()
            .collect();
        let host = pod_ref
            .and_then(|p| nodefit::pod_requests(p).ok())
            .and_then(nodefit::Resources::host)
            .unwrap_or_default();
        let mut out = DefragOutcome {
            pending: pod_ref.map_or_else(|| k.clone(), |p| key(&p.metadata)),
            claims: group.iter().map(|c| key(&c.metadata)).collect(),
            node: None,
            moves: Vec::new(),
            reason: None,
        };
        if let Ok(placement) = allocator.allocate_pod(&snapshot, &group, &candidates, &host) {
            commit(&mut snapshot, &mut claims, &group, &placement.allocations);
            out.node = Some(placement.node);
            outcomes.push(out);
            continue;
        }
        let movable = defrag::movable(driver, &pods, &claims, &[]);
        match defrag::plan(
            &allocator,
            &mut snapshot,
            &group,
            &host,
            &candidates,
            &movable,
            left,
        ) {
            Some(plan) => {
                left -= plan.moves.len();
                carry_out(
                    &allocator,
                    &mut snapshot,
                    &mut claims,
                    &mut pods,
                    &movable,
                    &plan,
                    &nodes,
                );
                commit(
                    &mut snapshot,
                    &mut claims,
                    &group,
                    &plan.placement.allocations,
                );
                out.node = Some(plan.node.clone());
                out.moves = plan.moves;
            }
            None => {
                out.reason = Some(if left == 0 {
                    "it fits on no node, and the eviction budget is spent (or zero)".to_owned()
                } else {
                    format!(
                        "it fits on no node, and moving at most {left} movable pod(s) (batch, \
                         owned by a controller) to other nodes makes no room for it"
                    )
                });
            }
        }
        outcomes.push(out);
    }
    Ok(outcomes)
}

/// Commits `group`'s `allocations` to the snapshot and records the claims as allocated.
fn commit(
    snapshot: &mut Snapshot,
    claims: &mut BTreeMap<String, res::ResourceClaim>,
    group: &[&res::ResourceClaim],
    allocations: &[res::AllocationResult],
) {
    for (c, a) in group.iter().zip(allocations) {
        snapshot.commit(c, a);
        let mut placed = (*c).clone();
        placed
            .status
            .get_or_insert_with(Default::default)
            .allocation = Some(a.clone());
        claims.insert(key(&c.metadata), placed);
    }
}

/// Moves the plan's pods in the snapshot: their claims are released and placed again on the
/// node the plan says (the same search the plan made), and the pods are renamed out of the way
/// so they are not moved twice.
fn carry_out(
    allocator: &Allocator,
    snapshot: &mut Snapshot,
    claims: &mut BTreeMap<String, res::ResourceClaim>,
    pods: &mut [core::Pod],
    movable: &[defrag::Evictable],
    plan: &defrag::DefragPlan,
    nodes: &[core::Node],
) {
    for m in &plan.moves {
        let Some(e) = movable.iter().find(|e| e.pod == m.pod) else {
            continue;
        };
        for c in &e.claims {
            snapshot.release(&claim_key(c));
        }
        let refs: Vec<&res::ResourceClaim> = e.claims.iter().collect();
        let to: Vec<core::Node> = nodes
            .iter()
            .filter(|n| n.metadata.name.as_deref() == Some(m.to.as_str()))
            .cloned()
            .collect();
        if let Ok(p) = allocator.allocate_pod(snapshot, &refs, &to, &HostResources::default()) {
            commit(snapshot, claims, &refs, &p.allocations);
        }
        // A moved pod is a new pod on its new node: not movable again in this run.
        if let Some(pod) = pods.iter_mut().find(|p| key(&p.metadata) == m.pod) {
            pod.metadata.owner_references = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::Pod;
    use serde_json::json;

    use super::*;
    use crate::node::slices::{self, RenderOptions};
    use crate::testing;

    fn pod(name: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "default", "uid": format!("pod-{name}"),
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                              "name": "rs", "uid": "rs", "controller": true}]},
            "spec": {"containers": [{"name": "c"}],
                     "resourceClaims": [{"name": "gpu", "resourceClaimName": name}]},
        }))
        .unwrap()
    }

    /// Nodes `a` (two GPUs, each with a 50Gi batch share) and `c` (one GPU with 30Gi online),
    /// and a pending 60Gi share.
    fn snapshot() -> (
        Vec<res::ResourceSlice>,
        Vec<res::DeviceClass>,
        Vec<res::ResourceClaim>,
        Vec<Pod>,
    ) {
        let inventory = testing::inventory(
            "nodes:\n- name: a\n  mode: shared\n  gpus:\n  - model: a100-80g\n    count: 2\n\
             - name: c\n  mode: shared\n  gpus:\n  - model: a100-80g\n    count: 1\n",
        );
        let slices: Vec<res::ResourceSlice> = inventory
            .nodes
            .iter()
            .flat_map(|n| slices::render(n, &RenderOptions::default()).unwrap())
            .collect();
        let classes: Vec<res::DeviceClass> =
            [testing::SHARED_CLASS_YAML, testing::BATCH_CLASS_YAML]
                .into_iter()
                .map(testing::class_from_yaml)
                .collect();
        let mut snapshot = Snapshot::new(&slices, &classes, &[]).unwrap();
        let allocator = Allocator::new(AllocatorOptions::default());
        let mut claims = Vec::new();
        let mut pods = Vec::new();
        for (name, class, gib, on) in [
            ("a0", "batch.gpu.tessera.dev", 50, "a"),
            ("a1", "batch.gpu.tessera.dev", 50, "a"),
            ("c0", "shared.gpu.tessera.dev", 30, "c"),
        ] {
            let mut claim =
                testing::gpu_claim(name, class, Some(testing::gpu_share(&format!("{gib}Gi"))));
            let placed = allocator
                .allocate(&snapshot, &[&claim], &[testing::k8s_node(on)])
                .unwrap();
            snapshot.commit(&claim, &placed.allocations[0]);
            claim.status = Some(res::ResourceClaimStatus {
                allocation: Some(placed.allocations[0].clone()),
                ..Default::default()
            });
            claims.push(claim);
            pods.push(pod(name));
        }
        claims.push(testing::gpu_claim(
            "big",
            "shared.gpu.tessera.dev",
            Some(testing::gpu_share("60Gi")),
        ));
        pods.push(pod("big"));
        (slices, classes, claims, pods)
    }

    #[test]
    fn a_pending_pod_gets_a_plan_with_the_reason_for_every_move_within_the_budget() {
        let (slices, classes, claims, pods) = snapshot();
        let input = BatchInput {
            classes: &classes,
            slices: &slices,
            claims: &claims,
            nodes: &[],
            pods: &pods,
        };
        let plans = defrag_batch(&input, testing::DRIVER, Policy::FirstFit, 4).unwrap();
        assert_eq!(plans.len(), 1);
        let plan = &plans[0];
        assert_eq!(plan.pending, "default/big");
        assert_eq!(plan.node.as_deref(), Some("a"));
        assert_eq!(plan.moves.len(), 1);
        assert_eq!(
            (plan.moves[0].from.as_str(), plan.moves[0].to.as_str()),
            ("a", "c")
        );
        assert!(
            plan.moves[0].reason.contains("default/big fits on a"),
            "{}",
            plan.moves[0].reason
        );

        let none = defrag_batch(&input, testing::DRIVER, Policy::FirstFit, 0).unwrap();
        assert_eq!(none[0].node, None);
        assert!(none[0].reason.as_deref().unwrap().contains("budget"));
    }
}
