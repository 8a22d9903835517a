//! Which device-plugin ResourceClaimTemplates should exist: the decision half of the
//! controller's template keeper (`controller/src/device_plugin_templates.rs` makes the API
//! calls).
//!
//! The pod webhook points a rewritten pod at a template named after its claim's shape and
//! records the pod's original request in an annotation ([`super::device_plugin_names`]).
//! [`plan`] compares the pods with the templates known to exist (those labelled
//! `gpu.tessera.dev/device-plugin-template`):
//! * a **rewritten** pod referring to a template that is not known gets it made, from its
//!   recorded request mapped again by the same function the webhook used;
//! * a known template that **no pod refers to** is deleted; any pod, rewritten or not, keeps a
//!   known template alive by referring to it;
//! * a rewritten pod whose recorded request no longer maps (an annotation edited by hand, or
//!   options changed since admission) is reported, and nothing is made for it.
//!
//! Only templates known to exist are ever deleted, so a pod that was not rewritten is looked at
//! only while some are known: at thousands of pods, this walk runs on every controller pass.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::resource::v1 as res;

use super::device_plugin_names::{self, Options};
use crate::error::Error;
use crate::names;

/// A template's namespace and name.
pub type TemplateKey = (String, String);

/// What the controller should do to the device-plugin templates.
#[derive(Debug, Default)]
pub struct TemplatePlan {
    /// Templates to create, by key.
    pub create: BTreeMap<TemplateKey, res::ResourceClaimTemplate>,
    /// Known templates no pod refers to.
    pub delete: Vec<TemplateKey>,
    /// Rewritten pods (`namespace/name`) whose recorded request cannot be mapped, and why.
    pub unmappable: Vec<(String, Error)>,
}

/// A pod's `namespace/name`, as the plan reports it.
pub fn pod_key(pod: &core::Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or("default"),
        pod.metadata.name.as_deref().unwrap_or_default()
    )
}

/// The plan for `pods` (the complete, synced set) given the templates `known` to exist.
pub fn plan<'a>(
    pods: impl IntoIterator<Item = &'a core::Pod>,
    known: &BTreeSet<TemplateKey>,
    options: &Options,
) -> TemplatePlan {
    let mut out = TemplatePlan::default();
    let mut referenced: BTreeSet<TemplateKey> = BTreeSet::new();
    for pod in pods {
        let rewritten = pod
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(names::ANNOTATION_DEVICE_PLUGIN_REQUEST));
        if !rewritten && known.is_empty() {
            continue;
        }
        let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
        let mut missing = false;
        for name in device_plugin_names::referenced_templates(pod) {
            let key = (namespace.to_owned(), name.to_owned());
            let is_known = known.contains(&key);
            missing |= !is_known;
            // Only known templates can be deleted, so only those (and the ones made now)
            // need to be collected.
            if is_known || rewritten {
                referenced.insert(key);
            }
        }
        if !missing || !rewritten {
            continue;
        }
        match device_plugin_names::templates_for_pod(pod, options) {
            Ok(templates) => {
                for t in templates {
                    let key = (
                        namespace.to_owned(),
                        t.metadata.name.clone().unwrap_or_default(),
                    );
                    if !known.contains(&key) {
                        out.create.insert(key, t);
                    }
                }
            }
            Err(e) => out.unmappable.push((pod_key(pod), e)),
        }
    }
    out.delete = known.difference(&referenced).cloned().collect();
    out
}

#[cfg(test)]
mod tests;
