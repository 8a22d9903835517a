//! The webhook's hooks reading the cluster through `ApiAdmissionLookup` on the in-process fake
//! API server (in each served resource.k8s.io version), and mutated reviews of the example
//! claims, none of which may panic.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use serde_json::{Value, json};
use tessera_controller::webhook::{
    Admission, AdmissionLookup, ApiAdmissionLookup, FakeAdmissionLookup, Hook,
};
use tessera_driver::names;
use tessera_tests::fake_apiserver::FakeApiServer;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
}

fn review(request: &Value) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": request,
    }))
    .unwrap()
}

/// The body of a review of the creation of the v1 ResourceClaim `object`.
fn claim_create_review(uid: &str, namespace: &str, object: &Value) -> Vec<u8> {
    review(&json!({
        "uid": uid,
        "kind": {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaim"},
        "resource": {"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaims"},
        "namespace": namespace,
        "operation": "CREATE",
        "object": object,
    }))
}

fn pod_review(claims: &Value) -> Vec<u8> {
    review(&json!({
        "uid": "u1",
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "namespace": "team-a",
        "operation": "CREATE",
        "object": {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {
            "containers": [{"name": "c", "image": "i"}],
            "resourceClaims": claims,
        }},
    }))
}

/// Seeds a claim and a template in `version` (v1beta1 requests are flat, without `exactly`).
async fn seeded(version: &str) -> (FakeApiServer, Admission, tempfile::TempDir) {
    let server = FakeApiServer::start(&[version]).await.unwrap();
    let api_version = format!("resource.k8s.io/{version}");
    let request = |class: &str| {
        if version == "v1beta1" {
            json!({"name": "gpu", "deviceClassName": class})
        } else {
            json!({"name": "gpu", "exactly": {"deviceClassName": class}})
        }
    };
    server
        .create(
            "resourceclaims",
            json!({"apiVersion": api_version, "kind": "ResourceClaim",
                   "metadata": {"name": "share", "namespace": "team-a"},
                   "spec": {"devices": {"requests": [request(names::CLASS_SHARED_GPU)]}}}),
        )
        .unwrap();
    server
        .create(
            "resourceclaimtemplates",
            json!({"apiVersion": api_version, "kind": "ResourceClaimTemplate",
                   "metadata": {"name": "whole", "namespace": "team-a"},
                   "spec": {"spec": {"devices": {"requests": [request(names::CLASS_GPU)]}}}}),
        )
        .unwrap();
    server
        .create(
            "deviceclasses",
            json!({"apiVersion": api_version, "kind": "DeviceClass",
                   "metadata": {"name": names::CLASS_GPU, "annotations": {names::ANNOTATION_ALLOCATE: "true"}},
                   "spec": {}}),
        )
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, server.kubeconfig()).unwrap();
    let client = tessera_kubeapi::client(Some(&kubeconfig)).await.unwrap();
    let lookup: Arc<dyn AdmissionLookup> = Arc::new(ApiAdmissionLookup::new(client).await.unwrap());
    let admission = Admission::new(lookup, names::DEFAULT_DRIVER_NAME, Duration::from_secs(10));
    (server, admission, dir)
}

async fn gated(admission: &Admission, claims: &Value) -> (bool, Value) {
    let answer = admission
        .review(Hook::MutatePods, &pod_review(claims))
        .await
        .unwrap();
    let response = serde_json::to_value(&answer.response).unwrap();
    (response.get("patch").is_some(), response)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_templates_and_class_annotations_are_read_in_every_served_version() {
    for version in ["v1", "v1beta2", "v1beta1"] {
        let (_server, admission, _dir) = seeded(version).await;
        let (patched, response) = gated(
            &admission,
            &json!([{"name": "a", "resourceClaimName": "share"}]),
        )
        .await;
        assert!(patched, "{version}: {response}");
        // The whole-GPU class is marked by its annotation on this cluster.
        let (patched, response) = gated(
            &admission,
            &json!([{"name": "a", "resourceClaimTemplateName": "whole"}]),
        )
        .await;
        assert!(patched, "{version}: {response}");
        let (patched, response) = gated(
            &admission,
            &json!([{"name": "a", "resourceClaimName": "absent"}]),
        )
        .await;
        assert!(!patched, "{version}: {response}");
        assert!(response["warnings"][0].as_str().unwrap().contains("absent"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_made_for_a_gated_pod_is_marked_after_reading_the_pod_from_the_server() {
    let (server, admission, _dir) = seeded("v1").await;
    let pod = server
        .create(
            "pods",
            json!({"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": "train", "namespace": "team-a"},
                   "spec": {"containers": [{"name": "c", "image": "i"}],
                            "schedulingGates": [{"name": names::SCHEDULING_GATE}]}}),
        )
        .unwrap();
    let claim = json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "train-gpu-x", "namespace": "team-a",
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "train",
                "uid": pod["metadata"]["uid"], "controller": true}]},
        "spec": {"devices": {"requests": [{"name": "gpu",
            "exactly": {"deviceClassName": names::CLASS_SHARED_GPU}}]}}});
    let answer = admission
        .review(
            Hook::MutateClaims,
            &claim_create_review("u2", "team-a", &claim),
        )
        .await
        .unwrap();
    let response = serde_json::to_value(&answer.response).unwrap();
    let bytes: k8s_openapi::ByteString = serde_json::from_value(response["patch"].clone()).unwrap();
    let patch: Value = serde_json::from_slice(&bytes.0).unwrap();
    assert_eq!(
        patch,
        json!([
            {"op": "add", "path": "/metadata/finalizers", "value": [names::CLAIM_FINALIZER]},
            {"op": "add", "path": "/metadata/annotations",
             "value": {names::ANNOTATION_ALLOCATED_BY: "train"}},
        ])
    );
}

fn example_claims() -> Vec<Value> {
    let mut claims = Vec::new();
    let mut paths: Vec<_> = std::fs::read_dir(repo().join("examples/claims"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    paths.sort();
    for path in paths {
        let text = std::fs::read_to_string(path).unwrap();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let value: serde_yaml::Value = serde::Deserialize::deserialize(doc).unwrap();
            let value = serde_json::to_value(value).unwrap();
            if value["kind"] == "ResourceClaim" {
                claims.push(value);
            }
        }
    }
    claims
}

const ODD: &[&str] = &[
    "-1",
    "0",
    "-5Gi",
    "1e99999",
    "99999999999999999999999",
    "",
    "x",
    "5.5",
    "[",
    "Gi",
];

/// Replaces the `pick`-th leaf (in document order) of `value` with `odd`.
fn mutate(value: &mut Value, pick: &mut usize, odd: &Value) {
    match value {
        Value::Object(map) => map.values_mut().for_each(|v| mutate(v, pick, odd)),
        Value::Array(items) => items.iter_mut().for_each(|v| mutate(v, pick, odd)),
        leaf => {
            if *pick == 0 {
                *leaf = odd.clone();
            }
            *pick = pick.wrapping_sub(1);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn no_mutated_claim_review_panics(
        which in 0usize..64,
        leaf in 0usize..64,
        odd in prop::sample::select(ODD),
        as_number in any::<bool>(),
    ) {
        let claims = example_claims();
        let mut claim = claims[which % claims.len()].clone();
        let odd = if as_number {
            serde_json::from_str(odd).unwrap_or(Value::Null)
        } else {
            Value::String(odd.to_owned())
        };
        let mut pick = leaf;
        mutate(&mut claim, &mut pick, &odd);
        let body = claim_create_review("u", "default", &claim);
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let admission = Admission::new(
            Arc::new(FakeAdmissionLookup::new()),
            names::DEFAULT_DRIVER_NAME,
            Duration::from_secs(1),
        );
        for hook in Hook::ALL {
            let answer = runtime.block_on(admission.review(hook, &body)).unwrap();
            let response = serde_json::to_value(&answer.response).unwrap();
            prop_assert_eq!(&response["uid"], "u");
            if response["allowed"] == false {
                prop_assert!(response["status"]["message"].as_str().is_some_and(|m| !m.is_empty()));
            }
        }
    }
}
