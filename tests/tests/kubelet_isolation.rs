//! A node proves its share isolation before it offers shares: the kubelet plugin (its whole
//! wiring, fake GPU backend and fake probe) publishes each shared GPU's `isolation`, and the
//! shipped share class allocates nothing on a GPU whose isolation is unverified unless the
//! admin accepted it. Also: a plugin that does not follow its inventory
//! (`--inventory-poll-seconds 0`) still publishes it.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

#[path = "support/plugin_run.rs"]
mod plugin_run;

use std::path::Path;

use k8s_openapi::api::resource::v1 as res;
use plugin_run::{RunningArgs, server_with_node, wait_for_device};
use serde_json::{Value, json};
use tessera_driver::names;
use tessera_driver::placement::allocator::{Allocator, AllocatorOptions, Snapshot};
use tessera_tests::fake_apiserver::FakeApiServer;

const NODE: &str = "probe-node";
/// gpu-0's limits hold under the probe; gpu-1's do not (as HAMi-core's did on driver 580).
const INVENTORY: &str = "nodes:\n- name: probe-node\n  mode: shared\n  gpus:\n  - model: h200-141g\n  - model: h200-141g\n    isolation: unverified\n";

/// The plugin of [`NODE`] on [`INVENTORY`], enforcing with `enforcement`, with
/// `--accept-unverified-isolation` `accept_unverified`.
fn start(server: &FakeApiServer, enforcement: &str, accept_unverified: &str) -> RunningArgs {
    RunningArgs::start(
        server,
        NODE,
        INVENTORY,
        &[
            "--enforcement",
            enforcement,
            "--accept-unverified-isolation",
            accept_unverified,
        ],
    )
}

fn isolation(device: &Value) -> Option<&str> {
    device["attributes"][names::ATTR_ISOLATION]["string"].as_str()
}

fn shared_class() -> res::DeviceClass {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deviceclasses/shared-gpu.yaml");
    serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A claim of the shipped share class for 100Gi of one GPU (two never fit one H200).
fn big_share(name: &str) -> res::ResourceClaim {
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}")},
        "spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": "shared.gpu.tessera.dev"}}],
            "config": [{"requests": ["gpu"], "opaque": {"driver": "gpu.tessera.dev", "parameters": {
                "apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuShare", "memory": "100Gi"}}}]
        }}
    }))
    .unwrap()
}

/// Allocates two big shares, one after the other, on what the plugin published; the devices
/// they got (`None`: not allocated).
fn allocate_two(server: &FakeApiServer) -> Vec<Option<String>> {
    let slices: Vec<res::ResourceSlice> = server
        .objects("resourceslices")
        .into_iter()
        .map(|s| serde_json::from_value(s).unwrap())
        .collect();
    let mut snap = Snapshot::new(&slices, &[shared_class()], &[]).unwrap();
    let allocator = Allocator::new(AllocatorOptions::default());
    let node = tessera_driver::tools::batch::bare_node(NODE);
    let mut got = Vec::new();
    for name in ["first", "second"] {
        let claim = big_share(name);
        match allocator.allocate(&snap, &[&claim], std::slice::from_ref(&node)) {
            Ok(placement) => {
                let allocation = placement.allocations[0].clone();
                snap.commit(&claim, &allocation);
                got.push(Some(
                    allocation.devices.unwrap().results.unwrap()[0]
                        .device
                        .clone(),
                ));
            }
            Err(_) => got.push(None),
        }
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unverified_gpu_offers_no_shares_by_default() {
    let server = server_with_node(NODE).await;
    let plugin = start(&server, "mps", "false");
    wait_for_device(&server, "gpu-0", "verified", |d| {
        isolation(d) == Some(names::ISOLATION_VERIFIED)
    })
    .await;
    wait_for_device(&server, "gpu-1", "unverified", |d| {
        isolation(d) == Some(names::ISOLATION_UNVERIFIED)
            && d["attributes"][names::ATTR_ISOLATION_REASON]["string"] == "limit-not-enforced"
    })
    .await;
    // The shipped class places the first share on the verified GPU and no share on the other.
    assert_eq!(allocate_two(&server), [Some("gpu-0".to_owned()), None]);
    plugin.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_accepts_unverified_isolation_explicitly() {
    let server = server_with_node(NODE).await;
    let plugin = start(&server, "mps", "true");
    wait_for_device(&server, "gpu-0", "verified", |d| {
        isolation(d) == Some(names::ISOLATION_VERIFIED)
    })
    .await;
    wait_for_device(&server, "gpu-1", "accepted", |d| {
        isolation(d) == Some(names::ISOLATION_ACCEPTED)
    })
    .await;
    assert_eq!(
        allocate_two(&server),
        [Some("gpu-0".to_owned()), Some("gpu-1".to_owned())]
    );
    plugin.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_enforcement_offers_no_shares_by_default() {
    let server = server_with_node(NODE).await;
    let plugin = start(&server, "none", "false");
    for gpu in ["gpu-0", "gpu-1"] {
        wait_for_device(&server, gpu, "unverified (no enforcement)", |d| {
            isolation(d) == Some(names::ISOLATION_UNVERIFIED)
                && d["attributes"][names::ATTR_ISOLATION_REASON]["string"] == "no-enforcement"
        })
        .await;
    }
    assert_eq!(allocate_two(&server), [None, None]);
    plugin.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_that_does_not_follow_its_inventory_still_publishes_it() {
    let server = server_with_node(NODE).await;
    let plugin = RunningArgs::start(&server, NODE, INVENTORY, &["--inventory-poll-seconds", "0"]);
    wait_for_device(&server, "gpu-1", "published", |_| true).await;
    // Deleted by someone else (kubelet wipes a node's slices at its start): published again.
    for slice in server.objects("resourceslices") {
        let name = slice["metadata"]["name"].as_str().unwrap().to_owned();
        server.delete("resourceslices", None, &name).unwrap();
    }
    wait_for_device(&server, "gpu-0", "published again", |_| true).await;
    plugin.stop().await;
}
