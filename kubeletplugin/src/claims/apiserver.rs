//! `ApiClaimSource`, which fetches the claims kubelet names from the API server in the
//! resource.k8s.io version it serves and converts them to the v1 model. The client and version
//! discovery are `tessera_kubeapi`'s, shared with the controller.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, DynamicObject};
use tessera_driver::apiversion::{self, ApiVersion, Object};
use tessera_driver::names;

use crate::claims::{ClaimRef, ClaimSource, PodSource};
use crate::error::{Error, Result};

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

    /// The resource.k8s.io version the API server serves (discovered once, again after a 404).
    pub async fn version(&self) -> Result<ApiVersion> {
        if let Some(v) = self.cached_version() {
            return Ok(v);
        }
        let v = tessera_kubeapi::served_resource_version(&self.client).await?;
        self.set_version(Some(v));
        Ok(v)
    }

    /// The client the source fetches with.
    pub fn client(&self) -> &kube::Client {
        &self.client
    }

    /// Fetches and converts one claim, without [`ClaimSource::claim`]'s time limit.
    pub async fn fetch(&self, claim: &ClaimRef) -> Result<ResourceClaim> {
        let version = self.version().await?;
        let api: Api<DynamicObject> = Api::namespaced_with(
            self.client.clone(),
            &claim.namespace,
            &tessera_kubeapi::resource(version, tessera_driver::names::RESOURCE_CLAIM),
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
        let value = tessera_kubeapi::typed_json(
            &object,
            version,
            names::RESOURCE_CLAIM,
            &format!("getting claim {claim}"),
        )?;
        let Object::ResourceClaim(found) = apiversion::decode_document(value, &context)? else {
            return Err(Error::Api {
                action: format!("getting claim {claim}"),
                code: None,
                message: "the answer is not a ResourceClaim".to_owned(),
            });
        };
        claim.check_uid(&found)?;
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

#[tonic::async_trait]
impl PodSource for ApiClaimSource {
    async fn pod(&self, namespace: &str, name: &str) -> Result<Option<Pod>> {
        let action = || {
            format!(
                "getting pod {}/{}",
                namespace.escape_debug(),
                name.escape_debug()
            )
        };
        let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        match tokio::time::timeout(self.timeout, api.get_opt(name)).await {
            Ok(Ok(found)) => Ok(found),
            Ok(Err(e)) => Err(Error::api(action(), &e)),
            Err(_) => Err(Error::Api {
                action: action(),
                code: None,
                message: format!("no answer within {:?}", self.timeout),
            }),
        }
    }
}
