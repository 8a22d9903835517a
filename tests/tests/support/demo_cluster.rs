//! The repository's demo cluster (`examples/inventory/demo-cluster.yaml`) and its example
//! objects, for the tests that drive the plugin on claims the batch allocator placed there.
#![allow(dead_code, reason = "each test file uses a subset")]

use std::path::Path;

use k8s_openapi::api::resource::v1 as res;
use serde::Deserialize as _;
use tessera_driver::apiversion::{Object, decode_document};
use tessera_driver::names;
use tessera_driver::node::inventory::{Inventory, NodeInventory};
use tessera_driver::node::slices::{self, RenderOptions};
use tessera_driver::tools::batch::{BatchInput, BatchOptions, ClaimOutcome, allocate_batch};

/// The repository's root.
pub(crate) fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
}

/// The objects of the YAML file at `path`, one a document.
pub(crate) fn load(path: &Path) -> Vec<Object> {
    let text = std::fs::read_to_string(path).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| {
            let value = serde_json::Value::deserialize(doc).unwrap();
            decode_document(value, &path.display().to_string()).unwrap()
        })
        .collect()
}

/// The demo cluster's inventory.
pub(crate) fn inventory() -> Inventory {
    let text =
        std::fs::read_to_string(repo().join("examples/inventory/demo-cluster.yaml")).unwrap();
    Inventory::from_yaml(&text).unwrap()
}

/// Node `name` of the demo cluster's inventory.
pub(crate) fn node(name: &str) -> NodeInventory {
    inventory().node(name).cloned().unwrap()
}

/// `claims` allocated by the batch allocator (the default driver name and policy) with
/// `classes` on the ResourceSlices of `inventory`'s nodes, rendered with consumable capacity;
/// one outcome a claim, in the claims' order.
pub(crate) fn allocate(
    inventory: &Inventory,
    classes: &[res::DeviceClass],
    claims: &[res::ResourceClaim],
) -> Vec<ClaimOutcome> {
    let render = RenderOptions {
        driver_name: names::DEFAULT_DRIVER_NAME.to_owned(),
        consumable_capacity: true,
        ..RenderOptions::default()
    };
    let slices: Vec<res::ResourceSlice> = inventory
        .nodes
        .iter()
        .flat_map(|n| slices::render(n, &render).unwrap())
        .collect();
    allocate_batch(
        &BatchInput {
            classes,
            slices: &slices,
            claims,
            nodes: &[],
            pods: &[],
        },
        &BatchOptions {
            driver_name: names::DEFAULT_DRIVER_NAME.to_owned(),
            policy: tessera_driver::placement::allocator::Policy::default(),
            node: None,
        },
    )
    .unwrap()
}
