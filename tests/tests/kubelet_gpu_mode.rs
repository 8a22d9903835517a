//! A GPU's mode chosen by the admin: plugin flags, and node labels read from the API server
//! (at start and when they change), seen in the ResourceSlices the plugin publishes; a GPU
//! whose mode change waits for its claims drains (tainted, shown by `tessera inspect`).
#![allow(clippy::unwrap_used, missing_docs)]

#[path = "support/plugin_run.rs"]
mod plugin_run;

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use plugin_run::{RunningArgs, connect, server_with_node, wait_for_device};
use serde_json::{Value, json};
use tessera_driver::names;
use tessera_tests::fake_apiserver::FakeApiServer;

const NODE: &str = "mode-node";
const INVENTORY: &str = "nodes:\n- name: mode-node\n  gpus:\n  - model: t4-16g\n    count: 3\n  - model: a100-40g\n    mig:\n    - profile: 7g.40gb\n";

fn sharing(device: &Value) -> Option<&str> {
    device["attributes"][names::ATTR_SHARING]["string"].as_str()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn labels_choose_modes_over_flags_and_changes_are_republished() {
    let server = FakeApiServer::start(&["v1"]).await.unwrap();
    server
        .create(
            "nodes",
            json!({"apiVersion": "v1", "kind": "Node", "metadata": {
                "name": NODE,
                "labels": {
                    names::LABEL_GPU_MODE: "shared",
                    format!("{}1", names::LABEL_GPU_MODE_PER_GPU_PREFIX): "exclusive",
                },
            }}),
        )
        .unwrap();
    let plugin = RunningArgs::start(
        &server,
        NODE,
        INVENTORY,
        &["--gpu-mode-override", "0=exclusive,2=exclusive"],
    );

    // gpu-0: the node label beats the flag; gpu-1: its own label; gpu-2: its flag is beaten
    // by the node label too (labels win over every flag).
    let shared = |d: &Value| sharing(d) == Some("shared");
    let exclusive = |d: &Value| sharing(d) == Some("exclusive");
    wait_for_device(&server, "gpu-0", "shared", shared).await;
    wait_for_device(&server, "gpu-1", "exclusive", exclusive).await;
    wait_for_device(&server, "gpu-2", "shared", shared).await;
    // MIG comes from the hardware whatever the labels say.
    wait_for_device(&server, "gpu-3-mig-7g-40gb-0", "published", |_| true).await;

    let client = {
        let path = plugin.path("kubeconfig");
        tessera_kubeapi::client(Some(&path)).await.unwrap()
    };
    Api::<Node>::all(client)
        .patch(
            NODE,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {names::LABEL_GPU_MODE: null}}})),
        )
        .await
        .unwrap();
    // Without the node label the flags decide again.
    wait_for_device(&server, "gpu-0", "exclusive", exclusive).await;
    wait_for_device(&server, "gpu-2", "exclusive", exclusive).await;
    wait_for_device(&server, "gpu-1", "exclusive", exclusive).await;

    plugin.stop().await;
}

fn taints(device: &Value) -> Vec<(String, String)> {
    device["taints"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| {
            (
                t["key"].as_str().unwrap_or_default().to_owned(),
                t["value"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

/// Runs `tessera inspect` with the plugin's kubeconfig and returns its table.
async fn inspect(plugin: &RunningArgs) -> String {
    use clap::Parser as _;
    let kubeconfig = plugin.path("kubeconfig").display().to_string();
    tokio::task::spawn_blocking(move || {
        let cli = tessera_controller::cli::Cli::try_parse_from([
            "tessera",
            "inspect",
            "--kubeconfig",
            &kubeconfig,
        ])
        .unwrap();
        let mut out = String::new();
        cli.run(&mut out).unwrap();
        out
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_gpu_drains_tainted_and_switches_when_its_claim_goes() {
    use tessera_proto::dra::v1;
    const DRAIN_NODE: &str = "drain-node";
    let one = |mode: &str| {
        format!(
            "nodes:\n- name: {DRAIN_NODE}\n  gpus:\n  - model: t4-16g\n    mode: {mode}\n  - model: t4-16g\n"
        )
    };
    let server = server_with_node(DRAIN_NODE).await;
    let claim = server
        .create(
            "resourceclaims",
            json!({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": "whole", "namespace": "default"},
                "spec": {"devices": {"requests": [
                    {"name": "gpu", "exactly": {"deviceClassName": names::CLASS_GPU}}]}},
            }),
        )
        .unwrap();
    server
        .set_status(
            "resourceclaims",
            Some("default"),
            "whole",
            &json!({"allocation": {
                "devices": {"results": [{"request": "gpu", "driver": names::DEFAULT_DRIVER_NAME,
                                         "pool": DRAIN_NODE, "device": "gpu-0"}]},
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [DRAIN_NODE]}]}]},
            }}),
        )
        .unwrap();
    let uid = claim["metadata"]["uid"].as_str().unwrap().to_owned();
    let plugin = RunningArgs::start(&server, DRAIN_NODE, &one("exclusive"), &[]);
    let exclusive = |d: &Value| sharing(d) == Some("exclusive");
    wait_for_device(&server, "gpu-0", "exclusive", exclusive).await;

    let mut kubelet = v1::dra_plugin_client::DraPluginClient::new(
        connect(&plugin.path("plugin").join(names::DRA_SOCKET_NAME)).await,
    );
    let request = || v1::Claim {
        namespace: "default".to_owned(),
        name: "whole".to_owned(),
        uid: uid.clone(),
    };
    let prepared = kubelet
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![request()],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(prepared.claims[&uid].error, "");

    // The admin makes gpu-0 shared while the claim holds it: it stays exclusive, tainted.
    plugin.write_inventory(&one("shared"));
    let draining = (names::TAINT_DRAINING.to_owned(), "shared".to_owned());
    wait_for_device(&server, "gpu-0", "draining", |d| {
        exclusive(d) && taints(d) == [draining.clone()]
    })
    .await;
    assert!(taints(&plugin_run::published_device(&server, "gpu-1").unwrap()).is_empty());
    let table = inspect(&plugin).await;
    let row = table.lines().find(|l| l.contains("gpu-0")).unwrap();
    assert!(row.contains("exclusive (draining to shared)"), "{table}");

    // The claim goes: the GPU switches and the taint goes with it.
    let unprepared = kubelet
        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
            claims: vec![request()],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(unprepared.claims[&uid].error, "");
    wait_for_device(&server, "gpu-0", "switched to shared", |d| {
        sharing(d) == Some("shared") && taints(d).is_empty()
    })
    .await;
    let table = inspect(&plugin).await;
    assert!(!table.contains("draining"), "{table}");

    plugin.stop().await;
}
