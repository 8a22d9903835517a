//! The ResourceClaimTemplates of mapped claims: each claim's template, the request the webhook
//! recorded on a rewritten pod, the templates such a pod needs (its request mapped again), and
//! a template as each resource API version writes it.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::resource::v1 as res;
use serde_json::{Value, json};

use super::claim::MappedClaim;
use super::request::DevicePluginRequest;
use super::{Options, map_request};
use crate::error::{Error, Result};
use crate::names;

/// The ResourceClaimTemplate of one mapped claim, in `namespace`.
pub fn template(claim: &MappedClaim, namespace: &str) -> res::ResourceClaimTemplate {
    let labels = BTreeMap::from([
        (
            names::LABEL_MANAGED_BY.to_owned(),
            names::CONTROLLER_MANAGER.to_owned(),
        ),
        (
            names::LABEL_DEVICE_PLUGIN_TEMPLATE.to_owned(),
            "true".to_owned(),
        ),
    ]);
    let forms = BTreeMap::from([(
        names::ANNOTATION_DEVICE_PLUGIN_FORMS.to_owned(),
        claim.forms.join(","),
    )]);
    res::ResourceClaimTemplate {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some(claim.template.clone()),
            namespace: Some(namespace.to_owned()),
            labels: Some(labels),
            ..Default::default()
        },
        spec: res::ResourceClaimTemplateSpec {
            metadata: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                annotations: Some(forms),
                ..Default::default()
            }),
            spec: claim.spec.clone(),
        },
    }
}

/// The request the webhook recorded on a rewritten pod: `None` for a pod it did not rewrite.
pub fn recorded_request(pod: &core::Pod, object: &str) -> Option<Result<DevicePluginRequest>> {
    let text = pod
        .metadata
        .annotations
        .as_ref()?
        .get(names::ANNOTATION_DEVICE_PLUGIN_REQUEST)?;
    Some(serde_json::from_str(text).map_err(|e| {
        Error::invalid(
            object,
            format!(
                "metadata.annotations[{}]",
                names::ANNOTATION_DEVICE_PLUGIN_REQUEST
            ),
            format!("not a device-plugin request Tessera wrote: {e}"),
        )
    }))
}

/// The names of the ResourceClaimTemplates `pod` refers to, in its namespace.
pub fn referenced_templates(pod: &core::Pod) -> impl Iterator<Item = &str> {
    pod.spec
        .iter()
        .flat_map(|s| s.resource_claims.iter().flatten())
        .filter_map(|c| c.resource_claim_template_name.as_deref())
}

/// The templates a rewritten pod needs: its recorded request mapped again, kept where the pod
/// refers to the template. Empty for a pod the webhook did not rewrite.
pub fn templates_for_pod(
    pod: &core::Pod,
    options: &Options,
) -> Result<Vec<res::ResourceClaimTemplate>> {
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    let object = format!(
        "Pod {namespace}/{}",
        pod.metadata.name.as_deref().unwrap_or_default()
    );
    let Some(request) = recorded_request(pod, &object) else {
        return Ok(Vec::new());
    };
    let mapping = map_request(&request?, options, &object)?;
    let referenced: BTreeSet<&str> = referenced_templates(pod).collect();
    Ok(mapping
        .claims
        .iter()
        .filter(|c| referenced.contains(c.template.as_str()))
        .map(|c| template(c, namespace))
        .collect())
}

/// A v1 template as `version` writes it: v1 and v1beta2 share the claim spec's shape; v1beta1
/// has a request's fields where v1 nests them under `exactly`.
pub fn template_document(
    template: &res::ResourceClaimTemplate,
    version: crate::apiversion::ApiVersion,
) -> Result<Value> {
    let mut value = serde_json::to_value(template).map_err(|e| Error::Decode {
        context: "ResourceClaimTemplate".to_owned(),
        message: e.to_string(),
    })?;
    value["apiVersion"] = json!(version.as_str());
    value["kind"] = json!("ResourceClaimTemplate");
    if version == crate::apiversion::ApiVersion::V1beta1
        && let Some(requests) = value
            .pointer_mut("/spec/spec/devices/requests")
            .and_then(Value::as_array_mut)
    {
        for request in requests {
            if let Some(Value::Object(exactly)) =
                request.as_object_mut().and_then(|r| r.remove("exactly"))
                && let Some(map) = request.as_object_mut()
            {
                map.extend(exactly);
            }
        }
    }
    Ok(value)
}
