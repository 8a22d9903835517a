//! What the view keeps of ResourceClaims: the fields some decision or write reads, nothing
//! else (ResourceSlices are kept in the allocator's compact form, `PublishedSlice`). At
//! 1,000 nodes the view holds thousands of claims, so whatever a field costs is paid
//! thousands of times (see docs/controller.md, "Memory and CPU at scale").

use k8s_openapi::api::resource::v1 as res;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use tessera_driver::names;

/// Keeps of an object's metadata its identity and version only (name, namespace, uid,
/// resourceVersion), plus deletion time, finalizers and the annotations `keep` accepts.
fn slim_meta(meta: &mut ObjectMeta, keep: impl Fn(&str) -> bool) {
    let annotations = meta.annotations.take().and_then(|mut all| {
        all.retain(|k, _| keep(k));
        (!all.is_empty()).then_some(all)
    });
    *meta = ObjectMeta {
        name: meta.name.take(),
        namespace: meta.namespace.take(),
        uid: meta.uid.take(),
        resource_version: meta.resource_version.take(),
        deletion_timestamp: meta.deletion_timestamp.take(),
        finalizers: meta.finalizers.take(),
        annotations,
        ..ObjectMeta::default()
    };
}

/// Keeps of a claim what the gate protocol and the allocator read: identity and version,
/// deletion time, finalizers (the finalizer patch rewrites the list), Tessera's own
/// annotations (who allocated it), the pod that owns it as its controller (a claim made from a
/// template: released only once it is deleted, see `gate::releases`), the spec and the status.
/// Labels, other annotations, other owner references and `managedFields` go.
pub(crate) fn claim(claim: &mut res::ResourceClaim) {
    let owner = claim.metadata.owner_references.take().and_then(|refs| {
        let pods: Vec<_> = refs
            .into_iter()
            .filter(|r| r.kind == names::POD.kind && r.controller == Some(true))
            .collect();
        (!pods.is_empty()).then_some(pods)
    });
    let ours = names::ANNOTATION_ALLOCATED_BY
        .split_once('/')
        .map_or(names::ANNOTATION_ALLOCATED_BY, |(domain, _)| domain);
    slim_meta(&mut claim.metadata, |k| {
        k.split_once('/').is_some_and(|(domain, _)| domain == ours)
    });
    claim.metadata.owner_references = owner;
}

#[cfg(test)]
mod tests {

    use super::*;
    use serde_json::json;
    use tessera_driver::placement::allocator::{Allocator, AllocatorOptions, Learn, Snapshot};

    fn served_slice() -> res::ResourceSlice {
        serde_json::from_value(json!({
            "metadata": {"name": "n1-gpus", "resourceVersion": "7", "uid": "s1",
                "labels": {"a": "b"}, "ownerReferences": [{"apiVersion": "v1", "kind": "Node",
                    "name": "n1", "uid": "n"}],
                "managedFields": [{"manager": "kubelet", "operation": "Update"}]},
            "spec": {"driver": names::DEFAULT_DRIVER_NAME, "nodeName": "n1",
                "pool": {"name": "n1", "generation": 3, "resourceSliceCount": 1},
                "sharedCounters": [{"name": "gpu-0-mem", "counters": {"memory": {"value": "80Gi"}}}],
                "devices": [{"name": "gpu-0",
                    "attributes": {"type": {"string": "gpu"}, "sharing": {"string": "shared"},
                                   "nvlinkDomain": {"string": "n1-0"}, "index": {"int": 0}},
                    "capacity": {"memory": {"value": "80Gi",
                                    "requestPolicy": {"default": "1Gi", "validRange": {"min": "1Gi", "step": "1Gi"}}},
                                 "compute": {"value": "100"}},
                    "consumesCounters": [{"counterSet": "gpu-0-mem", "counters": {"memory": {"value": "80Gi"}}}],
                    "allowMultipleAllocations": true,
                    "taints": [{"key": "k", "value": "v", "effect": "None"}]}]}
        }))
        .unwrap()
    }

    fn served_claim() -> res::ResourceClaim {
        serde_json::from_value(json!({
            "metadata": {"name": "c", "namespace": "ml", "uid": "u1", "resourceVersion": "4",
                "labels": {"app": "x"}, "finalizers": ["other/keep"],
                "annotations": {"resource.kubernetes.io/pod-claim-name": "gpu",
                                names::ANNOTATION_ALLOCATED_BY: "ml/p"},
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "p1", "controller": true},
                    {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "r", "uid": "r1"}],
                "managedFields": [{"manager": "kube-controller-manager", "operation": "Update"}]},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": "gpu.tessera.dev",
                "capacity": {"requests": {"memory": "10Gi"}}}}]}}
        }))
        .unwrap()
    }

    #[test]
    fn a_slim_claim_keeps_what_the_protocol_reads() {
        let full = served_claim();
        let mut slim = full.clone();
        claim(&mut slim);
        assert_eq!(slim.spec, full.spec);
        assert_eq!(
            serde_json::to_value(&slim.metadata).unwrap(),
            json!({"name": "c", "namespace": "ml", "uid": "u1", "resourceVersion": "4",
                   "finalizers": ["other/keep"],
                   "annotations": {names::ANNOTATION_ALLOCATED_BY: "ml/p"},
                   "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "p",
                                        "uid": "p1", "controller": true}]})
        );
        // What `gate::releases` reads to keep a template claim marked until it is deleted.
        assert!(tessera_driver::placement::gate::owning_pod(&slim).is_some());
    }

    #[test]
    fn slim_claims_allocate_exactly_as_the_full_objects() {
        let classes: Vec<res::DeviceClass> = vec![
            serde_json::from_value(json!({"metadata": {"name": "gpu.tessera.dev"},
                "spec": {"selectors": [{"cel": {"expression":
                    "device.attributes[\"gpu.tessera.dev\"].type == \"gpu\""}}]}}))
            .unwrap(),
        ];
        let allocate = |s: res::ResourceSlice, c: res::ResourceClaim| {
            let mut snapshot = Snapshot::for_driver(
                names::DEFAULT_DRIVER_NAME,
                std::slice::from_ref(&s),
                &classes,
                &[],
            )
            .unwrap();
            let nodes = vec![serde_json::from_value(json!({"metadata": {"name": "n1"}})).unwrap()];
            let placed = Allocator::new(AllocatorOptions::default()).place_pod(
                &mut snapshot,
                &[&c],
                &nodes,
                &tessera_driver::placement::fragmentation::HostResources::default(),
                Learn::FromClaims,
            );
            let placement = placed.result.unwrap();
            (
                placement.node,
                serde_json::to_value(&placement.allocations).unwrap(),
                format!("{:?}", snapshot.device_usage()),
            )
        };
        let full = allocate(served_slice(), served_claim());
        let mut c = served_claim();
        claim(&mut c);
        assert_eq!(allocate(served_slice(), c), full);
        // The share was booked: the allocation holds a consumed capacity from the slice.
        assert!(
            full.1.to_string().contains("consumedCapacity"),
            "{}",
            full.1
        );
    }
}
