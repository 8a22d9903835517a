//! `tessera allocate`, `validate` and `demo` with pods written for device plugins: one run per
//! row of the mapping table (docs/migration.md), through the real binary.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::{Path, PathBuf};
use std::process::Output;

use serde_json::{Value, json};
use tessera_driver::node::inventory::Inventory;
use tessera_driver::node::slices::{self, RenderOptions};

mod support;
use support::{assert_success, tessera};

/// Three nodes: whole V100s, shared A10s and L20s, an A100 40 GB cut into 1g.5gb instances.
const INVENTORY: &str = "
nodes:
- name: whole-node
  gpus:
  - model: v100-32g
    count: 2
- name: shared-node
  mode: shared
  gpus:
  - model: a10-24g
    count: 2
  - model: l20-48g
    count: 2
- name: mig-node
  gpus:
  - model: a100-40g
    mig:
    - profile: 1g.5gb
      count: 7
";

fn slices_file(dir: &Path) -> PathBuf {
    let inventory = Inventory::from_yaml(INVENTORY).unwrap();
    let mut text = String::new();
    for node in &inventory.nodes {
        for slice in slices::render(node, &RenderOptions::default()).unwrap() {
            let mut value = serde_json::to_value(&slice).unwrap();
            value["apiVersion"] = json!("resource.k8s.io/v1");
            value["kind"] = json!("ResourceSlice");
            text.push_str("---\n");
            text.push_str(&serde_yaml::to_string(&value).unwrap());
        }
    }
    let path = dir.join("slices.yaml");
    std::fs::write(&path, text).unwrap();
    path
}

fn pod(limits: &Value, labels: &Value) -> String {
    serde_yaml::to_string(&json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "legacy", "namespace": "default", "labels": labels},
        "spec": {"containers": [{"name": "main", "image": "cuda", "resources": {"limits": limits}}]},
    }))
    .unwrap()
}

/// Runs `tessera allocate -o json` on the shipped classes, the test cluster and one pod.
fn run_allocate(limits: &Value, labels: &Value) -> Output {
    let dir = tempfile::tempdir().unwrap();
    let slices = slices_file(dir.path());
    let pods = dir.path().join("pod.yaml");
    std::fs::write(&pods, pod(limits, labels)).unwrap();
    tessera(&[
        "allocate",
        "-f",
        "deviceclasses",
        slices.to_str().unwrap(),
        pods.to_str().unwrap(),
        "-o",
        "json",
    ])
}

/// `tessera allocate -o json` of the shipped classes, the test cluster and one pod.
fn allocate(limits: &Value, labels: &Value) -> Value {
    let out = run_allocate(limits, labels);
    assert!(
        out.status.success(),
        "{limits}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `(pool, device)` of every result; `(memory, compute)` of every recorded per-device share.
type Placed = (Vec<(String, String)>, Vec<(String, i64)>);

/// The (pool, device) of every result, and every per-device share the allocation records.
fn placed(result: &Value) -> Placed {
    assert_eq!(result["allocated"], true, "{result}");
    let allocation = &result["allocation"]["devices"];
    let devices = allocation["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["pool"].as_str().unwrap().to_owned(),
                r["device"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let shares = allocation["config"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|c| c["opaque"]["parameters"]["kind"] == "AllocatedShares")
        .flat_map(|c| {
            c["opaque"]["parameters"]["devices"]
                .as_array()
                .unwrap()
                .clone()
        })
        .map(|d| {
            (
                d["memory"].as_str().unwrap().to_owned(),
                d["compute"].as_i64().unwrap(),
            )
        })
        .collect();
    (devices, shares)
}

fn only_result(json: &Value) -> &Value {
    let results = json["results"].as_array().unwrap();
    assert_eq!(results.len(), 1, "{json}");
    assert_eq!(results[0]["name"], "legacy-tessera-main", "{json}");
    &results[0]
}

/// Where the one container of a pod with `limits` and no labels is placed.
fn placed_alone(limits: &Value) -> Placed {
    placed(only_result(&allocate(limits, &json!({}))))
}

#[test]
fn nvidia_gpu_gets_whole_gpus() {
    let (devices, shares) = placed_alone(&json!({"nvidia.com/gpu": 2}));
    assert_eq!(devices.len(), 2);
    assert!(
        devices.iter().all(|(pool, _)| pool == "whole-node"),
        "{devices:?}"
    );
    assert!(shares.is_empty());
}

#[test]
fn nvidia_mig_gets_an_instance_of_the_profile() {
    let (devices, _) = placed_alone(&json!({"nvidia.com/mig-1g.5gb": 1}));
    assert_eq!(devices.len(), 1);
    assert_eq!(devices[0].0, "mig-node");
    assert!(devices[0].1.contains("mig-1g-5gb"), "{devices:?}");
}

#[test]
fn nvidia_gpu_shared_gets_a_quarter_of_a_card() {
    let (devices, shares) = placed_alone(&json!({"nvidia.com/gpu.shared": 1}));
    assert_eq!(devices[0].0, "shared-node");
    // A quarter of an A10's 23028 MiB, in whole MiB.
    assert_eq!(shares, [("5757Mi".to_owned(), 0)]);
}

#[test]
fn baidu_cards_alone_get_whole_gpus_of_the_model() {
    let (devices, shares) = placed_alone(&json!({"baidu.com/v100_32g_cgpu": 1}));
    assert_eq!(devices[0].0, "whole-node");
    assert!(shares.is_empty());
    // A model the cluster does not have is a claim that does not fit, not an error.
    let json = allocate(&json!({"baidu.com/t4_16g_cgpu": 1}), &json!({}));
    assert_eq!(only_result(&json)["allocated"], false, "{json}");
}

#[test]
fn a_baidu_share_splits_its_totals_over_its_cards_of_the_model() {
    let (devices, shares) = placed_alone(
        &json!({"baidu.com/a10_24g_cgpu": 2, "baidu.com/a10_24g_cgpu_memory": 10, "baidu.com/a10_24g_cgpu_core": 50}),
    );
    assert_eq!(devices.len(), 2);
    assert_ne!(devices[0], devices[1]);
    assert_eq!(shares, [("5Gi".to_owned(), 25), ("5Gi".to_owned(), 25)]);
}

#[test]
fn a_baidu_memory_percent_is_of_each_card() {
    let (devices, shares) =
        placed_alone(&json!({"baidu.com/l20_cgpu": 1, "baidu.com/l20_cgpu_memory_percent": 50}));
    assert_eq!(devices.len(), 1);
    // Half of an L20's 46068 MiB.
    assert_eq!(shares, [("23034Mi".to_owned(), 0)]);
}

#[test]
fn aliyun_memory_spreads_over_the_labelled_cards() {
    let json = allocate(
        &json!({"aliyun.com/gpu-mem": 8}),
        &json!({"aliyun.com/gpu-count": "2"}),
    );
    let results = json["results"].as_array().unwrap();
    assert_eq!(results[0]["name"], "legacy-tessera", "{json}");
    let (devices, shares) = placed(&results[0]);
    assert_eq!(devices.len(), 2);
    assert_eq!(shares, [("4Gi".to_owned(), 0), ("4Gi".to_owned(), 0)]);
}

#[test]
fn hami_sizes_are_per_card_rounded_up_with_a_warning() {
    let out = run_allocate(
        &json!({"nvidia.com/gpu": 1, "nvidia.com/gpumem": 3000, "nvidia.com/gpucores": 30}),
        &json!({}),
    );
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("warning: Pod default/legacy") && stderr.contains("rounded up to 3Gi"),
        "{stderr}"
    );
    let json: Value = serde_json::from_slice(&out.stdout).unwrap();
    let (_, shares) = placed(only_result(&json));
    assert_eq!(shares, [("3Gi".to_owned(), 30)]);
}

#[test]
fn a_bad_device_plugin_pod_exits_2_from_allocate_and_is_explained_by_validate() {
    let dir = tempfile::tempdir().unwrap();
    let pods = dir.path().join("pod.yaml");
    std::fs::write(
        &pods,
        pod(
            &json!({"baidu.com/v100_32g_cgpu": 1, "baidu.com/v100_32g_cgpu_core": 50}),
            &json!({}),
        ),
    )
    .unwrap();
    let out = tessera(&["allocate", "-f", "deviceclasses", pods.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    // The pod's error is in the output with the results, as `kubectl apply -f` lists it.
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("compute needs memory"), "{stdout}");
    let out = tessera(&["validate", "-f", pods.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("error: Pod default/legacy: spec.containers[0].resources.limits[baidu.com/v100_32g_cgpu_core]")
            && stdout.contains("container main")
            && stdout.contains("compute needs memory"),
        "{stdout}"
    );
    std::fs::write(&pods, pod(&json!({"nvidia.com/gpu": 1}), &json!({}))).unwrap();
    assert_success(&tessera(&["validate", "-f", pods.to_str().unwrap()]));
}

#[test]
fn the_demo_places_a_baidu_and_an_aliyun_pod() {
    let out = tessera(&["demo"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let section = text
        .split("Pods written for device plugins")
        .nth(1)
        .unwrap_or_else(|| panic!("no pods section:\n{text}"));
    assert!(
        section.contains("claim baidu-infer-tessera-main"),
        "{section}"
    );
    assert!(section.contains("claim aliyun-train-tessera"), "{section}");
    assert!(section.contains("baidu -> t4-node/"), "{section}");
    assert_eq!(section.matches("aliyun -> ").count(), 2, "{section}");
    assert!(
        !section
            .split("GPUs in use")
            .next()
            .unwrap()
            .contains("NOT ALLOCATED"),
        "{section}"
    );
}
