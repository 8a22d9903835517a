//! The reconcile loop against an in-memory API (`FakeWrites`): the gate protocol's writes in
//! order, conflicts re-read and retried, a failure half-way rolled back, a refusal that waits
//! for a change of the pod or its claims. No HTTP server.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1 as res;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;
use serde_json::{Value, json};
use tessera_driver::placement::allocator::Policy;
use tessera_driver::{names, placement::gate, testing};
use tokio::sync::watch;

use super::*;
use crate::cluster::{Change, ClusterView, Resource};

/// One call the reconciler made, as `verb namespace/name`.
type Call = String;

#[derive(Debug, Default)]
struct State {
    claims: BTreeMap<String, res::ResourceClaim>,
    pods: BTreeMap<String, Pod>,
    version: u64,
    calls: Vec<Call>,
    /// Answers queued per verb and object: the next such call fails with the code.
    failures: Vec<(&'static str, String, u16)>,
    /// Verbs answered 422 for this claim, always (as for a claim the server cannot change).
    immutable: Option<String>,
}

/// The API server in memory: stores claims and pods, checks resourceVersion preconditions,
/// records every call, answers queued failures.
#[derive(Debug, Clone, Default)]
struct FakeWrites(Arc<Mutex<State>>);

fn key_of(meta: &ObjectMeta) -> String {
    format!(
        "{}/{}",
        meta.namespace.as_deref().unwrap_or("default"),
        meta.name.as_deref().unwrap_or_default()
    )
}

fn api_error(verb: &str, key: &str, code: u16) -> Error {
    Error::Api {
        action: format!("{verb} {key}"),
        code: Some(code),
        message: format!("injected {code}"),
    }
}

impl FakeWrites {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.lock().unwrap()
    }

    fn calls(&self) -> Vec<Call> {
        self.state().calls.clone()
    }

    fn fail(&self, verb: &'static str, key: &str, code: u16) {
        self.state().failures.push((verb, key.to_owned(), code));
    }

    /// Records the call and answers an injected failure, if one is due.
    fn enter(&self, verb: &'static str, key: &str) -> Result<()> {
        let mut s = self.state();
        s.calls.push(format!("{verb} {key}"));
        if s.immutable.as_deref() == Some(key) && verb != "get-claim" {
            return Err(api_error(verb, key, 422));
        }
        if let Some(pos) = s
            .failures
            .iter()
            .position(|(v, k, _)| *v == verb && k == key)
        {
            let (_, _, code) = s.failures.remove(pos);
            return Err(api_error(verb, key, code));
        }
        Ok(())
    }

    /// Updates the stored copy of `object` (kept in the map `stored_in` picks) with `change`, as
    /// the API server does with `object`'s resourceVersion as precondition: 404 for an object it
    /// does not have, 409 for a stale version, else the object with a new version.
    fn update<T>(
        &self,
        verb: &'static str,
        object: &T,
        stored_in: fn(&mut State) -> &mut BTreeMap<String, T>,
        change: impl FnOnce(&mut T),
    ) -> Result<T>
    where
        T: k8s_openapi::Metadata<Ty = ObjectMeta> + Clone,
    {
        let key = key_of(object.metadata());
        self.enter(verb, &key)?;
        let mut s = self.state();
        s.version += 1;
        let version = s.version.to_string();
        let stored = stored_in(&mut s)
            .get_mut(&key)
            .ok_or_else(|| api_error(verb, &key, 404))?;
        if stored.metadata().resource_version != object.metadata().resource_version {
            return Err(api_error(verb, &key, 409));
        }
        change(stored);
        stored.metadata_mut().resource_version = Some(version);
        Ok(stored.clone())
    }

    fn update_claim(
        &self,
        verb: &'static str,
        claim: &res::ResourceClaim,
        change: impl FnOnce(&mut res::ResourceClaim),
    ) -> Result<res::ResourceClaim> {
        self.update(verb, claim, |s| &mut s.claims, change)
    }
}

impl Writes for FakeWrites {
    async fn get_claim(&self, namespace: &str, name: &str) -> Result<Option<res::ResourceClaim>> {
        // A real server answers later: let other pods\' writes run meanwhile.
        tokio::task::yield_now().await;
        let key = format!("{namespace}/{name}");
        self.enter("get-claim", &key)?;
        Ok(self.state().claims.get(&key).cloned())
    }

    async fn mark_claim(
        &self,
        claim: &res::ResourceClaim,
        pod: &str,
    ) -> Result<res::ResourceClaim> {
        // A real server answers later: let other pods\' writes run meanwhile.
        tokio::task::yield_now().await;
        self.update_claim("mark", claim, |c| {
            let f = c.metadata.finalizers.get_or_insert_with(Vec::new);
            if !f.iter().any(|x| x == names::CLAIM_FINALIZER) {
                f.push(names::CLAIM_FINALIZER.to_owned());
            }
            c.metadata
                .annotations
                .get_or_insert_with(BTreeMap::new)
                .insert(names::ANNOTATION_ALLOCATED_BY.to_owned(), pod.to_owned());
        })
    }

    async fn write_allocation(
        &self,
        claim: &res::ResourceClaim,
        allocation: &res::AllocationResult,
        reserve_for: Option<&Pod>,
    ) -> Result<res::ResourceClaim> {
        // A real server answers later: let other pods\' writes run meanwhile.
        tokio::task::yield_now().await;
        let verb = if reserve_for.is_some() {
            "allocate+reserve"
        } else {
            "allocate"
        };
        self.update_claim(verb, claim, |c| {
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

    async fn clear_allocation(&self, claim: &res::ResourceClaim) -> Result<res::ResourceClaim> {
        // A real server answers later: let other pods\' writes run meanwhile.
        tokio::task::yield_now().await;
        self.update_claim("deallocate", claim, |c| {
            if let Some(s) = c.status.as_mut() {
                s.allocation = None;
                s.reserved_for = None;
            }
        })
    }

    async fn unmark_claim(&self, claim: &res::ResourceClaim) -> Result<res::ResourceClaim> {
        // A real server answers later: let other pods\' writes run meanwhile.
        tokio::task::yield_now().await;
        let release = !gate::is_allocated(claim) && !gate::is_reserved(claim);
        self.update_claim("unmark", claim, |c| {
            if let Some(a) = c.metadata.annotations.as_mut() {
                a.remove(names::ANNOTATION_ALLOCATED_BY);
            }
            if release && let Some(f) = c.metadata.finalizers.as_mut() {
                f.retain(|x| x != names::CLAIM_FINALIZER);
            }
        })
    }

    async fn get_pod(&self, namespace: &str, name: &str) -> Result<Option<Pod>> {
        // A real server answers later: let other pods\' writes run meanwhile.
        tokio::task::yield_now().await;
        let key = format!("{namespace}/{name}");
        self.enter("get-pod", &key)?;
        Ok(self.state().pods.get(&key).cloned())
    }

    async fn ungate(&self, pod: &Pod) -> Result<Pod> {
        // A real server answers later: let other pods\' writes run meanwhile.
        tokio::task::yield_now().await;
        self.update(
            "ungate",
            pod,
            |s| &mut s.pods,
            |p| {
                if let Some(spec) = p.spec.as_mut() {
                    let left = gate::gates_without_ours(&Pod {
                        spec: Some(spec.clone()),
                        ..Pod::default()
                    });
                    spec.scheduling_gates = (!left.is_empty()).then(|| {
                        left.into_iter()
                            .map(|name| k8s_openapi::api::core::v1::PodSchedulingGate { name })
                            .collect()
                    });
                }
            },
        )
    }

    async fn set_condition(
        &self,
        pod: &Pod,
        allocated: bool,
        reason: &str,
        message: &str,
        now: Timestamp,
    ) -> Result<Pod> {
        // A real server answers later: let other pods\' writes run meanwhile.
        tokio::task::yield_now().await;
        let key = key_of(&pod.metadata);
        self.state().calls.push(format!("condition {key} {reason}"));
        let _ = (allocated, message, now);
        let mut s = self.state();
        s.version += 1;
        let version = s.version.to_string();
        let stored = s
            .pods
            .get_mut(&key)
            .ok_or_else(|| api_error("condition", &key, 404))?;
        stored.metadata.resource_version = Some(version);
        Ok(stored.clone())
    }

    async fn evict(&self, pod: &Pod, dry_run: bool) -> Result<Eviction> {
        tokio::task::yield_now().await;
        let key = key_of(&pod.metadata);
        let verb = if dry_run { "evict-dry-run" } else { "evict" };
        match self.enter(verb, &key) {
            Err(e) if e.api_code() == Some(429) => return Ok(Eviction::Blocked(e.to_string())),
            Err(e) => return Err(e),
            Ok(()) => {}
        }
        let mut s = self.state();
        let Some(stored) = s.pods.get(&key) else {
            return Ok(Eviction::Gone);
        };
        if stored.metadata.uid != pod.metadata.uid {
            return Ok(Eviction::Gone);
        }
        if !dry_run {
            s.pods.remove(&key);
        }
        Ok(Eviction::Evicted)
    }

    async fn event(
        &self,
        pod: &Pod,
        _warning: bool,
        _action: &str,
        reason: &str,
        _message: &str,
    ) -> Result<()> {
        // A real server answers later: let other pods\' writes run meanwhile.
        tokio::task::yield_now().await;
        self.state()
            .calls
            .push(format!("event {} {reason}", key_of(&pod.metadata)));
        Ok(())
    }

    async fn annotate_node(&self, node: &Node, key: &str, value: &str) -> Result<Node> {
        tokio::task::yield_now().await;
        let name = node.metadata.name.clone().unwrap_or_default();
        self.state()
            .calls
            .push(format!("annotate node {name} {key}"));
        let mut written = node.clone();
        written
            .metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(key.to_owned(), value.to_owned());
        Ok(written)
    }

    async fn node_event(
        &self,
        node: &Node,
        _warning: bool,
        _action: &str,
        reason: &str,
        _message: &str,
    ) -> Result<()> {
        tokio::task::yield_now().await;
        self.state().calls.push(format!(
            "node event {} {reason}",
            node.metadata.name.as_deref().unwrap_or_default()
        ));
        Ok(())
    }
}

const DRIVER: &str = names::DEFAULT_DRIVER_NAME;

fn slice(node: &str, gpus: usize) -> Value {
    let devices: Vec<Value> = (0..gpus)
        .map(|i| {
            json!({"name": format!("gpu-{i}"),
                   "attributes": {"type": {"string": "gpu"}, "index": {"int": i}},
                   "capacity": {"memory": {"value": "80Gi"}}})
        })
        .collect();
    json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
           "metadata": {"name": format!("{node}-gpus"), "resourceVersion": "1"},
           "spec": {"driver": DRIVER, "nodeName": node,
                    "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                    "devices": devices}})
}

fn claim_json(name: &str, version: &str) -> Value {
    json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
           "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}"),
                        "resourceVersion": version},
           "spec": {"devices": {"requests": [{"name": "gpu",
               "exactly": {"deviceClassName": "gpu"}}]}}})
}

fn pod_json(name: &str, claims: &[&str]) -> Value {
    let refs: Vec<Value> = claims
        .iter()
        .enumerate()
        .map(|(i, c)| json!({"name": format!("c{i}"), "resourceClaimName": c}))
        .collect();
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": "ns", "resourceVersion": "1",
                        "uid": format!("uid-{name}"),
                        "creationTimestamp": "2026-01-01T00:00:00Z"},
           "spec": {"schedulingGates": [{"name": names::SCHEDULING_GATE}],
                    "resourceClaims": refs,
                    "containers": [{"name": "c", "image": "x"}]}})
}

/// A view of one node with `gpus` whole GPUs, the objects also stored in the fake.
fn cluster(gpus: usize, claims: &[&str], pods: &[(&str, &[&str])]) -> (ClusterView, FakeWrites) {
    let fake = FakeWrites::default();
    let mut view = ClusterView::new(DRIVER);
    view.apply(
        Resource::Nodes,
        Change::Listed(vec![json!({"apiVersion": "v1", "kind": "Node",
                                   "metadata": {"name": "n1", "resourceVersion": "1"}})]),
    );
    view.apply(Resource::Slices, Change::Listed(vec![slice("n1", gpus)]));
    view.apply(
        Resource::Classes,
        Change::Listed(vec![json!({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": {"name": "gpu", "resourceVersion": "1"},
            "spec": {"selectors": [{"cel": {"expression": format!("device.driver == \"{DRIVER}\"")}}]}})]),
    );
    let claims: Vec<Value> = claims.iter().map(|c| claim_json(c, "1")).collect();
    let pods: Vec<Value> = pods.iter().map(|(p, c)| pod_json(p, c)).collect();
    {
        let mut s = fake.state();
        for c in &claims {
            let c: res::ResourceClaim = serde_json::from_value(c.clone()).unwrap();
            s.claims.insert(key_of(&c.metadata), c);
        }
        for p in &pods {
            let p: Pod = serde_json::from_value(p.clone()).unwrap();
            s.pods.insert(key_of(&p.metadata), p);
        }
        s.version = 100;
    }
    view.apply(Resource::Claims, Change::Listed(claims));
    view.apply(Resource::Pods, Change::Listed(pods));
    (view, fake)
}

/// A reconciler on the gate protocol only (kube-scheduler binds every pod).
fn reconciler(fake: &FakeWrites) -> (Reconciler<FakeWrites>, watch::Sender<bool>) {
    reconciler_with(fake, false)
}

fn reconciler_with(
    fake: &FakeWrites,
    fast_path: bool,
) -> (Reconciler<FakeWrites>, watch::Sender<bool>) {
    let (tx, rx) = watch::channel(true);
    let r = Reconciler::new(
        ReconcilerConfig {
            driver_name: DRIVER.to_owned(),
            policy: Policy::FirstFit,
            unbound_after: Duration::from_hours(1),
            fast_path,
            preemption: false,
            defrag_per_hour: 0,
        },
        fake.clone(),
        Arc::new(Metrics::new("first-fit")),
        rx,
    );
    (r, tx)
}

#[tokio::test]
async fn a_gated_pod_gets_its_three_writes_in_protocol_order() {
    let (mut view, fake) = cluster(2, &["a"], &[("p", &["a"])]);
    let (mut r, _leader) = reconciler(&fake);
    let report = r.pass(&mut view).await;
    assert_eq!(report.placed, 1);
    assert_eq!(fake.calls(), ["mark ns/a", "allocate ns/a", "ungate ns/p"]);
    let stored = fake.state().claims["ns/a"].clone();
    assert!(gate::is_allocated(&stored) && gate::is_ours(&stored));
    assert!(!gate::is_gated(&fake.state().pods["ns/p"]));
    // The view holds what the server answered: a second pass writes nothing.
    let again = r.pass(&mut view).await;
    assert_eq!((again.placed, fake.calls().len()), (0, 3));
}

#[tokio::test]
async fn two_pods_never_get_the_same_gpu_and_the_third_waits_with_a_reason() {
    let (mut view, fake) = cluster(
        2,
        &["a", "b", "c"],
        &[("p", &["a"]), ("q", &["b"]), ("r", &["c"])],
    );
    let (mut r, _leader) = reconciler(&fake);
    let report = r.pass(&mut view).await;
    assert_eq!((report.placed, report.pending), (2, 1));
    let s = fake.state();
    let device = |k: &str| testing::first_device(&s.claims[k]);
    assert_ne!(device("ns/a"), device("ns/b"));
    assert!(
        s.calls.contains(&format!("event ns/r {REASON_FAILED}")),
        "{:?}",
        s.calls
    );
}

#[tokio::test]
async fn a_conflict_is_re_read_and_retried() {
    let (mut view, fake) = cluster(1, &["a"], &[("p", &["a"])]);
    fake.fail("allocate", "ns/a", 409);
    let (mut r, _leader) = reconciler(&fake);
    assert_eq!(r.pass(&mut view).await.placed, 1);
    assert_eq!(
        fake.calls(),
        [
            "mark ns/a",
            "allocate ns/a",
            "get-claim ns/a",
            "allocate ns/a",
            "ungate ns/p"
        ]
    );
}

#[tokio::test]
async fn a_failure_on_the_second_claim_rolls_back_the_first() {
    let (mut view, fake) = cluster(2, &["a", "b"], &[("p", &["a", "b"])]);
    fake.fail("mark", "ns/b", 500);
    let (mut r, _leader) = reconciler(&fake);
    let report = r.pass(&mut view).await;
    assert!(report.retry_soon && report.placed == 0);
    assert_eq!(
        fake.calls(),
        [
            "mark ns/a",
            "allocate ns/a",
            "mark ns/b",
            "deallocate ns/a",
            "unmark ns/a"
        ]
    );
    let a = fake.state().claims["ns/a"].clone();
    assert!(!gate::is_allocated(&a) && !gate::is_ours(&a));
    assert!(a.metadata.finalizers.iter().flatten().next().is_none());
    // The next pass (the service retries soon) places the pod.
    view.bump();
    assert_eq!(r.pass(&mut view).await.placed, 1);
    assert!(!gate::is_gated(&fake.state().pods["ns/p"]));
}

#[tokio::test]
async fn a_refused_claim_waits_for_a_change_of_itself_not_of_the_cluster() {
    let (mut view, fake) = cluster(2, &["a", "other"], &[("p", &["a"])]);
    fake.state().immutable = Some("ns/a".to_owned());
    let (mut r, _leader) = reconciler(&fake);
    let report = r.pass(&mut view).await;
    assert_eq!((report.placed, report.pending), (0, 1));
    assert_eq!(
        fake.calls(),
        [
            "mark ns/a".to_owned(),
            format!("event ns/p {REASON_REFUSED}"),
            format!("condition ns/p {REASON_REFUSED}"),
        ]
    );
    // Unrelated changes: a resync, another claim changing, a pod going.
    view.bump();
    view.apply(
        Resource::Claims,
        Change::Applied(claim_json("other", "200")),
    );
    view.apply(Resource::Pods, Change::Applied(pod_json("gone", &[])));
    view.apply(Resource::Pods, Change::Deleted(pod_json("gone", &[])));
    for _ in 0..3 {
        r.pass(&mut view).await;
    }
    assert_eq!(fake.calls().len(), 3, "{:?}", fake.calls());
    // The claim itself changed: one more try (refused again, the same message not repeated).
    view.apply(Resource::Claims, Change::Applied(claim_json("a", "300")));
    fake.state()
        .claims
        .get_mut("ns/a")
        .unwrap()
        .metadata
        .resource_version = Some("300".into());
    r.pass(&mut view).await;
    r.pass(&mut view).await;
    assert_eq!(fake.calls().len(), 4, "{:?}", fake.calls());
    assert_eq!(fake.calls()[3], "mark ns/a");
}

#[tokio::test]
async fn different_pods_writes_are_in_flight_together_each_in_protocol_order() {
    let (mut view, fake) = cluster(2, &["a", "b"], &[("p", &["a"]), ("q", &["b"])]);
    let (mut r, _leader) = reconciler(&fake);
    assert_eq!(r.pass(&mut view).await.placed, 2);
    let calls = fake.calls();
    let at = |c: &str| calls.iter().position(|x| x == c).unwrap();
    // Each pod's own writes keep their order...
    assert!(at("mark ns/a") < at("allocate ns/a") && at("allocate ns/a") < at("ungate ns/p"));
    assert!(at("mark ns/b") < at("allocate ns/b") && at("allocate ns/b") < at("ungate ns/q"));
    // ...while the second pod's writes start before the first pod's are done.
    assert!(at("mark ns/b") < at("ungate ns/p"), "{calls:?}");
}

fn reserved_for(fake: &FakeWrites, claim: &str) -> Vec<String> {
    fake.state().claims[claim]
        .status
        .as_ref()
        .and_then(|s| s.reserved_for.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|r| r.uid)
        .collect()
}

#[tokio::test]
async fn a_fast_path_pod_gets_its_claims_reserved_in_the_allocation_write() {
    let (mut view, fake) = cluster(2, &["a"], &[("p", &["a"])]);
    let (mut r, _leader) = reconciler_with(&fake, true);
    assert_eq!(r.pass(&mut view).await.placed, 1);
    assert_eq!(
        fake.calls(),
        ["mark ns/a", "allocate+reserve ns/a", "ungate ns/p"]
    );
    assert_eq!(reserved_for(&fake, "ns/a"), ["uid-p"]);
    // kube-scheduler binds it; nothing more for the controller to do.
    r.pass(&mut view).await;
    assert_eq!(fake.calls().len(), 3);
}

#[tokio::test]
async fn a_claim_marked_at_admission_costs_no_mark_write() {
    let (mut view, fake) = cluster(2, &["a"], &[("p", &["a"])]);
    let mut marked = claim_json("a", "2");
    marked["metadata"]["finalizers"] = json!([names::CLAIM_FINALIZER]);
    marked["metadata"]["annotations"] = json!({names::ANNOTATION_ALLOCATED_BY: "p"});
    view.apply(Resource::Claims, Change::Applied(marked.clone()));
    fake.state()
        .claims
        .insert("ns/a".into(), serde_json::from_value(marked).unwrap());
    let (mut r, _leader) = reconciler_with(&fake, true);
    assert_eq!(r.pass(&mut view).await.placed, 1);
    assert_eq!(fake.calls(), ["allocate+reserve ns/a", "ungate ns/p"]);
}

#[tokio::test]
async fn a_fast_path_failure_on_the_second_claim_rolls_back_the_first_with_its_reservation() {
    let (mut view, fake) = cluster(2, &["a", "b"], &[("p", &["a", "b"])]);
    fake.fail("allocate+reserve", "ns/b", 500);
    let (mut r, _leader) = reconciler_with(&fake, true);
    let report = r.pass(&mut view).await;
    assert!(report.retry_soon && report.placed == 0);
    assert_eq!(
        fake.calls(),
        [
            "mark ns/a",
            "allocate+reserve ns/a",
            "mark ns/b",
            "allocate+reserve ns/b",
            "deallocate ns/a",
            "unmark ns/a",
        ]
    );
    let a = fake.state().claims["ns/a"].clone();
    assert!(!gate::is_allocated(&a) && !gate::is_reserved(&a) && !gate::is_ours(&a));
    assert!(gate::is_gated(&fake.state().pods["ns/p"]));
    // The next pass places it.
    view.bump();
    assert_eq!(r.pass(&mut view).await.placed, 1);
    assert_eq!(reserved_for(&fake, "ns/a"), ["uid-p"]);
    assert_eq!(reserved_for(&fake, "ns/b"), ["uid-p"]);
}

#[tokio::test]
async fn a_pod_deleted_before_its_gate_goes_gets_its_reserved_claims_rolled_back() {
    let (mut view, fake) = cluster(2, &["a"], &[("p", &["a"])]);
    fake.fail("ungate", "ns/p", 404);
    let (mut r, _leader) = reconciler_with(&fake, true);
    let report = r.pass(&mut view).await;
    assert_eq!(report.placed, 0);
    assert_eq!(
        fake.calls(),
        [
            "mark ns/a",
            "allocate+reserve ns/a",
            "ungate ns/p",
            "deallocate ns/a",
            "unmark ns/a"
        ]
    );
    let a = fake.state().claims["ns/a"].clone();
    assert!(!gate::is_allocated(&a) && !gate::is_reserved(&a));
    assert!(a.metadata.finalizers.iter().flatten().next().is_none());
}

#[tokio::test]
async fn a_failed_ungate_on_the_fast_path_is_finished_by_the_next_pass() {
    let (mut view, fake) = cluster(2, &["a"], &[("p", &["a"])]);
    fake.fail("ungate", "ns/p", 500);
    let (mut r, _leader) = reconciler_with(&fake, true);
    assert!(r.pass(&mut view).await.retry_soon);
    // Allocated and reserved for the still-gated pod: nothing rolled back.
    assert_eq!(reserved_for(&fake, "ns/a"), ["uid-p"]);
    view.bump();
    assert_eq!(r.pass(&mut view).await.placed, 1);
    assert_eq!(fake.calls()[3..], ["ungate ns/p".to_owned()]);
    assert!(!gate::is_gated(&fake.state().pods["ns/p"]));
}

#[tokio::test]
async fn a_pod_with_a_constraint_the_controller_does_not_evaluate_keeps_the_gate_protocol() {
    let (mut view, fake) = cluster(2, &["a"], &[]);
    let mut pod = pod_json("p", &["a"]);
    pod["spec"]["volumes"] = json!([{"name": "data", "persistentVolumeClaim": {"claimName": "d"}}]);
    fake.state()
        .pods
        .insert("ns/p".into(), serde_json::from_value(pod.clone()).unwrap());
    view.apply(Resource::Pods, Change::Applied(pod));
    let (mut r, _leader) = reconciler_with(&fake, true);
    assert_eq!(r.pass(&mut view).await.placed, 1);
    assert_eq!(fake.calls(), ["mark ns/a", "allocate ns/a", "ungate ns/p"]);
    assert!(reserved_for(&fake, "ns/a").is_empty());
}

/// One node with one shared 80Gi GPU and the classes `shared` (online) and `batch`.
fn shared_gpu_view() -> ClusterView {
    let mut view = ClusterView::new(DRIVER);
    view.apply(
        Resource::Nodes,
        Change::Listed(vec![json!({"apiVersion": "v1", "kind": "Node",
                                   "metadata": {"name": "n1", "resourceVersion": "1"}})]),
    );
    view.apply(
        Resource::Slices,
        Change::Listed(vec![
            json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": "n1-gpus", "resourceVersion": "1"},
            "spec": {"driver": DRIVER, "nodeName": "n1",
                     "pool": {"name": "n1", "generation": 1, "resourceSliceCount": 1},
                     "devices": [{"name": "gpu-0",
                        "attributes": {"type": {"string": "gpu"}, "sharing": {"string": "shared"}},
                        "capacity": {"memory": {"value": "80Gi"}, "compute": {"value": "100"}}}]}}),
        ]),
    );
    let class = |name: &str, config: Value| {
        json!({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
               "metadata": {"name": name, "resourceVersion": "1"},
               "spec": {"selectors": [{"cel": {"expression": format!("device.driver == \"{DRIVER}\"")}}],
                        "config": config}})
    };
    view.apply(
        Resource::Classes,
        Change::Listed(vec![
            class("shared", json!([])),
            class(
                "batch",
                json!([{"opaque": {"driver": DRIVER, "parameters": {
                    "apiVersion": names::CONFIG_API_VERSION, "kind": names::TIER_POLICY_KIND,
                    "tier": "batch"}}}]),
            ),
        ]),
    );
    view
}

/// A share claim of `class` for `gib` GiB, and its gated pod of `priority`, stored in the fake
/// and applied to the view.
fn add_share_pod(
    view: &mut ClusterView,
    fake: &FakeWrites,
    name: &str,
    class: &str,
    gib: u32,
    priority: i32,
) {
    let claim = json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}"),
                     "resourceVersion": "1"},
        "spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": class}}],
            "config": [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": {
                "apiVersion": names::CONFIG_API_VERSION, "kind": names::GPU_SHARE_KIND,
                "memory": format!("{gib}Gi")}}}]}}});
    let mut pod = pod_json(name, &[name]);
    pod["metadata"]["uid"] = json!(format!("pod-{name}"));
    pod["spec"]["priority"] = json!(priority);
    {
        let mut s = fake.state();
        let c: res::ResourceClaim = serde_json::from_value(claim.clone()).unwrap();
        s.claims.insert(key_of(&c.metadata), c);
        let p: Pod = serde_json::from_value(pod.clone()).unwrap();
        s.pods.insert(key_of(&p.metadata), p);
    }
    view.apply(Resource::Claims, Change::Applied(claim));
    view.apply(Resource::Pods, Change::Applied(pod));
}

#[tokio::test]
async fn an_online_pod_preempts_once_and_waits_while_its_victim_terminates() {
    let fake = FakeWrites::default();
    let mut view = shared_gpu_view();
    add_share_pod(&mut view, &fake, "low", "batch", 40, 0);
    add_share_pod(&mut view, &fake, "high", "batch", 40, 5);
    let (_tx, rx) = watch::channel(true);
    let mut r = Reconciler::new(
        ReconcilerConfig {
            driver_name: DRIVER.to_owned(),
            policy: Policy::FirstFit,
            unbound_after: Duration::from_hours(1),
            fast_path: false,
            preemption: true,
            defrag_per_hour: 0,
        },
        fake.clone(),
        Arc::new(Metrics::new("first-fit")),
        rx,
    );
    assert_eq!(r.pass(&mut view).await.placed, 2);
    add_share_pod(&mut view, &fake, "online", "shared", 40, 0);
    let before = fake.calls().len();
    r.pass(&mut view).await;
    let calls: Vec<String> = fake.calls()[before..].to_vec();
    assert_eq!(
        calls,
        [
            "evict-dry-run ns/low",
            "evict ns/low",
            "event ns/low Preempted",
            "event ns/online Preempting",
            "condition ns/online Preempting",
        ],
        "the lowest-priority batch pod alone makes room"
    );
    // The victim is still in the view (terminating): passes evict nothing more.
    for _ in 0..3 {
        view.bump();
        let before = fake.calls().len();
        r.pass(&mut view).await;
        assert!(
            !fake.calls()[before..]
                .iter()
                .any(|c| c.starts_with("evict")),
            "{:?}",
            fake.calls()
        );
    }
    // Gone: its claim is released and the online pod placed.
    view.apply(Resource::Pods, Change::Deleted(pod_json("low", &["low"])));
    r.pass(&mut view).await;
    assert!(
        fake.calls().iter().any(|c| c == "ungate ns/online"),
        "{:?}",
        fake.calls()
    );
    assert!(!gate::is_gated(&fake.state().pods["ns/online"]));
}

#[test]
fn answers_waiting_for_the_end_of_a_pass_are_kept_slim() {
    let mut claim: res::ResourceClaim = serde_json::from_value(claim_json("c1", "3")).unwrap();
    claim.metadata.labels = Some([("app".to_owned(), "x".to_owned())].into());
    claim.metadata.managed_fields = Some(vec![
        k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry::default(),
    ]);
    let mut pod: Pod = serde_json::from_value(pod_json("p1", &["c1"])).unwrap();
    pod.metadata.managed_fields = Some(vec![
        k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry::default(),
    ]);
    let done = Done {
        job: Job {
            pod: pod.clone(),
            claims: Vec::new(),
            started: Instant::now(),
            reserve: false,
        },
        updates: vec![
            ViewUpdate::Claim(Box::new(claim)),
            ViewUpdate::Pod(Box::new(pod)),
        ],
        written: Vec::new(),
        pod_gone: false,
        result: Ok(()),
    };
    let mut out = Vec::new();
    push_done(&mut out, Ok(done));
    let [ViewUpdate::Claim(c), ViewUpdate::Pod(p)] = out[0].updates.as_slice() else {
        panic!("updates changed: {:?}", out[0].updates);
    };
    assert!(c.metadata.labels.is_none() && c.metadata.managed_fields.is_none());
    assert!(p.metadata.managed_fields.is_none());
    // Containers keep only what decisions read.
    let containers = &p.spec.as_ref().unwrap().containers;
    assert!(containers.iter().all(|c| c.image.is_none()));
}

#[tokio::test]
async fn device_gauges_are_worked_out_at_most_once_an_interval_and_never_left_stale() {
    let (mut view, fake) = cluster(2, &["a", "b"], &[("p", &["a"])]);
    let (mut r, _leader) = reconciler(&fake);
    let gauge = |r: &Reconciler<FakeWrites>, device: &str| {
        let text = r.metrics.encode().unwrap();
        let line = format!(
            "tessera_controller_gpu_memory_allocated_bytes{{pool=\"n1\",device=\"{device}\"}} "
        );
        text.lines()
            .find_map(|l| l.strip_prefix(line.as_str()))
            .map(str::to_owned)
    };
    assert_eq!(r.pass(&mut view).await.placed, 1);
    let whole = (80_u64 << 30).to_string();
    assert_eq!(gauge(&r, "gpu-0").as_deref(), Some(whole.as_str()));
    assert_eq!(gauge(&r, "gpu-1").as_deref(), Some("0"));
    // A second placement right after: the gauges wait for their interval, and the pass asks to
    // be woken when it ends.
    let pod = pod_json("q", &["b"]);
    fake.state().pods.insert(
        "ns/q".to_owned(),
        serde_json::from_value(pod.clone()).unwrap(),
    );
    view.apply(Resource::Pods, Change::Applied(pod));
    let report = r.pass(&mut view).await;
    assert_eq!(report.placed, 1);
    assert_eq!(gauge(&r, "gpu-1").as_deref(), Some("0"));
    let wake = report.wake_in.expect("woken for the stale gauges");
    assert!(wake <= GAUGE_INTERVAL, "{wake:?}");
    // When the interval has passed, the next pass works them out.
    r.gauges_at = Instant::now().checked_sub(GAUGE_INTERVAL);
    let report = r.pass(&mut view).await;
    assert_eq!(gauge(&r, "gpu-1").as_deref(), Some(whole.as_str()));
    assert_eq!(report.wake_in, None);
}

/// Issue 31, 5: a selector that fails at runtime on a GPU of node n2 aborts the pod's attempt,
/// as kube-scheduler's does (its Filter runs on every node): the pod is placed nowhere, not on
/// n1 where it would fit, gets a Warning and a condition that say why, and is tried again
/// within seconds; once n2's GPU has the attribute it is placed.
#[tokio::test]
async fn an_error_on_any_node_leaves_the_pod_pending_with_the_reason_and_it_is_retried() {
    let (mut view, fake) = cluster(1, &["a"], &[("p", &["a"])]);
    // Newer than the helper's slice of n1, which they replace.
    let with_model = |node: &str, model: Option<&str>, version: &str| {
        let mut s = slice(node, 1);
        if let Some(m) = model {
            s["spec"]["devices"][0]["attributes"]["model"] = json!({"string": m});
        }
        s["metadata"]["resourceVersion"] = json!(version);
        s
    };
    view.apply(
        Resource::Nodes,
        Change::Listed(vec![
            json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1", "resourceVersion": "1"}}),
            json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n2", "resourceVersion": "1"}}),
        ]),
    );
    view.apply(
        Resource::Slices,
        Change::Listed(vec![
            with_model("n1", Some("h100"), "2"),
            with_model("n2", None, "2"),
        ]),
    );
    view.apply(
        Resource::Classes,
        Change::Listed(vec![
            json!({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": {"name": "gpu", "resourceVersion": "2"},
            "spec": {"selectors": [{"cel": {"expression":
                format!("device.attributes[\"{DRIVER}\"].model == \"h100\"")}}]}}),
        ]),
    );
    let (mut r, _leader) = reconciler(&fake);
    let report = r.pass(&mut view).await;
    assert_eq!((report.placed, report.pending), (0, 1));
    assert!(
        !fake.calls().iter().any(|c| c.starts_with("allocate")),
        "{:?}",
        fake.calls()
    );
    assert!(
        fake.calls()
            .contains(&format!("condition ns/p {REASON_ABORTED}")),
        "{:?}",
        fake.calls()
    );
    assert!(
        r.remembered["ns/p"].message.contains("error on node n2"),
        "{:?}",
        r.remembered
    );
    assert!(
        report.wake_in.is_some_and(|w| w <= Duration::from_secs(10)),
        "{:?}",
        report.wake_in
    );
    view.apply(
        Resource::Slices,
        Change::Applied(with_model("n2", Some("a100"), "3")),
    );
    let report = r.pass(&mut view).await;
    assert_eq!(report.placed, 1, "{:?}", r.remembered);
    let claim = fake.state().claims["ns/a"].clone();
    assert_eq!(testing::results(testing::allocation(&claim))[0].pool, "n1");
}
