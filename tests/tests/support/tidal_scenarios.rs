//! GPU profiles on a schedule against an API server: a window opens, free GPUs switch and held
//! ones drain, the drain deadline evicts only preemptible pods (a `PodDisruptionBudget` blocks
//! one), a controller restart mid-switch continues the switch without starting it again or
//! evicting more, and the switch finishes once the last holder is gone. The test plays the
//! kubelet plugin (it publishes the GPUs' modes as the plugin would after reading the node's
//! labels) and the kubelet (pods run; a deleted pod finishes).
#![allow(dead_code, reason = "each test file uses a subset")]

use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tessera_driver::apiversion::{self, ApiVersion};
use tessera_driver::names;
use tessera_driver::node::inventory::{GpuMode, Inventory};
use tessera_driver::node::schedule::switch::SwitchRecord;
use tessera_driver::node::slices::{self, RenderOptions};
use tessera_driver::placement::allocator::Policy;

use crate::scenarios::*;
use crate::tiers::*;

fn one_node(gpus: usize) -> Inventory {
    Inventory::from_yaml(&format!(
        "nodes:\n- name: {}\n  mode: shared\n  gpus:\n  - model: a100-80g\n    count: {gpus}\n",
        node_name(0)
    ))
    .unwrap()
}

/// Plays the plugin: publishes the node's GPUs with `modes` (a draining GPU keeps its mode
/// and carries the draining taint, as the plugin publishes a GPU that claims still hold).
async fn publish(client: &kube::Client, version: ApiVersion, modes: &[(GpuMode, Option<GpuMode>)]) {
    let mut inventory = one_node(modes.len());
    for (gpu, (mode, draining_to)) in inventory.nodes[0].gpus.iter_mut().zip(modes) {
        gpu.mode = *mode;
        gpu.draining_to = *draining_to;
    }
    let api: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &tessera_kubeapi::resource(version, names::RESOURCE_SLICE),
    );
    let options = RenderOptions {
        consumable_capacity: version == ApiVersion::V1,
        ..RenderOptions::default()
    };
    for slice in slices::render(&inventory.nodes[0], &options).unwrap() {
        let value = apiversion::encode_slice(&slice, version).unwrap();
        let name = slice.metadata.name.clone().unwrap();
        let _ = api.delete(&name, &DeleteParams::default()).await;
        let object: DynamicObject = serde_json::from_value(value).unwrap();
        api.create(&PostParams::default(), &object).await.unwrap();
    }
}

fn schedule(deadline: Option<&str>) -> Value {
    let mut night = json!({"name": "night", "mode": "exclusive"});
    if let Some(d) = deadline {
        night["drainDeadline"] = json!(d);
    }
    json!({
        "apiVersion": names::CONFIG_API_VERSION,
        "kind": names::GPU_PROFILE_SCHEDULE.kind,
        "metadata": {"name": "tidal"},
        "spec": {
            "nodeSelector": {"matchLabels": {"pool": "tidal"}},
            "timeZone": "Europe/Berlin",
            "profiles": [night],
            // Every minute: the night profile is in force whenever the test runs.
            "windows": [{"start": "* * * * *", "profile": "night"}],
        },
    })
}

fn schedules(client: &kube::Client) -> Api<DynamicObject> {
    Api::all_with(
        client.clone(),
        &tessera_controller::tidal::schedule_resource(),
    )
}

async fn node(client: &kube::Client) -> Node {
    Api::<Node>::all(client.clone())
        .get(&node_name(0))
        .await
        .unwrap()
}

async fn record(client: &kube::Client) -> Option<SwitchRecord> {
    node(client)
        .await
        .metadata
        .annotations
        .as_ref()
        .and_then(SwitchRecord::from_annotations)
}

fn is_gone_or_terminating(pods: &std::collections::BTreeMap<String, Pod>, name: &str) -> bool {
    pods.get(name)
        .is_none_or(|p| p.metadata.deletion_timestamp.is_some())
}

/// See the module docs. One node of three shared GPUs, labelled into the schedule; an online
/// share, a batch share and a batch share that a `PodDisruptionBudget` protects all land on one
/// GPU.
#[allow(
    clippy::too_many_lines,
    reason = "one story, step by step: the window, the deadline, the restart, the end"
)]
pub(crate) async fn a_scheduled_profile_drains_evicts_only_preemptible_pods_and_survives_a_restart(
    client: &kube::Client,
    version: ApiVersion,
) {
    let wait = Duration::from_secs(30);
    seed(client, version, &one_node(3), "16").await;
    seed_batch_class(client, version).await;
    let label = json!({"metadata": {"labels": {"pool": "tidal"}}});
    Api::<Node>::all(client.clone())
        .patch(
            &node_name(0),
            &PatchParams::default(),
            &Patch::Merge(&label),
        )
        .await
        .unwrap();
    let first = start_controller(client, config(Policy::FirstFit, None));
    let placed = [
        ("serve", names::CLASS_SHARED_GPU, json!({})),
        ("train", BATCH_CLASS, json!({})),
        ("sweep", BATCH_CLASS, json!({"app": "protected"})),
    ];
    for (name, class, labels) in &placed {
        create_claim(client, version, class_share_claim(name, class, 10, None)).await;
        create_tier_pod(client, name, 0, labels).await;
    }
    let names_placed: Vec<String> = placed.iter().map(|p| p.0.to_owned()).collect();
    eventually(wait, "the three pods are placed", || {
        all_ungated(client, &names_placed)
    })
    .await;
    for name in &names_placed {
        run_pod(client, name).await;
    }
    let pdbs = Api::<PodDisruptionBudget>::namespaced(client.clone(), NS);
    let pdb: PodDisruptionBudget = serde_json::from_value(json!({
        "metadata": {"name": "protected", "namespace": NS},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "protected"}}},
    }))
    .unwrap();
    let created = pdbs.create(&PostParams::default(), &pdb).await.unwrap();
    let status = json!({"status": {"observedGeneration": created.metadata.generation.unwrap_or(1),
        "disruptionsAllowed": 0, "currentHealthy": 1, "desiredHealthy": 1, "expectedPods": 1}});
    pdbs.patch_status("protected", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();

    // The window opens: a profile without a deadline waits for every holder.
    let object: DynamicObject = serde_json::from_value(schedule(None)).unwrap();
    schedules(client)
        .create(&PostParams::default(), &object)
        .await
        .unwrap();
    eventually(
        wait,
        "the node gets the night profile's label and record",
        || async {
            let n = node(client).await;
            let labelled = n
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(names::LABEL_GPU_MODE))
                .map(String::as_str)
                == Some("exclusive");
            labelled && record(client).await.is_some_and(|r| r.profile == "night")
        },
    )
    .await;
    let started = record(client).await.unwrap();
    assert!(started.evicted.is_empty() && started.finished.is_none());
    eventually(
        wait,
        "the switch's start is an Event on the node",
        || async {
            events(client, names::REASON_PROFILE_SWITCH)
                .await
                .iter()
                .any(|(on, message)| *on == node_name(0) && message.contains("profile night"))
        },
    )
    .await;

    // The plugin switches the two free GPUs and drains the held one.
    let exclusive = (GpuMode::Exclusive, None);
    publish(
        client,
        version,
        &[
            (GpuMode::Shared, Some(GpuMode::Exclusive)),
            exclusive,
            exclusive,
        ],
    )
    .await;
    // The admin sets a deadline that has passed: the batch pod is evicted, the protected one
    // is refused by its budget, the online one is waited for.
    let mut with_deadline = schedule(Some("0s"));
    let stored = schedules(client).get("tidal").await.unwrap();
    with_deadline["metadata"]["resourceVersion"] = json!(stored.metadata.resource_version);
    let object: DynamicObject = serde_json::from_value(with_deadline).unwrap();
    schedules(client)
        .replace("tidal", &PostParams::default(), &object)
        .await
        .unwrap();
    eventually(wait, "the batch pod is evicted and recorded", || async {
        let evicted = is_gone_or_terminating(&pods(client).await, "train");
        evicted
            && record(client)
                .await
                .is_some_and(|r| r.evicted == ["default/train"])
    })
    .await;
    eventually(
        wait,
        "the budget's refusal and the online wait are Events on the pods",
        || async {
            let waiting = events(client, names::REASON_PROFILE_WAITING).await;
            waiting
                .iter()
                .any(|(p, m)| p == "sweep" && m.contains("not evicted"))
                && waiting
                    .iter()
                    .any(|(p, m)| p == "serve" && m.contains("never evicted"))
        },
    )
    .await;
    let now = pods(client).await;
    assert!(
        !is_gone_or_terminating(&now, "serve"),
        "an online pod is never evicted"
    );
    assert!(
        !is_gone_or_terminating(&now, "sweep"),
        "a PodDisruptionBudget blocks the eviction"
    );
    assert_eq!(
        events(client, names::REASON_PROFILE_EVICTION)
            .await
            .iter()
            .filter(|(p, _)| p == "train")
            .count(),
        1
    );

    // A restart mid-switch: the new controller continues it.
    first.kill();
    let refusals = events(client, names::REASON_PROFILE_WAITING).await.len();
    let second = start_controller(client, config(Policy::FirstFit, None));
    eventually(wait, "the new controller works on the switch", || async {
        events(client, names::REASON_PROFILE_WAITING).await.len() > refusals
    })
    .await;
    let continued = record(client).await.unwrap();
    assert_eq!(
        continued.started, started.started,
        "the switch is not started again"
    );
    assert_eq!(
        continued.evicted,
        ["default/train"],
        "nothing more is evicted"
    );
    assert_eq!(events(client, names::REASON_PROFILE_SWITCH).await.len(), 1);
    assert_eq!(
        events(client, names::REASON_PROFILE_EVICTION)
            .await
            .iter()
            .filter(|(p, _)| p == "train")
            .count(),
        1
    );

    // The holders end (their owners delete them); the plugin switches the last GPU.
    for name in ["serve", "sweep"] {
        Api::<Pod>::namespaced(client.clone(), NS)
            .delete(name, &DeleteParams::default())
            .await
            .unwrap();
    }
    finish_deleted_pods(client, version).await;
    publish(client, version, &[exclusive, exclusive, exclusive]).await;
    eventually(
        wait,
        "the switch finishes, recorded and reported",
        || async {
            record(client).await.is_some_and(|r| r.finished.is_some())
                && !events(client, names::REASON_PROFILE_SWITCHED)
                    .await
                    .is_empty()
        },
    )
    .await;
    let report = second.metrics.encode().unwrap();
    assert!(
        report.contains("tessera_controller_scheduled_gpus{mode=\"exclusive\"} 3"),
        "{report}"
    );
    assert!(
        report.contains("tessera_controller_scheduled_gpus_draining 0"),
        "{report}"
    );
    second.stop().await;
}
