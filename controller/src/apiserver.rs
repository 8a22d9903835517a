//! Talking to the Kubernetes API server: the client, and which resource.k8s.io version it
//! serves.
//!
//! Objects of resource.k8s.io are read and written as JSON in the served version and converted
//! to and from the v1 model with `tessera_driver::apiversion`, so one code path covers
//! Kubernetes 1.32 (v1beta1), 1.33 (v1beta2) and 1.34+ (v1). The kubelet plugin has its own
//! copy of these few functions: the controller must not depend on the plugin crate.

use std::path::Path;

use kube::core::{ApiResource, GroupVersionKind};
use tessera_driver::apiversion::ApiVersion;

use crate::error::{Error, Result};

/// The API group of Dynamic Resource Allocation.
pub const RESOURCE_GROUP: &str = "resource.k8s.io";

/// A client from `kubeconfig`, or from the pod's service account when `None`.
pub async fn client(kubeconfig: Option<&Path>) -> Result<kube::Client> {
    let config_error =
        |what: &str, e: &dyn std::fmt::Display| Error::Config(format!("{what}: {e}"));
    let config = match kubeconfig {
        Some(path) => {
            let file = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| config_error(&format!("reading kubeconfig {}", path.display()), &e))?;
            kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| config_error(&format!("kubeconfig {}", path.display()), &e))?
        }
        None => kube::Config::incluster().map_err(|e| {
            config_error(
                "in-cluster configuration (use --kubeconfig outside a pod)",
                &e,
            )
        })?,
    };
    let mut config = config;
    // No retrying inside the client: a 429 from the eviction subresource is a
    // PodDisruptionBudget's "not now", which the client would retry for minutes (kube retries
    // 429s up to 15 times with exponential backoff) while the pass waits. Every write here
    // already treats a failure as "retry soon" (see reconcile), throttling included.
    config.default_retry = false;
    kube::Client::try_from(config).map_err(|e| Error::api("building the API client", &e))
}

/// The newest resource.k8s.io version the API server serves among those Tessera speaks
/// (v1, else v1beta2, else v1beta1).
pub async fn served_resource_version(client: &kube::Client) -> Result<ApiVersion> {
    let groups = client
        .list_api_groups()
        .await
        .map_err(|e| Error::api("discovering API groups", &e))?;
    let served: Vec<String> = groups
        .groups
        .iter()
        .filter(|g| g.name == RESOURCE_GROUP)
        .flat_map(|g| g.versions.iter().map(|v| v.group_version.clone()))
        .collect();
    ApiVersion::ALL
        .into_iter()
        .find(|v| served.iter().any(|s| s == v.as_str()))
        .ok_or_else(|| Error::Api {
            action: "discovering resource.k8s.io".to_owned(),
            code: None,
            message: format!(
                "the API server serves none of {} (it serves {served:?}); DRA needs Kubernetes 1.32 or later",
                ApiVersion::ALL.map(ApiVersion::as_str).join(", ")
            ),
        })
}

/// The dynamic API resource of a resource.k8s.io kind in `version`.
pub fn resource(version: ApiVersion, kind: &str, plural: &str) -> ApiResource {
    let group_version = version.as_str();
    let short = group_version
        .strip_prefix("resource.k8s.io/")
        .unwrap_or(group_version);
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(RESOURCE_GROUP, short, kind), plural)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[tokio::test]
    async fn a_missing_kubeconfig_is_a_config_error() {
        let Err(err) = client(Some(Path::new("/nonexistent/kubeconfig"))).await else {
            panic!("a missing kubeconfig built a client");
        };
        assert!(matches!(err, Error::Config(_)), "{err}");
    }

    #[test]
    fn resources_name_the_group_version() {
        let r = resource(ApiVersion::V1beta2, "ResourceClaim", "resourceclaims");
        assert_eq!(r.api_version, "resource.k8s.io/v1beta2");
        assert_eq!(r.version, "v1beta2");
        assert_eq!(r.plural, "resourceclaims");
    }
}
