//! Defragmentation against an API server: a pod that fits nowhere for lack of contiguous room
//! gets it by the eviction of the fewest movable batch pods, within the admin's budget per
//! hour; a `PodDisruptionBudget` keeps a pod in place; an online pod is never moved; the room
//! goes to the pod it was made for; a restarted controller counts the evictions already made
//! this hour (from the node's record) and does not evict past the budget. The test plays the
//! kubelet (pods run) and kube-controller-manager (a budget's status; the claims of pods that
//! are gone released).
#![allow(dead_code, reason = "each test file uses a subset")]

use std::fmt::Write as _;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tessera_controller::service::ControllerConfig;
use tessera_driver::apiversion::ApiVersion;
use tessera_driver::names;
use tessera_driver::node::inventory::Inventory;
use tessera_driver::placement::allocator::Policy;
use tessera_driver::placement::defrag::record::DefragRecord;
use tessera_driver::placement::gate;

use crate::scenarios::*;
use crate::tiers::*;

fn defragmenting(per_hour: u32) -> ControllerConfig {
    ControllerConfig {
        defrag_per_hour: per_hour,
        ..config(Policy::FirstFit, None)
    }
}

/// A gated pod with one claim of its own name, kept on `node` by a node selector and owned by
/// a `ReplicaSet` (a controller that re-creates it), with `labels`.
async fn create_owned_pod(client: &kube::Client, name: &str, node: &str, labels: &Value) {
    let pod = gated_pod(name, &[name], &[], "1");
    let mut value = serde_json::to_value(&pod).unwrap();
    value["metadata"]["labels"] = labels.clone();
    value["metadata"]["ownerReferences"] = json!([{"apiVersion": "apps/v1", "kind": "ReplicaSet",
        "name": format!("{name}-rs"), "uid": format!("rs-{name}"), "controller": true}]);
    value["spec"]["nodeSelector"] = json!({names::LABEL_HOSTNAME: node});
    let pod: Pod = serde_json::from_value(value).unwrap();
    create_pod(client, &pod).await;
}

/// The node the first device of claim `name` is on (its result's pool is the node's).
async fn node_of(client: &kube::Client, version: ApiVersion, name: &str) -> Option<String> {
    let claims = claims(client, version).await;
    claims
        .get(name)?
        .status
        .as_ref()?
        .allocation
        .as_ref()?
        .devices
        .as_ref()?
        .results
        .as_ref()?
        .first()
        .map(|r| r.pool.clone())
}

/// The pods an Event with `reason` was recorded on (not the nodes), sorted.
async fn pods_with_event(client: &kube::Client, reason: &str) -> Vec<String> {
    let nodes: Vec<String> = (0..3).map(node_name).collect();
    let mut on: Vec<String> = events(client, reason)
        .await
        .into_iter()
        .map(|(object, _)| object)
        .filter(|o| !nodes.contains(o))
        .collect();
    on.sort();
    on
}

fn three_nodes() -> Inventory {
    let mut yaml = String::from("nodes:\n");
    for i in 0..3 {
        let _ = write!(
            yaml,
            "- name: {}\n  mode: shared\n  gpus:\n  - model: a100-80g\n    count: 1\n",
            node_name(i)
        );
    }
    Inventory::from_yaml(&yaml).unwrap()
}

/// Whether pod `name` carries the controller's condition (with `reason`, when given).
async fn has_condition(client: &kube::Client, name: &str, reason: Option<&str>) -> bool {
    pods(client).await[name]
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| {
            c.iter().any(|c| {
                c.type_ == names::CONDITION_ALLOCATED
                    && reason.is_none_or(|r| c.status == "False" && c.reason.as_deref() == Some(r))
            })
        })
}

/// Three nodes with one 80Gi GPU each, shared. node-0 holds two movable batch shares of 30Gi;
/// node-1 one movable batch share of 20Gi a `PodDisruptionBudget` protects; node-2 an online
/// share of 40Gi (also owned by a `ReplicaSet`: its tier alone keeps it in place). A pod
/// asking 70Gi fits nowhere. With a budget of one eviction per hour: node-0 would take two
/// moves, node-1's move is refused by the budget's 429, node-2's holder is online: nothing
/// moves. Once the budget allows it (and the controller restarted), node-1's batch pod is
/// evicted and the big pod placed on node-1. A second big pod that one move on node-0 would
/// serve waits: a restarted controller reads the hour's eviction from node-1's record.
pub(crate) async fn defragmentation_moves_the_fewest_batch_pods_within_its_budget(
    client: &kube::Client,
    version: ApiVersion,
) {
    let wait = Duration::from_secs(30);
    seed(client, version, &three_nodes(), "16").await;
    seed_batch_class(client, version).await;
    let placed = [
        ("batch-a1", BATCH_CLASS, 30, 0, json!({"app": "a"})),
        ("batch-a2", BATCH_CLASS, 30, 0, json!({"app": "a"})),
        ("batch-b", BATCH_CLASS, 20, 1, json!({"app": "protected"})),
        (
            "online-c",
            names::CLASS_SHARED_GPU,
            40,
            2,
            json!({"app": "c"}),
        ),
    ];
    let first = start_controller(client, defragmenting(1));
    for (name, class, gib, node, labels) in &placed {
        create_claim(client, version, class_share_claim(name, class, *gib, None)).await;
        create_owned_pod(client, name, &node_name(*node), labels).await;
    }
    let names: Vec<String> = placed.iter().map(|p| p.0.to_owned()).collect();
    eventually(wait, "the four pods are placed", || {
        all_ungated(client, &names)
    })
    .await;
    for name in &names {
        run_pod(client, name).await;
    }
    let pdb: PodDisruptionBudget = serde_json::from_value(json!({
        "metadata": {"name": "protected", "namespace": NS},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "protected"}}},
    }))
    .unwrap();
    let pdbs = Api::<PodDisruptionBudget>::namespaced(client.clone(), NS);
    let created = pdbs.create(&PostParams::default(), &pdb).await.unwrap();
    let budget_status = |allowed: i32| {
        json!({"status": {"observedGeneration": created.metadata.generation.unwrap_or(1),
            "disruptionsAllowed": allowed, "currentHealthy": 1, "desiredHealthy": 1, "expectedPods": 1}})
    };
    pdbs.patch_status(
        "protected",
        &PatchParams::default(),
        &Patch::Merge(&budget_status(0)),
    )
    .await
    .unwrap();

    create_claim(
        client,
        version,
        class_share_claim("trainer", names::CLASS_SHARED_GPU, 70, None),
    )
    .await;
    create_pod(client, &gated_pod("trainer", &["trainer"], &[], "1")).await;
    eventually(wait, "the big pod is reported as not fitting", || {
        has_condition(client, "trainer", Some("FailedAllocation"))
    })
    .await;
    // Passes go by (the resync is 2s): nothing is moved.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        pods(client).await.len(),
        5,
        "two moves exceed the budget, the budget's 429 keeps batch-b, online-c is online: nothing is evicted"
    );
    assert!(
        pods_with_event(client, names::REASON_DEFRAGMENTED)
            .await
            .is_empty()
    );
    first.stop().await;

    pdbs.patch_status(
        "protected",
        &PatchParams::default(),
        &Patch::Merge(&budget_status(1)),
    )
    .await
    .unwrap();
    the_room_goes_to_the_pod_it_was_made_for(client, version, wait).await;
    a_restart_does_not_evict_past_the_budget(client, version, wait).await;
}

/// The disruption budget now allows one disruption: a new controller moves batch-b, and the
/// big pod lands on node-1, whose record names it and the eviction.
async fn the_room_goes_to_the_pod_it_was_made_for(
    client: &kube::Client,
    version: ApiVersion,
    wait: Duration,
) {
    let second = start_controller(client, defragmenting(1));
    eventually(
        wait,
        "batch-b is evicted and the big pod placed on its node",
        || async {
            release_claims_of_gone_pods(client, version).await;
            !pods(client).await.contains_key("batch-b") && is_ungated(client, "trainer").await
        },
    )
    .await;
    assert_eq!(
        node_of(client, version, "trainer").await.as_deref(),
        Some(node_name(1).as_str()),
        "the pending pod lands where the room was made"
    );
    assert_eq!(
        pods_with_event(client, names::REASON_DEFRAGMENTED).await,
        ["batch-b"]
    );
    let record_node = Api::<Node>::all(client.clone())
        .get(&node_name(1))
        .await
        .unwrap();
    let record = DefragRecord::of(&record_node)
        .unwrap()
        .expect("the node carries the record");
    assert_eq!(record.room_for, format!("{NS}/trainer"));
    assert_eq!(
        record
            .evicted
            .iter()
            .map(|e| e.pod.as_str())
            .collect::<Vec<_>>(),
        [format!("{NS}/batch-b")]
    );
    second.stop().await;
}

/// One move on node-0 would now make room for a second big pod, but this hour's eviction is
/// on node-1's record: a restarted controller does not evict past the budget; with a budget
/// of two it moves batch-a1 (never the online pod) and the pod lands on node-0.
async fn a_restart_does_not_evict_past_the_budget(
    client: &kube::Client,
    version: ApiVersion,
    wait: Duration,
) {
    crate::scenarios::delete_pod(client, "batch-a2").await;
    release_claims_of_gone_pods(client, version).await;
    create_claim(
        client,
        version,
        class_share_claim("trainer-2", names::CLASS_SHARED_GPU, 70, None),
    )
    .await;
    create_pod(client, &gated_pod("trainer-2", &["trainer-2"], &[], "1")).await;
    let third = start_controller(client, defragmenting(1));
    eventually(
        wait,
        "the second big pod is reported as not fitting",
        || async {
            pods(client).await["trainer-2"]
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == names::CONDITION_ALLOCATED))
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let left = pods(client).await;
    assert!(
        left.contains_key("batch-a1"),
        "the budget of the hour is spent"
    );
    assert!(gate::is_gated(&left["trainer-2"]));
    assert!(
        left.contains_key("online-c"),
        "an online pod is never moved"
    );
    assert_eq!(
        pods_with_event(client, names::REASON_DEFRAGMENTED).await,
        ["batch-b"]
    );
    third.stop().await;

    // With a larger budget the same controller state moves batch-a1 for trainer-2.
    let fourth = start_controller(client, defragmenting(2));
    eventually(
        wait,
        "batch-a1 is moved and trainer-2 placed on node-0",
        || async {
            release_claims_of_gone_pods(client, version).await;
            !pods(client).await.contains_key("batch-a1") && is_ungated(client, "trainer-2").await
        },
    )
    .await;
    assert_eq!(
        node_of(client, version, "trainer-2").await.as_deref(),
        Some(node_name(0).as_str())
    );
    assert!(
        pods(client).await.contains_key("online-c"),
        "an online pod is never moved"
    );
    check_invariants(client, version).await;
    fourth.stop().await;
}
