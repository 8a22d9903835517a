//! The gate protocol's decisions, as pure functions of the cluster's objects: which gated pods
//! are ready to allocate, which allocations the controller must release, and which of its
//! allocations wait too long for their pod to bind.
//!
//! A pod carrying the scheduling gate [`names::SCHEDULING_GATE`] is the controller's to place.
//! Its claims are those its `spec.resourceClaims` name directly, plus those generated from
//! templates, whose names kube-controller-manager records in `status.resourceClaimStatuses`.
//! An allocation is the controller's own when the claim carries the annotation
//! [`names::ANNOTATION_ALLOCATED_BY`]; no other allocation is ever released.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{NodeSelector, Pod, PodResourceClaim};
use k8s_openapi::api::resource::v1 as res;
use k8s_openapi::jiff::{SignedDuration, Timestamp};

use crate::names;

/// The field key a node selector uses to name a node.
const FIELD_NODE_NAME: &str = "metadata.name";

/// `namespace/name` of an object's metadata.
fn object_key(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> String {
    format!(
        "{}/{}",
        meta.namespace.as_deref().unwrap_or("default"),
        meta.name.as_deref().unwrap_or_default()
    )
}

/// Whether `pod` carries Tessera's scheduling gate.
pub fn is_gated(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.scheduling_gates.as_ref())
        .is_some_and(|g| g.iter().any(|g| g.name == names::SCHEDULING_GATE))
}

/// The scheduling gates of `pod` without Tessera's.
pub fn gates_without_ours(pod: &Pod) -> Vec<String> {
    pod.spec
        .as_ref()
        .and_then(|s| s.scheduling_gates.as_ref())
        .into_iter()
        .flatten()
        .filter(|g| g.name != names::SCHEDULING_GATE)
        .map(|g| g.name.clone())
        .collect()
}

/// Whether the pod has finished or is going away: it needs nothing any more.
pub fn is_done(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_some()
        || pod
            .status
            .as_ref()
            .and_then(|s| s.phase.as_deref())
            .is_some_and(|p| p == "Succeeded" || p == "Failed")
}

/// The pod's `spec.resourceClaims` entries.
fn spec_claims(pod: &Pod) -> impl Iterator<Item = &PodResourceClaim> {
    pod.spec
        .as_ref()
        .and_then(|s| s.resource_claims.as_ref())
        .into_iter()
        .flatten()
}

/// The names of the claims `pod` uses, or what it still waits for: a claim from a template
/// that kube-controller-manager has not created (and recorded in the pod's status) yet.
pub fn claim_names(pod: &Pod) -> Result<Vec<String>, String> {
    let statuses: BTreeMap<&str, Option<&String>> = pod
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref())
        .into_iter()
        .flatten()
        .map(|s| (s.name.as_str(), s.resource_claim_name.as_ref()))
        .collect();
    let mut out = Vec::new();
    for entry in spec_claims(pod) {
        if let Some(name) = &entry.resource_claim_name {
            out.push(name.clone());
        } else if let Some(template) = &entry.resource_claim_template_name {
            match statuses.get(entry.name.as_str()) {
                Some(Some(name)) => out.push((*name).clone()),
                // Recorded without a name: the template needs no claim for this pod.
                Some(None) => {}
                None => {
                    return Err(format!(
                        "waiting for the claim of pod claim {:?} from ResourceClaimTemplate {template:?}",
                        entry.name
                    ));
                }
            }
        }
    }
    Ok(out)
}

/// The node an allocation is bound to, when its node selector names exactly one node (as
/// every allocation of node-local devices does).
pub fn allocation_node(allocation: &res::AllocationResult) -> Option<String> {
    node_of_selector(allocation.node_selector.as_ref()?)
}

fn node_of_selector(selector: &NodeSelector) -> Option<String> {
    let [term] = selector.node_selector_terms.as_slice() else {
        return None;
    };
    term.match_fields
        .iter()
        .flatten()
        .chain(term.match_expressions.iter().flatten())
        .find_map(
            |r| match (r.key.as_str(), r.operator.as_str(), r.values.as_deref()) {
                (FIELD_NODE_NAME | names::LABEL_HOSTNAME, "In", Some([node])) => Some(node.clone()),
                _ => None,
            },
        )
}

/// Whether the claim carries an allocation.
pub fn is_allocated(claim: &res::ResourceClaim) -> bool {
    claim
        .status
        .as_ref()
        .is_some_and(|s| s.allocation.is_some())
}

/// Whether some pod has reserved the claim (kube-scheduler did, so it is in use).
pub fn is_reserved(claim: &res::ResourceClaim) -> bool {
    claim
        .status
        .as_ref()
        .and_then(|s| s.reserved_for.as_ref())
        .is_some_and(|r| !r.is_empty())
}

/// Whether the controller made the claim's allocation (or is making it).
pub fn is_ours(claim: &res::ResourceClaim) -> bool {
    claim
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(names::ANNOTATION_ALLOCATED_BY))
}

/// What to do with a gated pod now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodPlan {
    /// Not the controller's pod (no gate), or done: nothing to do.
    Ignore,
    /// Not ready yet; the reason says what is missing.
    Wait(String),
    /// A claim is broken in a way only its owner can fix: report it, do not retry.
    Refuse(String),
    /// Allocate the `pending` claims (keys `namespace/name`) together, on `node` when the
    /// pod's claims that are already allocated tie it to one.
    Allocate {
        /// Claims to allocate, in the pod's order.
        pending: Vec<String>,
        /// Claims of the pod already allocated.
        allocated: Vec<String>,
        /// The node the already-allocated claims are bound to.
        node: Option<String>,
    },
    /// Every claim is allocated: remove the gate.
    Ungate,
}

/// Decides what to do with `pod`, given the claims in its namespace by `namespace/name`.
pub fn plan_pod(pod: &Pod, claims: &BTreeMap<String, res::ResourceClaim>) -> PodPlan {
    if !is_gated(pod) || is_done(pod) {
        return PodPlan::Ignore;
    }
    let names = match claim_names(pod) {
        Ok(n) => n,
        Err(wait) => return PodPlan::Wait(wait),
    };
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    let mut pending = Vec::new();
    let mut allocated = Vec::new();
    let mut nodes = BTreeSet::new();
    for name in names {
        let key = format!("{namespace}/{name}");
        let Some(claim) = claims.get(&key) else {
            return PodPlan::Wait(format!("waiting for ResourceClaim {key}"));
        };
        if claim.metadata.deletion_timestamp.is_some() {
            return PodPlan::Wait(format!("ResourceClaim {key} is being deleted"));
        }
        if let Some(allocation) = claim.status.as_ref().and_then(|s| s.allocation.as_ref()) {
            if let Some(node) = allocation_node(allocation) {
                nodes.insert(node);
            }
            allocated.push(key);
        } else if !pending.contains(&key) {
            pending.push(key);
        }
    }
    if nodes.len() > 1 {
        return PodPlan::Refuse(format!(
            "the pod's claims are already allocated on different nodes ({}); a pod runs on one node",
            nodes.into_iter().collect::<Vec<_>>().join(", ")
        ));
    }
    if pending.is_empty() {
        return PodPlan::Ungate;
    }
    PodPlan::Allocate {
        pending,
        allocated,
        node: nodes.into_iter().next(),
    }
}

/// The claims (`namespace/name`) each live pod uses, from its spec and status.
pub fn claim_users<'a>(pods: impl IntoIterator<Item = &'a Pod>) -> BTreeMap<String, Vec<String>> {
    let mut users: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for pod in pods {
        if is_done(pod) {
            continue;
        }
        let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
        let mut names: BTreeSet<String> = spec_claims(pod)
            .filter_map(|c| c.resource_claim_name.clone())
            .collect();
        names.extend(
            pod.status
                .as_ref()
                .and_then(|s| s.resource_claim_statuses.as_ref())
                .into_iter()
                .flatten()
                .filter_map(|s| s.resource_claim_name.clone()),
        );
        for name in names {
            users
                .entry(format!("{namespace}/{name}"))
                .or_default()
                .push(object_key(&pod.metadata));
        }
    }
    users
}

/// One of the controller's claims to give back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Release {
    /// The claim, `namespace/name`.
    pub claim: String,
    /// Whether it still has an allocation to clear (else only the finalizer and annotation go).
    pub deallocate: bool,
    /// Why, for the log.
    pub reason: String,
}

/// What the controller must give back: its allocations that no live pod uses and nobody
/// reserved (the gated pod was deleted before it bound, or the claim is being deleted), and
/// the finalizers it put on claims it never finished allocating for such pods. Allocations
/// made by anyone else, and reserved claims, are never in the list. A claim made from a
/// template (owned by its pod) that holds nothing yet is left marked until it is deleted: the
/// admission webhook marks it before kube-controller-manager names it in the pod's status, and
/// it goes with its pod (the garbage collector deletes it, and a claim being deleted is
/// released).
pub fn releases<'a>(
    claims: impl IntoIterator<Item = &'a res::ResourceClaim>,
    users: &BTreeMap<String, Vec<String>>,
) -> Vec<Release> {
    let mut out = Vec::new();
    for claim in claims {
        if !is_ours(claim) || is_reserved(claim) {
            continue;
        }
        let key = object_key(&claim.metadata);
        let reason = if claim.metadata.deletion_timestamp.is_some() {
            "the claim is being deleted"
        } else if !is_allocated(claim) && owning_pod(claim).is_some() {
            continue;
        } else if !users.contains_key(&key) {
            "no live pod uses the claim any more"
        } else {
            continue;
        };
        out.push(Release {
            claim: key,
            deallocate: is_allocated(claim),
            reason: reason.to_owned(),
        });
    }
    out
}

/// One of the controller's allocations whose pod has not bound for too long.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unbound {
    /// The claim, `namespace/name`.
    pub claim: String,
    /// The waiting pods, `namespace/name`.
    pub pods: Vec<String>,
    /// How long since the allocation was written.
    pub age: SignedDuration,
}

/// The controller's allocations older than `max_age` at `now` whose pods are all still
/// unbound (no `spec.nodeName`) and that nobody reserved.
pub fn unbound<'a, P: std::borrow::Borrow<Pod>>(
    claims: impl IntoIterator<Item = &'a res::ResourceClaim>,
    pods: &BTreeMap<String, P>,
    users: &BTreeMap<String, Vec<String>>,
    now: Timestamp,
    max_age: SignedDuration,
) -> Vec<Unbound> {
    let mut out = Vec::new();
    for claim in claims {
        if !is_ours(claim) || is_reserved(claim) {
            continue;
        }
        let Some(at) = claim
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.allocation_timestamp.as_ref())
        else {
            continue;
        };
        let age = now.duration_since(at.0);
        if age < max_age {
            continue;
        }
        let key = object_key(&claim.metadata);
        let Some(waiting) = users.get(&key) else {
            continue;
        };
        let unbound = waiting.iter().all(|p| {
            pods.get(p)
                .and_then(|p| p.borrow().spec.as_ref())
                .is_none_or(|s| s.node_name.as_deref().unwrap_or_default().is_empty())
        });
        if unbound {
            out.push(Unbound {
                claim: key,
                pods: waiting.clone(),
                age,
            });
        }
    }
    out
}

/// `(name, uid)` of the pod that controls `claim` (its controller owner reference of kind
/// `Pod` in core v1), as kube-controller-manager sets it on claims made from templates.
pub fn owning_pod(claim: &res::ResourceClaim) -> Option<(&str, &str)> {
    claim
        .metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| {
            o.controller == Some(true)
                && o.kind == names::POD.kind
                && o.api_version == names::CORE_API_V1
        })
        .map(|o| (o.name.as_str(), o.uid.as_str()))
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::needless_pass_by_value,
        reason = "test fixtures built from json! literals"
    )]

    use super::*;
    use serde_json::{Value, json};

    fn pod(spec: Value, status: Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "train", "namespace": "ml", "uid": "p1"},
            "spec": spec,
            "status": status,
        }))
        .unwrap()
    }

    fn gated(claims: Value) -> Pod {
        pod(
            json!({"containers": [], "schedulingGates": [{"name": names::SCHEDULING_GATE}, {"name": "other"}],
                   "resourceClaims": claims}),
            json!({}),
        )
    }

    fn claim(
        name: &str,
        ours: bool,
        allocation: Option<Value>,
        reserved: bool,
    ) -> res::ResourceClaim {
        let mut annotations = json!({});
        if ours {
            annotations[names::ANNOTATION_ALLOCATED_BY] = json!("tessera-controller");
        }
        let mut status = json!({});
        if let Some(a) = allocation {
            status["allocation"] = a;
        }
        if reserved {
            status["reservedFor"] = json!([{"resource": "pods", "name": "train", "uid": "p1"}]);
        }
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ml", "annotations": annotations},
            "spec": {"devices": {}},
            "status": status,
        }))
        .unwrap()
    }

    fn on_node(node: &str) -> Value {
        json!({
            "devices": {"results": []},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [node]}]}]},
            "allocationTimestamp": "2026-01-01T00:00:00Z",
        })
    }

    fn by_key(claims: Vec<res::ResourceClaim>) -> BTreeMap<String, res::ResourceClaim> {
        claims
            .into_iter()
            .map(|c| (object_key(&c.metadata), c))
            .collect()
    }

    #[test]
    fn an_ungated_pod_is_left_to_kube_scheduler() {
        let p = pod(
            json!({"containers": [], "resourceClaims": [{"name": "gpu", "resourceClaimName": "a"}]}),
            json!({}),
        );
        assert_eq!(plan_pod(&p, &BTreeMap::new()), PodPlan::Ignore);
    }

    #[test]
    fn a_pod_waits_for_its_template_claim_to_be_generated() {
        let p = gated(json!([{"name": "gpu", "resourceClaimTemplateName": "t"}]));
        let PodPlan::Wait(why) = plan_pod(&p, &BTreeMap::new()) else {
            panic!("did not wait")
        };
        assert!(why.contains("ResourceClaimTemplate \"t\""), "{why}");
    }

    #[test]
    fn a_pod_waits_for_a_named_claim_to_exist() {
        let p = gated(json!([{"name": "gpu", "resourceClaimName": "a"}]));
        assert_eq!(
            plan_pod(&p, &BTreeMap::new()),
            PodPlan::Wait("waiting for ResourceClaim ml/a".into())
        );
    }

    #[test]
    fn a_ready_pod_allocates_its_pending_claims_together() {
        let mut p = gated(json!([
            {"name": "gpu", "resourceClaimName": "a"},
            {"name": "share", "resourceClaimTemplateName": "t"},
        ]));
        p.status = Some(
            serde_json::from_value(json!({"resourceClaimStatuses": [{"name": "share", "resourceClaimName": "train-share-x"}]}))
                .unwrap(),
        );
        let claims = by_key(vec![
            claim("a", false, None, false),
            claim("train-share-x", false, None, false),
        ]);
        assert_eq!(
            plan_pod(&p, &claims),
            PodPlan::Allocate {
                pending: vec!["ml/a".into(), "ml/train-share-x".into()],
                allocated: vec![],
                node: None
            }
        );
    }

    /// A gated pod using the claims `a` and `b`.
    fn gated_with_a_and_b() -> Pod {
        gated(json!([
            {"name": "gpu", "resourceClaimName": "a"},
            {"name": "more", "resourceClaimName": "b"},
        ]))
    }

    #[test]
    fn already_allocated_claims_tie_the_pod_to_their_node() {
        let p = gated_with_a_and_b();
        let claims = by_key(vec![
            claim("a", true, Some(on_node("n7")), false),
            claim("b", false, None, false),
        ]);
        assert_eq!(
            plan_pod(&p, &claims),
            PodPlan::Allocate {
                pending: vec!["ml/b".into()],
                allocated: vec!["ml/a".into()],
                node: Some("n7".into())
            }
        );
    }

    #[test]
    fn a_fully_allocated_pod_is_ungated_and_claims_on_two_nodes_are_refused() {
        let p = gated_with_a_and_b();
        let same = by_key(vec![
            claim("a", true, Some(on_node("n1")), false),
            claim("b", true, Some(on_node("n1")), false),
        ]);
        assert_eq!(plan_pod(&p, &same), PodPlan::Ungate);
        let split = by_key(vec![
            claim("a", true, Some(on_node("n1")), false),
            claim("b", false, Some(on_node("n2")), false),
        ]);
        assert!(matches!(plan_pod(&p, &split), PodPlan::Refuse(m) if m.contains("n1, n2")));
    }

    #[test]
    fn the_gate_is_removed_and_other_gates_stay() {
        let p = gated(json!([]));
        assert_eq!(gates_without_ours(&p), vec!["other".to_owned()]);
    }

    #[test]
    fn only_our_unreserved_allocations_without_a_pod_are_released() {
        let user = gated(json!([{"name": "gpu", "resourceClaimName": "used"}]));
        let users = claim_users([&user]);
        let claims = [
            claim("used", true, Some(on_node("n1")), false),
            claim("orphan", true, Some(on_node("n1")), false),
            claim("half-done", true, None, false),
            claim("schedulers", false, Some(on_node("n1")), false),
            claim("reserved", true, Some(on_node("n1")), true),
        ];
        let released = releases(&claims, &users);
        assert_eq!(
            released,
            vec![
                Release {
                    claim: "ml/orphan".into(),
                    deallocate: true,
                    reason: "no live pod uses the claim any more".into()
                },
                Release {
                    claim: "ml/half-done".into(),
                    deallocate: false,
                    reason: "no live pod uses the claim any more".into()
                },
            ]
        );
    }

    #[test]
    fn a_template_claim_marked_at_admission_stays_marked_until_it_is_deleted() {
        let mut c = claim("p-gpu-x7", true, None, false);
        c.metadata.owner_references = Some(vec![
            k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
                api_version: "v1".into(),
                kind: "Pod".into(),
                name: "p".into(),
                uid: "u1".into(),
                controller: Some(true),
                block_owner_deletion: Some(true),
            },
        ]);
        // Its pod does not name it yet (kube-controller-manager writes the status next).
        assert_eq!(releases([&c], &BTreeMap::new()), vec![]);
        c.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            Timestamp::UNIX_EPOCH,
        ));
        let released = releases([&c], &BTreeMap::new());
        assert_eq!(
            (released[0].deallocate, released[0].reason.as_str()),
            (false, "the claim is being deleted")
        );
    }

    #[test]
    fn a_deleted_claim_of_ours_is_released_even_while_its_pod_lives() {
        let user = gated(json!([{"name": "gpu", "resourceClaimName": "used"}]));
        let mut c = claim("used", true, Some(on_node("n1")), false);
        c.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            Timestamp::UNIX_EPOCH,
        ));
        let released = releases([&c], &claim_users([&user]));
        assert_eq!(released[0].reason, "the claim is being deleted");
    }

    #[test]
    fn allocations_whose_pod_stays_unbound_too_long_are_reported() {
        let user = gated(json!([{"name": "gpu", "resourceClaimName": "a"}]));
        let pods = BTreeMap::from([("ml/train".to_owned(), user.clone())]);
        let users = claim_users([&user]);
        let claims = [claim("a", true, Some(on_node("n1")), false)];
        let at: Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        let later = at + SignedDuration::from_secs(600);
        let found = unbound(
            &claims,
            &pods,
            &users,
            later,
            SignedDuration::from_secs(300),
        );
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].pods, vec!["ml/train".to_owned()]);
        assert!(
            unbound(
                &claims,
                &pods,
                &users,
                later,
                SignedDuration::from_secs(900)
            )
            .is_empty()
        );
    }

    #[test]
    fn the_node_of_an_allocation_is_read_from_its_selector() {
        let a: res::AllocationResult = serde_json::from_value(on_node("n3")).unwrap();
        assert_eq!(allocation_node(&a).as_deref(), Some("n3"));
    }
}
