//! Victim choice, on snapshots built from the shipped DeviceClasses and rendered slices.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1 as res;
use serde_json::json;

use super::*;
use crate::node::slices::{self, RenderOptions};
use crate::placement::allocator::{AllocatorOptions, Policy};
use crate::testing::{self, k8s_node as node};

const SHARED: &str = "shared.gpu.tessera.dev";
const BATCH: &str = "batch.gpu.tessera.dev";
const WHOLE: &str = "gpu.tessera.dev";

/// A cluster of nodes `a` and `b`, each with `gpus` A100s (80Gi) in shared mode, plus node
/// `x` with one exclusive GPU; its claims and pods as they are placed.
struct Cluster {
    snapshot: Snapshot,
    allocator: Allocator,
    claims: BTreeMap<String, res::ResourceClaim>,
    pods: Vec<Pod>,
}

impl Cluster {
    fn new(gpus: usize) -> Self {
        let inventory = testing::inventory(&format!(
            "nodes:\n- name: a\n  mode: shared\n  gpus:\n  - model: a100-80g\n    count: {gpus}\n\
             - name: b\n  mode: shared\n  gpus:\n  - model: a100-80g\n    count: {gpus}\n\
             - name: x\n  mode: exclusive\n  gpus:\n  - model: a100-80g\n    count: 1\n"
        ));
        let slices: Vec<_> = inventory
            .nodes
            .iter()
            .flat_map(|n| slices::render(n, &RenderOptions::default()).unwrap())
            .collect();
        let classes: Vec<res::DeviceClass> = [
            testing::SHARED_CLASS_YAML,
            testing::BATCH_CLASS_YAML,
            testing::WHOLE_CLASS_YAML,
        ]
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
        }
    }

    /// A claim of `class` for `memory` GiB (a share) or a whole GPU (`memory` 0).
    fn claim(name: &str, class: &str, memory: u32) -> res::ResourceClaim {
        testing::gpu_claim(
            name,
            class,
            (memory > 0).then(|| testing::gpu_share(&format!("{memory}Gi"))),
        )
    }

    fn pod(name: &str, priority: i32) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "default", "uid": format!("pod-{name}")},
            "spec": {"priority": priority, "containers": [{"name": "c"}],
                     "resourceClaims": [{"name": "gpu", "resourceClaimName": name}]},
        }))
        .unwrap()
    }

    /// Places a pod named `name` with one claim on `on`.
    fn run(&mut self, name: &str, class: &str, memory: u32, priority: i32, on: &str) {
        let mut claim = Self::claim(name, class, memory);
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
        self.pods.push(Self::pod(name, priority));
    }

    fn evictable(&self) -> Vec<Evictable> {
        evictable("gpu.tessera.dev", &self.pods, &self.claims)
    }

    fn victims(&mut self, class: &str, memory: u32) -> Option<Victims> {
        let claim = Self::claim("new", class, memory);
        let evictable = self.evictable();
        let nodes = [node("a"), node("b"), node("x")];
        self.allocator.choose_victims(
            &mut self.snapshot,
            &[&claim],
            &nodes,
            &HostResources::default(),
            &evictable,
        )
    }
}

fn names(e: &[Evictable]) -> Vec<&str> {
    e.iter().map(|e| e.pod.as_str()).collect()
}

#[test]
fn only_pods_holding_nothing_but_batch_shares_are_evictable() {
    let mut c = Cluster::new(1);
    c.run("batch", BATCH, 10, 0, "a");
    c.run("online", SHARED, 10, 0, "a");
    c.run("whole", WHOLE, 0, 0, "x");
    let mut gated = Cluster::pod("gated", 0);
    gated.spec.as_mut().unwrap().scheduling_gates =
        Some(vec![k8s_openapi::api::core::v1::PodSchedulingGate {
            name: crate::names::SCHEDULING_GATE.to_owned(),
        }]);
    c.run("leaving", BATCH, 10, 0, "a");
    c.pods.last_mut().unwrap().metadata.deletion_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            "2026-01-01T00:00:00Z".parse().unwrap(),
        ));
    c.pods.push(gated);
    let found = c.evictable();
    assert_eq!(names(&found), ["default/batch"]);
    assert_eq!(found[0].node, "a");
    assert_eq!(found[0].memory_bytes, 10 << 30);
    // A claim two pods use goes with neither of them.
    let mut twin = Cluster::pod("twin", 0);
    twin.metadata.uid = Some("pod-twin".into());
    twin.spec
        .as_mut()
        .unwrap()
        .resource_claims
        .as_mut()
        .unwrap()[0]
        .resource_claim_name = Some("batch".into());
    c.pods.push(twin);
    assert!(c.evictable().is_empty());
}

#[test]
fn the_fewest_victims_are_chosen() {
    let mut c = Cluster::new(1);
    c.run("small-1", BATCH, 20, 0, "a");
    c.run("small-2", BATCH, 20, 0, "a");
    c.run("large", BATCH, 40, 0, "a");
    c.run("full-b", SHARED, 80, 0, "b");
    let v = c.victims(SHARED, 40).unwrap();
    assert_eq!(v.node, "a");
    assert_eq!(v.pods, ["default/large"]);
}

#[test]
fn lower_priority_victims_go_before_higher_ones() {
    let mut c = Cluster::new(1);
    c.run("high", BATCH, 40, 100, "a");
    c.run("low", BATCH, 40, 1, "a");
    c.run("full-b", SHARED, 80, 0, "b");
    assert_eq!(c.victims(SHARED, 40).unwrap().pods, ["default/low"]);
}

#[test]
fn victims_the_pod_fits_without_are_spared() {
    let mut c = Cluster::new(1);
    c.run("tiny", BATCH, 10, 0, "a");
    c.run("mid", BATCH, 40, 5, "a");
    c.run("online", SHARED, 30, 0, "a");
    c.run("full-b", SHARED, 80, 0, "b");
    // Lowest priority first takes tiny, then mid; tiny alone frees too little and mid alone
    // is enough, so tiny stays.
    assert_eq!(c.victims(SHARED, 40).unwrap().pods, ["default/mid"]);
}

#[test]
fn the_node_with_the_fewest_victims_wins() {
    let mut c = Cluster::new(1);
    c.run("a-1", BATCH, 40, 0, "a");
    c.run("a-2", BATCH, 40, 0, "a");
    c.run("b-1", BATCH, 60, 3, "b");
    c.run("b-2", SHARED, 20, 0, "b");
    let v = c.victims(SHARED, 60).unwrap();
    assert_eq!(
        (v.node.as_str(), v.pods.as_slice()),
        ("b", &["default/b-1".to_owned()][..])
    );
}

#[test]
fn online_pods_are_never_victims_so_some_pods_cannot_preempt() {
    let mut c = Cluster::new(1);
    c.run("online-a", SHARED, 70, 0, "a");
    c.run("batch-a", BATCH, 10, 0, "a");
    c.run("online-b", SHARED, 80, 0, "b");
    assert_eq!(c.victims(SHARED, 30), None);
    // A whole GPU on node x is online too.
    c.run("whole", WHOLE, 0, 0, "x");
    assert_eq!(c.victims(WHOLE, 0), None);
}

#[test]
fn choosing_leaves_the_snapshot_as_it_was() {
    let mut c = Cluster::new(2);
    c.run("b1", BATCH, 40, 0, "a");
    c.run("b2", BATCH, 40, 0, "a");
    c.run("b3", BATCH, 80, 0, "a");
    c.run("full-b", SHARED, 80, 0, "b");
    c.run("full-b2", SHARED, 80, 0, "b");
    let before = c.snapshot.device_usage();
    assert!(c.victims(SHARED, 80).is_some());
    assert_eq!(c.snapshot.device_usage(), before);
}

#[test]
fn only_online_pods_preempt() {
    let c = Cluster::new(1);
    let online = Cluster::claim("o", SHARED, 10);
    let batch = Cluster::claim("b", BATCH, 10);
    let whole = Cluster::claim("w", WHOLE, 0);
    assert!(c.allocator.is_online(&c.snapshot, &[&online, &whole]));
    assert!(!c.allocator.is_online(&c.snapshot, &[&online, &batch]));
}
