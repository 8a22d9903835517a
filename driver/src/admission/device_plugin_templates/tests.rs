use serde_json::json;

use super::*;
use crate::admission::device_plugin_names::{PodRewrite, rewrite_pod};

/// A pod asking `limits` with device-plugin names, as the webhook admits it: pointed at its
/// templates, with its request recorded. Also the names of those templates.
fn admitted(name: &str, limits: &serde_json::Value) -> (core::Pod, Vec<String>) {
    let p: core::Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"containers": [{"name": "main", "image": "i", "resources": {"limits": limits}}]},
    }))
    .unwrap();
    let object = format!("Pod ns/{name}");
    let PodRewrite::Rewritten {
        request, mapping, ..
    } = rewrite_pod(&p, &Options::default(), &object).unwrap()
    else {
        panic!("not rewritten");
    };
    let templates: Vec<String> = mapping.claims.iter().map(|c| c.template.clone()).collect();
    let mut pod = p;
    let spec = pod.spec.as_mut().unwrap();
    spec.resource_claims = Some(
        mapping
            .claims
            .iter()
            .map(|c| core::PodResourceClaim {
                name: c.template.clone(),
                resource_claim_template_name: Some(c.template.clone()),
                ..Default::default()
            })
            .collect(),
    );
    pod.metadata.annotations = Some(
        [(
            names::ANNOTATION_DEVICE_PLUGIN_REQUEST.to_owned(),
            serde_json::to_string(&request).unwrap(),
        )]
        .into(),
    );
    (pod, templates)
}

/// A pod the webhook did not rewrite that refers to template `name` itself.
fn referring(name: &str, template: &str) -> core::Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {
            "containers": [{"name": "main", "image": "i"}],
            "resourceClaims": [{"name": "c", "resourceClaimTemplateName": template}],
        },
    }))
    .unwrap()
}

fn plan_for(pods: &[&core::Pod], known: &BTreeSet<TemplateKey>) -> TemplatePlan {
    plan(pods.iter().copied(), known, &Options::default())
}

fn key(name: &str) -> TemplateKey {
    ("ns".to_owned(), name.to_owned())
}

#[test]
fn a_rewritten_pod_gets_the_templates_it_refers_to_made_once() {
    let (a, names) = admitted("a", &json!({"nvidia.com/gpu": "1"}));
    let (b, same) = admitted("b", &json!({"nvidia.com/gpu": "1"}));
    assert_eq!(names, same, "the same shape is the same template");
    let plan = plan_for(&[&a, &b], &BTreeSet::new());
    assert_eq!(
        plan.create.keys().cloned().collect::<Vec<_>>(),
        [key(&names[0])]
    );
    let t = &plan.create[&key(&names[0])];
    assert_eq!(t.metadata.namespace.as_deref(), Some("ns"));
    assert!(plan.delete.is_empty() && plan.unmappable.is_empty());
    // Once it exists, nothing is made again and nothing is deleted.
    let known: BTreeSet<_> = [key(&names[0])].into();
    let plan = plan_for(&[&a, &b], &known);
    assert!(plan.create.is_empty() && plan.delete.is_empty());
}

#[test]
fn a_known_template_no_pod_refers_to_is_deleted_and_any_pod_keeps_one_alive() {
    let (a, names) = admitted("a", &json!({"nvidia.com/gpu": "1"}));
    let known: BTreeSet<_> = [key(&names[0]), key("tessera-stale")].into();
    let plan = plan_for(&[&a], &known);
    assert_eq!(plan.delete, [key("tessera-stale")]);
    // A pod the webhook did not rewrite, written against the template by hand, keeps it.
    let by_hand = referring("hand", "tessera-stale");
    let plan = plan_for(&[&a, &by_hand], &known);
    assert!(plan.delete.is_empty(), "{:?}", plan.delete);
    assert!(plan.create.is_empty());
    // With no pods left, every known template goes; a template in another namespace is
    // not kept by a pod of this one.
    let elsewhere: BTreeSet<_> = [("other".to_owned(), "tessera-stale".to_owned())].into();
    assert_eq!(plan_for(&[&by_hand], &elsewhere).delete.len(), 1);
    assert_eq!(plan_for(&[], &known).delete.len(), 2);
}

#[test]
fn a_pod_not_rewritten_makes_nothing_even_when_its_template_is_missing() {
    let plan = plan_for(&[&referring("hand", "tessera-missing")], &BTreeSet::new());
    assert!(plan.create.is_empty() && plan.delete.is_empty() && plan.unmappable.is_empty());
}

#[test]
fn a_recorded_request_that_no_longer_maps_is_reported_with_the_pod() {
    let (mut a, _) = admitted("a", &json!({"nvidia.com/gpu": "1"}));
    a.metadata.annotations.as_mut().unwrap().insert(
        names::ANNOTATION_DEVICE_PLUGIN_REQUEST.to_owned(),
        "{not json".to_owned(),
    );
    let plan = plan_for(&[&a], &BTreeSet::new());
    assert!(plan.create.is_empty());
    assert_eq!(plan.unmappable.len(), 1);
    assert_eq!(plan.unmappable[0].0, "ns/a");
    let why = plan.unmappable[0].1.to_string();
    assert!(why.contains("Pod ns/a"), "{why}");
}
