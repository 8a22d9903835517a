//! What the webhook reads from the cluster: DeviceClasses, ResourceClaims,
//! ResourceClaimTemplates and Pods, behind a small trait with a kube implementation and a fake.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Mutex, PoisonError};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1 as res;
use kube::api::{Api, DynamicObject, GetParams};
use tessera_driver::apiversion::{self, ApiVersion, Object};
use tessera_driver::names::{self, ResourceKind};

use crate::error::{Error, Result};

/// The future a lookup returns: the object, `None` when it does not exist, or an error.
pub type LookupFuture<'a, T> = Pin<Box<dyn Future<Output = Result<Option<T>>> + Send + 'a>>;

/// Reads the objects an admission decision needs, in their v1 shape.
pub trait AdmissionLookup: Send + Sync {
    /// The DeviceClass `name`.
    fn device_class<'a>(&'a self, name: &'a str) -> LookupFuture<'a, res::DeviceClass>;
    /// The ResourceClaim `namespace/name`.
    fn resource_claim<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> LookupFuture<'a, res::ResourceClaim>;
    /// The ResourceClaimTemplate `namespace/name`.
    fn resource_claim_template<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> LookupFuture<'a, res::ResourceClaimTemplate>;
    /// The Pod `namespace/name` (the owner of a claim made from a template).
    fn pod<'a>(&'a self, namespace: &'a str, name: &'a str) -> LookupFuture<'a, Pod>;
}

/// The lookup against the API server, in the resource.k8s.io version it serves.
///
/// The version is discovered at construction; an answer "not found" makes the next lookup
/// discover it again, so a cluster upgraded under a running controller (a version no longer
/// served) costs one lookup, not every lookup after it.
pub struct ApiAdmissionLookup {
    client: kube::Client,
    version: Mutex<Option<ApiVersion>>,
}

impl std::fmt::Debug for ApiAdmissionLookup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiAdmissionLookup")
            .field("version", &self.cached_version())
            .finish_non_exhaustive()
    }
}

impl ApiAdmissionLookup {
    /// A lookup through `client`, after asking which resource.k8s.io version it serves.
    pub async fn new(client: kube::Client) -> Result<Self> {
        let version = tessera_kubeapi::served_resource_version(&client).await?;
        Ok(Self::with_version(client, version))
    }

    /// A lookup through `client` in a known served version.
    pub fn with_version(client: kube::Client, version: ApiVersion) -> Self {
        Self {
            client,
            version: Mutex::new(Some(version)),
        }
    }

    fn cached_version(&self) -> Option<ApiVersion> {
        *self.version.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn set_version(&self, version: Option<ApiVersion>) {
        *self.version.lock().unwrap_or_else(PoisonError::into_inner) = version;
    }

    async fn version(&self) -> Result<ApiVersion> {
        if let Some(v) = self.cached_version() {
            return Ok(v);
        }
        let v = tessera_kubeapi::served_resource_version(&self.client).await?;
        self.set_version(Some(v));
        Ok(v)
    }

    async fn get(
        &self,
        kind: ResourceKind,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<Object>> {
        let version = self.version().await?;
        let resource = tessera_kubeapi::resource(version, kind);
        let api: Api<DynamicObject> = match namespace {
            Some(ns) => Api::namespaced_with(self.client.clone(), ns, &resource),
            None => Api::all_with(self.client.clone(), &resource),
        };
        let described = match namespace {
            Some(ns) => format!("{} {ns}/{name}", kind.kind),
            None => format!("{} {name}", kind.kind),
        };
        let action = format!("getting {described}");
        let Some(found) = api
            .get_opt(name)
            .await
            .map_err(|e| Error::api(action.clone(), &e))?
        else {
            // The object, or the whole version (the cluster was upgraded): look again next time.
            self.set_version(None);
            return Ok(None);
        };
        let value = tessera_kubeapi::typed_json(&found, version, kind, &action)?;
        Ok(Some(apiversion::decode_document(value, &described)?))
    }
}

fn wrong_kind(kind: &str) -> Error {
    Error::Api {
        action: format!("getting a {kind}"),
        code: None,
        message: format!("the answer is not a {kind}"),
    }
}

impl AdmissionLookup for ApiAdmissionLookup {
    fn device_class<'a>(&'a self, name: &'a str) -> LookupFuture<'a, res::DeviceClass> {
        Box::pin(async move {
            match self.get(names::DEVICE_CLASS, None, name).await? {
                None => Ok(None),
                Some(Object::DeviceClass(c)) => Ok(Some(c)),
                Some(_) => Err(wrong_kind(names::DEVICE_CLASS.kind)),
            }
        })
    }

    fn resource_claim<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> LookupFuture<'a, res::ResourceClaim> {
        Box::pin(async move {
            match self
                .get(names::RESOURCE_CLAIM, Some(namespace), name)
                .await?
            {
                None => Ok(None),
                Some(Object::ResourceClaim(c)) => Ok(Some(c)),
                Some(_) => Err(wrong_kind(names::RESOURCE_CLAIM.kind)),
            }
        })
    }

    fn resource_claim_template<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> LookupFuture<'a, res::ResourceClaimTemplate> {
        Box::pin(async move {
            match self
                .get(names::RESOURCE_CLAIM_TEMPLATE, Some(namespace), name)
                .await?
            {
                None => Ok(None),
                Some(Object::ResourceClaimTemplate(t)) => Ok(Some(t)),
                Some(_) => Err(wrong_kind(names::RESOURCE_CLAIM_TEMPLATE.kind)),
            }
        })
    }

    fn pod<'a>(&'a self, namespace: &'a str, name: &'a str) -> LookupFuture<'a, Pod> {
        Box::pin(async move {
            // From the API server's watch cache (`resourceVersion=0`): no etcd read. A pod
            // too new for the cache is "not found", and the controller writes the mark.
            match Api::<Pod>::namespaced(self.client.clone(), namespace)
                .get_with(name, &GetParams::any())
                .await
            {
                Ok(p) => Ok(Some(p)),
                Err(kube::Error::Api(s)) if s.code == 404 => Ok(None),
                Err(e) => Err(Error::api(format!("getting Pod {namespace}/{name}"), &e)),
            }
        })
    }
}

/// How a [`FakeAdmissionLookup`] answers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum FakeBehaviour {
    /// From its objects.
    #[default]
    Answer,
    /// Every lookup fails with this message (an API server that answers 500).
    Fail(String),
    /// Every lookup waits forever (an API server that does not answer).
    Hang,
}

/// A deterministic in-memory lookup for tests.
#[derive(Debug, Clone, Default)]
pub struct FakeAdmissionLookup {
    classes: BTreeMap<String, res::DeviceClass>,
    claims: BTreeMap<(String, String), res::ResourceClaim>,
    templates: BTreeMap<(String, String), res::ResourceClaimTemplate>,
    pods: BTreeMap<(String, String), Pod>,
    behaviour: FakeBehaviour,
}

fn ns_name(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> (String, String) {
    (
        meta.namespace
            .clone()
            .unwrap_or_else(|| "default".to_owned()),
        meta.name.clone().unwrap_or_default(),
    )
}

impl FakeAdmissionLookup {
    /// An empty cluster.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a DeviceClass.
    #[must_use]
    pub fn with_class(mut self, class: res::DeviceClass) -> Self {
        let name = class.metadata.name.clone().unwrap_or_default();
        self.classes.insert(name, class);
        self
    }

    /// Adds a ResourceClaim (namespace `default` when unset).
    #[must_use]
    pub fn with_claim(mut self, claim: res::ResourceClaim) -> Self {
        self.claims.insert(ns_name(&claim.metadata), claim);
        self
    }

    /// Adds a ResourceClaimTemplate (namespace `default` when unset).
    #[must_use]
    pub fn with_template(mut self, template: res::ResourceClaimTemplate) -> Self {
        self.templates.insert(ns_name(&template.metadata), template);
        self
    }

    /// Adds a Pod (namespace `default` when unset).
    #[must_use]
    pub fn with_pod(mut self, pod: Pod) -> Self {
        self.pods.insert(ns_name(&pod.metadata), pod);
        self
    }

    /// Sets how every lookup answers.
    #[must_use]
    pub fn behaving(mut self, behaviour: FakeBehaviour) -> Self {
        self.behaviour = behaviour;
        self
    }

    fn answer<'a, T: Clone + Send + 'a>(&'a self, found: Option<&'a T>) -> LookupFuture<'a, T> {
        match &self.behaviour {
            FakeBehaviour::Answer => Box::pin(std::future::ready(Ok(found.cloned()))),
            FakeBehaviour::Fail(message) => Box::pin(std::future::ready(Err(Error::Api {
                action: "fake lookup".to_owned(),
                code: Some(500),
                message: message.clone(),
            }))),
            FakeBehaviour::Hang => Box::pin(std::future::pending()),
        }
    }
}

impl AdmissionLookup for FakeAdmissionLookup {
    fn device_class<'a>(&'a self, name: &'a str) -> LookupFuture<'a, res::DeviceClass> {
        self.answer(self.classes.get(name))
    }

    fn resource_claim<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> LookupFuture<'a, res::ResourceClaim> {
        self.answer(self.claims.get(&(namespace.to_owned(), name.to_owned())))
    }

    fn resource_claim_template<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> LookupFuture<'a, res::ResourceClaimTemplate> {
        self.answer(self.templates.get(&(namespace.to_owned(), name.to_owned())))
    }

    fn pod<'a>(&'a self, namespace: &'a str, name: &'a str) -> LookupFuture<'a, Pod> {
        self.answer(self.pods.get(&(namespace.to_owned(), name.to_owned())))
    }
}
