//! Pods that ask with device-plugin resource names, in the offline tools: rewritten as the pod
//! webhook would, with their claims made from the templates as kube-controller-manager would
//! (`<pod>-<entry>`), through the same pure mapping (`device_plugin_names`).

use tessera_driver::admission::device_plugin_names::{self, Options, PodRewrite};

use crate::cli::input::{Objects, Refusal};
use crate::error::{Error, Result};

fn object_name(pod: &k8s_openapi::api::core::v1::Pod) -> String {
    format!(
        "Pod {}/{}",
        pod.metadata.namespace.as_deref().unwrap_or("default"),
        pod.metadata
            .name
            .as_deref()
            .or(pod.metadata.generate_name.as_deref())
            .unwrap_or("<unnamed>")
    )
}

/// Rewrites every pod of `objects` that asks with device-plugin names and adds the claims it
/// gets after the input's own claims. Returns the warnings (roundings, pods left alone); a
/// pod the webhook would refuse is left out with the webhook's message when the input skips
/// what it refuses ([`Objects::load_skipping_refused`]), and is malformed input (exit 2)
/// otherwise.
pub fn rewrite(objects: &mut Objects, options: &Options) -> Result<Vec<String>> {
    let mut warnings = Vec::new();
    let mut claims = Vec::new();
    let mut refused = Vec::new();
    for (i, pod) in objects.pods.iter_mut().enumerate() {
        if pod.metadata.name.is_none() {
            // A generateName pod gets its name at creation; offline, its input position.
            let prefix = pod.metadata.generate_name.clone().unwrap_or_default();
            pod.metadata.name = Some(format!("{prefix}{i}"));
        }
        let object = object_name(pod);
        match device_plugin_names::rewrite_pod(pod, options, &object) {
            Ok(PodRewrite::Untouched) => {}
            Ok(PodRewrite::Skipped(warning)) => warnings.push(format!("{object}: {warning}")),
            Ok(PodRewrite::Rewritten {
                request, mapping, ..
            }) => match device_plugin_names::rewrite_offline(pod, &request, &mapping, &object) {
                Ok((rewritten, made)) => {
                    warnings.extend(mapping.warnings.iter().map(|w| format!("{object}: {w}")));
                    *pod = rewritten;
                    claims.extend(made);
                }
                Err(e) => refused.push((i, e.to_string())),
            },
            Err(e) => refused.push((i, e.to_string())),
        }
    }
    let refusals: Vec<Refusal> = refused
        .iter()
        .map(|(i, message)| {
            let pod = &objects.pods[*i];
            Refusal {
                message: message.clone(),
                object: Some((
                    "Pod".to_owned(),
                    pod.metadata
                        .namespace
                        .clone()
                        .unwrap_or_else(|| "default".to_owned()),
                    pod.metadata.name.clone().unwrap_or_default(),
                )),
                pod_claims: pod
                    .spec
                    .iter()
                    .flat_map(|s| s.resource_claims.iter().flatten())
                    .filter_map(|c| c.resource_claim_name.clone())
                    .collect(),
            }
        })
        .collect();
    for refusal in refusals {
        let error = Error::Malformed(refusal.message.clone());
        objects.refuse(refusal, error)?;
    }
    for (i, _) in refused.iter().rev() {
        objects.pods.remove(*i);
    }
    objects.claims.extend(claims);
    Ok(warnings)
}

/// What `tessera validate` says about the pods' device-plugin names: every pod the webhook
/// would refuse, with its reason, and the number of pods that ask with such names.
pub fn problems(objects: &Objects, driver: &str) -> (usize, Vec<tessera_driver::Error>) {
    let options = Options {
        driver: driver.to_owned(),
        ..Options::default()
    };
    let mut asking = 0;
    let mut problems = Vec::new();
    for pod in &objects.pods {
        match device_plugin_names::rewrite_pod(pod, &options, &object_name(pod)) {
            Ok(PodRewrite::Untouched) => {}
            Ok(_) => asking += 1,
            Err(e) => {
                asking += 1;
                problems.push(e);
            }
        }
    }
    (asking, problems)
}
