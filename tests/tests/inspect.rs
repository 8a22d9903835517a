//! `tessera inspect` against the in-process fake API server: the per-GPU table and the
//! explanation of a gated pod, read through a kubeconfig as an operator would.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;

use clap::Parser as _;
use k8s_openapi::api::resource::v1 as res;
use serde_json::{Value, json};
use tessera_controller::cli::Cli;
use tessera_driver::apiversion::{self, ApiVersion};
use tessera_driver::names;
use tessera_driver::node::inventory::Inventory;
use tessera_driver::node::slices::{RenderOptions, render};
use tessera_driver::tools::batch::{BatchInput, BatchOptions, allocate_batch};
use tessera_tests::fake_apiserver::FakeApiServer;

const NODE: &str = "gpu-node";

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
}

fn classes() -> Vec<Value> {
    let mut classes = Vec::new();
    for entry in std::fs::read_dir(repo().join("deviceclasses")).unwrap() {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        let yaml: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
        classes.push(serde_json::to_value(yaml).unwrap());
    }
    classes
}

fn slices() -> Vec<res::ResourceSlice> {
    let inventory = Inventory::from_yaml(&format!(
        "nodes:\n- name: {NODE}\n  gpus:\n  - model: a100-80g\n    mode: shared\n  - model: a100-80g\n    mode: exclusive\n"
    ))
    .unwrap();
    render(
        inventory.node(NODE).unwrap(),
        &RenderOptions {
            consumable_capacity: true,
            ..RenderOptions::default()
        },
    )
    .unwrap()
}

fn share_claim(name: &str, memory: &str, compute: Option<i64>) -> Value {
    let mut parameters =
        json!({"apiVersion": names::CONFIG_API_VERSION, "kind": "GpuShare", "memory": memory});
    if let Some(c) = compute {
        parameters["compute"] = json!(c);
    }
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "team-a", "uid": format!("uid-{name}")},
        "spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": names::CLASS_SHARED_GPU}}],
            "config": [{"requests": ["gpu"], "opaque": {"driver": names::DEFAULT_DRIVER_NAME, "parameters": parameters}}],
        }},
    })
}

fn whole_claim(name: &str) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "team-a", "uid": format!("uid-{name}")},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": names::CLASS_GPU}}]}},
    })
}

/// Creates pod `name` in `team-a` with the pod claims `claims`, gated by Tessera when `gated`.
fn create_pod(server: &FakeApiServer, name: &str, claims: &Value, gated: bool) {
    let mut spec = json!({
        "containers": [{"name": "main", "image": "cuda"}],
        "resourceClaims": claims,
    });
    if gated {
        spec["schedulingGates"] = json!([{"name": names::SCHEDULING_GATE}]);
    }
    let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "team-a"}, "spec": spec});
    server.create("pods", pod).unwrap();
}

/// A cluster with one node of two A100s: gpu-0 shared and holding a 10Gi/50 % share reserved
/// for pod `train`, gpu-1 exclusive and held whole by `whole`.
async fn cluster() -> (FakeApiServer, tempfile::TempDir) {
    let server = FakeApiServer::start(&["v1"]).await.unwrap();
    server
        .create(
            "nodes",
            json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": {names::LABEL_HOSTNAME: NODE}}}),
        )
        .unwrap();
    let mut class_objects = Vec::new();
    for class in classes() {
        server.create("deviceclasses", class.clone()).unwrap();
        let apiversion::Object::DeviceClass(c) =
            apiversion::decode_document(class, "class").unwrap()
        else {
            panic!("not a class")
        };
        class_objects.push(c);
    }
    let slices = slices();
    for slice in &slices {
        server
            .create(
                "resourceslices",
                apiversion::encode_slice(slice, ApiVersion::V1).unwrap(),
            )
            .unwrap();
    }
    // Allocate the two held claims with the allocator itself, as the controller would.
    let held = [share_claim("share", "10Gi", Some(50)), whole_claim("whole")];
    let claims: Vec<res::ResourceClaim> = held
        .iter()
        .map(|c| serde_json::from_value(c.clone()).unwrap())
        .collect();
    let outcomes = allocate_batch(
        &BatchInput {
            classes: &class_objects,
            slices: &slices,
            claims: &claims,
            nodes: &[],
            pods: &[],
        },
        &BatchOptions {
            driver_name: names::DEFAULT_DRIVER_NAME.to_owned(),
            policy: tessera_driver::placement::allocator::Policy::FirstFit,
            node: None,
        },
    )
    .unwrap();
    for (claim, outcome) in held.iter().zip(&outcomes) {
        assert!(outcome.allocated, "{outcome:?}");
        server.create("resourceclaims", claim.clone()).unwrap();
        let mut status = json!({"allocation": outcome.allocation});
        if outcome.name == "share" {
            status["reservedFor"] =
                json!([{"resource": "pods", "name": "train", "uid": "uid-train"}]);
        }
        server
            .set_status("resourceclaims", Some("team-a"), &outcome.name, &status)
            .unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("kubeconfig"), server.kubeconfig()).unwrap();
    (server, dir)
}

/// Runs the `tessera` command line off the async workers (it has its own runtime).
async fn tessera(args: &[&str]) -> (Result<(), String>, String) {
    let args: Vec<String> = std::iter::once("tessera")
        .chain(args.iter().copied())
        .map(str::to_owned)
        .collect();
    tokio::task::spawn_blocking(move || {
        let cli = Cli::try_parse_from(args).unwrap();
        let mut out = String::new();
        let result = cli.run(&mut out).map_err(|e| e.to_string());
        (result, out)
    })
    .await
    .unwrap()
}

/// `tessera inspect pod <pod> -n team-a` through the kubeconfig in `dir`, as JSON when `json`.
async fn inspect_pod(
    dir: &tempfile::TempDir,
    pod: &str,
    json: bool,
) -> (Result<(), String>, String) {
    let cfg = kubeconfig(dir);
    let mut args = vec!["inspect", "--kubeconfig", &cfg, "pod", pod, "-n", "team-a"];
    if json {
        args.extend(["-o", "json"]);
    }
    tessera(&args).await
}

fn kubeconfig(dir: &tempfile::TempDir) -> String {
    dir.path().join("kubeconfig").display().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gpu_table_shows_allocated_and_free_memory_and_compute_with_claims_and_pods() {
    let (_server, dir) = cluster().await;
    let (result, out) =
        tessera(&["inspect", "--kubeconfig", &kubeconfig(&dir), "-o", "json"]).await;
    result.unwrap();
    let view: Value = serde_json::from_str(&out).unwrap();
    let gpus = &view["nodes"][0]["gpus"];
    assert_eq!(view["nodes"][0]["node"], NODE);
    assert_eq!(gpus[0]["device"], "gpu-0");
    assert_eq!(gpus[0]["mode"], "shared");
    assert_eq!(gpus[0]["model"], "a100-80g");
    assert_eq!(gpus[0]["memoryAllocated"], "10Gi");
    assert_eq!(gpus[0]["memoryFree"], "70Gi");
    assert_eq!(gpus[0]["computeAllocated"], 50);
    assert_eq!(gpus[0]["computeFree"], 50);
    assert_eq!(
        gpus[0]["claims"],
        json!([{"namespace": "team-a", "name": "share", "pods": ["train"], "memoryBooked": "10Gi"}])
    );
    assert_eq!(gpus[1]["mode"], "exclusive");
    assert_eq!(gpus[1]["memoryFree"], "0");
    assert_eq!(gpus[1]["computeAllocated"], 100);
    assert_eq!(gpus[1]["claims"][0]["name"], "whole");

    let (result, table) = tessera(&["inspect", "--kubeconfig", &kubeconfig(&dir)]).await;
    result.unwrap();
    let row = table.lines().find(|l| l.contains("gpu-0")).unwrap();
    for cell in [
        "gpu-node",
        "a100-80g",
        "shared",
        "10Gi/80Gi",
        "70Gi",
        "50%",
        "team-a/share (train)",
    ] {
        assert!(row.contains(cell), "{cell} missing from {row}\n{table}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gated_pod_whose_share_does_not_fit_is_explained_by_the_allocator() {
    let (server, dir) = cluster().await;
    server
        .create("resourceclaims", share_claim("big", "75Gi", None))
        .unwrap();
    create_pod(
        &server,
        "waiting",
        &json!([{"name": "gpu", "resourceClaimName": "big"}]),
        true,
    );
    let (result, out) = inspect_pod(&dir, "waiting", true).await;
    result.unwrap();
    let explained: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(explained["verdict"], "unplaceable", "{explained}");
    let message = explained["message"].as_str().unwrap();
    assert!(message.contains("team-a/big"), "{message}");
    assert_eq!(explained["claims"][0]["state"], "pending");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gated_pod_that_fits_names_the_node_and_suspects_the_controller() {
    let (server, dir) = cluster().await;
    server
        .create("resourceclaims", share_claim("small", "4Gi", Some(25)))
        .unwrap();
    create_pod(
        &server,
        "ready",
        &json!([{"name": "gpu", "resourceClaimName": "small"}]),
        true,
    );
    let (result, out) = inspect_pod(&dir, "ready", false).await;
    result.unwrap();
    assert!(
        out.contains("fit on gpu-node") && out.contains("controller"),
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ungated_pod_is_kube_schedulers_and_a_missing_claim_is_named() {
    let (server, dir) = cluster().await;
    create_pod(
        &server,
        "plain",
        &json!([{"name": "gpu", "resourceClaimName": "whole"}]),
        false,
    );
    create_pod(
        &server,
        "early",
        &json!([{"name": "gpu", "resourceClaimTemplateName": "shares"}]),
        true,
    );
    let (result, out) = inspect_pod(&dir, "plain", false).await;
    result.unwrap();
    assert!(out.contains("not gated: kube-scheduler's"), "{out}");
    let (result, out) = inspect_pod(&dir, "early", true).await;
    result.unwrap();
    let explained: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(explained["verdict"], "waitingForClaims");
    assert!(
        explained["claims"][0]["detail"]
            .as_str()
            .unwrap()
            .contains("ResourceClaimTemplate shares"),
        "{explained}"
    );
    let (result, _) = inspect_pod(&dir, "nobody", false).await;
    assert!(result.unwrap_err().contains("not found"));
}

/// An events.k8s.io/v1 Event by `controller` about `kind/name` in team-a.
async fn post_event(dir: &tempfile::TempDir, controller: &str, kind: &str, name: &str, note: &str) {
    use k8s_openapi::api::events::v1::Event;
    let client = tessera_kubeapi::client(Some(&dir.path().join("kubeconfig")))
        .await
        .unwrap();
    let event: Event = serde_json::from_value(json!({
        "apiVersion": "events.k8s.io/v1", "kind": "Event",
        "metadata": {"name": format!("{name}.{controller}"), "namespace": "team-a"},
        "eventTime": "2026-01-01T00:00:00.000000Z",
        "type": "Warning", "reason": names::REASON_GPU_MEMORY_OVER_BOOKING,
        "action": "StopProcesses", "note": note,
        "reportingController": controller, "reportingInstance": NODE,
        "regarding": {"apiVersion": "v1", "kind": kind, "namespace": "team-a", "name": name},
    }))
    .unwrap();
    kube::Api::<Event>::namespaced(client, "team-a")
        .create(&kube::api::PostParams::default(), &event)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_claim_shows_the_booking_what_the_node_says_it_got_and_uses_and_its_events() {
    let (server, dir) = cluster().await;
    // What the node's plugin wrote after preparing the share (claim-status.md).
    let stored = server
        .get("resourceclaims", Some("team-a"), "share")
        .unwrap();
    let result = &stored["status"]["allocation"]["devices"]["results"][0];
    let mut status = stored["status"].clone();
    status["devices"] = json!([{
        "driver": result["driver"], "pool": result["pool"], "device": result["device"],
        "shareID": result["shareID"],
        "data": {"apiVersion": names::CONFIG_API_VERSION, "kind": "PreparedDevice",
                 "backend": "mps", "isolation": "verified", "memoryLimitBytes": 10u64 << 30,
                 "computePercent": 50, "tier": "online", "memoryUsedBytes": 12u64 << 30},
        "conditions": [
            {"type": "Ready", "status": "True", "reason": "Prepared", "message": "prepared",
             "lastTransitionTime": "2026-01-01T00:00:00Z"},
            {"type": "MemoryWithinBooking", "status": "False", "reason": "OverBooking",
             "message": "the claim's processes use 12288 MiB, more than the 10240 MiB booked",
             "lastTransitionTime": "2026-01-01T00:00:00Z"},
        ],
    }]);
    server
        .set_status("resourceclaims", Some("team-a"), "share", &status)
        .unwrap();
    post_event(
        &dir,
        names::KUBELET_PLUGIN_COMPONENT,
        "Pod",
        "train",
        "stopped process 4002\u{1b}[31m",
    )
    .await;
    post_event(&dir, "someone-else", "Pod", "train", "not the node's").await;
    post_event(
        &dir,
        names::KUBELET_PLUGIN_COMPONENT,
        "Pod",
        "stranger",
        "another pod's",
    )
    .await;

    let cfg = kubeconfig(&dir);
    let (result, out) = tessera(&[
        "inspect",
        "--kubeconfig",
        &cfg,
        "-o",
        "json",
        "claim",
        "team-a/share",
    ])
    .await;
    result.unwrap();
    let view: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(view["pods"], json!(["train"]));
    let device = &view["devices"][0];
    assert_eq!(device["memoryBooked"], "10Gi");
    assert_eq!(device["computeBooked"], 50);
    assert_eq!(device["memoryUsed"], "12Gi");
    assert_eq!(device["backend"], "mps");
    assert_eq!(device["isolation"], "verified");
    assert_eq!(device["ready"], "True");
    assert_eq!(device["memoryWithinBooking"][0], "False");
    let events = view["events"].as_array().unwrap();
    assert_eq!(
        events.len(),
        1,
        "only the node plugin's Events about the claim's pods: {events:?}"
    );
    assert_eq!(events[0]["regarding"], "Pod/train");

    let (result, table) = tessera(&[
        "inspect",
        "--kubeconfig",
        &cfg,
        "claim",
        "share",
        "-n",
        "team-a",
    ])
    .await;
    result.unwrap();
    println!("{table}");
    assert!(
        table.contains("claim team-a/share: allocated, reserved for pod train"),
        "{table}"
    );
    let row = table.lines().find(|l| l.contains("/gpu-")).unwrap();
    for cell in [
        "gpu", "10Gi", "12Gi", "50%", "mps", "verified", "True", "False",
    ] {
        assert!(row.contains(cell), "{cell} missing in {row}");
    }
    assert!(table.contains("more than the 10240 MiB booked"), "{table}");
    assert!(
        table.contains(names::REASON_GPU_MEMORY_OVER_BOOKING),
        "{table}"
    );
    assert!(
        !table.contains('\u{1b}'),
        "a control character in an Event note printed raw: {table}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_claim_of_a_missing_claim_says_so() {
    let (_server, dir) = cluster().await;
    let (result, _) = tessera(&[
        "inspect",
        "--kubeconfig",
        &kubeconfig(&dir),
        "claim",
        "team-a/absent",
    ])
    .await;
    let error = result.unwrap_err();
    assert!(
        error.contains("team-a/absent") && error.contains("not found"),
        "{error}"
    );
}
