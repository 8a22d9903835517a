//! Defragmentation plans, on snapshots built from the shipped DeviceClasses and rendered slices.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::resource::v1 as res;
use proptest::prelude::*;
use serde_json::json;

use super::*;
use crate::node::slices::{self, RenderOptions};
use crate::placement::allocator::{AllocatorOptions, Policy};
use crate::testing::{self, k8s_node as node};

const SHARED: &str = "shared.gpu.tessera.dev";
const BATCH: &str = "batch.gpu.tessera.dev";

/// Nodes each with some A100s (80Gi) in shared mode.
struct Cluster {
    snapshot: Snapshot,
    allocator: Allocator,
    claims: BTreeMap<String, res::ResourceClaim>,
    pods: Vec<Pod>,
    nodes: Vec<Node>,
}

impl Cluster {
    fn new(gpus: usize, nodes: &[&str]) -> Self {
        let sized: Vec<(&str, usize)> = nodes.iter().map(|n| (*n, gpus)).collect();
        Self::sized(&sized)
    }

    fn sized(nodes: &[(&str, usize)]) -> Self {
        let mut yaml = String::new();
        for (n, gpus) in nodes {
            let _ = write!(
                yaml,
                "- name: {n}\n  mode: shared\n  gpus:\n  - model: a100-80g\n    count: {gpus}\n"
            );
        }
        let inventory = testing::inventory(&format!("nodes:\n{yaml}"));
        let slices: Vec<_> = inventory
            .nodes
            .iter()
            .flat_map(|n| slices::render(n, &RenderOptions::default()).unwrap())
            .collect();
        let classes: Vec<res::DeviceClass> =
            [testing::SHARED_CLASS_YAML, testing::BATCH_CLASS_YAML]
                .into_iter()
                .map(testing::class_from_yaml)
                .collect();
        Self {
            snapshot: Snapshot::new(&slices, &classes, &[]).unwrap(),
            allocator: Allocator::new(AllocatorOptions {
                policy: Policy::FirstFit,
                ..AllocatorOptions::default()
            }),
            claims: BTreeMap::new(),
            pods: Vec::new(),
            nodes: nodes.iter().map(|(n, _)| node(n)).collect(),
        }
    }

    fn pod(name: &str, owner: Option<&str>) -> Pod {
        let owners = owner.map_or_else(Vec::new, |kind| {
            vec![json!({"apiVersion": "apps/v1", "kind": kind, "name": "owner", "uid": "o", "controller": true})]
        });
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "default", "uid": format!("pod-{name}"),
                         "labels": {"app": name}, "ownerReferences": owners},
            "spec": {"containers": [{"name": "c"}],
                     "resourceClaims": [{"name": "gpu", "resourceClaimName": name}]},
        }))
        .unwrap()
    }

    /// Places a pod `name` owned by a `ReplicaSet` with one share of `memory` GiB on `on`.
    fn run(&mut self, name: &str, class: &str, memory: u32, on: &str) {
        self.run_owned(name, class, memory, on, Some("ReplicaSet"));
    }

    fn run_owned(&mut self, name: &str, class: &str, memory: u32, on: &str, owner: Option<&str>) {
        let mut claim = testing::gpu_claim(
            name,
            class,
            Some(testing::gpu_share(&format!("{memory}Gi"))),
        );
        let placement = self
            .allocator
            .allocate(&self.snapshot, &[&claim], &[node(on)])
            .unwrap_or_else(|u| panic!("{name} does not fit on {on}: {u}"));
        let allocation = placement.allocations[0].clone();
        self.snapshot.commit(&claim, &allocation);
        claim.status = Some(res::ResourceClaimStatus {
            allocation: Some(allocation),
            ..res::ResourceClaimStatus::default()
        });
        self.claims.insert(format!("default/{name}"), claim);
        self.pods.push(Self::pod(name, owner));
    }

    fn movable(&self, pdbs: &[PodDisruptionBudget]) -> Vec<Evictable> {
        movable(testing::DRIVER, &self.pods, &self.claims, pdbs)
    }

    fn plan_for(&mut self, memory: u32, budget: usize) -> Option<DefragPlan> {
        let claim = testing::gpu_claim(
            "big",
            SHARED,
            Some(testing::gpu_share(&format!("{memory}Gi"))),
        );
        let movable = self.movable(&[]);
        plan(
            &self.allocator,
            &mut self.snapshot,
            &[&claim],
            &HostResources::default(),
            &self.nodes,
            &movable,
            budget,
        )
    }

    fn fits(&self, memory: u32) -> bool {
        let claim = testing::gpu_claim(
            "big",
            SHARED,
            Some(testing::gpu_share(&format!("{memory}Gi"))),
        );
        self.allocator
            .allocate(&self.snapshot, &[&claim], &self.nodes)
            .is_ok()
    }
}

fn pdb(app: &str, allowed: i32) -> PodDisruptionBudget {
    serde_json::from_value(json!({
        "metadata": {"name": format!("pdb-{app}"), "namespace": "default"},
        "spec": {"selector": {"matchLabels": {"app": app}}, "maxUnavailable": 0},
        "status": {"disruptionsAllowed": allowed, "currentHealthy": 1, "desiredHealthy": 1, "expectedPods": 1},
    }))
    .unwrap()
}

/// Nodes `a` and `b` of two GPUs, each GPU holding a 50Gi batch share, and node `c` of one
/// GPU holding 30Gi: a 60Gi share fits nowhere.
fn half_full() -> Cluster {
    let mut c = Cluster::sized(&[("a", 2), ("b", 2), ("c", 1)]);
    for (name, on) in [("a0", "a"), ("a1", "a"), ("b0", "b"), ("b1", "b")] {
        c.run(name, BATCH, 50, on);
    }
    c.run("c0", SHARED, 30, "c");
    c
}

#[test]
fn one_batch_pod_moves_and_the_pending_share_gets_its_gpu() {
    let mut c = half_full();
    assert!(!c.fits(60));
    let plan = c.plan_for(60, 4).expect("a plan");
    assert_eq!(plan.node, "a");
    assert_eq!(plan.placement.node, "a");
    assert_eq!(plan.moves.len(), 1, "{plan:?}");
    let m = &plan.moves[0];
    assert_eq!((m.from.as_str(), m.to.as_str()), ("a", "c"));
    assert!(
        m.reason.contains("fits on c")
            && m.reason.contains("50.0Gi")
            && m.reason.contains("default/big fits on a"),
        "{}",
        m.reason
    );
    assert!(!c.fits(60), "planning leaves the snapshot as it was");
}

#[test]
fn online_pods_never_move() {
    let mut c = Cluster::new(2, &["a", "b"]);
    for (name, on) in [("a0", "a"), ("a1", "a"), ("b0", "b"), ("b1", "b")] {
        c.run(name, SHARED, 40, on);
    }
    assert!(c.movable(&[]).is_empty());
    assert_eq!(c.plan_for(60, 4), None);
}

#[test]
fn no_budget_means_no_plan_and_a_plan_never_exceeds_it() {
    let mut c = half_full();
    assert_eq!(
        c.plan_for(60, 0),
        None,
        "defragmentation is off with no budget"
    );
    // Room on a full GPU may take two moves: a budget of one is then too small.
    let mut two = Cluster::new(1, &["a", "b", "c"]);
    two.run("a0", BATCH, 40, "a");
    two.run("a1", BATCH, 40, "a");
    two.run("b0", SHARED, 40, "b");
    two.run("c0", SHARED, 40, "c");
    assert!(!two.fits(50));
    assert_eq!(two.plan_for(50, 1), None);
    let plan = two.plan_for(50, 2).expect("two moves make room on a");
    assert_eq!(plan.moves.len(), 2);
}

#[test]
fn bare_pods_daemonset_pods_and_pdb_blocked_pods_are_not_movable() {
    let mut c = Cluster::new(2, &["a"]);
    c.run_owned("bare", BATCH, 10, "a", None);
    c.run_owned("daemon", BATCH, 10, "a", Some("DaemonSet"));
    c.run("guarded", BATCH, 10, "a");
    c.run("free", BATCH, 10, "a");
    let names = |m: Vec<Evictable>| m.into_iter().map(|e| e.pod).collect::<Vec<_>>();
    assert_eq!(names(c.movable(&[pdb("guarded", 0)])), ["default/free"]);
    assert_eq!(
        names(c.movable(&[pdb("guarded", 1)])),
        ["default/guarded", "default/free"],
        "a PDB that allows a disruption does not block"
    );
}

#[test]
fn no_plan_when_the_moved_pod_fits_nowhere_else() {
    let mut c = Cluster::new(2, &["a", "b"]);
    c.run("a0", BATCH, 40, "a");
    c.run("a1", BATCH, 40, "a");
    c.run("b0", SHARED, 70, "b");
    c.run("b1", SHARED, 70, "b");
    assert_eq!(c.plan_for(60, 4), None);
}

#[test]
fn the_budget_counts_evictions_of_the_last_hour() {
    let now: Timestamp = "2026-11-28T12:00:00Z".parse().unwrap();
    let t = |s: &str| -> Timestamp { s.parse().unwrap() };
    let done = [
        t("2026-11-28T10:59:00Z"),
        t("2026-11-28T11:30:00Z"),
        t("2026-11-28T11:59:59Z"),
    ];
    assert_eq!(budget_left(0, &done, now), 0);
    assert_eq!(budget_left(3, &done, now), 1);
    assert_eq!(budget_left(1, &done, now), 0);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Whatever the cluster, a plan stays within its budget, moves only movable pods, is
    /// minimal (without any one of its moves the claim does not fit), and once carried out
    /// (moved pods released and placed where it says) the pending claim fits where it says.
    #[test]
    fn a_plan_is_within_budget_minimal_and_makes_the_room_it_promises(
        shares in proptest::collection::vec((0usize..3, 0usize..2, 10u32..50, any::<bool>()), 1..10),
        ask in 30u32..80,
        budget in 0usize..4,
    ) {
        let mut c = Cluster::new(2, &["a", "b", "c"]);
        for (i, (n, _gpu, memory, batch)) in shares.iter().enumerate() {
            let on = ["a", "b", "c"][*n];
            let name = format!("p{i}");
            let class = if *batch { BATCH } else { SHARED };
            let claim = testing::gpu_claim(&name, class, Some(testing::gpu_share(&format!("{memory}Gi"))));
            if c.allocator.allocate(&c.snapshot, &[&claim], &[node(on)]).is_ok() {
                c.run(&name, class, *memory, on);
            }
        }
        let fits_before = c.fits(ask);
        let movable = c.movable(&[]);
        let Some(plan) = c.plan_for(ask, budget) else {
            prop_assert_eq!(c.fits(ask), fits_before);
            return Ok(());
        };
        prop_assert!(!fits_before, "a pod that fits needs no plan");
        prop_assert!(plan.moves.len() <= budget);
        prop_assert!(plan.moves.iter().all(|m| movable.iter().any(|e| e.pod == m.pod && e.node == plan.node)));
        prop_assert!(plan.moves.iter().all(|m| m.to != plan.node));
        let claim = testing::gpu_claim("big", SHARED, Some(testing::gpu_share(&format!("{ask}Gi"))));
        let on = [node(&plan.node)];
        for skip in 0..plan.moves.len() {
            for (i, m) in plan.moves.iter().enumerate() {
                if i != skip {
                    c.snapshot.release(&claim_key(&c.claims[&m.pod]));
                }
            }
            prop_assert!(c.allocator.allocate(&c.snapshot, &[&claim], &on).is_err(), "move {} is needed", skip);
            for (i, m) in plan.moves.iter().enumerate() {
                if i != skip {
                    let key = m.pod.clone();
                    let original = c.claims[&key].clone();
                    c.snapshot.commit(&original, original.status.as_ref().unwrap().allocation.as_ref().unwrap());
                }
            }
        }
        for m in &plan.moves {
            c.snapshot.release(&claim_key(&c.claims[&m.pod]));
        }
        prop_assert!(c.allocator.allocate(&c.snapshot, &[&claim], &on).is_ok());
    }
}
