//! Scenarios of the kubelet plugin against an API server, written only against a kube client
//! so they run the same on the fake API server and on a real kube-apiserver.
#![allow(dead_code, reason = "each test file uses a subset")]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, DynamicObject, ListParams, PostParams};
use serde_json::{Value, json};
use tessera_driver::apiversion::ApiVersion;
use tessera_driver::names;
use tessera_driver::node::cdi::Enforcement;
use tessera_driver::node::inventory::{Inventory, NodeInventory};
use tessera_kubelet_plugin::claims::apiserver::ApiClaimSource;
use tessera_kubelet_plugin::claims::preparer::{CdiPreparer, CdiPreparerConfig};
use tessera_kubelet_plugin::kubelet::server::{self, PluginConfig};
use tessera_kubelet_plugin::publisher::{PublisherConfig, SlicePublisher};
use tessera_proto::dra::v1;

use crate::plugin_run::connect;

pub(crate) const DRIVER: &str = names::DEFAULT_DRIVER_NAME;
pub(crate) const NODE: &str = "a100-node";

pub(crate) fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
}

pub(crate) fn node_inventory() -> NodeInventory {
    let text =
        std::fs::read_to_string(repo().join("examples/inventory/demo-cluster.yaml")).unwrap();
    Inventory::from_yaml(&text)
        .unwrap()
        .node(NODE)
        .cloned()
        .unwrap()
}

/// Creates the Node object the slices are owned by; returns its UID.
pub(crate) async fn create_node(client: &kube::Client) -> String {
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE}},
    }))
    .unwrap();
    let api = Api::<Node>::all(client.clone());
    let created = match api.create(&PostParams::default(), &node).await {
        Ok(n) => n,
        // A real API server is shared by the scenarios of one run.
        Err(kube::Error::Api(s)) if s.code == 409 => api.get(NODE).await.unwrap(),
        Err(e) => panic!("creating Node {NODE}: {e}"),
    };
    created.metadata.uid.unwrap()
}

pub(crate) fn fast_config() -> PublisherConfig {
    PublisherConfig {
        initial_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(80),
        ..PublisherConfig::new(DRIVER, NODE)
    }
}

pub(crate) fn slices_api(client: &kube::Client, version: ApiVersion) -> Api<DynamicObject> {
    Api::all_with(
        client.clone(),
        &tessera_kubeapi::resource(version, tessera_driver::names::RESOURCE_SLICE),
    )
}

/// The node's slices as stored, by name, as JSON.
pub(crate) async fn stored_slices(
    client: &kube::Client,
    version: ApiVersion,
) -> BTreeMap<String, Value> {
    slices_api(client, version)
        .list(&ListParams::default().fields(&format!("spec.nodeName={NODE}")))
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|o| {
            let v = serde_json::to_value(&o).unwrap();
            (v["metadata"]["name"].as_str().unwrap().to_owned(), v)
        })
        .collect()
}

/// Publishes the node's pool and checks the stored objects have the shape of `version`.
pub(crate) async fn publish_and_check_shape(client: &kube::Client, version: ApiVersion) {
    let node_uid = create_node(client).await;
    assert_eq!(
        tessera_kubeapi::served_resource_version(client)
            .await
            .unwrap(),
        version
    );
    let slice_publisher = SlicePublisher::new(client.clone(), fast_config());
    let published = slice_publisher
        .publish_once(&node_inventory())
        .await
        .unwrap();
    assert_eq!(published.version, version);
    assert_eq!(published.generation, 1);
    assert!(published.changed);

    let stored = stored_slices(client, version).await;
    assert_eq!(stored.keys().cloned().collect::<Vec<_>>(), published.slices);
    let gpus = node_inventory().gpus.len();
    let mut devices = 0;
    for slice in stored.values() {
        if let Some(kind) = slice.get("apiVersion") {
            assert_eq!(kind, version.as_str(), "{slice}");
        }
        assert_eq!(slice["spec"]["driver"], DRIVER);
        assert_eq!(slice["spec"]["nodeName"], NODE);
        assert_eq!(slice["spec"]["pool"]["name"], NODE);
        assert_eq!(slice["spec"]["pool"]["generation"], 1);
        assert_eq!(
            slice["metadata"]["labels"][names::LABEL_MANAGED_BY],
            names::KUBELET_PLUGIN_MANAGER
        );
        let owner = &slice["metadata"]["ownerReferences"][0];
        assert_eq!(owner["kind"], "Node");
        assert_eq!(owner["name"], NODE);
        assert_eq!(owner["uid"], node_uid.as_str());
        for device in slice["spec"]["devices"].as_array().unwrap() {
            devices += 1;
            let fields = if version == ApiVersion::V1beta1 {
                assert!(device.get("capacity").is_none(), "{device}");
                &device["basic"]
            } else {
                assert!(device.get("basic").is_none(), "{device}");
                device
            };
            assert!(
                fields["capacity"]["memory"]["value"].is_string(),
                "{device}"
            );
            assert_eq!(fields["attributes"]["type"]["string"], "gpu", "{device}");
        }
    }
    assert_eq!(devices, gpus);

    // Nothing changed: nothing written, same generation.
    let again = slice_publisher
        .publish_once(&node_inventory())
        .await
        .unwrap();
    assert!(!again.changed);
    assert_eq!(again.generation, 1);
    // A new publisher (a plugin restart) finds the generation from the stored slices.
    let restarted = SlicePublisher::new(client.clone(), fast_config());
    let after_restart = restarted.publish_once(&node_inventory()).await.unwrap();
    assert!(!after_restart.changed);
    assert_eq!(after_restart.generation, 1);
}

/// One device per slice; then a GPU goes away: the generation is bumped everywhere and the
/// surplus slice deleted.
pub(crate) async fn republish_after_inventory_change(client: &kube::Client, version: ApiVersion) {
    create_node(client).await;
    let config = PublisherConfig {
        max_devices_per_slice: 1,
        ..fast_config()
    };
    let slice_publisher = SlicePublisher::new(client.clone(), config);
    let mut node = node_inventory();
    assert!(node.gpus.len() >= 2, "the demo node has several GPUs");
    let first = slice_publisher.publish(&node).await;
    assert_eq!(first.slices.len(), node.gpus.len());
    node.gpus.pop();
    let second = slice_publisher.publish(&node).await;
    assert!(second.changed);
    assert_eq!(second.generation, first.generation + 1);
    assert_eq!(second.slices.len(), node.gpus.len());
    let stored = stored_slices(client, version).await;
    assert_eq!(stored.keys().cloned().collect::<Vec<_>>(), second.slices);
    for slice in stored.values() {
        assert_eq!(slice["spec"]["pool"]["generation"], second.generation);
        assert_eq!(slice["spec"]["pool"]["resourceSliceCount"], node.gpus.len());
    }
}

/// A v1 (or v1beta1) ResourceClaim allocated one whole GPU of the node.
pub(crate) fn allocated_claim(version: ApiVersion, name: &str) -> (Value, Value) {
    let request = if version == ApiVersion::V1beta1 {
        json!({"name": "gpu", "deviceClassName": "gpu.tessera.dev"})
    } else {
        json!({"name": "gpu", "exactly": {"deviceClassName": "gpu.tessera.dev"}})
    };
    let claim = json!({
        "apiVersion": version.as_str(),
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [request]}},
    });
    let status = json!({
        "allocation": {
            "devices": {
                "results": [{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0"}],
            },
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [NODE]}
            ]}]},
        },
    });
    (claim, status)
}

/// Creates the claim and writes its allocation through the status subresource; returns its UID.
pub(crate) async fn create_allocated_claim(
    client: &kube::Client,
    version: ApiVersion,
    name: &str,
) -> String {
    let api: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        "default",
        &tessera_kubeapi::resource(version, tessera_driver::names::RESOURCE_CLAIM),
    );
    let (claim, status) = allocated_claim(version, name);
    let mut created = api
        .create(
            &PostParams::default(),
            &serde_json::from_value(claim).unwrap(),
        )
        .await
        .unwrap();
    created.data["status"] = status;
    let updated = api
        .replace_status(name, &PostParams::default(), &created)
        .await
        .unwrap();
    updated.metadata.uid.unwrap()
}

/// Prepares through the real DRA socket with claims fetched from the API server: the right
/// UID prepares, a wrong UID is that claim's error.
pub(crate) async fn prepare_through_kubelet(
    client: &kube::Client,
    version: ApiVersion,
    dir: &Path,
) {
    let uid = create_allocated_claim(client, version, "whole-gpu").await;
    let source = ApiClaimSource::new(client.clone());
    let path = |name: &str| -> PathBuf { dir.join(name) };
    let preparer = CdiPreparer::new(
        CdiPreparerConfig {
            driver_name: DRIVER.to_owned(),
            cdi_dir: path("cdi"),
            state_dir: path("state"),
            enforcement: Enforcement::None,
            boot_id: "boot-1".to_owned(),
        },
        node_inventory(),
        Arc::new(source),
    )
    .unwrap();
    let plugin = server::start(
        PluginConfig {
            driver_name: DRIVER.to_owned(),
            registration_dir: path("registry"),
            plugin_dir: path("plugin"),
        },
        Arc::new(preparer),
    )
    .unwrap();
    let mut kubelet =
        v1::dra_plugin_client::DraPluginClient::new(connect(&plugin.config().dra_socket()).await);
    let claim = |name: &str, uid: &str| v1::Claim {
        namespace: "default".to_owned(),
        name: name.to_owned(),
        uid: uid.to_owned(),
    };
    let answer = kubelet
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![
                claim("whole-gpu", &uid),
                claim("whole-gpu", "someone-else"),
                claim("missing", "uid-missing"),
            ],
        })
        .await
        .unwrap()
        .into_inner()
        .claims;
    let good = &answer[&uid];
    assert_eq!(good.error, "");
    assert_eq!(good.devices.len(), 1);
    assert_eq!(good.devices[0].device_name, "gpu-0");
    assert_eq!(
        good.devices[0].cdi_device_ids,
        vec![format!("{}={uid}-gpu-0", names::CDI_KIND)]
    );
    let wrong = &answer["someone-else"].error;
    assert!(wrong.contains("UID"), "{wrong}");
    let missing = &answer["uid-missing"].error;
    assert!(missing.contains("not found"), "{missing}");
    plugin.shutdown().await.unwrap();
}

/// The pool generation of the node's stored slices when they are exactly the slices
/// `expected` names, each with its devices, all of one generation above `above`.
async fn restored(
    client: &kube::Client,
    version: ApiVersion,
    expected: &BTreeMap<String, usize>,
    above: i64,
) -> Option<i64> {
    let stored = stored_slices(client, version).await;
    let names: Vec<&String> = stored.keys().collect();
    if names != expected.keys().collect::<Vec<_>>() {
        return None;
    }
    let mut generations = std::collections::BTreeSet::new();
    for (name, slice) in &stored {
        let devices = slice["spec"]["devices"].as_array().map_or(0, Vec::len);
        if devices != expected[name] {
            return None;
        }
        generations.insert(slice["spec"]["pool"]["generation"].as_i64()?);
    }
    let generation = *generations.first()?;
    (generations.len() == 1 && generation > above).then_some(generation)
}

/// Removes every device of the stored slice `name` (someone else's edit).
pub(crate) async fn strip_devices(client: &kube::Client, version: ApiVersion, name: &str) {
    let api = slices_api(client, version);
    let mut slice = api.get(name).await.unwrap();
    slice.data["spec"]["devices"] = json!([]);
    api.replace(name, &PostParams::default(), &slice)
        .await
        .unwrap();
}

/// The running plugin keeps its slices true: after kubelet's wipe (a delete-collection of
/// every slice of the node) and after edits they come back, after each edit exactly one
/// generation up, so its own writes never start another publication. Returns the number of
/// slices and the generations seen: first publication, after the wipe, after each of two
/// edits.
pub(crate) async fn slices_come_back(
    client: &kube::Client,
    version: ApiVersion,
) -> (usize, [i64; 4]) {
    use kube::api::DeleteParams;
    create_node(client).await;
    let config = PublisherConfig {
        max_devices_per_slice: 2,
        drift_settle: Duration::from_millis(10),
        ..fast_config()
    };
    let publisher = Arc::new(SlicePublisher::new(client.clone(), config));
    let node = node_inventory();
    let (_inventory, receiver) = tokio::sync::watch::channel(node.clone());
    let running = Arc::clone(&publisher).spawn(receiver);
    let rendered = tessera_driver::node::slices::render(
        &node,
        &tessera_driver::node::slices::RenderOptions {
            max_devices_per_slice: 2,
            consumable_capacity: version == ApiVersion::V1,
            ..Default::default()
        },
    )
    .unwrap();
    let expected: BTreeMap<String, usize> = rendered
        .iter()
        .map(|s| {
            (
                s.metadata.name.clone().unwrap(),
                s.spec.devices.as_ref().map_or(0, Vec::len),
            )
        })
        .collect();
    assert!(expected.len() >= 2, "the demo node fills several slices");

    let mut generations = [0; 4];
    let mut above = 0;
    for (step, generation) in generations.iter_mut().enumerate() {
        match step {
            0 => {}
            // What kubelet does at its start: every slice of the node goes, whatever driver.
            1 => {
                slices_api(client, version)
                    .delete_collection(
                        &DeleteParams::default(),
                        &ListParams::default().fields(&format!("spec.nodeName={NODE}")),
                    )
                    .await
                    .unwrap();
            }
            _ => {
                let name = expected.keys().nth(step - 2).unwrap();
                strip_devices(client, version, name).await;
            }
        }
        let deadline = std::time::Instant::now() + Duration::from_mins(1);
        *generation = loop {
            if let Some(g) = restored(client, version, &expected, above).await {
                break g;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "timed out: the slices are not restored (step {step})"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        above = *generation;
    }
    running.abort();
    // A real API server deletes a collection one object at a time, so the plugin may recreate
    // a slice that the same wipe then deletes (kubelet's wipe does the same): that costs one
    // more generation. An edit is one write: exactly one publication answers it.
    assert!(generations[1] > generations[0], "{generations:?}");
    assert_eq!(
        generations[2..],
        [generations[1] + 1, generations[1] + 2],
        "one publication per edit, none for the plugin's own writes"
    );
    (expected.len(), generations)
}
