//! Talking to the Kubernetes API server: the client, which resource.k8s.io version it serves,
//! and `ApiClaimSource`, which fetches the claims kubelet names.
//!
//! Objects of resource.k8s.io are read and written as JSON in the served version and converted
//! to and from the v1 model with `tessera_driver::apiversion`, so one code path covers
//! Kubernetes 1.32 (v1beta1), 1.33 (v1beta2) and 1.34+ (v1).

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, DynamicObject};
use kube::core::{ApiResource, GroupVersionKind};
use tessera_driver::apiversion::{self, ApiVersion, Object};

use crate::claims::{ClaimRef, ClaimSource};
use crate::error::{Error, Result};

const RESOURCE_GROUP: &str = "resource.k8s.io";

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

/// Fetches claims from the API server in the served resource.k8s.io version.
#[derive(Clone)]
pub struct ApiClaimSource {
    client: kube::Client,
    version: Arc<Mutex<Option<ApiVersion>>>,
    timeout: Duration,
}

impl std::fmt::Debug for ApiClaimSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiClaimSource")
            .field("version", &self.cached_version())
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl ApiClaimSource {
    /// A source using `client`. The served version is discovered on first use.
    pub fn new(client: kube::Client) -> Self {
        Self {
            client,
            version: Arc::new(Mutex::new(None)),
            timeout: Duration::from_secs(30),
        }
    }

    /// How long one fetch may take before the claim fails (kubelet retries).
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    fn cached_version(&self) -> Option<ApiVersion> {
        *self
            .version
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn set_version(&self, version: Option<ApiVersion>) {
        *self
            .version
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = version;
    }

    /// Fetches and converts one claim, without [`ClaimSource::claim`]'s time limit.
    pub async fn fetch(&self, claim: &ClaimRef) -> Result<ResourceClaim> {
        let version = if let Some(v) = self.cached_version() {
            v
        } else {
            let v = served_resource_version(&self.client).await?;
            self.set_version(Some(v));
            v
        };
        let api: Api<DynamicObject> = Api::namespaced_with(
            self.client.clone(),
            &claim.namespace,
            &resource(version, "ResourceClaim", "resourceclaims"),
        );
        let object = match api.get(&claim.name).await {
            Ok(o) => o,
            Err(kube::Error::Api(status)) if status.code == 404 => {
                // The claim, or the whole version (the cluster was upgraded): look again next time.
                self.set_version(None);
                return Err(Error::ClaimNotFound {
                    namespace: claim.namespace.clone(),
                    name: claim.name.clone(),
                });
            }
            Err(e) => return Err(Error::api(format!("getting claim {claim}"), &e)),
        };
        let context = format!("ResourceClaim {}/{}", claim.namespace, claim.name);
        let mut value = serde_json::to_value(&object).map_err(|e| Error::Api {
            action: format!("getting claim {claim}"),
            code: None,
            message: format!("cannot re-encode the answer: {e}"),
        })?;
        if let Some(map) = value.as_object_mut() {
            // An answer without type information is the kind and version asked for.
            map.entry("apiVersion")
                .or_insert_with(|| version.as_str().into());
            map.entry("kind").or_insert_with(|| "ResourceClaim".into());
        }
        let Object::ResourceClaim(found) = apiversion::decode_document(value, &context)? else {
            return Err(Error::Api {
                action: format!("getting claim {claim}"),
                code: None,
                message: "the answer is not a ResourceClaim".to_owned(),
            });
        };
        let actual = found.metadata.uid.clone().unwrap_or_default();
        if actual != claim.uid {
            return Err(Error::ClaimUidMismatch {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
                expected: claim.uid.clone(),
                actual,
            });
        }
        Ok(found)
    }
}

#[tonic::async_trait]
impl ClaimSource for ApiClaimSource {
    async fn claim(&self, claim: &ClaimRef) -> Result<ResourceClaim> {
        tokio::time::timeout(self.timeout, self.fetch(claim))
            .await
            .unwrap_or_else(|_| {
                Err(Error::Api {
                    action: format!("getting claim {claim}"),
                    code: None,
                    message: format!("no answer within {:?}", self.timeout),
                })
            })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// The TLS stack (rustls with ring) builds a client for an HTTPS server; nothing panics
    /// choosing a crypto provider.
    #[tokio::test]
    async fn https_kubeconfig_builds_a_client() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubeconfig");
        std::fs::write(
            &path,
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    \
             server: https://127.0.0.1:1\n    insecure-skip-tls-verify: true\n\
             contexts:\n- name: c\n  context:\n    cluster: c\n    user: u\n\
             current-context: c\nusers:\n- name: u\n  user:\n    token: t\n",
        )
        .unwrap();
        let client = client(Some(&path)).await.unwrap();
        // Nothing listens there: an error, not a panic.
        assert!(served_resource_version(&client).await.is_err());
    }

    #[tokio::test]
    async fn a_missing_kubeconfig_is_a_config_error() {
        let Err(err) = client(Some(Path::new("/nonexistent/kubeconfig"))).await else {
            panic!("a missing kubeconfig built a client");
        };
        assert!(matches!(err, Error::Config(_)), "{err}");
    }

    #[test]
    fn resources_name_the_group_version() {
        let r = resource(ApiVersion::V1beta1, "ResourceSlice", "resourceslices");
        assert_eq!(r.api_version, "resource.k8s.io/v1beta1");
        assert_eq!(r.version, "v1beta1");
        assert_eq!(r.plural, "resourceslices");
    }
}
