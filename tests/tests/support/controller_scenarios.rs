//! Scenarios of the controller against an API server, written only against a kube client so
//! they run the same on the fake API server and on a real kube-apiserver.
#![allow(dead_code, reason = "each test file uses a subset")]

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1 as res;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tessera_controller::leader::LeaderConfig;
use tessera_controller::metrics::Metrics;
use tessera_controller::service::{self, ControllerConfig};
use tessera_driver::apiversion::{self, ApiVersion, Object};
use tessera_driver::node::inventory::Inventory;
use tessera_driver::node::slices::{self, RenderOptions};
use tessera_driver::placement::allocator::{Policy, Snapshot};
use tessera_driver::{names, placement::gate};
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub(crate) const DRIVER: &str = names::DEFAULT_DRIVER_NAME;
pub(crate) const NS: &str = "default";

/// Node names of a test cluster of `n` nodes.
pub(crate) fn node_name(i: usize) -> String {
    format!("gpu-node-{i:04}")
}

/// An inventory of `nodes` nodes with `gpus` A100s each (two NVLink islands), `shared` or
/// `exclusive`.
pub(crate) fn inventory(nodes: usize, gpus: usize, shared: bool) -> Inventory {
    let mode = if shared { "shared" } else { "exclusive" };
    let mut text = String::from("nodes:\n");
    for i in 0..nodes {
        let name = node_name(i);
        let half = gpus / 2;
        let _ = write!(
            text,
            "- name: {name}\n  mode: {mode}\n  gpus:\n  - model: a100-80g\n    count: {half}\n    nvlinkDomain: {name}-nv0\n    numaNode: 0\n"
        );
        if gpus - half > 0 {
            let _ = write!(
                text,
                "  - model: a100-80g\n    count: {}\n    nvlinkDomain: {name}-nv1\n    numaNode: 1\n",
                gpus - half
            );
        }
    }
    Inventory::from_yaml(&text).unwrap()
}

fn dynamic(
    client: &kube::Client,
    version: ApiVersion,
    kind: tessera_driver::names::ResourceKind,
) -> Api<DynamicObject> {
    Api::all_with(client.clone(), &tessera_kubeapi::resource(version, kind))
}

pub(crate) fn claims_api(client: &kube::Client, version: ApiVersion) -> Api<DynamicObject> {
    Api::namespaced_with(
        client.clone(),
        NS,
        &tessera_kubeapi::resource(version, tessera_driver::names::RESOURCE_CLAIM),
    )
}

async fn create_tolerant(api: &Api<DynamicObject>, value: Value) {
    let object: DynamicObject = serde_json::from_value(value).unwrap();
    match api.create(&PostParams::default(), &object).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => panic!("creating {:?}: {e}", object.metadata.name),
    }
}

/// Creates the DeviceClasses, Nodes (with allocatable CPU and memory) and ResourceSlices of
/// `inventory`.
pub(crate) async fn seed(
    client: &kube::Client,
    version: ApiVersion,
    inventory: &Inventory,
    cpu: &str,
) {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap();
    let classes = dynamic(client, version, tessera_driver::names::DEVICE_CLASS);
    for file in ["gpu.yaml", "shared-gpu.yaml"] {
        let text = std::fs::read_to_string(repo.join("deviceclasses").join(file)).unwrap();
        let mut value: Value = serde_yaml::from_str(&text).unwrap();
        value["apiVersion"] = json!(version.as_str());
        create_tolerant(&classes, value).await;
    }
    let nodes = Api::<Node>::all(client.clone());
    let slices_api = dynamic(client, version, tessera_driver::names::RESOURCE_SLICE);
    let options = RenderOptions {
        consumable_capacity: version == ApiVersion::V1,
        ..RenderOptions::default()
    };
    for node in &inventory.nodes {
        let object: Node = serde_json::from_value(json!({
            "metadata": {"name": node.name, "labels": {names::LABEL_HOSTNAME: node.name}},
        }))
        .unwrap();
        match nodes.create(&PostParams::default(), &object).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => panic!("creating Node {}: {e}", node.name),
        }
        let status = json!({"status": {
            "allocatable": {"cpu": cpu, "memory": "64Gi", "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "played by the test"}],
        }});
        nodes
            .patch_status(&node.name, &PatchParams::default(), &Patch::Merge(&status))
            .await
            .unwrap();
        // A real API server taints every new Node `node.kubernetes.io/not-ready:NoSchedule`;
        // kube-controller-manager's node lifecycle controller lifts it once the kubelet
        // reports Ready. There is neither here, so the test lifts it, or no pod fits anywhere
        // (for the controller as for kube-scheduler).
        let untainted = json!({"spec": {"taints": null}});
        nodes
            .patch(
                &node.name,
                &PatchParams::default(),
                &Patch::Merge(&untainted),
            )
            .await
            .unwrap();
        for slice in slices::render(node, &options).unwrap() {
            let value = apiversion::encode_slice(&slice, version).unwrap();
            create_tolerant(&slices_api, value).await;
        }
    }
}

/// A claim for `count` whole GPUs.
pub(crate) fn whole_gpu_claim(name: &str, count: u32) -> Value {
    json!({
        "metadata": {"name": name, "namespace": NS},
        "spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": names::CLASS_GPU, "count": count}}]}},
    })
}

/// A claim for a share of `memory_gib` GiB of one GPU (`GpuShare` opaque config).
pub(crate) fn share_claim(name: &str, memory_gib: u32) -> Value {
    json!({
        "metadata": {"name": name, "namespace": NS},
        "spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": names::CLASS_SHARED_GPU}}],
            "config": [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": {
                "apiVersion": names::CONFIG_API_VERSION, "kind": names::GPU_SHARE_KIND,
                "memory": format!("{memory_gib}Gi")}}}],
        }},
    })
}

/// Creates a claim in `version` (the body is written in the v1 shape, which v1beta2 shares for
/// these simple claims).
pub(crate) async fn create_claim(client: &kube::Client, version: ApiVersion, mut body: Value) {
    body["apiVersion"] = json!(version.as_str());
    body["kind"] = json!("ResourceClaim");
    if version == ApiVersion::V1beta1 {
        // v1beta1 nests the request's fields directly instead of under `exactly`.
        for r in body["spec"]["devices"]["requests"].as_array_mut().unwrap() {
            let exactly = r["exactly"].take();
            if let (Value::Object(req), Value::Object(fields)) = (r, exactly) {
                req.remove("exactly");
                req.extend(fields);
            }
        }
    }
    let object: DynamicObject = serde_json::from_value(body).unwrap();
    claims_api(client, version)
        .create(&PostParams::default(), &object)
        .await
        .unwrap();
}

/// A gated pod using the named claims (`resourceClaimName`) and templates, requesting `cpu`.
pub(crate) fn gated_pod(name: &str, claims: &[&str], templates: &[&str], cpu: &str) -> Pod {
    let mut refs: Vec<Value> = claims
        .iter()
        .enumerate()
        .map(|(i, c)| json!({"name": format!("c{i}"), "resourceClaimName": c}))
        .collect();
    refs.extend(
        templates
            .iter()
            .enumerate()
            .map(|(i, t)| json!({"name": format!("t{i}"), "resourceClaimTemplateName": t})),
    );
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "schedulingGates": [{"name": names::SCHEDULING_GATE}],
            "resourceClaims": refs,
            "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                "resources": {"requests": {"cpu": cpu, "memory": "1Gi"}}}],
        },
    }))
    .unwrap()
}

pub(crate) async fn create_pod(client: &kube::Client, pod: &Pod) -> Pod {
    Api::<Pod>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), pod)
        .await
        .unwrap()
}

pub(crate) async fn delete_pod(client: &kube::Client, name: &str) {
    let _ = Api::<Pod>::namespaced(client.clone(), NS)
        .delete(name, &DeleteParams::default().grace_period(0))
        .await;
}

/// Plays kube-controller-manager for a template claim: creates the claim owned by the pod and
/// records its name in the pod's status.
pub(crate) async fn generate_template_claim(
    client: &kube::Client,
    version: ApiVersion,
    pod: &Pod,
    entry: &str,
    mut body: Value,
) {
    let pod_name = pod.metadata.name.clone().unwrap();
    let claim_name = format!("{pod_name}-{entry}-gen");
    body["metadata"]["name"] = json!(claim_name);
    body["metadata"]["ownerReferences"] = json!([{
        "apiVersion": "v1", "kind": "Pod", "name": pod_name,
        "uid": pod.metadata.uid.clone().unwrap(), "controller": true, "blockOwnerDeletion": true}]);
    body["metadata"]["annotations"] = json!({"resource.kubernetes.io/pod-claim-name": entry});
    create_claim(client, version, body).await;
    let status = json!({"status": {"resourceClaimStatuses": [{"name": entry, "resourceClaimName": claim_name}]}});
    Api::<Pod>::namespaced(client.clone(), NS)
        .patch_status(&pod_name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
}

/// A running controller inside the test process.
pub(crate) struct Running {
    pub(crate) task: JoinHandle<()>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) synced: watch::Receiver<bool>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Running {
    /// Kills it at once, mid-whatever (as a crashed process would stop).
    pub(crate) fn kill(&self) {
        self.task.abort();
    }

    pub(crate) async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = self.task.await;
    }
}

pub(crate) fn config(policy: Policy, leader: Option<LeaderConfig>) -> ControllerConfig {
    ControllerConfig {
        driver_name: DRIVER.to_owned(),
        policy,
        unbound_after: Duration::from_hours(1),
        resync: Duration::from_secs(2),
        leader,
        metrics_addr: None,
        shared_replicas: tessera_driver::admission::device_plugin_names::DEFAULT_SHARED_REPLICAS,
        fast_path: true,
        preemption: false,
        defrag_per_hour: 0,
    }
}

pub(crate) fn leader_config(identity: &str) -> LeaderConfig {
    LeaderConfig {
        namespace: NS.to_owned(),
        name: names::LEADER_LEASE.to_owned(),
        identity: identity.to_owned(),
        lease_duration: Duration::from_secs(3),
        renew_deadline: Duration::from_secs(2),
        retry_period: Duration::from_millis(200),
    }
}

pub(crate) fn start_controller(client: &kube::Client, config: ControllerConfig) -> Running {
    let metrics = Arc::new(Metrics::new(&config.policy.to_string()));
    let (synced_tx, synced) = watch::channel(false);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let client = client.clone();
    let task_metrics = Arc::clone(&metrics);
    let task = tokio::spawn(async move {
        let shutdown = async {
            let _ = stopped.await;
        };
        if let Err(e) = service::run_with(client, config, task_metrics, synced_tx, shutdown).await {
            panic!("the controller failed: {e}");
        }
    });
    Running {
        task,
        metrics,
        synced,
        stop: Some(stop),
    }
}

/// Polls `check` until it holds or `timeout` passes; panics with `what` then.
pub(crate) async fn eventually<F, Fut>(timeout: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Plays kube-controller-manager's claim controller for pods that are gone (the fake API
/// server runs none): a claim loses the reservations of pods that no longer exist, and a claim
/// left with none that carries the allocation finalizer ([`names::CLAIM_FINALIZER`]) is
/// deallocated and the finalizer removed, as that controller does for an allocation made by
/// a scheduler.
pub(crate) async fn release_claims_of_gone_pods(client: &kube::Client, version: ApiVersion) {
    let live: BTreeSet<String> = pods(client)
        .await
        .values()
        .filter_map(|p| p.metadata.uid.clone())
        .collect();
    let api = claims_api(client, version);
    for (name, claim) in claims(client, version).await {
        let Some(reserved) = claim
            .status
            .as_ref()
            .and_then(|s| s.reserved_for.as_ref())
            .filter(|r| r.iter().any(|r| !live.contains(&r.uid)))
        else {
            continue;
        };
        let keep: Vec<&res::ResourceClaimConsumerReference> =
            reserved.iter().filter(|r| live.contains(&r.uid)).collect();
        let finalizers = claim.metadata.finalizers.clone().unwrap_or_default();
        let deallocate = keep.is_empty() && finalizers.iter().any(|f| f == names::CLAIM_FINALIZER);
        let mut status =
            json!({"reservedFor": if keep.is_empty() { Value::Null } else { json!(keep) }});
        if deallocate {
            status["allocation"] = Value::Null;
        }
        let body = json!({"status": status});
        if api
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&body))
            .await
            .is_err()
            || !deallocate
        {
            continue;
        }
        let rest: Vec<&String> = finalizers
            .iter()
            .filter(|f| *f != names::CLAIM_FINALIZER)
            .collect();
        let body = json!({"metadata": {"finalizers": if rest.is_empty() { Value::Null } else { json!(rest) }}});
        let _ = api
            .patch(&name, &PatchParams::default(), &Patch::Merge(&body))
            .await;
    }
}

/// Every claim in the namespace, decoded to v1.
pub(crate) async fn claims(
    client: &kube::Client,
    version: ApiVersion,
) -> BTreeMap<String, res::ResourceClaim> {
    let list = claims_api(client, version)
        .list(&ListParams::default())
        .await
        .unwrap();
    list.items
        .into_iter()
        .map(|o| {
            let mut v = serde_json::to_value(&o).unwrap();
            v["apiVersion"] = json!(version.as_str());
            v["kind"] = json!("ResourceClaim");
            let Object::ResourceClaim(c) = apiversion::decode_document(v, "test").unwrap() else {
                panic!("not a claim")
            };
            (c.metadata.name.clone().unwrap(), c)
        })
        .collect()
}

pub(crate) async fn pods(client: &kube::Client) -> BTreeMap<String, Pod> {
    Api::<Pod>::namespaced(client.clone(), NS)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|p| (p.metadata.name.clone().unwrap(), p))
        .collect()
}

/// Whether every pod in `names` is ungated.
pub(crate) async fn all_ungated(client: &kube::Client, names: &[String]) -> bool {
    let pods = pods(client).await;
    names
        .iter()
        .all(|n| pods.get(n).is_some_and(|p| !gate::is_gated(p)))
}

/// Whether the pod exists and is ungated.
pub(crate) async fn is_ungated(client: &kube::Client, name: &str) -> bool {
    Api::<Pod>::namespaced(client.clone(), NS)
        .get_opt(name)
        .await
        .unwrap()
        .is_some_and(|p| !gate::is_gated(&p))
}

/// The invariants every scenario ends with:
/// * no device is double-booked (rebuilding the accounting from every allocated claim);
/// * every ungated pod's claims are allocated, all on one node;
/// * no claim the controller allocated is left for a pod that is gone;
/// * a bound pod runs where its claims are allocated, and each of them is reserved for it.
#[allow(
    clippy::too_many_lines,
    reason = "the invariants read best as one list"
)]
pub(crate) async fn check_invariants(client: &kube::Client, version: ApiVersion) {
    let decode_all = |items: Vec<DynamicObject>, kind: &str| -> Vec<Object> {
        items
            .into_iter()
            .map(|o| {
                let mut v = serde_json::to_value(&o).unwrap();
                v["apiVersion"] = json!(version.as_str());
                v["kind"] = json!(kind);
                apiversion::decode_document(v, "invariants").unwrap()
            })
            .collect()
    };
    let slices: Vec<res::ResourceSlice> = decode_all(
        dynamic(client, version, tessera_driver::names::RESOURCE_SLICE)
            .list(&ListParams::default())
            .await
            .unwrap()
            .items,
        "ResourceSlice",
    )
    .into_iter()
    .filter_map(|o| match o {
        Object::ResourceSlice(s) => Some(s),
        _ => None,
    })
    .collect();
    let classes: Vec<res::DeviceClass> = decode_all(
        dynamic(client, version, tessera_driver::names::DEVICE_CLASS)
            .list(&ListParams::default())
            .await
            .unwrap()
            .items,
        "DeviceClass",
    )
    .into_iter()
    .filter_map(|o| match o {
        Object::DeviceClass(c) => Some(c),
        _ => None,
    })
    .collect();
    let claims = claims(client, version).await;
    let allocated: Vec<res::ResourceClaim> = claims
        .values()
        .filter(|c| gate::is_allocated(c))
        .cloned()
        .collect();
    let snapshot = Snapshot::for_driver(DRIVER, &slices, &classes, &allocated).unwrap();
    for d in snapshot.device_usage() {
        assert!(
            d.exclusive <= 1,
            "device {}/{} is held whole {} times",
            d.pool,
            d.device,
            d.exclusive
        );
        assert!(
            d.exclusive == 0 || d.shares == 0,
            "device {}/{} is held whole and shared",
            d.pool,
            d.device
        );
        assert!(
            d.memory_used <= d.memory_total || d.memory_total.is_zero(),
            "device {}/{} has {:?} of {:?} memory allocated",
            d.pool,
            d.device,
            d.memory_used,
            d.memory_total
        );
    }
    let pods = pods(client).await;
    let pod_list: Vec<&Pod> = pods.values().collect();
    let users = gate::claim_users(pod_list.iter().copied());
    for pod in pods.values() {
        if gate::is_gated(pod) {
            continue;
        }
        let names = gate::claim_names(pod).unwrap();
        // Pods that never carried the gate are kube-scheduler's.
        if !names
            .iter()
            .any(|n| claims.get(n).is_some_and(gate::is_ours))
        {
            continue;
        }
        let nodes: BTreeSet<Option<String>> = names
            .iter()
            .map(|n| {
                let c = claims
                    .get(n)
                    .unwrap_or_else(|| panic!("claim {n} of an ungated pod is gone"));
                let a = c.status.as_ref().and_then(|s| s.allocation.as_ref());
                let a = a.unwrap_or_else(|| {
                    panic!(
                        "claim {n} of ungated pod {:?} is not allocated",
                        pod.metadata.name
                    )
                });
                assert!(
                    a.allocation_timestamp.is_some(),
                    "claim {n} has no allocationTimestamp"
                );
                assert!(
                    c.metadata
                        .finalizers
                        .iter()
                        .flatten()
                        .any(|f| f == names::CLAIM_FINALIZER),
                    "claim {n} has no finalizer"
                );
                gate::allocation_node(a)
            })
            .collect();
        assert!(
            nodes.len() <= 1,
            "pod {:?} has claims on several nodes: {nodes:?}",
            pod.metadata.name
        );
        if let Some(bound) = pod.spec.as_ref().and_then(|s| s.node_name.clone()) {
            assert_eq!(
                nodes.iter().next().cloned().flatten().as_deref(),
                Some(bound.as_str()),
                "pod {:?} is bound elsewhere than its claims",
                pod.metadata.name
            );
            for n in &names {
                let reserved = claims[n]
                    .status
                    .as_ref()
                    .and_then(|s| s.reserved_for.as_ref())
                    .is_some_and(|r| r.iter().any(|r| Some(&r.uid) == pod.metadata.uid.as_ref()));
                assert!(
                    reserved,
                    "claim {n} of bound pod {:?} is not reserved for it",
                    pod.metadata.name
                );
            }
        }
    }
    for (name, claim) in &claims {
        if gate::is_ours(claim) && gate::is_allocated(claim) {
            assert!(
                users.contains_key(&format!("{NS}/{name}")),
                "claim {name} is still allocated by the controller for a pod that is gone"
            );
        }
    }
}

/// The whole protocol on several nodes: whole GPUs and shares, named claims, more pods than
/// fit, one pod that fits nowhere; ends with the invariants.
pub(crate) async fn place_several_pods(client: &kube::Client, version: ApiVersion) {
    let inventory = inventory(3, 4, false);
    seed(client, version, &inventory, "8").await;
    let running = start_controller(client, config(Policy::Binpack, None));
    let mut names = Vec::new();
    for i in 0..10 {
        let claim = format!("whole-{i}");
        create_claim(client, version, whole_gpu_claim(&claim, 1)).await;
        let pod = format!("pod-{i}");
        create_pod(client, &gated_pod(&pod, &[&claim], &[], "1")).await;
        names.push(pod);
    }
    create_claim(client, version, whole_gpu_claim("too-big", 5)).await;
    create_pod(client, &gated_pod("too-big", &["too-big"], &[], "1")).await;
    eventually(Duration::from_secs(20), "ten pods are ungated", || {
        all_ungated(client, &names)
    })
    .await;
    eventually(
        Duration::from_secs(20),
        "the pod that fits nowhere has a condition",
        || async {
            pods(client).await.get("too-big").is_some_and(|p| {
                p.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|c| {
                        c.iter().any(|c| {
                            c.type_ == names::CONDITION_ALLOCATED
                                && c.status == "False"
                                && c.message.as_deref().is_some_and(|m| m.contains("too-big"))
                        })
                    })
            })
        },
    )
    .await;
    assert!(gate::is_gated(&pods(client).await["too-big"]));
    check_invariants(client, version).await;
    // Binpack fills the nodes in order: 10 GPUs over 3 nodes of 4 use the first two fully.
    let per_node: BTreeMap<String, usize> = claims(client, version)
        .await
        .values()
        .filter_map(|c| gate::allocation_node(c.status.as_ref()?.allocation.as_ref()?))
        .fold(BTreeMap::new(), |mut m, n| {
            *m.entry(n).or_default() += 1;
            m
        });
    assert_eq!(
        per_node.values().filter(|n| **n == 4).count(),
        2,
        "{per_node:?}"
    );
    running.stop().await;
}

/// The fast path: pods whose every constraint the controller evaluates get their claims
/// allocated and reserved for them in one write each, then lose their gate; a pod with a host
/// port or inter-pod anti-affinity gets unreserved claims (kube-scheduler reserves them when
/// it binds). No pod is bound by the controller. Ends with the invariants.
pub(crate) async fn fast_path_pods_get_their_claims_reserved(
    client: &kube::Client,
    version: ApiVersion,
) {
    seed(client, version, &inventory(2, 4, true), "8").await;
    let running = start_controller(client, config(Policy::Binpack, None));
    let mut fast = Vec::new();
    for i in 0..4 {
        let claim = format!("fast-share-{i}");
        create_claim(client, version, share_claim(&claim, 10)).await;
        let pod = format!("fast-{i}");
        create_pod(client, &gated_pod(&pod, &[&claim], &[], "1")).await;
        fast.push(pod);
    }
    // Two claims, both reserved by the controller before the pod is bound.
    create_claim(client, version, share_claim("fast-two-a", 20)).await;
    create_claim(client, version, share_claim("fast-two-b", 20)).await;
    create_pod(
        client,
        &gated_pod("fast-two", &["fast-two-a", "fast-two-b"], &[], "1"),
    )
    .await;
    fast.push("fast-two".to_owned());
    let mut slow = Vec::new();
    for (name, extra) in [
        (
            "host-port",
            json!({"containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                "ports": [{"containerPort": 80, "hostPort": 8080}],
                "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}]}),
        ),
        (
            "anti-affinity",
            json!({"affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                {"topologyKey": names::LABEL_HOSTNAME,
                 "labelSelector": {"matchLabels": {"app": "nothing"}}}]}}}),
        ),
    ] {
        let claim = format!("{name}-share");
        create_claim(client, version, share_claim(&claim, 10)).await;
        let mut pod = serde_json::to_value(gated_pod(name, &[&claim], &[], "1")).unwrap();
        for (k, v) in extra.as_object().unwrap() {
            pod["spec"][k] = v.clone();
        }
        create_pod(client, &serde_json::from_value(pod).unwrap()).await;
        slow.push(name.to_owned());
    }
    eventually(Duration::from_secs(30), "every pod is ungated", || async {
        all_ungated(client, &fast).await && all_ungated(client, &slow).await
    })
    .await;
    let claims = claims(client, version).await;
    let pods = pods(client).await;
    for name in &slow {
        let claim = &claims[&format!("{name}-share")];
        assert!(
            gate::is_allocated(claim) && !gate::is_reserved(claim),
            "{name}"
        );
    }
    for name in &fast {
        let pod = &pods[name];
        assert!(!gate::is_gated(pod));
        for claim in gate::claim_names(pod).unwrap() {
            let c = &claims[&claim];
            assert!(gate::is_ours(c), "{claim}");
            let reserved = &c.status.as_ref().unwrap().reserved_for.as_ref().unwrap()[0];
            assert_eq!(
                (reserved.resource.as_str(), Some(&reserved.uid)),
                ("pods", pod.metadata.uid.as_ref())
            );
        }
    }
    check_invariants(client, version).await;
    running.stop().await;
}

/// A pod written for the device-plugin world, as the webhook admits it: rewritten into claims
/// from shape-named templates, the request recorded, gated.
pub(crate) fn device_plugin_pod(
    name: &str,
    limits: &Value,
) -> (Pod, tessera_driver::admission::device_plugin_names::Mapping) {
    use tessera_driver::admission::device_plugin_names::{self as dp, PodRewrite};
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": NS},
        "spec": {"containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
            "resources": {"limits": limits, "requests": {"cpu": "1", "memory": "1Gi"}}}]},
    }))
    .unwrap();
    let object = format!("Pod {NS}/{name}");
    let PodRewrite::Rewritten { mapping, patch, .. } =
        dp::rewrite_pod(&pod, &dp::Options::default(), &object).unwrap()
    else {
        panic!("{object} is not rewritten");
    };
    (dp::apply_pod_patch(&pod, &patch, &object).unwrap(), mapping)
}

/// The ResourceClaimTemplates in `NS`, by name, decoded to v1.
pub(crate) async fn templates(
    client: &kube::Client,
    version: ApiVersion,
) -> BTreeMap<String, res::ResourceClaimTemplate> {
    let api: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        NS,
        &tessera_kubeapi::resource(version, tessera_driver::names::RESOURCE_CLAIM_TEMPLATE),
    );
    let mut found = BTreeMap::new();
    for item in api.list(&ListParams::default()).await.unwrap().items {
        let mut value = serde_json::to_value(&item).unwrap();
        value["apiVersion"] = json!(version.as_str());
        value["kind"] = json!("ResourceClaimTemplate");
        if let Object::ResourceClaimTemplate(t) = apiversion::decode_document(value, "t").unwrap() {
            found.insert(t.metadata.name.clone().unwrap(), t);
        }
    }
    found
}

/// Pods asking with device-plugin names: the controller makes the templates their claims come
/// from, the pods are placed once (playing kube-controller-manager) their claims exist, and a
/// template goes when the last pod using it goes.
pub(crate) async fn device_plugin_pods_get_their_templates(
    client: &kube::Client,
    version: ApiVersion,
) {
    let wait = Duration::from_secs(30);
    seed(client, version, &inventory(1, 4, true), "8").await;
    let running = start_controller(client, config(Policy::FirstFit, None));
    let (pod_a, mapping) = device_plugin_pod("legacy-a", &json!({"aliyun.com/gpu-mem": "8"}));
    let (pod_b, _) = device_plugin_pod("legacy-b", &json!({"aliyun.com/gpu-mem": "8"}));
    let (pod_c, other) = device_plugin_pod(
        "legacy-c",
        &json!({"baidu.com/a100_80g_cgpu": "1", "baidu.com/a100_80g_cgpu_memory": "4"}),
    );
    let created_a = create_pod(client, &pod_a).await;
    create_pod(client, &pod_b).await;
    create_pod(client, &pod_c).await;
    let shape = mapping.claims[0].template.clone();
    let baidu = other.claims[0].template.clone();
    eventually(
        wait,
        "the controller makes one template per shape",
        || async {
            let found = templates(client, version).await;
            found.len() == 2 && found.contains_key(&shape) && found.contains_key(&baidu)
        },
    )
    .await;
    let found = templates(client, version).await;
    assert_eq!(found[&shape].spec.spec, mapping.claims[0].spec);
    assert_eq!(
        found[&shape].metadata.labels.as_ref().unwrap()[names::LABEL_DEVICE_PLUGIN_TEMPLATE],
        "true"
    );
    // kube-controller-manager's part: the claim from the template, named in the pod's status.
    let body = json!({"metadata": {"namespace": NS}, "spec": serde_json::to_value(&found[&shape].spec.spec).unwrap()});
    generate_template_claim(client, version, &created_a, &mapping.claims[0].entry, body).await;
    eventually(wait, "the rewritten pod is placed", || {
        is_ungated(client, "legacy-a")
    })
    .await;
    check_invariants(client, version).await;

    // Pod events arrive in order: once legacy-c's template is gone, legacy-b's deletion was
    // seen too, and the shape legacy-a still uses must be there.
    delete_pod(client, "legacy-b").await;
    delete_pod(client, "legacy-c").await;
    eventually(wait, "a template no pod uses is deleted", || async {
        !templates(client, version).await.contains_key(&baidu)
    })
    .await;
    assert!(
        templates(client, version).await.contains_key(&shape),
        "the template is kept while legacy-a uses it"
    );
    delete_pod(client, "legacy-a").await;
    eventually(wait, "the last template goes with the last pod", || async {
        templates(client, version).await.is_empty()
    })
    .await;
    running.stop().await;
}
