//! Memory and CPU of the controller's cluster view and reconcile passes in one process, with
//! no HTTP: what each device, pod and claim costs once the view holds it, and the decision CPU
//! per placed pod, and at the end the CPU of a pass in steady state (a pod status event with
//! nothing gated). It complements `controller_scale` (the real process against the fake API
//! server) by isolating the view and the pass from the client and its JSON decoding.
//!
//! Run: `cargo bench -p tessera-controller --bench view_scale` (1,000 nodes × 8 GPUs, 5,000
//! pods), or with `TESSERA_BENCH_NODES` and `TESSERA_BENCH_PODS`. The objects are those of
//! `controller_scale` (and of issue 15's real-cluster measurement), sent as the API server
//! sends them (`managedFields` included). Each phase prints the process's resident memory
//! (`VmRSS`) and its peak (`VmHWM`); per-object figures are the growth of `VmRSS` over the
//! phase divided by the objects added (slices come in list pages of 50, each dropped once
//! applied, so their figure is what the view and the snapshot keep plus one page in flight).
//! For exact heap figures run it under
//! `valgrind --tool=massif` (docs/controller.md, "Memory and CPU at scale").
//!
//! The writes go to an in-memory store that answers each as the API server would (the
//! object with a new resourceVersion); the answers also come back as watch events, as JSON,
//! so the view decodes every object as often as the real controller does.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::print_stdout,
    clippy::cast_precision_loss,
    clippy::too_many_lines,
    reason = "a benchmark binary that prints its numbers, its run read top to bottom"
)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1 as res;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;
use serde_json::{Value, json};
use tessera_controller::cluster::{Change, ClusterView, Resource};
use tessera_controller::metrics::Metrics;
use tessera_controller::reconcile::{Reconciler, ReconcilerConfig, Writes};
use tessera_controller::writer::Eviction;
use tessera_driver::apiversion::{self, ApiVersion};
use tessera_driver::node::slices::{self, RenderOptions};
use tessera_driver::placement::allocator::Policy;
use tessera_driver::{names, placement::gate};
use tessera_tests::fake_apiserver::fields_v1;
use tessera_tests::scale::{GPUS, Rng, claim_spec, inventory};

/// Slices per list page (the reflector's page for slices).
const SLICE_PAGE: usize = 50;
/// Pods created between two passes.
const BATCH: usize = 50;
/// Pod status updates sent once every pod is placed.
const STEADY_UPDATES: usize = 500;

/// The object as a server sends it: with a `managedFields` entry covering its fields.
fn served(mut value: Value) -> Value {
    let entry = json!({"manager": "bench", "operation": "Update", "apiVersion": value["apiVersion"],
        "time": "2026-01-01T00:00:00Z", "fieldsType": "FieldsV1", "fieldsV1": fields_v1(&value)});
    value["metadata"]["managedFields"] = json!([entry]);
    value
}

fn node_json(name: &str) -> Value {
    served(json!({"apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "resourceVersion": "1", "labels": {
            names::LABEL_HOSTNAME: name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}},
        "status": {"capacity": {"cpu": "96", "memory": "512Gi", "pods": "110"},
                   "allocatable": {"cpu": "96", "memory": "512Gi", "pods": "110"},
                   "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
                   "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}]}}))
}

/// Gated pod `i` and its claim, as the API server holds them once kube-controller-manager
/// made the claim from the template.
fn pod_and_claim(i: usize, spec: &Value) -> (Value, Value) {
    let name = format!("p{i:05}");
    let claim = format!("{name}-gpu");
    let pod = served(json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": format!("pod-{i}"),
                     "resourceVersion": "1", "creationTimestamp": "2026-01-01T00:00:00Z",
                     "labels": {"app": "bench", "tier": "gpu"}},
        "spec": {"schedulingGates": [{"name": names::SCHEDULING_GATE}],
                 "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}],
                 "restartPolicy": "Never", "terminationGracePeriodSeconds": 30,
                 "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                     "imagePullPolicy": "IfNotPresent", "env": [{"name": "MODE", "value": "bench"}],
                     "resources": {"requests": {"cpu": "1", "memory": "4Gi"}, "claims": [{"name": "gpu"}]}}]},
        "status": {"phase": "Pending",
                   "conditions": [{"type": "PodScheduled", "status": "False", "reason": "SchedulingGated",
                                   "message": "Scheduling is blocked due to non-empty scheduling gates"}],
                   "resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": claim}]}}));
    let claim = served(
        json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": claim, "namespace": "default", "uid": format!("claim-{i}"),
                     "resourceVersion": "1", "creationTimestamp": "2026-01-01T00:00:00Z",
                     "annotations": {"resource.kubernetes.io/pod-claim-name": "gpu"},
                     "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": name,
                         "uid": format!("pod-{i}"), "controller": true, "blockOwnerDeletion": true}]},
        "spec": spec}),
    );
    (pod, claim)
}

#[derive(Debug, Default)]
struct Store {
    claims: HashMap<String, res::ResourceClaim>,
    pods: HashMap<String, Pod>,
    version: u64,
    /// Objects written since the last look, to come back as watch events.
    written: Vec<(Resource, String)>,
}

/// The API server's side of the writes, in memory.
#[derive(Debug, Clone, Default)]
struct MemoryApi(Arc<Mutex<Store>>);

fn key_of(meta: &ObjectMeta) -> String {
    format!(
        "{}/{}",
        meta.namespace.as_deref().unwrap_or("default"),
        meta.name.as_deref().unwrap_or_default()
    )
}

fn gone(key: &str) -> tessera_controller::Error {
    tessera_controller::Error::Api {
        action: key.to_owned(),
        code: Some(404),
        message: "not found".to_owned(),
    }
}

impl MemoryApi {
    /// Applies `change` to the stored copy of `object` (of `resource`, kept in the map
    /// `stored_in` picks) with a new resourceVersion, and queues it as a watch event.
    fn update<T>(
        &self,
        resource: Resource,
        object: &T,
        stored_in: fn(&mut Store) -> &mut HashMap<String, T>,
        change: impl FnOnce(&mut T),
    ) -> tessera_controller::Result<T>
    where
        T: k8s_openapi::Metadata<Ty = ObjectMeta> + Clone,
    {
        let key = key_of(object.metadata());
        let mut s = self.0.lock().unwrap();
        s.version += 1;
        let version = s.version.to_string();
        let stored = stored_in(&mut s).get_mut(&key).ok_or_else(|| gone(&key))?;
        change(stored);
        stored.metadata_mut().resource_version = Some(version);
        let out = stored.clone();
        s.written.push((resource, key));
        Ok(out)
    }

    fn claim(
        &self,
        claim: &res::ResourceClaim,
        change: impl FnOnce(&mut res::ResourceClaim),
    ) -> tessera_controller::Result<res::ResourceClaim> {
        self.update(Resource::Claims, claim, |s| &mut s.claims, change)
    }

    fn pod(&self, pod: &Pod, change: impl FnOnce(&mut Pod)) -> tessera_controller::Result<Pod> {
        self.update(Resource::Pods, pod, |s| &mut s.pods, change)
    }

    /// The objects written since the last call, as watch events carry them.
    fn events(&self) -> Vec<(Resource, Value)> {
        let mut s = self.0.lock().unwrap();
        let written = std::mem::take(&mut s.written);
        written
            .into_iter()
            .filter_map(|(r, k)| {
                let v = match r {
                    Resource::Claims => serde_json::to_value(s.claims.get(&k)?).ok()?,
                    _ => serde_json::to_value(s.pods.get(&k)?).ok()?,
                };
                Some((r, served(v)))
            })
            .collect()
    }
}

impl Writes for MemoryApi {
    async fn get_claim(
        &self,
        namespace: &str,
        name: &str,
    ) -> tessera_controller::Result<Option<res::ResourceClaim>> {
        let s = self.0.lock().unwrap();
        Ok(s.claims.get(&format!("{namespace}/{name}")).cloned())
    }
    async fn mark_claim(
        &self,
        claim: &res::ResourceClaim,
        pod: &str,
    ) -> tessera_controller::Result<res::ResourceClaim> {
        self.claim(claim, |c| {
            c.metadata
                .finalizers
                .get_or_insert_with(Vec::new)
                .push(names::CLAIM_FINALIZER.to_owned());
            c.metadata
                .annotations
                .get_or_insert_with(Default::default)
                .insert(names::ANNOTATION_ALLOCATED_BY.to_owned(), pod.to_owned());
        })
    }
    async fn write_allocation(
        &self,
        claim: &res::ResourceClaim,
        allocation: &res::AllocationResult,
        reserve_for: Option<&Pod>,
    ) -> tessera_controller::Result<res::ResourceClaim> {
        self.claim(claim, |c| {
            let status = c.status.get_or_insert_with(Default::default);
            status.allocation = Some(allocation.clone());
            if let Some(pod) = reserve_for {
                status.reserved_for = Some(vec![res::ResourceClaimConsumerReference {
                    resource: "pods".to_owned(),
                    name: pod.metadata.name.clone().unwrap_or_default(),
                    uid: pod.metadata.uid.clone().unwrap_or_default(),
                    api_group: None,
                }]);
            }
        })
    }
    async fn clear_allocation(
        &self,
        claim: &res::ResourceClaim,
    ) -> tessera_controller::Result<res::ResourceClaim> {
        self.claim(claim, |c| {
            if let Some(s) = c.status.as_mut() {
                s.allocation = None;
                s.reserved_for = None;
            }
        })
    }
    async fn unmark_claim(
        &self,
        claim: &res::ResourceClaim,
    ) -> tessera_controller::Result<res::ResourceClaim> {
        self.claim(claim, |c| {
            if let Some(a) = c.metadata.annotations.as_mut() {
                a.remove(names::ANNOTATION_ALLOCATED_BY);
            }
        })
    }
    async fn evict(&self, pod: &Pod, dry_run: bool) -> tessera_controller::Result<Eviction> {
        let mut s = self.0.lock().unwrap();
        let key = key_of(&pod.metadata);
        if s.pods.get(&key).map(|p| &p.metadata.uid) != Some(&pod.metadata.uid) {
            return Ok(Eviction::Gone);
        }
        if !dry_run {
            s.pods.remove(&key);
        }
        Ok(Eviction::Evicted)
    }
    async fn get_pod(
        &self,
        namespace: &str,
        name: &str,
    ) -> tessera_controller::Result<Option<Pod>> {
        let s = self.0.lock().unwrap();
        Ok(s.pods.get(&format!("{namespace}/{name}")).cloned())
    }
    async fn ungate(&self, pod: &Pod) -> tessera_controller::Result<Pod> {
        self.pod(pod, |p| {
            let left = gate::gates_without_ours(p);
            if let Some(spec) = p.spec.as_mut() {
                spec.scheduling_gates = (!left.is_empty()).then(|| {
                    left.into_iter()
                        .map(|name| k8s_openapi::api::core::v1::PodSchedulingGate { name })
                        .collect()
                });
            }
        })
    }
    async fn set_condition(
        &self,
        pod: &Pod,
        _allocated: bool,
        _reason: &str,
        _message: &str,
        _now: Timestamp,
    ) -> tessera_controller::Result<Pod> {
        self.pod(pod, |_| {})
    }
    async fn event(
        &self,
        _pod: &Pod,
        _warning: bool,
        _action: &str,
        _reason: &str,
        _message: &str,
    ) -> tessera_controller::Result<()> {
        Ok(())
    }
    async fn annotate_node(
        &self,
        node: &k8s_openapi::api::core::v1::Node,
        _key: &str,
        _value: &str,
    ) -> tessera_controller::Result<k8s_openapi::api::core::v1::Node> {
        Ok(node.clone())
    }
    async fn node_event(
        &self,
        _node: &k8s_openapi::api::core::v1::Node,
        _warning: bool,
        _action: &str,
        _reason: &str,
        _message: &str,
    ) -> tessera_controller::Result<()> {
        Ok(())
    }
}

/// `VmRSS` and `VmHWM` of this process, in KiB.
fn memory() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// CPU time this thread has run (the scheduler's own count, in nanoseconds).
fn thread_cpu() -> Duration {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
    let ns = text
        .split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    Duration::from_nanos(ns)
}

fn phase(name: &str, before: u64, count: usize, unit: &str) -> u64 {
    let (rss, hwm) = memory();
    let per = (rss.saturating_sub(before) * 1024) as f64 / count.max(1) as f64;
    println!(
        "view_scale {name:<28} VmRSS {:>6.1} MiB  VmHWM {:>6.1} MiB  +{per:>8.0} bytes/{unit}",
        rss as f64 / 1024.0,
        hwm as f64 / 1024.0
    );
    rss
}

async fn run(nodes: usize, pods: usize) {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap();
    let devices = nodes * GPUS;
    let (start, _) = memory();
    println!("view_scale nodes={nodes} gpus={devices} pods={pods}");
    let mut view = ClusterView::new(names::DEFAULT_DRIVER_NAME);
    let classes: Vec<Value> = ["gpu.yaml", "shared-gpu.yaml"]
        .iter()
        .map(|f| {
            let text = std::fs::read_to_string(repo.join("deviceclasses").join(f)).unwrap();
            let mut v: Value = serde_yaml::from_str(&text).unwrap();
            v["metadata"]["resourceVersion"] = json!("1");
            served(v)
        })
        .collect();
    view.apply(Resource::Classes, Change::Listed(classes));
    view.apply(
        Resource::Nodes,
        Change::Listed(
            (0..nodes)
                .map(|i| node_json(&format!("node-{i:04}")))
                .collect(),
        ),
    );
    let rss = phase("nodes", start, nodes, "node");
    // The slices in pages of 50, as the reflector lists them and hands them on: each page
    // is decoded into the view and dropped before the next is read.
    let options = RenderOptions {
        consumable_capacity: true,
        ..RenderOptions::default()
    };
    let inventory = inventory(nodes);
    let pages: Vec<&[_]> = inventory.nodes.chunks(SLICE_PAGE).collect();
    let mut took = Duration::ZERO;
    for (i, chunk) in pages.iter().enumerate() {
        let mut items = Vec::with_capacity(chunk.len());
        for node in *chunk {
            for slice in slices::render(node, &options).unwrap() {
                let mut v = apiversion::encode_slice(&slice, ApiVersion::V1).unwrap();
                v["metadata"]["resourceVersion"] = json!("1");
                items.push(served(v));
            }
        }
        let change = Change::Page {
            items,
            first: i == 0,
            last: i + 1 == pages.len(),
        };
        let cpu = thread_cpu();
        view.apply(Resource::Slices, change);
        took += thread_cpu().saturating_sub(cpu);
    }
    let rss = phase("slices in the view", rss, devices, "device");
    let cpu = thread_cpu();
    view.snapshot().unwrap();
    let snap_took = thread_cpu().saturating_sub(cpu);
    let rss = phase("snapshot built", rss, devices, "device");
    println!(
        "view_scale decoding {devices} devices took {:.0} ms, building the snapshot {:.0} ms",
        took.as_secs_f64() * 1000.0,
        snap_took.as_secs_f64() * 1000.0
    );
    for r in [Resource::Claims, Resource::Pods] {
        view.apply(r, Change::Listed(Vec::new()));
    }
    let api = MemoryApi::default();
    let (_leader_tx, leader) = tokio::sync::watch::channel(true);
    let mut reconciler = Reconciler::new(
        ReconcilerConfig {
            driver_name: names::DEFAULT_DRIVER_NAME.to_owned(),
            policy: Policy::default(),
            unbound_after: Duration::from_mins(5),
            // The controller's defaults.
            fast_path: true,
            preemption: false,
            defrag_per_hour: 0,
        },
        api.clone(),
        Arc::new(Metrics::new("bench")),
        leader,
    );
    // Pods arrive in batches, as watch events between passes; each pass's answers come back
    // as events before the next batch.
    let mut rng = Rng(0x5eed_1234_abcd_ef01);
    let mut cpu_total = Duration::ZERO;
    let mut placed = 0;
    let mut passes = 0;
    let mut created = 0;
    while created < pods || placed < pods {
        let batch: Vec<(Value, Value)> = (created..pods.min(created + BATCH))
            .map(|i| pod_and_claim(i, &claim_spec(&mut rng)))
            .collect();
        created += batch.len();
        {
            let mut s = api.0.lock().unwrap();
            for (p, c) in &batch {
                let p: Pod = serde_json::from_value(p.clone()).unwrap();
                let c: res::ResourceClaim = serde_json::from_value(c.clone()).unwrap();
                s.pods.insert(key_of(&p.metadata), p);
                s.claims.insert(key_of(&c.metadata), c);
            }
        }
        let cpu = thread_cpu();
        for (p, c) in batch {
            view.apply(Resource::Claims, Change::Applied(c));
            view.apply(Resource::Pods, Change::Applied(p));
        }
        let report = reconciler.pass(&mut view).await;
        cpu_total += thread_cpu().saturating_sub(cpu);
        placed += report.placed;
        passes += 1;
        let events = api.events();
        let cpu = thread_cpu();
        for (r, v) in events {
            view.apply(r, Change::Applied(v));
        }
        cpu_total += thread_cpu().saturating_sub(cpu);
        if report.placed == 0 && created >= pods {
            break;
        }
    }
    phase("pods and claims placed", rss, pods, "pod+claim");
    println!(
        "view_scale placed {placed} of {pods} pods in {passes} passes: {:.2} ms CPU/pod in the view and passes",
        cpu_total.as_secs_f64() * 1000.0 / placed.max(1) as f64
    );
    // Steady state: nothing gated, and every event is a pass that finds nothing to place;
    // here a status update of a placed pod, as its kubelet would send.
    let keys: Vec<String> = api
        .0
        .lock()
        .unwrap()
        .pods
        .keys()
        .take(STEADY_UPDATES)
        .cloned()
        .collect();
    let mut cpu_steady = Duration::ZERO;
    for key in &keys {
        let pod = api.0.lock().unwrap().pods[key].clone();
        let updated = api
            .pod(&pod, |p| {
                p.status.get_or_insert_default().phase = Some("Running".to_owned());
            })
            .unwrap();
        let event = serde_json::to_value(updated).unwrap();
        let cpu = thread_cpu();
        view.apply(Resource::Pods, Change::Applied(event));
        let report = reconciler.pass(&mut view).await;
        cpu_steady += thread_cpu().saturating_sub(cpu);
        assert_eq!(report.placed, 0);
    }
    api.events();
    println!(
        "view_scale steady state: {:.1} µs CPU per pod status event and its pass, nothing gated ({} events)",
        cpu_steady.as_secs_f64() * 1e6 / keys.len().max(1) as f64,
        keys.len()
    );
}

fn main() {
    let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<usize>().ok());
    let nodes = env("TESSERA_BENCH_NODES").unwrap_or(1000);
    let pods = env("TESSERA_BENCH_PODS").unwrap_or(nodes * 5);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(run(nodes, pods));
}
