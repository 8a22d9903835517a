//! Pods that ask with device-plugin resource names, in the offline tools: rewritten as the pod
//! webhook would, with their claims made from the templates as kube-controller-manager would
//! (`<pod>-<entry>`), through the same pure mapping (`device_plugin_names`).

use tessera_driver::admission::device_plugin_names::{self, Options, PodRewrite};

use crate::cli::input::Objects;
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
/// pod the webhook would refuse is malformed input (exit 2), with the webhook's message.
pub fn rewrite(objects: &mut Objects, options: &Options) -> Result<Vec<String>> {
    let mut warnings = Vec::new();
    let mut claims = Vec::new();
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
            }) => {
                let (rewritten, made) =
                    device_plugin_names::rewrite_offline(pod, &request, &mapping, &object)
                        .map_err(|e| Error::Malformed(e.to_string()))?;
                warnings.extend(mapping.warnings.iter().map(|w| format!("{object}: {w}")));
                *pod = rewritten;
                claims.extend(made);
            }
            Err(e) => return Err(Error::Malformed(e.to_string())),
        }
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
