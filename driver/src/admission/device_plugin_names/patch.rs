//! The JSON patch that rewrites a pod for its mapped claims ([`pod_patch`]), and the patch
//! applied to the pod as the API server would ([`apply_pod_patch`]).

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1 as core;
use serde_json::{Value, json};

use super::claim::Mapping;
use super::request::{ContainerAsk, DevicePluginRequest};
use crate::admission::PatchOp;
use crate::error::{Error, Result};
use crate::names;

/// Escapes one JSON-pointer token (RFC 6901).
fn token(name: &str) -> String {
    name.replace('~', "~0").replace('/', "~1")
}

fn add(path: String, value: Value) -> PatchOp {
    PatchOp {
        op: "add",
        path,
        value,
    }
}

fn container_of<'a>(pod: &'a core::Pod, ask: &ContainerAsk) -> Option<&'a core::Container> {
    pod.spec.as_ref().and_then(|s| {
        if ask.init {
            s.init_containers.as_ref().and_then(|c| c.get(ask.index))
        } else {
            s.containers.get(ask.index)
        }
    })
}

/// The patch removing the asked names from the containers' limits and requests.
fn remove_names(pod: &core::Pod, request: &DevicePluginRequest) -> Vec<PatchOp> {
    let mut ops = Vec::new();
    for ask in &request.containers {
        let resources = container_of(pod, ask).and_then(|c| c.resources.as_ref());
        for (list, map) in [
            ("limits", resources.and_then(|r| r.limits.as_ref())),
            ("requests", resources.and_then(|r| r.requests.as_ref())),
        ] {
            for name in ask.resources.keys() {
                if map.is_some_and(|m| m.contains_key(name)) {
                    ops.push(PatchOp {
                        op: "remove",
                        path: format!("{}/resources/{list}/{}", ask.pointer(), token(name)),
                        value: Value::Null,
                    });
                }
            }
        }
    }
    ops
}

/// The JSON patch that rewrites `pod`: the names removed from requests and limits, the claims
/// added to `spec.resourceClaims` and to each container's `resources.claims`, the request
/// recorded in an annotation, and the scheduling gate.
///
/// An entry name the pod already uses is an error (the pod mixes its own claims with
/// device-plugin names under the same name).
pub fn pod_patch(
    pod: &core::Pod,
    request: &DevicePluginRequest,
    mapping: &Mapping,
    object: &str,
) -> Result<Vec<PatchOp>> {
    let spec = pod.spec.as_ref();
    let container = |ask: &ContainerAsk| container_of(pod, ask);
    let mut ops = remove_names(pod, request);
    let existing: BTreeSet<&str> = spec
        .and_then(|s| s.resource_claims.as_ref())
        .into_iter()
        .flatten()
        .map(|c| c.name.as_str())
        .collect();
    let mut with_claims: BTreeSet<usize> = BTreeSet::new();
    for claim in &mapping.claims {
        if existing.contains(claim.entry.as_str()) {
            return Err(Error::invalid(
                object,
                "spec.resourceClaims".to_owned(),
                format!(
                    "the pod already has a claim named {:?}, the name Tessera gives the claim it \
                     makes from the device-plugin names; rename the pod's claim",
                    claim.entry
                ),
            ));
        }
        for &i in &claim.containers {
            let ask = &request.containers[i];
            let has = container(ask)
                .and_then(|c| c.resources.as_ref())
                .is_some_and(|r| r.claims.is_some());
            let reference = json!({ "name": claim.entry });
            if has || !with_claims.insert(i) {
                ops.push(add(
                    format!("{}/resources/claims/-", ask.pointer()),
                    reference,
                ));
            } else if container(ask).is_some_and(|c| c.resources.is_some()) {
                ops.push(add(
                    format!("{}/resources/claims", ask.pointer()),
                    json!([reference]),
                ));
            } else {
                ops.push(add(
                    format!("{}/resources", ask.pointer()),
                    json!({ "claims": [reference] }),
                ));
            }
        }
    }
    let entries: Vec<Value> = mapping
        .claims
        .iter()
        .map(|c| json!({ "name": c.entry, "resourceClaimTemplateName": c.template }))
        .collect();
    if existing.is_empty() && spec.is_none_or(|s| s.resource_claims.is_none()) {
        ops.push(add("/spec/resourceClaims".to_owned(), json!(entries)));
    } else {
        for entry in entries {
            ops.push(add("/spec/resourceClaims/-".to_owned(), entry));
        }
    }
    let recorded = serde_json::to_string(request).map_err(|e| Error::Decode {
        context: format!("{object}: the device-plugin request"),
        message: e.to_string(),
    })?;
    if pod.metadata.annotations.is_some() {
        ops.push(add(
            format!(
                "/metadata/annotations/{}",
                token(names::ANNOTATION_DEVICE_PLUGIN_REQUEST)
            ),
            json!(recorded),
        ));
    } else {
        ops.push(add(
            "/metadata/annotations".to_owned(),
            json!({ names::ANNOTATION_DEVICE_PLUGIN_REQUEST: recorded }),
        ));
    }
    let gates = spec.and_then(|s| s.scheduling_gates.as_ref());
    let gate = json!({ "name": names::SCHEDULING_GATE });
    match gates {
        Some(g) if g.iter().any(|g| g.name == names::SCHEDULING_GATE) => {}
        Some(_) => ops.push(add("/spec/schedulingGates/-".to_owned(), gate)),
        None => ops.push(add("/spec/schedulingGates".to_owned(), json!([gate]))),
    }
    Ok(ops)
}

/// The pod as the API server stores it after the webhook's patch ([`pod_patch`]): what
/// `tessera allocate` and tests start from.
pub fn apply_pod_patch(pod: &core::Pod, patch: &[PatchOp], object: &str) -> Result<core::Pod> {
    let mut value = serde_json::to_value(pod).map_err(|e| Error::Decode {
        context: object.to_owned(),
        message: e.to_string(),
    })?;
    apply_patch(&mut value, patch, object)?;
    serde_json::from_value(value).map_err(|e| Error::Decode {
        context: object.to_owned(),
        message: e.to_string(),
    })
}

/// Applies the patches [`pod_patch`] writes (`add` and `remove`) to a JSON object.
fn apply_patch(target: &mut Value, ops: &[PatchOp], object: &str) -> Result<()> {
    let fail = |path: &str| Error::Decode {
        context: object.to_owned(),
        message: format!("the rewrite's patch does not apply at {path}"),
    };
    for op in ops {
        let (parent, last) = op.path.rsplit_once('/').ok_or_else(|| fail(&op.path))?;
        let last = last.replace("~1", "/").replace("~0", "~");
        let parent = target.pointer_mut(parent).ok_or_else(|| fail(&op.path))?;
        match (op.op, parent) {
            ("add", Value::Array(items)) if last == "-" => items.push(op.value.clone()),
            ("add", Value::Object(map)) => {
                map.insert(last, op.value.clone());
            }
            ("remove", Value::Object(map)) => {
                map.remove(&last).ok_or_else(|| fail(&op.path))?;
            }
            _ => return Err(fail(&op.path)),
        }
    }
    Ok(())
}
