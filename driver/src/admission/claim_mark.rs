//! The controller's mark on a claim, added at admission: a claim that kube-controller-manager
//! makes from a template for a pod carrying Tessera's scheduling gate gets the finalizer
//! [`names::CLAIM_FINALIZER`] and the annotation [`names::ANNOTATION_ALLOCATED_BY`] naming the
//! pod as it is created, so the controller need not write them before the allocation (one
//! write fewer per claim). The mark is exactly what the controller would write itself for that
//! pod: the claim is the controller's to allocate from the start, since kube-scheduler does not
//! touch a gated pod's claims.
//!
//! Nothing is added for a claim created on its own (`resourceClaimName`): no pod is known
//! when it is created, and the finalizer alone would save no write (the controller still has
//! to name the pod). Nor for a claim of a pod that is not gated, is gone, or is another pod
//! under the same name (UID): such claims stay kube-scheduler's.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1 as res;
use serde_json::json;

use super::PatchOp;
use crate::names;
use crate::placement::gate::{self, owning_pod};

/// The JSON patch that marks `claim` for its owning pod `owner` (as looked up by name), or
/// nothing when the claim is not made for a pod the controller will place.
pub fn claim_mark_patch(claim: &res::ResourceClaim, owner: &Pod) -> Vec<PatchOp> {
    let Some((name, uid)) = owning_pod(claim) else {
        return Vec::new();
    };
    if owner.metadata.uid.as_deref() != Some(uid)
        || owner.metadata.name.as_deref() != Some(name)
        || !gate::is_gated(owner)
        || gate::is_done(owner)
    {
        return Vec::new();
    }
    let mut ops = Vec::new();
    match &claim.metadata.finalizers {
        None => ops.push(PatchOp {
            op: "add",
            path: "/metadata/finalizers".to_owned(),
            value: json!([names::CLAIM_FINALIZER]),
        }),
        Some(f) if !f.iter().any(|f| f == names::CLAIM_FINALIZER) => ops.push(PatchOp {
            op: "add",
            path: "/metadata/finalizers/-".to_owned(),
            value: json!(names::CLAIM_FINALIZER),
        }),
        Some(_) => {}
    }
    match &claim.metadata.annotations {
        None => ops.push(PatchOp {
            op: "add",
            path: "/metadata/annotations".to_owned(),
            value: json!({names::ANNOTATION_ALLOCATED_BY: name}),
        }),
        Some(_) => ops.push(PatchOp {
            op: "add",
            path: format!(
                "/metadata/annotations/{}",
                names::ANNOTATION_ALLOCATED_BY
                    .replace('~', "~0")
                    .replace('/', "~1")
            ),
            value: json!(name),
        }),
    }
    ops
}

#[cfg(test)]
mod tests {

    use serde_json::{Value, json};

    use super::*;

    fn claim(extra_meta: &Value) -> res::ResourceClaim {
        let mut meta = json!({"name": "p-gpu-x7", "namespace": "ml",
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "u1",
                                 "controller": true, "blockOwnerDeletion": true}]});
        for (k, v) in extra_meta.as_object().unwrap() {
            meta[k] = v.clone();
        }
        serde_json::from_value(json!({"metadata": meta, "spec": {}})).unwrap()
    }

    fn pod(uid: &str, with_gate: bool) -> Pod {
        let gates = if with_gate {
            json!([{"name": names::SCHEDULING_GATE}])
        } else {
            json!([])
        };
        serde_json::from_value(
            json!({"metadata": {"name": "p", "namespace": "ml", "uid": uid},
            "spec": {"containers": [], "schedulingGates": gates}}),
        )
        .unwrap()
    }

    /// Applies the ops the way the API server does, enough for these tests.
    fn applied(claim: &res::ResourceClaim, ops: &[PatchOp]) -> res::ResourceClaim {
        let mut v = serde_json::to_value(claim).unwrap();
        for op in ops {
            let (parent, key) = op.path.rsplit_once('/').unwrap();
            let key = key.replace("~1", "/").replace("~0", "~");
            let target = v.pointer_mut(parent).unwrap();
            if key == "-" {
                target.as_array_mut().unwrap().push(op.value.clone());
            } else {
                target[key.as_str()] = op.value.clone();
            }
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn a_template_claim_of_a_gated_pod_is_marked_for_that_pod() {
        for extra in [
            json!({}),
            json!({"finalizers": ["example.com/keep"],
                   "annotations": {"resource.kubernetes.io/pod-claim-name": "gpu"}}),
        ] {
            let c = claim(&extra);
            let marked = applied(&c, &claim_mark_patch(&c, &pod("u1", true)));
            assert!(gate::is_ours(&marked), "{extra}");
            assert_eq!(
                marked.metadata.annotations.unwrap()[names::ANNOTATION_ALLOCATED_BY],
                "p"
            );
            let finalizers = marked.metadata.finalizers.unwrap();
            assert!(finalizers.iter().any(|f| f == names::CLAIM_FINALIZER));
            assert_eq!(
                finalizers.len(),
                extra["finalizers"].as_array().map_or(0, Vec::len) + 1
            );
        }
    }

    #[test]
    fn claims_not_made_for_a_gated_pod_are_left_alone() {
        let c = claim(&json!({}));
        // Not gated: kube-scheduler's. Another pod under the same name: not this claim's.
        assert!(claim_mark_patch(&c, &pod("u1", false)).is_empty());
        assert!(claim_mark_patch(&c, &pod("u2", true)).is_empty());
        // A claim created on its own has no owning pod.
        let mut alone = c.clone();
        alone.metadata.owner_references = None;
        assert_eq!(owning_pod(&alone), None);
        assert!(claim_mark_patch(&alone, &pod("u1", true)).is_empty());
    }
}
