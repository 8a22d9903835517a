//! Every shipped DeviceClass compiles and selects exactly the devices it is meant for on the
//! demo cluster.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use k8s_openapi::api::resource::v1 as res;
use serde::Deserialize;
use tessera_driver::apiversion::{Object, decode_document};
use tessera_driver::node::inventory::Inventory;
use tessera_driver::node::slices::{self, RenderOptions};
use tessera_driver::rules::cel::{CelCache, CelDevice};
use tessera_driver::rules::published::PublishedDevice;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
}

fn classes() -> Vec<res::DeviceClass> {
    let mut classes = Vec::new();
    let mut paths: Vec<_> = std::fs::read_dir(repo().join("deviceclasses"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    paths.sort();
    for path in paths {
        let text = std::fs::read_to_string(&path).unwrap();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let value = serde_json::Value::deserialize(doc).unwrap();
            match decode_document(value, &path.display().to_string()).unwrap() {
                Object::DeviceClass(class) => classes.push(class),
                _ => panic!(
                    "{} holds something other than a DeviceClass",
                    path.display()
                ),
            }
        }
    }
    classes
}

/// (pool/device) of every device of the demo cluster, rendered for 1.34+ and for 1.32.
fn demo_devices(consumable_capacity: bool) -> Vec<(String, res::Device)> {
    let text =
        std::fs::read_to_string(repo().join("examples/inventory/demo-cluster.yaml")).unwrap();
    let inventory = Inventory::from_yaml(&text).unwrap();
    let opts = RenderOptions {
        consumable_capacity,
        ..RenderOptions::default()
    };
    let mut devices = Vec::new();
    for node in &inventory.nodes {
        for slice in slices::render(node, &opts).unwrap() {
            for device in slice.spec.devices.into_iter().flatten() {
                devices.push((format!("{}/{}", slice.spec.pool.name, device.name), device));
            }
        }
    }
    devices
}

fn selected(
    class: &res::DeviceClass,
    devices: &[(String, res::Device)],
    cel: &CelCache,
) -> BTreeSet<String> {
    let exprs: Vec<_> = class
        .spec
        .selectors
        .iter()
        .flatten()
        .map(|s| cel.compile(&s.cel.as_ref().unwrap().expression).unwrap())
        .collect();
    devices
        .iter()
        .filter(|(_, d)| {
            let view = CelDevice::new("gpu.tessera.dev", &PublishedDevice::from(d.clone()));
            exprs.iter().all(|e| e.evaluate(&view).unwrap())
        })
        .map(|(id, _)| id.clone())
        .collect()
}

fn names(node: &str, devices: &[&str]) -> BTreeSet<String> {
    devices.iter().map(|d| format!("{node}/{d}")).collect()
}

#[test]
fn every_class_selects_exactly_its_devices() {
    let cel = CelCache::new();
    let a100: Vec<String> = (0..8).map(|i| format!("gpu-{i}")).collect();
    let a100: Vec<&str> = a100.iter().map(String::as_str).collect();
    let mut shared = names("t4-node", &["gpu-0", "gpu-1", "gpu-2", "gpu-3"]);
    shared.extend(names("h100-node", &["gpu-0", "gpu-1", "gpu-2", "gpu-3"]));
    let mut mig: Vec<String> = (0..7).map(|p| format!("gpu-0-mig-1g-5gb-{p}")).collect();
    mig.extend([
        "gpu-1-mig-3g-20gb-4".to_owned(),
        "gpu-1-mig-2g-10gb-0".to_owned(),
        "gpu-1-mig-2g-10gb-2".to_owned(),
    ]);
    let mig: Vec<&str> = mig.iter().map(String::as_str).collect();

    let mut expected: BTreeMap<&str, BTreeSet<String>> = BTreeMap::new();
    expected.insert("gpu.tessera.dev", names("a100-node", &a100));
    expected.insert("batch.gpu.tessera.dev", shared.clone());
    expected.insert("batch-overcommit.gpu.tessera.dev", shared.clone());
    expected.insert("shared.gpu.tessera.dev", shared);
    expected.insert("mig.gpu.tessera.dev", names("mig-node", &mig));
    expected.insert("a100-80g.gpu.tessera.dev", names("a100-node", &a100));

    for consumable_capacity in [true, false] {
        let devices = demo_devices(consumable_capacity);
        for class in classes() {
            let name = class.metadata.name.clone().unwrap();
            let got = selected(&class, &devices, &cel);
            let want = expected.get(name.as_str()).cloned().unwrap_or_default();
            assert_eq!(
                got, want,
                "class {name} (consumable capacity {consumable_capacity})"
            );
        }
    }
}

#[test]
fn every_model_has_a_class() {
    let classes: BTreeSet<String> = classes()
        .into_iter()
        .filter_map(|c| c.metadata.name)
        .collect();
    for model in tessera_driver::node::inventory::models::MODELS {
        let class = format!("{}.gpu.tessera.dev", model.id);
        assert!(classes.contains(&class), "no DeviceClass {class}");
    }
}

#[test]
fn share_classes_select_only_gpus_whose_isolation_is_verified_or_accepted() {
    let text = "nodes:\n- name: n\n  mode: shared\n  gpus:\n  - model: h200-141g\n  - model: h200-141g\n    isolation: unverified\n  - model: h200-141g\n  - model: h200-141g\n    mode: exclusive\n";
    let mut node = Inventory::from_yaml(text).unwrap().nodes.remove(0);
    // As the kubelet plugin publishes a GPU the admin accepted unverified.
    node.gpus[2].isolation = tessera_driver::node::inventory::Isolation::Accepted;
    let mut devices = Vec::new();
    for slice in slices::render(&node, &RenderOptions::default()).unwrap() {
        for device in slice.spec.devices.into_iter().flatten() {
            devices.push((format!("n/{}", device.name), device));
        }
    }
    // A shared device published before the attribute existed is not selected either.
    let mut old = devices[0].clone();
    old.0 = "n/old".to_owned();
    if let Some(attrs) = old.1.attributes.as_mut() {
        attrs.remove("isolation");
    }
    devices.push(old);
    let cel = CelCache::new();
    for class in classes() {
        let name = class.metadata.name.clone().unwrap();
        if !["shared", "batch", "batch-overcommit"]
            .iter()
            .any(|c| name == format!("{c}.gpu.tessera.dev"))
        {
            continue;
        }
        assert_eq!(
            selected(&class, &devices, &cel),
            names("n", &["gpu-0", "gpu-2"]),
            "{name}"
        );
    }
}
