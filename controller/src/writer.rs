//! The controller's writes to the API server, each one request with a resourceVersion
//! precondition (so a lost race is a 409 to re-read and retry, never a silent overwrite).
//!
//! Claims are written as JSON merge patches in the served resource.k8s.io version: the
//! allocation's JSON is the same in v1, v1beta2 and v1beta1, so one patch fits all three.

use std::future::Future;

use k8s_openapi::api::core::v1::{Node, ObjectReference, Pod, PodCondition};
use k8s_openapi::api::resource::v1 as res;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::core::ApiResource;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use serde_json::{Value, json};
use tessera_driver::apiversion::{self, ApiVersion, Object};
use tessera_driver::{names, placement::gate};
use tessera_kubeapi::JsonObject;

use crate::error::{Error, Result};

/// What the API server answered an eviction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Eviction {
    /// The pod is being deleted (or, for a dry run, would be).
    Evicted,
    /// 429: a `PodDisruptionBudget` does not allow it now; the server's message.
    Blocked(String),
    /// The pod is gone, or is another pod by now (a UID precondition failed).
    Gone,
}

/// What the reconcile loop asks of the API server; every write carries the object's
/// resourceVersion as a precondition and answers the object as stored after it. [`Writer`] is
/// the real one; the reconcile tests' `FakeWrites` keeps objects in memory and records every
/// call, so the loop is tested without an HTTP server.
pub trait Writes: Send + Sync {
    /// The claim as stored now, or `None` when it is gone.
    fn get_claim(
        &self,
        namespace: &str,
        name: &str,
    ) -> impl Future<Output = Result<Option<res::ResourceClaim>>> + Send;

    /// Adds the delete-protection finalizer and the allocated-by annotation naming `pod`.
    fn mark_claim(
        &self,
        claim: &res::ResourceClaim,
        pod: &str,
    ) -> impl Future<Output = Result<res::ResourceClaim>> + Send;

    /// Writes `allocation` into the claim's status; with `reserve_for` (the fast path), also
    /// `reservedFor` naming that pod, in the same write.
    fn write_allocation(
        &self,
        claim: &res::ResourceClaim,
        allocation: &res::AllocationResult,
        reserve_for: Option<&Pod>,
    ) -> impl Future<Output = Result<res::ResourceClaim>> + Send;

    /// Clears the claim's allocation, and `reservedFor` with it when the claim in hand has
    /// one (only ever the controller's own reservation: the caller checks).
    fn clear_allocation(
        &self,
        claim: &res::ResourceClaim,
    ) -> impl Future<Output = Result<res::ResourceClaim>> + Send;

    /// Removes the allocated-by annotation, and the finalizer when nothing is allocated or
    /// reserved any more.
    fn unmark_claim(
        &self,
        claim: &res::ResourceClaim,
    ) -> impl Future<Output = Result<res::ResourceClaim>> + Send;

    /// The pod as stored now, or `None` when it is gone.
    fn get_pod(
        &self,
        namespace: &str,
        name: &str,
    ) -> impl Future<Output = Result<Option<Pod>>> + Send;

    /// Removes Tessera's scheduling gate (other gates stay).
    fn ungate(&self, pod: &Pod) -> impl Future<Output = Result<Pod>> + Send;

    /// Sets the controller's condition on the pod.
    fn set_condition(
        &self,
        pod: &Pod,
        allocated: bool,
        reason: &str,
        message: &str,
        now: Timestamp,
    ) -> impl Future<Output = Result<Pod>> + Send;

    /// Asks the API server to evict the pod (policy/v1 Eviction, so `PodDisruptionBudgets` are
    /// respected), or with `dry_run` only whether it would.
    fn evict(&self, pod: &Pod, dry_run: bool) -> impl Future<Output = Result<Eviction>> + Send;

    /// Records an Event about the pod: `action` is what the controller did or tried
    /// (`names::ACTION_*`), `reason` why, `message` the whole story (an Event keeps at most its
    /// first `tessera_kubeapi::events::NOTE_BYTES`).
    fn event(
        &self,
        pod: &Pod,
        warning: bool,
        action: &str,
        reason: &str,
        message: &str,
    ) -> impl Future<Output = Result<()>> + Send;

    /// Sets annotation `key` of the node to `value`, with the node's resourceVersion as a
    /// precondition (a 409 is an error: the caller reads the node again); answers the node as
    /// stored.
    fn annotate_node(
        &self,
        node: &Node,
        key: &str,
        value: &str,
    ) -> impl Future<Output = Result<Node>> + Send;

    /// Records an Event about the node, as [`Writes::event`] does about a pod.
    fn node_event(
        &self,
        node: &Node,
        warning: bool,
        action: &str,
        reason: &str,
        message: &str,
    ) -> impl Future<Output = Result<()>> + Send;
}

/// The `reservedFor` entry naming `pod`.
fn reservation(pod: &Pod) -> Value {
    json!({"resource": names::POD.plural, "name": pod.metadata.name, "uid": pod.metadata.uid})
}

fn name_of(meta: &ObjectMeta) -> (&str, &str) {
    (
        meta.namespace.as_deref().unwrap_or("default"),
        meta.name.as_deref().unwrap_or_default(),
    )
}

/// Writes claims, pods and Events.
#[derive(Clone)]
pub struct Writer {
    client: kube::Client,
    claims: ApiResource,
    /// Writes the Events (events.k8s.io/v1), as `tessera-controller` on this host; one
    /// recorder, so that a repeated Event is counted on the first one (a `series`).
    events: Recorder,
}

impl std::fmt::Debug for Writer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Writer")
            .field("claims", &self.claims.api_version)
            .finish_non_exhaustive()
    }
}

impl Writer {
    /// A writer of claims in resource.k8s.io `version`.
    pub fn new(client: kube::Client, version: ApiVersion) -> Self {
        Self {
            events: Recorder::new(client.clone(), Reporter::from(names::CONTROLLER_COMPONENT)),
            client,
            claims: tessera_kubeapi::resource(version, tessera_driver::names::RESOURCE_CLAIM),
        }
    }

    /// Publishes one Event about `regarding`, its note bounded by
    /// [`tessera_kubeapi::events::note`].
    async fn publish(
        &self,
        regarding: &ObjectReference,
        warning: bool,
        action: &str,
        reason: &str,
        message: &str,
    ) -> std::result::Result<(), kube::Error> {
        let event = Event {
            type_: if warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: reason.to_owned(),
            note: Some(tessera_kubeapi::events::note(message)),
            action: action.to_owned(),
            secondary: None,
        };
        self.events.publish(&event, regarding).await
    }

    /// Claims are read as [`JsonObject`]s: the answer's JSON without `managedFields`, decoded
    /// once into the v1 model.
    fn claim_api(&self, namespace: &str) -> Api<JsonObject> {
        Api::namespaced_with(self.client.clone(), namespace, &self.claims)
    }

    fn pod_api(&self, namespace: &str) -> Api<Pod> {
        Api::namespaced(self.client.clone(), namespace)
    }

    fn decode_claim(&self, object: JsonObject) -> Result<res::ResourceClaim> {
        match apiversion::decode_document(object.into_value(&self.claims), "ResourceClaim")? {
            Object::ResourceClaim(c) => Ok(c),
            other => Err(Error::Malformed(format!(
                "the server answered a {} for a ResourceClaim",
                other.kind()
            ))),
        }
    }

    async fn patch_claim(
        &self,
        claim: &res::ResourceClaim,
        body: &Value,
        status: bool,
        action: &str,
    ) -> Result<res::ResourceClaim> {
        let (namespace, name) = name_of(&claim.metadata);
        let object = merge_patch(&self.claim_api(namespace), name, body, status)
            .await
            .map_err(|e| Error::api(format!("{action} ResourceClaim {namespace}/{name}"), &e))?;
        self.decode_claim(object)
    }

    /// Merge-patches `pod` with `body` (its status when `status`); `action` names the write
    /// in errors ("{action} Pod ns/name").
    async fn patch_pod(&self, pod: &Pod, body: &Value, status: bool, action: &str) -> Result<Pod> {
        let (namespace, name) = name_of(&pod.metadata);
        merge_patch(&self.pod_api(namespace), name, body, status)
            .await
            .map_err(|e| Error::api(format!("{action} Pod {namespace}/{name}"), &e))
    }
}

/// Sends `body` as a JSON merge patch of object `name`, to its status subresource when
/// `status`.
async fn merge_patch<K>(api: &Api<K>, name: &str, body: &Value, status: bool) -> kube::Result<K>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let params = PatchParams::default();
    let patch = Patch::Merge(body);
    if status {
        api.patch_status(name, &params, &patch).await
    } else {
        api.patch(name, &params, &patch).await
    }
}

impl Writes for Writer {
    /// The claim as stored now, or `None` when it is gone.
    async fn get_claim(&self, namespace: &str, name: &str) -> Result<Option<res::ResourceClaim>> {
        match self.claim_api(namespace).get_opt(name).await {
            Ok(Some(o)) => self.decode_claim(o).map(Some),
            Ok(None) => Ok(None),
            Err(e) => Err(Error::api(
                format!("reading ResourceClaim {namespace}/{name}"),
                &e,
            )),
        }
    }

    /// Adds the delete-protection finalizer and the allocated-by annotation, before the
    /// allocation is written (as kube-scheduler adds the finalizer first).
    /// The annotation names `pod`, the pod the claim is allocated for.
    async fn mark_claim(
        &self,
        claim: &res::ResourceClaim,
        pod: &str,
    ) -> Result<res::ResourceClaim> {
        let mut finalizers = claim.metadata.finalizers.clone().unwrap_or_default();
        if !finalizers.iter().any(|f| f == names::CLAIM_FINALIZER) {
            finalizers.push(names::CLAIM_FINALIZER.to_owned());
        }
        let body = json!({"metadata": {
            "resourceVersion": claim.metadata.resource_version,
            "finalizers": finalizers,
            "annotations": {names::ANNOTATION_ALLOCATED_BY: pod},
        }});
        self.patch_claim(claim, &body, false, "marking").await
    }

    /// Writes `allocation` into the claim's status (the caller sets `allocationTimestamp`);
    /// with `reserve_for`, `reservedFor` naming that pod too, in the same write (the fast
    /// path: the API server accepts both at once, as kube-scheduler writes them).
    async fn write_allocation(
        &self,
        claim: &res::ResourceClaim,
        allocation: &res::AllocationResult,
        reserve_for: Option<&Pod>,
    ) -> Result<res::ResourceClaim> {
        let mut status = json!({"allocation": allocation});
        if let Some(pod) = reserve_for {
            status["reservedFor"] = json!([reservation(pod)]);
        }
        let body = json!({
            "metadata": {"resourceVersion": claim.metadata.resource_version},
            "status": status,
        });
        self.patch_claim(claim, &body, true, "allocating").await
    }

    /// Clears the claim's allocation, and its `reservedFor` when the claim in hand has one
    /// (the resourceVersion precondition makes it the reservation the caller checked).
    async fn clear_allocation(&self, claim: &res::ResourceClaim) -> Result<res::ResourceClaim> {
        let mut status = json!({"allocation": null});
        if gate::is_reserved(claim) {
            status["reservedFor"] = Value::Null;
        }
        let body = json!({
            "metadata": {"resourceVersion": claim.metadata.resource_version},
            "status": status,
        });
        self.patch_claim(claim, &body, true, "deallocating").await
    }

    /// Removes the allocated-by annotation, and the finalizer when nothing is allocated or
    /// reserved any more.
    async fn unmark_claim(&self, claim: &res::ResourceClaim) -> Result<res::ResourceClaim> {
        let mut meta = json!({
            "resourceVersion": claim.metadata.resource_version,
            "annotations": {names::ANNOTATION_ALLOCATED_BY: null},
        });
        if !gate::is_allocated(claim) && !gate::is_reserved(claim) {
            let finalizers: Vec<&String> = claim
                .metadata
                .finalizers
                .iter()
                .flatten()
                .filter(|f| *f != names::CLAIM_FINALIZER)
                .collect();
            meta["finalizers"] = json!(finalizers);
        }
        self.patch_claim(claim, &json!({"metadata": meta}), false, "unmarking")
            .await
    }

    /// The pod as stored now, or `None` when it is gone.
    async fn get_pod(&self, namespace: &str, name: &str) -> Result<Option<Pod>> {
        self.pod_api(namespace)
            .get_opt(name)
            .await
            .map_err(|e| Error::api(format!("reading Pod {namespace}/{name}"), &e))
    }

    /// Removes Tessera's scheduling gate from the pod (other gates stay).
    async fn ungate(&self, pod: &Pod) -> Result<Pod> {
        let gates: Vec<Value> = gate::gates_without_ours(pod)
            .into_iter()
            .map(|g| json!({"name": g}))
            .collect();
        let gates = if gates.is_empty() {
            Value::Null
        } else {
            Value::Array(gates)
        };
        let body = json!({
            "metadata": {"resourceVersion": pod.metadata.resource_version},
            "spec": {"schedulingGates": gates},
        });
        self.patch_pod(pod, &body, false, "removing the scheduling gate of")
            .await
    }

    /// Sets the controller's condition on the pod (replacing an older one of the same type).
    async fn set_condition(
        &self,
        pod: &Pod,
        allocated: bool,
        reason: &str,
        message: &str,
        now: Timestamp,
    ) -> Result<Pod> {
        let mut conditions: Vec<PodCondition> = pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.clone())
            .unwrap_or_default()
            .into_iter()
            .filter(|c| c.type_ != names::CONDITION_ALLOCATED)
            .collect();
        conditions.push(PodCondition {
            type_: names::CONDITION_ALLOCATED.to_owned(),
            status: if allocated { "True" } else { "False" }.to_owned(),
            reason: Some(reason.to_owned()),
            message: Some(message.to_owned()),
            last_transition_time: Some(Time(now)),
            ..PodCondition::default()
        });
        let body = json!({
            "metadata": {"resourceVersion": pod.metadata.resource_version},
            "status": {"conditions": conditions},
        });
        self.patch_pod(pod, &body, true, "setting the condition of")
            .await
    }

    /// Records an events.k8s.io/v1 Event about the pod through kube-runtime's [`Recorder`],
    /// which names it `<pod>.<nanoseconds>` and patches a `series` onto it when the same
    /// action, reason and pod come again within minutes.
    async fn event(
        &self,
        pod: &Pod,
        warning: bool,
        action: &str,
        reason: &str,
        message: &str,
    ) -> Result<()> {
        let (namespace, name) = name_of(&pod.metadata);
        let regarding = ObjectReference {
            api_version: Some(names::CORE_API_V1.to_owned()),
            kind: Some(names::POD.kind.to_owned()),
            namespace: Some(namespace.to_owned()),
            name: Some(name.to_owned()),
            uid: pod.metadata.uid.clone(),
            resource_version: pod.metadata.resource_version.clone(),
            ..ObjectReference::default()
        };
        self.publish(&regarding, warning, action, reason, message)
            .await
            .map_err(|e| Error::api(format!("recording an Event on Pod {namespace}/{name}"), &e))
    }

    async fn annotate_node(&self, node: &Node, key: &str, value: &str) -> Result<Node> {
        let name = node.metadata.name.as_deref().unwrap_or_default();
        let body = json!({"metadata": {
            "resourceVersion": node.metadata.resource_version,
            "annotations": {key: value},
        }});
        Api::<Node>::all(self.client.clone())
            .patch(name, &PatchParams::default(), &Patch::Merge(&body))
            .await
            .map_err(|e| Error::api(format!("annotating Node {name} with {key}"), &e))
    }

    /// Records an events.k8s.io/v1 Event about the node through the same [`Recorder`] (a
    /// cluster-scoped object's Events live in `default`, as kube-runtime writes them).
    async fn node_event(
        &self,
        node: &Node,
        warning: bool,
        action: &str,
        reason: &str,
        message: &str,
    ) -> Result<()> {
        let name = node.metadata.name.as_deref().unwrap_or_default();
        let regarding = ObjectReference {
            api_version: Some(names::CORE_API_V1.to_owned()),
            kind: Some(names::NODE.kind.to_owned()),
            name: Some(name.to_owned()),
            uid: node.metadata.uid.clone(),
            resource_version: node.metadata.resource_version.clone(),
            ..ObjectReference::default()
        };
        self.publish(&regarding, warning, action, reason, message)
            .await
            .map_err(|e| Error::api(format!("recording an Event on Node {name}"), &e))
    }

    /// Evicts the pod through its `eviction` subresource (policy/v1), with its UID as a
    /// precondition; `dry_run` asks only whether the server would. A 429 (a
    /// `PodDisruptionBudget` does not allow it now) and a 404 or 409 (gone, or another pod by
    /// that name) are answers, not errors.
    async fn evict(&self, pod: &Pod, dry_run: bool) -> Result<Eviction> {
        let (namespace, name) = name_of(&pod.metadata);
        let body = json!({
            "apiVersion": names::POLICY_API_V1,
            "kind": names::EVICTION.kind,
            "metadata": {"name": name, "namespace": namespace},
            "deleteOptions": {"preconditions": {"uid": pod.metadata.uid}},
        });
        let params = PostParams {
            dry_run,
            ..PostParams::default()
        };
        let answer: std::result::Result<Value, kube::Error> = self
            .pod_api(namespace)
            .create_subresource("eviction", name, &params, &body)
            .await;
        match answer {
            Ok(_) => Ok(Eviction::Evicted),
            Err(kube::Error::Api(status)) if status.code == 429 => {
                Ok(Eviction::Blocked(status.message.clone()))
            }
            Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => {
                Ok(Eviction::Gone)
            }
            Err(e) => Err(Error::api(format!("evicting Pod {namespace}/{name}"), &e)),
        }
    }
}
