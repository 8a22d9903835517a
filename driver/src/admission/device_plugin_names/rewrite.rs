//! What the pod webhook and `tessera allocate` do with a pod that uses device-plugin names:
//! leave it, skip it with a warning, or rewrite it ([`rewrite_pod`]); offline, also make the
//! claims kube-controller-manager would make from the templates ([`rewrite_offline`]).

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::resource::v1 as res;

use super::claim::Mapping;
use super::patch::{apply_pod_patch, pod_patch};
use super::request::DevicePluginRequest;
use super::{Options, map_request};
use crate::admission::PatchOp;
use crate::error::Result;
use crate::names;

/// What the pod webhook does with a pod that may use device-plugin names.
#[derive(Debug, Clone, PartialEq)]
pub enum PodRewrite {
    /// The pod asks for none of the names.
    Untouched,
    /// The pod asks for them but is left as it is, for the reason given (a warning).
    Skipped(String),
    /// The pod is rewritten.
    Rewritten {
        /// The request recorded on the pod.
        request: DevicePluginRequest,
        /// The claims.
        mapping: Mapping,
        /// The JSON patch.
        patch: Vec<PatchOp>,
    },
}

/// Decides the pod webhook's rewrite of `pod` ([`PodRewrite`]), or the error that refuses it.
///
/// A pod with `spec.nodeName` set bypasses scheduling, so it cannot wait for an allocation: it
/// is left as it is (a device plugin still running on that node may serve it). So is a pod
/// labelled [`names::LABEL_KEEP_DEVICE_PLUGIN_NAMES`]` = "true"`, silently.
pub fn rewrite_pod(pod: &core::Pod, options: &Options, object: &str) -> Result<PodRewrite> {
    let keep = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(names::LABEL_KEEP_DEVICE_PLUGIN_NAMES))
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
    if keep {
        return Ok(PodRewrite::Untouched);
    }
    let Some(request) = DevicePluginRequest::from_pod(pod, object)? else {
        return Ok(PodRewrite::Untouched);
    };
    if pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .is_some_and(|n| !n.is_empty())
    {
        return Ok(PodRewrite::Skipped(format!(
            "spec.nodeName is set, so the pod bypasses scheduling: Tessera leaves its device-plugin \
             names ({}) to a device plugin on that node",
            request
                .containers
                .iter()
                .flat_map(|c| c.resources.keys())
                .cloned()
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    let mapping = map_request(&request, options, object)?;
    let patch = pod_patch(pod, &request, &mapping, object)?;
    Ok(PodRewrite::Rewritten {
        request,
        mapping,
        patch,
    })
}

/// What `tessera allocate` does with a pod that uses device-plugin names: the pod rewritten as
/// the webhook would, with its claims made from the templates as kube-controller-manager
/// would (named `<pod>-<entry>`, referred to by name).
pub fn rewrite_offline(
    pod: &core::Pod,
    request: &DevicePluginRequest,
    mapping: &Mapping,
    object: &str,
) -> Result<(core::Pod, Vec<res::ResourceClaim>)> {
    let patch = pod_patch(pod, request, mapping, object)?;
    let mut rewritten = apply_pod_patch(pod, &patch, object)?;
    let pod_name = pod.metadata.name.clone().unwrap_or_default();
    let namespace = pod
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".to_owned());
    let mut claims = Vec::new();
    for entry in rewritten
        .spec
        .iter_mut()
        .flat_map(|s| s.resource_claims.iter_mut().flatten())
    {
        let Some(claim) = mapping.claims.iter().find(|c| c.entry == entry.name) else {
            continue;
        };
        let name = format!("{pod_name}-{}", claim.entry);
        entry.resource_claim_template_name = None;
        entry.resource_claim_name = Some(name.clone());
        claims.push(res::ResourceClaim {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                name: Some(name),
                namespace: Some(namespace.clone()),
                annotations: Some(BTreeMap::from([(
                    names::ANNOTATION_DEVICE_PLUGIN_FORMS.to_owned(),
                    claim.forms.join(","),
                )])),
                ..Default::default()
            },
            spec: claim.spec.clone(),
            status: None,
        });
    }
    Ok((rewritten, claims))
}
