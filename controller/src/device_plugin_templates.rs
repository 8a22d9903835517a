//! The ResourceClaimTemplates that pods rewritten from device-plugin names refer to.
//!
//! The pod webhook has no side effects: it points the pod at a template named after the
//! claim's shape (`tessera-<hash>`) that may not exist yet, and records the pod's original
//! request in an annotation. Here the leader makes the missing templates and deletes the ones
//! it made (label `gpu.tessera.dev/device-plugin-template`) that no pod refers to any more;
//! which those are is decided by `tessera_driver::admission::device_plugin_templates::plan`,
//! and this keeper only lists, creates and deletes. Until a template exists,
//! kube-controller-manager fails to make the pod's claim and retries (with backoff); the pod is
//! gated meanwhile, so nothing else acts on it.
//!
//! What exists is listed (by label) at start and again every `relist` interval, and kept up to
//! date with this module's own writes.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams};
use kube::core::ApiResource;
use tessera_driver::admission::device_plugin_names::{self, Options};
use tessera_driver::admission::device_plugin_templates::{self, TemplateKey};
use tessera_driver::apiversion::ApiVersion;
use tessera_driver::names;
use tracing::{info, warn};

use crate::error::{Error, Result};

/// What one [`TemplateKeeper::sync`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SyncReport {
    /// Templates created.
    pub created: usize,
    /// Templates deleted.
    pub deleted: usize,
}

/// Keeps the device-plugin templates in step with the pods; see the module docs.
pub struct TemplateKeeper {
    client: kube::Client,
    api: ApiResource,
    version: ApiVersion,
    options: Options,
    relist: Duration,
    known: BTreeSet<TemplateKey>,
    listed_at: Option<Instant>,
    reported: BTreeSet<String>,
}

impl std::fmt::Debug for TemplateKeeper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TemplateKeeper")
            .field("version", &self.version)
            .field("options", &self.options)
            .field("known", &self.known.len())
            .finish_non_exhaustive()
    }
}

impl TemplateKeeper {
    /// A keeper writing templates in the served `version`, listing what exists every `relist`.
    pub fn new(
        client: kube::Client,
        version: ApiVersion,
        options: Options,
        relist: Duration,
    ) -> Self {
        Self {
            client,
            api: tessera_kubeapi::resource(version, tessera_driver::names::RESOURCE_CLAIM_TEMPLATE),
            version,
            options,
            relist,
            known: BTreeSet::new(),
            listed_at: None,
            reported: BTreeSet::new(),
        }
    }

    async fn list(&mut self) -> Result<()> {
        let api: Api<DynamicObject> = Api::all_with(self.client.clone(), &self.api);
        let params =
            ListParams::default().labels(&format!("{}=true", names::LABEL_DEVICE_PLUGIN_TEMPLATE));
        let list = api
            .list(&params)
            .await
            .map_err(|e| Error::api("listing device-plugin ResourceClaimTemplates", &e))?;
        self.known = list
            .items
            .iter()
            .map(|t| {
                (
                    t.metadata.namespace.clone().unwrap_or_default(),
                    t.metadata.name.clone().unwrap_or_default(),
                )
            })
            .collect();
        self.listed_at = Some(Instant::now());
        Ok(())
    }

    /// Creates the templates the pods need and deletes those none refers to. `pods` is the
    /// complete, synced set of pods (every pod's references keep a template alive).
    pub async fn sync<P: std::borrow::Borrow<Pod>>(
        &mut self,
        pods: &BTreeMap<String, P>,
    ) -> Result<SyncReport> {
        if self.listed_at.is_none_or(|at| at.elapsed() >= self.relist) {
            self.list().await?;
        }
        let mut report = SyncReport::default();
        let plan = device_plugin_templates::plan(
            pods.values().map(std::borrow::Borrow::borrow),
            &self.known,
            &self.options,
        );
        for (pod, e) in plan.unmappable {
            // Reported once per pod: only an annotation edited by hand, or options changed
            // since admission, get here.
            if !self.reported.contains(&pod) {
                warn!(pod, error = %e, "cannot make the claim templates of a pod rewritten from device-plugin names");
                self.reported.insert(pod);
            }
        }
        for ((namespace, name), template) in plan.create {
            let value = device_plugin_names::template_document(&template, self.version)?;
            let object: DynamicObject = serde_json::from_value(value).map_err(|e| {
                Error::Malformed(format!("ResourceClaimTemplate {namespace}/{name}: {e}"))
            })?;
            let api: Api<DynamicObject> =
                Api::namespaced_with(self.client.clone(), &namespace, &self.api);
            match api.create(&PostParams::default(), &object).await {
                Ok(_) => {
                    info!(
                        namespace,
                        template = name,
                        "created a claim template for pods asking with device-plugin names"
                    );
                    report.created += 1;
                }
                Err(kube::Error::Api(s)) if s.code == 409 => {}
                Err(e) => {
                    return Err(Error::api(
                        format!("creating ResourceClaimTemplate {namespace}/{name}"),
                        &e,
                    ));
                }
            }
            self.known.insert((namespace, name));
        }
        for (namespace, name) in plan.delete {
            let api: Api<DynamicObject> =
                Api::namespaced_with(self.client.clone(), &namespace, &self.api);
            match api.delete(&name, &DeleteParams::default()).await {
                Ok(_) => {
                    info!(
                        namespace,
                        template = name,
                        "deleted a claim template no pod uses"
                    );
                    report.deleted += 1;
                }
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => {
                    return Err(Error::api(
                        format!("deleting ResourceClaimTemplate {namespace}/{name}"),
                        &e,
                    ));
                }
            }
            self.known.remove(&(namespace, name));
        }
        self.reported.retain(|k| pods.contains_key(k));
        Ok(report)
    }
}
