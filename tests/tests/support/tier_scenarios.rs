//! Scenarios of the tiers (shared/DESIGN.md §8) against an API server, written only against a
//! kube client so they run the same on the fake API server and on a real kube-apiserver:
//! preemption through the Eviction API with a `PodDisruptionBudget`, and a delay-tolerant pod
//! waiting for a fragment. The test plays the parts of a cluster that are not running: the
//! kubelet (pods report Running and Ready; a pod being deleted finishes) and
//! kube-controller-manager (a budget's status; a deleted pod's reservations dropped).
#![allow(dead_code, reason = "each test file uses a subset")]

use std::collections::BTreeSet;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tessera_controller::metrics::Outcome;
use tessera_controller::service::ControllerConfig;
use tessera_driver::apiversion::ApiVersion;
use tessera_driver::placement::allocator::Policy;
use tessera_driver::{names, placement::gate};
use tessera_kubeapi as apiserver;

use crate::scenarios::*;

pub(crate) const BATCH_CLASS: &str = "batch.gpu.tessera.dev";

/// Installs the shipped batch DeviceClass.
pub(crate) async fn seed_batch_class(client: &kube::Client, version: ApiVersion) {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap();
    let text = std::fs::read_to_string(repo.join("deviceclasses/batch-gpu.yaml")).unwrap();
    let mut value: Value = serde_yaml::from_str(&text).unwrap();
    value["apiVersion"] = json!(version.as_str());
    let api: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &apiserver::resource(version, tessera_driver::names::DEVICE_CLASS),
    );
    let object: DynamicObject = serde_json::from_value(value).unwrap();
    match api.create(&PostParams::default(), &object).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => panic!("creating the batch class: {e}"),
    }
}

/// A claim of `class` for a share of `memory_gib` GiB, with an optional patience.
pub(crate) fn class_share_claim(
    name: &str,
    class: &str,
    memory_gib: u32,
    patience: Option<&str>,
) -> Value {
    let mut params = json!({"apiVersion": names::CONFIG_API_VERSION, "kind": names::GPU_SHARE_KIND,
        "memory": format!("{memory_gib}Gi")});
    if let Some(p) = patience {
        params["patience"] = json!(p);
    }
    json!({
        "metadata": {"name": name, "namespace": NS},
        "spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": class}}],
            "config": [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": params}}],
        }},
    })
}

fn priority_class(value: i32) -> String {
    format!("tessera-test-{value}")
}

/// `PriorityClasses` for `values` (a real server's Priority admission resolves a pod's priority
/// from its class; the fake serves no scheduling.k8s.io and keeps the pod's number as given).
async fn seed_priority_classes(client: &kube::Client, values: &[i32]) {
    let api = Api::<PriorityClass>::all(client.clone());
    for &value in values {
        let class: PriorityClass = serde_json::from_value(json!({
            "metadata": {"name": priority_class(value)}, "value": value}))
        .unwrap();
        match api.create(&PostParams::default(), &class).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => {}
            Err(e) => panic!("creating PriorityClass {value}: {e}"),
        }
    }
}

/// A gated pod with one claim, a priority and labels.
pub(crate) async fn create_tier_pod(
    client: &kube::Client,
    name: &str,
    priority: i32,
    labels: &Value,
) {
    let mut pod = gated_pod(name, &[name], &[], "1");
    let mut value = serde_json::to_value(&pod).unwrap();
    value["metadata"]["labels"] = labels.clone();
    value["spec"]["priority"] = json!(priority);
    value["spec"]["priorityClassName"] = json!(priority_class(priority));
    pod = serde_json::from_value(value).unwrap();
    create_pod(client, &pod).await;
}

/// Plays the kubelet for `name`: the pod runs and is ready.
pub(crate) async fn run_pod(client: &kube::Client, name: &str) {
    let status = json!({"status": {"phase": "Running", "conditions": [
        {"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}});
    Api::<Pod>::namespaced(client.clone(), NS)
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
}

/// Plays the kubelet and kube-controller-manager for pods being deleted: a pod with a
/// deletionTimestamp finishes (deleted at once), and the claims of pods that are gone are
/// released ([`release_claims_of_gone_pods`]).
pub(crate) async fn finish_deleted_pods(client: &kube::Client, version: ApiVersion) {
    for (name, pod) in &pods(client).await {
        if pod.metadata.deletion_timestamp.is_some() {
            let _ = Api::<Pod>::namespaced(client.clone(), NS)
                .delete(name, &DeleteParams::default().grace_period(0))
                .await;
        }
    }
    release_claims_of_gone_pods(client, version).await;
}

/// Keeps pod `name` terminating when it is deleted (a finalizer) and reserves its claim for
/// it (kube-scheduler's part), so the room it holds is freed only once the test lets it go.
async fn hold_and_reserve(client: &kube::Client, version: ApiVersion, name: &str) {
    let hold = json!({"metadata": {"finalizers": ["test.tessera.dev/hold"]}});
    let pod = Api::<Pod>::namespaced(client.clone(), NS)
        .patch(name, &PatchParams::default(), &Patch::Merge(&hold))
        .await
        .unwrap();
    let reserve = json!({"status": {"reservedFor": [
        {"resource": "pods", "name": name, "uid": pod.metadata.uid}]}});
    claims_api(client, version)
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&reserve))
        .await
        .unwrap();
}

/// The device the claim `name` is allocated (its first result).
fn allocated_device(
    claims: &std::collections::BTreeMap<String, k8s_openapi::api::resource::v1::ResourceClaim>,
    name: &str,
) -> String {
    tessera_driver::testing::first_device(&claims[name])
}

/// The Events in `NS` with `reason`, as (involved pod, message).
pub(crate) async fn events(client: &kube::Client, reason: &str) -> Vec<(String, String)> {
    Api::<Event>::namespaced(client.clone(), NS)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some(reason))
        .map(|e| {
            (
                e.involved_object.name.unwrap_or_default(),
                e.message.unwrap_or_default(),
            )
        })
        .collect()
}

/// The controller's condition on pod `name`: (status, reason, message).
async fn condition(client: &kube::Client, name: &str) -> Option<(String, String, String)> {
    let pod = pods(client).await.remove(name)?;
    pod.status?
        .conditions?
        .into_iter()
        .find(|c| c.type_ == names::CONDITION_ALLOCATED)
        .map(|c| {
            (
                c.status,
                c.reason.unwrap_or_default(),
                c.message.unwrap_or_default(),
            )
        })
}

fn preempting(policy: Policy) -> ControllerConfig {
    ControllerConfig {
        preemption: true,
        ..config(policy, None)
    }
}

/// One shared GPU of 80Gi full: an online share (priority 0), two low-priority batch shares
/// (one protected by a `PodDisruptionBudget` that allows no disruption) and a high-priority
/// batch share. An online pod of 40Gi fits nowhere. Without `--preemption` it only waits;
/// with it, the controller evicts the fewest, lowest-priority batch pods it may (the
/// unprotected low one and the high one), each with an Event naming the online pod, never the
/// online share nor the protected pod, and places the online pod once they are gone — and
/// evicts nothing more.
#[allow(clippy::too_many_lines, reason = "one story, told in order")]
pub(crate) async fn preemption_evicts_batch_pods_through_the_eviction_api(
    client: &kube::Client,
    version: ApiVersion,
) {
    let wait = Duration::from_secs(30);
    let one_gpu = tessera_driver::node::inventory::Inventory::from_yaml(&format!(
        "nodes:\n- name: {}\n  mode: shared\n  gpus:\n  - model: a100-80g\n    count: 1\n",
        node_name(0)
    ))
    .unwrap();
    seed(client, version, &one_gpu, "16").await;
    seed_batch_class(client, version).await;
    seed_priority_classes(client, &[0, 1, 100, 1000]).await;
    let first = start_controller(client, config(Policy::FirstFit, None));
    let placed = [
        ("online-old", names::CLASS_SHARED_GPU, 10, 0, json!({})),
        ("batch-low-1", BATCH_CLASS, 20, 1, json!({})),
        (
            "batch-low-2",
            BATCH_CLASS,
            20,
            1,
            json!({"app": "protected"}),
        ),
        ("batch-high", BATCH_CLASS, 30, 100, json!({})),
    ];
    for (name, class, gib, priority, labels) in &placed {
        create_claim(client, version, class_share_claim(name, class, *gib, None)).await;
        create_tier_pod(client, name, *priority, labels).await;
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
    // kube-controller-manager's disruption controller would write this status.
    let status = json!({"status": {"observedGeneration": created.metadata.generation.unwrap_or(1),
        "disruptionsAllowed": 0, "currentHealthy": 1, "desiredHealthy": 1, "expectedPods": 1}});
    pdbs.patch_status("protected", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();

    create_claim(
        client,
        version,
        class_share_claim("online-new", names::CLASS_SHARED_GPU, 40, None),
    )
    .await;
    create_tier_pod(client, "online-new", 1000, &json!({})).await;
    eventually(
        wait,
        "without --preemption the online pod is reported as not fitting",
        || async {
            condition(client, "online-new")
                .await
                .is_some_and(|(status, reason, _)| {
                    status == "False" && reason == "FailedAllocation"
                })
        },
    )
    .await;
    assert_eq!(
        pods(client).await.len(),
        5,
        "nothing is evicted without the flag"
    );
    first.stop().await;

    // batch-high stays terminating once evicted (a finalizer, as a slow shutdown would), and
    // its claim stays reserved for it (kube-scheduler's part): its room is not free yet.
    hold_and_reserve(client, version, "batch-high").await;
    let running = start_controller(client, preempting(Policy::FirstFit));
    eventually(
        wait,
        "batch-low-1 is gone and batch-high terminating",
        || async {
            let pods = pods(client).await;
            !pods.contains_key("batch-low-1")
                && pods
                    .get("batch-high")
                    .is_some_and(|p| p.metadata.deletion_timestamp.is_some())
        },
    )
    .await;
    eventually(wait, "the online pod waits for its victims", || async {
        condition(client, "online-new")
            .await
            .is_some_and(|(_, reason, message)| {
                reason == names::REASON_PREEMPTING && message.contains("default/batch-high")
            })
    })
    .await;
    // Passes go by (the resync is 2s): nothing more is evicted while a victim terminates.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(events(client, names::REASON_PREEMPTED).await.len(), 2);
    assert!(gate::is_gated(&pods(client).await["online-new"]));
    let release = json!({"metadata": {"finalizers": null}});
    Api::<Pod>::namespaced(client.clone(), NS)
        .patch(
            "batch-high",
            &PatchParams::default(),
            &Patch::Merge(&release),
        )
        .await
        .unwrap();
    eventually(
        wait,
        "the online pod is placed after preempting",
        || async {
            finish_deleted_pods(client, version).await;
            is_ungated(client, "online-new").await
        },
    )
    .await;
    let left: BTreeSet<String> = pods(client).await.into_keys().collect();
    let expected: BTreeSet<String> = ["online-old", "batch-low-2", "online-new"]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    assert_eq!(
        left, expected,
        "the unprotected low-priority and the high-priority batch pods were evicted"
    );
    let mut preempted = events(client, names::REASON_PREEMPTED).await;
    preempted.sort();
    assert_eq!(
        preempted
            .iter()
            .map(|(p, _)| p.as_str())
            .collect::<Vec<_>>(),
        ["batch-high", "batch-low-1"]
    );
    for (_, message) in &preempted {
        assert!(message.contains("default/online-new"), "{message}");
    }
    assert!(
        events(client, names::REASON_PREEMPTING)
            .await
            .iter()
            .any(|(p, _)| p == "online-new"),
        "the online pod was told it waits for its victims"
    );
    check_invariants(client, version).await;
    // A pass later (the resync is 2s), nothing more has been evicted.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(events(client, names::REASON_PREEMPTED).await.len(), 2);
    assert_eq!(pods(client).await.len(), 3);
    running.stop().await;
}

/// A delay-tolerant pod on a cluster whose GPUs are all empty waits, gated, with a condition
/// saying until when; once another share makes a GPU partly used, it goes there.
pub(crate) async fn a_delay_tolerant_pod_waits_for_a_fragment(
    client: &kube::Client,
    version: ApiVersion,
) {
    let wait = Duration::from_secs(30);
    seed(client, version, &inventory(1, 2, true), "16").await;
    seed_batch_class(client, version).await;
    seed_priority_classes(client, &[0]).await;
    // No periodic resync: only a change, or a waiting pod's deadline, wakes the controller.
    let quiet = ControllerConfig {
        resync: Duration::from_hours(1),
        ..config(Policy::FirstFit, None)
    };
    let running = start_controller(client, quiet);
    create_claim(
        client,
        version,
        class_share_claim("patient", BATCH_CLASS, 10, Some("1h")),
    )
    .await;
    create_tier_pod(client, "patient", 0, &json!({})).await;
    eventually(
        wait,
        "the patient pod says it waits for a fragment",
        || async {
            let c = condition(client, "patient").await;
            c.is_some_and(|(status, reason, message)| {
                status == "False"
                    && reason == names::REASON_WAITING_FOR_FRAGMENT
                    && message.contains("waits for a fragment until")
            })
        },
    )
    .await;
    assert!(gate::is_gated(&pods(client).await["patient"]));
    // An ordinary share goes (first-fit) to gpu-0, which becomes the fragment the patient
    // pod takes.
    create_claim(
        client,
        version,
        class_share_claim("opener", names::CLASS_SHARED_GPU, 10, None),
    )
    .await;
    create_tier_pod(client, "opener", 0, &json!({})).await;
    let both = ["patient".to_owned(), "opener".to_owned()];
    eventually(wait, "both pods are placed", || all_ungated(client, &both)).await;
    let placed = claims(client, version).await;
    let device = |n: &str| allocated_device(&placed, n);
    assert_eq!(
        device("patient"),
        device("opener"),
        "the patient share shares a GPU"
    );
    // A share too large for the fragment left (60Gi free on the used GPU) with little patience:
    // it waits, then, its patience spent, takes the empty GPU — woken by its deadline alone.
    create_claim(
        client,
        version,
        class_share_claim("hurried", BATCH_CLASS, 70, Some("3s")),
    )
    .await;
    create_tier_pod(client, "hurried", 0, &json!({})).await;
    eventually(
        wait,
        "the hurried pod is placed once its patience is spent",
        || is_ungated(client, "hurried"),
    )
    .await;
    let placed = claims(client, version).await;
    let device_of = |n: &str| allocated_device(&placed, n);
    assert_ne!(device_of("hurried"), device_of("opener"), "an empty GPU");
    assert!(
        events(client, names::REASON_WAITING_FOR_FRAGMENT)
            .await
            .iter()
            .any(|(p, _)| p == "hurried"),
        "it waited first"
    );
    // Waiting is its own outcome, not "unschedulable": every pod here could be placed.
    assert!(running.metrics.outcome_count(Outcome::Waiting) >= 2);
    assert_eq!(running.metrics.outcome_count(Outcome::Unschedulable), 0);
    check_invariants(client, version).await;
    running.stop().await;
}
