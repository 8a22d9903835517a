//! Fixture builders for tests and benches: nodes, inventories, devices, slices, classes,
//! claims and their opaque config, built the same way by every test that needs one.
//!
//! Compiled for this crate's own tests, and for other targets through the `testing` cargo
//! feature (`tessera-driver = { ..., features = ["testing"] }` as a dev-dependency). Nothing
//! outside tests and benches may use it. A builder panics on a bad literal: a fixture that
//! cannot be built is a broken test, not an input to handle.
//!
//! May import: every wing (it only builds their inputs).
#![allow(clippy::missing_panics_doc)] // Reason: a fixture panics on a bad literal, by design.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1 as res;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity as K8sQuantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
use serde_json::{Value, json};

use crate::names;
use crate::node::inventory::{Inventory, NodeInventory};
use crate::node::mps::{MpsDaemon, mps_daemon_id};
use crate::rules::config::AppliedConfig;

/// The driver name every fixture publishes and configures under.
pub const DRIVER: &str = names::DEFAULT_DRIVER_NAME;

/// The shipped `shared.gpu.tessera.dev` DeviceClass, as YAML.
pub const SHARED_CLASS_YAML: &str = include_str!("../../deviceclasses/shared-gpu.yaml");
/// The shipped `batch.gpu.tessera.dev` DeviceClass, as YAML.
pub const BATCH_CLASS_YAML: &str = include_str!("../../deviceclasses/batch-gpu.yaml");
/// The shipped `gpu.tessera.dev` (whole GPU) DeviceClass, as YAML.
pub const WHOLE_CLASS_YAML: &str = include_str!("../../deviceclasses/gpu.yaml");

/// The inventory written in `yaml` (the fake-inventory format).
pub fn inventory(yaml: &str) -> Inventory {
    Inventory::from_yaml(yaml).expect("a valid fixture inventory")
}

/// The first node of the inventory written in `yaml`.
pub fn node_inventory(yaml: &str) -> NodeInventory {
    inventory(yaml)
        .nodes
        .into_iter()
        .next()
        .expect("a fixture inventory with a node")
}

/// Node `name` of the shipped example cluster, `examples/inventory/demo-cluster.yaml`.
pub fn demo_node(name: &str) -> NodeInventory {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/inventory/demo-cluster.yaml"
    ))
    .expect("the example inventory");
    inventory(&text)
        .node(name)
        .cloned()
        .expect("the node in the example inventory")
}

/// A DeviceClass read from YAML (such as one of the shipped classes above).
pub fn class_from_yaml(yaml: &str) -> res::DeviceClass {
    serde_yaml::from_str(yaml).expect("a valid fixture DeviceClass")
}

/// A Kubernetes Node with only a name.
pub fn k8s_node(name: &str) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..ObjectMeta::default()
        },
        ..Node::default()
    }
}

/// The MPS daemon of the GPU set `uuids` (in that device order), under the default
/// `/run/tessera/mps` pipe root and `/var/log/tessera/mps` log root.
pub fn mps_daemon(uuids: &[&str]) -> MpsDaemon {
    let id = mps_daemon_id(uuids);
    MpsDaemon {
        pipe_dir: format!("/run/tessera/mps/{id}/pipe"),
        shm_dir: format!("/run/tessera/mps/{id}/shm"),
        log_dir: format!("/var/log/tessera/mps/{id}"),
        id,
        devices: uuids.iter().map(|u| (*u).to_owned()).collect(),
        user: None,
    }
}

/// A map of labels or annotations from `(key, value)` pairs.
pub fn string_map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// A Kubernetes quantity, as written.
pub fn quantity(s: &str) -> K8sQuantity {
    K8sQuantity(s.into())
}

/// A string device attribute.
pub fn string_attr(v: &str) -> res::DeviceAttribute {
    res::DeviceAttribute {
        string: Some(v.into()),
        ..Default::default()
    }
}

/// A capacity request policy: `default`, and the range `min..=max` in steps of `step`.
pub fn capacity_policy(
    default: &str,
    min: &str,
    max: &str,
    step: &str,
) -> res::CapacityRequestPolicy {
    res::CapacityRequestPolicy {
        default: Some(quantity(default)),
        valid_range: Some(res::CapacityRequestPolicyRange {
            min: quantity(min),
            max: Some(quantity(max)),
            step: Some(quantity(step)),
        }),
        valid_values: None,
    }
}

/// A published GPU device named `name` with string `attributes`, `memory` and 100 compute.
/// `multi` lets it be allocated many times, with request policies: memory from 1Gi in 1Gi
/// steps (default 1Gi), compute from 0 in steps of 5 (default 0).
pub fn gpu_device(
    name: &str,
    attributes: &[(&str, &str)],
    memory: &str,
    multi: bool,
) -> res::Device {
    let attributes = attributes
        .iter()
        .map(|(k, v)| ((*k).to_owned(), string_attr(v)))
        .collect::<BTreeMap<_, _>>();
    let mut capacity = BTreeMap::new();
    capacity.insert(
        names::CAP_MEMORY.to_owned(),
        res::DeviceCapacity {
            value: quantity(memory),
            request_policy: multi.then(|| capacity_policy("1Gi", "1Gi", memory, "1Gi")),
        },
    );
    capacity.insert(
        names::CAP_COMPUTE.to_owned(),
        res::DeviceCapacity {
            value: quantity("100"),
            request_policy: multi.then(|| capacity_policy("0", "0", "100", "5")),
        },
    );
    res::Device {
        name: name.into(),
        attributes: Some(attributes),
        capacity: Some(capacity),
        allow_multiple_allocations: multi.then_some(true),
        ..Default::default()
    }
}

/// ResourceSlice `name` of node `node`: the whole pool `node` (generation 1, one slice).
pub fn slice(name: &str, node: &str, devices: Vec<res::Device>) -> res::ResourceSlice {
    res::ResourceSlice {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..ObjectMeta::default()
        },
        spec: res::ResourceSliceSpec {
            driver: DRIVER.into(),
            node_name: Some(node.into()),
            pool: res::ResourcePool {
                name: node.into(),
                generation: 1,
                resource_slice_count: 1,
            },
            devices: Some(devices),
            ..Default::default()
        },
    }
}

/// DeviceClass `name` selecting with one CEL expression.
pub fn cel_class(name: &str, expression: &str) -> res::DeviceClass {
    res::DeviceClass {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..ObjectMeta::default()
        },
        spec: res::DeviceClassSpec {
            selectors: Some(vec![res::DeviceSelector {
                cel: Some(res::CELDeviceSelector {
                    expression: expression.into(),
                }),
            }]),
            ..Default::default()
        },
    }
}

/// DeviceClass `name` selecting this driver's devices whose `sharing` attribute is `sharing`.
pub fn sharing_class(name: &str, sharing: &str) -> res::DeviceClass {
    cel_class(
        name,
        &format!(
            r#"device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].sharing == "{sharing}""#
        ),
    )
}

/// Request `name` for exactly `count` devices of `class`.
pub fn exact_request(name: &str, class: &str, count: i64) -> res::DeviceRequest {
    res::DeviceRequest {
        name: name.into(),
        exactly: Some(res::ExactDeviceRequest {
            device_class_name: class.into(),
            count: Some(count),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// ResourceClaim `namespace/name` with `uid`, asking for `devices`, not allocated.
pub fn claim(
    namespace: &str,
    name: &str,
    uid: &str,
    devices: res::DeviceClaim,
) -> res::ResourceClaim {
    res::ResourceClaim {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(namespace.into()),
            uid: Some(uid.into()),
            ..ObjectMeta::default()
        },
        spec: res::ResourceClaimSpec {
            devices: Some(devices),
        },
        status: None,
    }
}

/// Opaque config for this driver with `parameters`, for every request of the claim.
pub fn opaque_config(parameters: Value) -> res::DeviceClaimConfiguration {
    res::DeviceClaimConfiguration {
        requests: None,
        opaque: Some(opaque(parameters)),
    }
}

/// The opaque part of a config for this driver with `parameters`.
pub fn opaque(parameters: Value) -> res::OpaqueDeviceConfiguration {
    res::OpaqueDeviceConfiguration {
        driver: DRIVER.into(),
        parameters: RawExtension(parameters),
    }
}

/// `list` as configs that apply to every request, each named `field` in messages.
pub fn applied<'a>(
    list: &'a [res::OpaqueDeviceConfiguration],
    field: &'a str,
) -> Vec<AppliedConfig<'a>> {
    list.iter()
        .map(|o| AppliedConfig {
            requests: &[],
            opaque: o,
            field,
        })
        .collect()
}

/// The parameters of a `GpuShare` of `memory`.
pub fn gpu_share(memory: &str) -> Value {
    json!({"apiVersion": names::CONFIG_API_VERSION, "kind": names::GPU_SHARE_KIND, "memory": memory})
}

/// ResourceClaim `default/name` (uid `uid-<name>`) with one request `gpu` for a device of
/// `class`, and, where given, opaque `parameters` for that request.
pub fn gpu_claim(name: &str, class: &str, parameters: Option<Value>) -> res::ResourceClaim {
    let mut spec = json!({"devices": {
        "requests": [{"name": "gpu", "exactly": {"deviceClassName": class}}]}});
    if let Some(parameters) = parameters {
        spec["devices"]["config"] = json!([{"requests": ["gpu"], "opaque": {
            "driver": DRIVER, "parameters": parameters}}]);
    }
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}")},
        "spec": spec,
    }))
    .expect("a valid fixture ResourceClaim")
}

/// `claim`'s allocation; panics when it has none.
pub fn allocation(claim: &res::ResourceClaim) -> &res::AllocationResult {
    claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .expect("an allocated claim")
}

/// The device results of `allocation`; panics when it has none.
pub fn results(allocation: &res::AllocationResult) -> &[res::DeviceRequestAllocationResult] {
    allocation
        .devices
        .as_ref()
        .and_then(|d| d.results.as_deref())
        .expect("an allocation with device results")
}

/// The device of the first result of `claim`'s allocation.
pub fn first_device(claim: &res::ResourceClaim) -> String {
    results(allocation(claim))[0].device.clone()
}
