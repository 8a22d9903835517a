//! A GPU's mode chosen by the admin: plugin flags, and node labels read from the API server
//! (at start and when they change), seen in the ResourceSlices the plugin publishes.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

#[path = "support/plugin_run.rs"]
mod plugin_run;

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use plugin_run::{RunningArgs, wait_for_device};
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
        tessera_kubelet_plugin::apiserver::client(Some(&path))
            .await
            .unwrap()
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
