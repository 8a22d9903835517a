use serde_json::json;

use super::*;
use crate::node::inventory::Inventory;
use crate::node::slices::{RenderOptions, render};

fn claim(api_version: &str) -> Value {
    json!({
        "apiVersion": api_version,
        "kind": "ResourceClaim",
        "metadata": {"name": "train", "namespace": "ml"},
        "spec": {"devices": {
            "requests": [
                {
                    "name": "gpus",
                    "deviceClassName": "gpu.tessera.dev",
                    "count": 2,
                    "allocationMode": "ExactCount",
                    "selectors": [{"cel": {"expression": "device.attributes['gpu.tessera.dev'].model == 'a100-80g'"}}],
                    "capacity": {"requests": {"memory": "10Gi"}}
                },
                {
                    "name": "any",
                    "firstAvailable": [
                        {"name": "big", "deviceClassName": "gpu.tessera.dev"},
                        {"name": "small", "deviceClassName": "mig.gpu.tessera.dev", "count": 2}
                    ]
                }
            ],
            "constraints": [{"requests": ["gpus"], "matchAttribute": "gpu.tessera.dev/nvlinkDomain"}]
        }}
    })
}

#[test]
fn v1beta1_claim_converts_to_v1() {
    let Object::ResourceClaim(c) =
        decode_document(claim("resource.k8s.io/v1beta1"), "c.yaml").expect("decodes")
    else {
        panic!("not a claim");
    };
    let requests = &c.spec.devices.as_ref().expect("devices").requests;
    let requests = requests.as_ref().expect("requests");
    let exactly = requests[0].exactly.as_ref().expect("exactly");
    assert_eq!(exactly.device_class_name, "gpu.tessera.dev");
    assert_eq!(exactly.count, Some(2));
    assert_eq!(exactly.allocation_mode.as_deref(), Some("ExactCount"));
    assert_eq!(exactly.selectors.as_ref().map(Vec::len), Some(1));
    let cap = exactly.capacity.as_ref().and_then(|c| c.requests.as_ref());
    assert_eq!(cap.map(|r| r["memory"].0.as_str()), Some("10Gi"));
    assert!(requests[1].exactly.is_none());
    let sub = requests[1]
        .first_available
        .as_ref()
        .expect("firstAvailable");
    assert_eq!(sub[1].count, Some(2));

    // The same claim written in v1 decodes to the same object.
    let mut v1_doc = claim("resource.k8s.io/v1");
    let r0 = &mut v1_doc["spec"]["devices"]["requests"][0];
    let mut exact = r0.as_object().cloned().expect("object");
    exact.remove("name");
    *r0 = json!({"name": "gpus", "exactly": exact});
    let Object::ResourceClaim(v1_claim) = decode_document(v1_doc, "c.yaml").expect("decodes")
    else {
        panic!("not a claim");
    };
    assert_eq!(c, v1_claim);
}

#[test]
fn v1beta2_claim_is_v1_with_another_name() {
    let mut doc = claim("resource.k8s.io/v1beta2");
    doc["spec"]["devices"]["requests"][0] = json!({
        "name": "gpus", "exactly": {"deviceClassName": "gpu.tessera.dev", "count": 1}
    });
    let Object::ResourceClaim(c) = decode_document(doc, "x").expect("decodes") else {
        panic!("not a claim");
    };
    let r = &c.spec.devices.expect("devices").requests.expect("requests")[0];
    assert_eq!(r.exactly.as_ref().and_then(|e| e.count), Some(1));
}

#[test]
fn v1beta1_template_requests_convert_too() {
    let doc = json!({
        "apiVersion": "resource.k8s.io/v1beta1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "t", "namespace": "ml"},
        "spec": {"spec": {"devices": {"requests": [{"name": "g", "deviceClassName": "gpu.tessera.dev"}]}}}
    });
    let Object::ResourceClaimTemplate(t) = decode_document(doc, "x").expect("decodes") else {
        panic!("not a template");
    };
    let r = &t
        .spec
        .spec
        .devices
        .expect("devices")
        .requests
        .expect("requests")[0];
    assert_eq!(
        r.exactly.as_ref().map(|e| e.device_class_name.as_str()),
        Some("gpu.tessera.dev")
    );
}

#[test]
fn errors_name_the_file_object_and_field() {
    let mut doc = claim("resource.k8s.io/v1beta1");
    doc["spec"]["devices"]["requests"][0]["count"] = json!("two");
    let e = decode_document(doc, "claims.yaml").expect_err("bad count");
    let Error::Decode { context, message } = &e else {
        panic!("wrong error {e:?}");
    };
    assert!(context.contains("claims.yaml"), "{context}");
    assert!(context.contains("ResourceClaim ml/train"), "{context}");
    assert!(
        message.starts_with("spec.devices.requests[0].count"),
        "{message}"
    );
}

#[test]
fn unknown_versions_and_kinds_are_clear_errors() {
    let mut doc = claim("resource.k8s.io/v1alpha3");
    let e = decode_document(doc.clone(), "f").expect_err("alpha");
    assert!(e.to_string().contains("unsupported apiVersion/kind"), "{e}");
    doc["apiVersion"] = json!("resource.k8s.io/v1");
    doc["kind"] = json!("DeviceTaintRule");
    assert!(decode_document(doc, "f").is_err());
    let e = decode_document(json!({"kind": "Pod"}), "f").expect_err("no version");
    assert!(e.to_string().contains("apiVersion"), "{e}");
    assert!(decode_document(json!([1, 2]), "f").is_err());
}

#[test]
fn core_node_and_pod_decode() {
    let node = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}});
    assert_eq!(decode_document(node, "f").expect("node").kind(), "Node");
    let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "d"},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]}});
    let obj = decode_document(pod, "f").expect("pod");
    assert_eq!(obj.metadata().namespace.as_deref(), Some("d"));
}

fn demo_slice(consumable: bool) -> v1::ResourceSlice {
    let inv = Inventory::from_yaml(
        "nodes:\n- name: n1\n  mode: shared\n  gpus:\n  - model: t4\n    healthy: false\n  - model: a100-40g\n    mig:\n    - profile: 1g.5gb\n",
    )
    .expect("inventory");
    let opts = RenderOptions {
        consumable_capacity: consumable,
        ..RenderOptions::default()
    };
    render(&inv.nodes[0], &opts).expect("render").remove(0)
}

#[test]
fn slices_round_trip_through_every_version() {
    for consumable in [false, true] {
        let slice = demo_slice(consumable);
        for version in ApiVersion::ALL {
            let value = encode_slice(&slice, version).expect("encodes");
            assert_eq!(value["apiVersion"], json!(version.as_str()));
            if version == ApiVersion::V1beta1 {
                assert!(value["spec"]["devices"][0]["basic"]["attributes"].is_object());
                assert!(value["spec"]["devices"][0].get("attributes").is_none());
            }
            let Object::ResourceSlice(back) = decode_document(value, "x").expect("decodes") else {
                panic!("not a slice");
            };
            assert_eq!(back, slice, "{version}");
        }
    }
}

#[test]
fn v1beta1_slice_zero_values_mean_unset() {
    let doc = json!({
        "apiVersion": "resource.k8s.io/v1beta1", "kind": "ResourceSlice",
        "metadata": {"name": "s"},
        "spec": {"driver": "gpu.tessera.dev", "nodeName": "", "allNodes": true,
                 "pool": {"name": "p", "generation": 1, "resourceSliceCount": 1},
                 "devices": [{"name": "gpu-0", "basic": {"attributes": {"index": {"int": 0}}}}]}
    });
    let Object::ResourceSlice(s) = decode_document(doc, "x").expect("decodes") else {
        panic!("not a slice");
    };
    assert!(s.spec.node_name.is_none());
    assert_eq!(s.spec.all_nodes, Some(true));
    let d = &s.spec.devices.expect("devices")[0];
    assert_eq!(d.attributes.as_ref().map(|a| a["index"].int), Some(Some(0)));
}

#[test]
fn difference_finder_names_the_dropped_field() {
    let a = json!({"spec": {"devices": [{"name": "x", "extra": 1}]}});
    let b = json!({"spec": {"devices": [{"name": "x"}]}});
    assert_eq!(
        first_difference(&a, &b, String::new()).as_deref(),
        Some("spec.devices[0].extra")
    );
    assert_eq!(first_difference(&a, &a, String::new()), None);
}

#[test]
fn kubectl_yaml_sorts_keys_and_separates_documents() {
    let v = json!([{"kind": "A", "apiVersion": "v1", "b": {"z": 1, "a": 2}}, {"kind": "B"}]);
    let text = to_kubectl_yaml(&v);
    assert_eq!(
        text,
        "apiVersion: v1\nb:\n  a: 2\n  z: 1\nkind: A\n---\nkind: B\n"
    );
}
