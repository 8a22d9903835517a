//! Publishing the node's pool as ResourceSlices in the version the API server serves.
//!
//! One publication: find the served resource.k8s.io version and the Node's UID, list the
//! slices of this node and driver (field selectors `spec.nodeName`, `spec.driver`), render
//! the inventory; when what is stored already says the same, stop; otherwise write every
//! slice with the pool generation one above any seen, then delete slices no longer needed.
//! Every failure (conflict, outage, missing Node) is retried with capped exponential backoff
//! from a fresh listing; nothing here ends the plugin.
//!
//! The publisher keeps a record of what it wrote (as the API server stored it), and while it
//! runs ([`SlicePublisher::spawn`]) a watch of the same slices (`slice_watch`) judges every
//! change against that record (`tessera_driver::node::slices::drift`): a slice deleted (kubelet's
//! wipe at its start, `kubectl delete`) or changed by someone else is published again.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams};
use serde_json::Value;
use tessera_driver::apiversion::{self, ApiVersion};
use tessera_driver::names;
use tessera_driver::node::inventory::NodeInventory;
use tessera_driver::node::slices::drift::{self, PendingWrite, SliceRecord, WrittenSlice};
use tessera_driver::node::slices::{self, RenderOptions};
use tokio::sync::{Mutex, Notify, watch};
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::error::{Error, Result};
mod slice_watch;

/// What to publish and how hard to retry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublisherConfig {
    /// The DRA driver name.
    pub driver_name: String,
    /// This node's name (also the pool's name).
    pub node_name: String,
    /// The first retry delay.
    pub initial_backoff: Duration,
    /// The longest retry delay.
    pub max_backoff: Duration,
    /// Devices per slice, at most the API's limit (a lower value only makes more slices).
    pub max_devices_per_slice: usize,
    /// How long to wait after the watch saw the slices drift before publishing again, so a
    /// burst of deletions (kubelet removes every slice of the node) is answered at once.
    pub drift_settle: Duration,
    /// The node's enforcement backend, published on shared GPUs (`enforcement` attribute).
    pub enforcement: Option<String>,
}

impl PublisherConfig {
    /// Defaults: retries from 500 ms doubling up to 30 s; as many devices per slice as the API
    /// allows; drift answered 500 ms after it is seen.
    pub fn new(driver_name: impl Into<String>, node_name: impl Into<String>) -> Self {
        Self {
            driver_name: driver_name.into(),
            node_name: node_name.into(),
            initial_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(30),
            max_devices_per_slice: tessera_driver::rules::limits::MAX_DEVICES_PER_SLICE,
            drift_settle: Duration::from_millis(500),
            enforcement: None,
        }
    }
}

/// The outcome of one successful publication.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// The resource.k8s.io version written.
    pub version: ApiVersion,
    /// The pool generation the slices carry.
    pub generation: i64,
    /// The names of the node's slices.
    pub slices: Vec<String>,
    /// Whether anything was written (false: the stored slices already matched).
    pub changed: bool,
}

#[derive(Debug, Default)]
struct State {
    version: Option<ApiVersion>,
    node_uid: Option<String>,
    generation: i64,
    /// What the last publication left stored (`None` before the first one completed).
    record: Option<SliceRecord>,
}

/// Publishes one node's pool.
pub struct SlicePublisher {
    client: kube::Client,
    config: PublisherConfig,
    state: Mutex<State>,
}

impl std::fmt::Debug for SlicePublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlicePublisher")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

fn str_at<'a>(value: &'a Value, pointer: &str) -> Option<&'a str> {
    value.pointer(pointer).and_then(Value::as_str)
}

fn to_dynamic(value: Value, name: &str) -> Result<DynamicObject> {
    serde_json::from_value(value).map_err(|e| Error::Api {
        action: format!("writing ResourceSlice {name}"),
        code: None,
        message: format!("cannot encode: {e}"),
    })
}

impl SlicePublisher {
    /// A publisher writing through `client`.
    pub fn new(client: kube::Client, config: PublisherConfig) -> Self {
        Self {
            client,
            config,
            state: Mutex::new(State::default()),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &PublisherConfig {
        &self.config
    }

    /// The slices to write for `node` in `version` with `generation`, as JSON by name.
    fn desired(
        &self,
        node: &NodeInventory,
        version: ApiVersion,
        generation: i64,
        owner: &OwnerReference,
    ) -> Result<BTreeMap<String, Value>> {
        let opts = RenderOptions {
            driver_name: self.config.driver_name.clone(),
            pool_generation: generation,
            // Shared devices with request policies need the v1 API (Kubernetes 1.34+).
            consumable_capacity: version == ApiVersion::V1,
            max_devices_per_slice: self.config.max_devices_per_slice,
            enforcement: self.config.enforcement.clone(),
        };
        let mut out = BTreeMap::new();
        for mut slice in slices::render(node, &opts)? {
            slice.metadata.labels = Some(BTreeMap::from([(
                names::LABEL_MANAGED_BY.to_owned(),
                names::KUBELET_PLUGIN_MANAGER.to_owned(),
            )]));
            slice.metadata.owner_references = Some(vec![owner.clone()]);
            let name = slice.metadata.name.clone().unwrap_or_default();
            let mut value = apiversion::encode_slice(&slice, version)?;
            if let Some(map) = value.as_object_mut() {
                map.insert("apiVersion".to_owned(), version.as_str().into());
                map.insert("kind".to_owned(), names::RESOURCE_SLICE.kind.into());
            }
            out.insert(name, value);
        }
        Ok(out)
    }

    async fn version(&self) -> Result<ApiVersion> {
        if let Some(v) = self.state.lock().await.version {
            return Ok(v);
        }
        let v = tessera_kubeapi::served_resource_version(&self.client).await?;
        info!(version = %v, "API server serves resource.k8s.io");
        self.state.lock().await.version = Some(v);
        Ok(v)
    }

    async fn owner(&self) -> Result<OwnerReference> {
        let cached = self.state.lock().await.node_uid.clone();
        let uid = if let Some(uid) = cached {
            uid
        } else {
            let node = Api::<Node>::all(self.client.clone())
                .get(&self.config.node_name)
                .await
                .map_err(|e| Error::api(format!("getting Node {}", self.config.node_name), &e))?;
            let uid = node.metadata.uid.ok_or_else(|| Error::Api {
                action: format!("getting Node {}", self.config.node_name),
                code: None,
                message: "the Node has no UID".to_owned(),
            })?;
            self.state.lock().await.node_uid = Some(uid.clone());
            uid
        };
        Ok(OwnerReference {
            api_version: names::CORE_API_V1.to_owned(),
            kind: names::NODE.kind.to_owned(),
            name: self.config.node_name.clone(),
            uid,
            controller: Some(true),
            block_owner_deletion: None,
        })
    }

    /// The API client.
    pub(crate) fn client(&self) -> &kube::Client {
        &self.client
    }

    /// The resource.k8s.io version the API server serves (asked once, then remembered).
    pub(crate) async fn served_version(&self) -> Result<ApiVersion> {
        self.version().await
    }

    /// The field selector of this node's slices of this driver.
    pub(crate) fn field_selector(&self) -> String {
        format!(
            "spec.nodeName={},spec.driver={}",
            self.config.node_name, self.config.driver_name
        )
    }

    /// What the publications so far left stored, and the one in flight (`None` before the
    /// first one completed).
    pub async fn record(&self) -> Option<SliceRecord> {
        self.state.lock().await.record.clone()
    }

    /// Forgets what discovery found, so the next attempt looks again (after a 404 the cluster
    /// may have been upgraded, or the Node re-created).
    pub(crate) async fn forget(&self) {
        let mut state = self.state.lock().await;
        state.version = None;
        state.node_uid = None;
    }

    /// The stored slices of this node and driver, as JSON by name. Every one is this
    /// plugin's, whatever its labels say (one that lost them is put right, not created again
    /// under the same name).
    async fn stored(&self, api: &Api<DynamicObject>) -> Result<BTreeMap<String, Value>> {
        let selector = ListParams::default().fields(&self.field_selector());
        let listed = api
            .list(&selector)
            .await
            .map_err(|e| Error::api("listing ResourceSlices", &e))?;
        let mut existing = BTreeMap::new();
        for item in listed.items {
            let value = serde_json::to_value(&item).map_err(|e| Error::Api {
                action: "listing ResourceSlices".to_owned(),
                code: None,
                message: format!("cannot re-encode: {e}"),
            })?;
            if let Some(name) = str_at(&value, "/metadata/name") {
                existing.insert(name.to_owned(), value);
            }
        }
        Ok(existing)
    }

    /// One attempt at publishing `node`'s pool.
    pub async fn publish_once(&self, node: &NodeInventory) -> Result<Published> {
        let version = self.version().await?;
        let owner = self.owner().await?;
        let api: Api<DynamicObject> = Api::all_with(
            self.client.clone(),
            &tessera_kubeapi::resource(version, tessera_driver::names::RESOURCE_SLICE),
        );
        let existing = self.stored(&api).await?;
        let seen = existing
            .values()
            .filter_map(|v| v.pointer("/spec/pool/generation").and_then(Value::as_i64))
            .max()
            .unwrap_or(0)
            .max(self.state.lock().await.generation);

        let same = self.desired(node, version, seen, &owner)?;
        let mut state = self.state.lock().await;
        let unchanged = seen > 0
            && same.len() == existing.len()
            && same.iter().all(|(name, want)| {
                existing
                    .get(name)
                    .is_some_and(|have| drift::publishes(state.record.as_ref(), want, have))
            });
        if unchanged {
            state.generation = seen;
            state.record = Some(SliceRecord {
                written: same
                    .iter()
                    .filter_map(|(name, want)| WrittenSlice::answering(want, existing.get(name)?))
                    .collect(),
                pending: None,
            });
            return Ok(Published {
                version,
                generation: seen,
                slices: same.into_keys().collect(),
                changed: false,
            });
        }

        let generation = seen + 1;
        let desired = self.desired(node, version, generation, &owner)?;
        state
            .record
            .get_or_insert_with(SliceRecord::default)
            .pending = Some(PendingWrite::sending(&desired));
        drop(state);
        let written = self.write(&api, &existing, &desired).await;
        let mut state = self.state.lock().await;
        let written = match written {
            Ok(written) => written,
            Err(e) => {
                // Partly written: the watch judges by the last complete record again (a
                // false alarm costs a listing, never a write).
                if let Some(record) = state.record.as_mut() {
                    record.pending = None;
                }
                return Err(e);
            }
        };
        state.generation = generation;
        state.record = Some(SliceRecord {
            written: written
                .iter()
                .filter_map(|stored| {
                    let name = str_at(stored, "/metadata/name")?;
                    WrittenSlice::answering(desired.get(name)?, stored)
                })
                .collect(),
            pending: None,
        });
        drop(state);
        info!(
            version = %version,
            generation,
            slices = desired.len(),
            removed = existing.keys().filter(|n| !desired.contains_key(*n)).count(),
            "published ResourceSlices"
        );
        Ok(Published {
            version,
            generation,
            slices: desired.into_keys().collect(),
            changed: true,
        })
    }

    /// Writes every slice of `desired` (an update with the listed `resourceVersion` where
    /// `existing` has it, else a create), then deletes the `existing` slices not desired;
    /// returns the written slices as the API server stored them.
    async fn write(
        &self,
        api: &Api<DynamicObject>,
        existing: &BTreeMap<String, Value>,
        desired: &BTreeMap<String, Value>,
    ) -> Result<Vec<Value>> {
        let stored = |object: &DynamicObject, name: &str| {
            serde_json::to_value(object).map_err(|e| Error::Api {
                action: format!("writing ResourceSlice {name}"),
                code: None,
                message: format!("cannot re-encode the answer: {e}"),
            })
        };
        let mut written = Vec::with_capacity(desired.len());
        for (name, mut value) in desired.clone() {
            if let Some(have) = existing.get(&name) {
                if let (Some(rv), Some(meta)) = (
                    str_at(have, "/metadata/resourceVersion"),
                    value.get_mut("metadata").and_then(Value::as_object_mut),
                ) {
                    // The precondition: a slice changed since the listing fails with 409 and
                    // the whole publication starts again from a fresh listing.
                    meta.insert("resourceVersion".to_owned(), rv.into());
                }
                let answer = api
                    .replace(&name, &PostParams::default(), &to_dynamic(value, &name)?)
                    .await
                    .map_err(|e| Error::api(format!("updating ResourceSlice {name}"), &e))?;
                written.push(stored(&answer, &name)?);
            } else {
                let answer = api
                    .create(&PostParams::default(), &to_dynamic(value, &name)?)
                    .await
                    .map_err(|e| Error::api(format!("creating ResourceSlice {name}"), &e))?;
                written.push(stored(&answer, &name)?);
            }
        }
        for name in existing.keys().filter(|n| !desired.contains_key(*n)) {
            match api.delete(name, &DeleteParams::default()).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => return Err(Error::api(format!("deleting ResourceSlice {name}"), &e)),
            }
        }
        Ok(written)
    }

    /// Publishes `node`'s pool, retrying every failure with capped exponential backoff until
    /// it succeeds. An inventory that cannot be rendered is retried too (the file may be fixed).
    #[tracing::instrument(name = "slice_publish", skip_all, fields(node = %self.config.node_name))]
    pub async fn publish(&self, node: &NodeInventory) -> Published {
        let mut delay = self.config.initial_backoff;
        let mut attempt = 1_u32;
        loop {
            match self.publish_once(node).await {
                Ok(published) => return published,
                Err(e) => {
                    warn!(error = %e, attempt, retry_in = ?delay, "publishing ResourceSlices failed");
                    if e.api_code() == Some(404) {
                        self.forget().await;
                    }
                }
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(self.config.max_backoff);
            attempt = attempt.saturating_add(1);
        }
    }

    /// Publishes every inventory `inventory` holds, the current one first; a newer inventory
    /// arriving while a publication is retrying replaces it. Meanwhile it watches the node's
    /// slices and publishes again when someone else deleted or changed them. A dropped sender
    /// only means the inventory no longer changes (nobody follows it, e.g.
    /// `--inventory-poll-seconds 0`): the last one stays published, and is published again on
    /// drift, until the task is aborted.
    pub fn spawn(self: Arc<Self>, inventory: watch::Receiver<NodeInventory>) -> JoinHandle<()> {
        tokio::spawn(async move {
            let drifted = Arc::new(Notify::new());
            tokio::select! {
                () = slice_watch::run(Arc::clone(&self), Arc::clone(&drifted)) => {}
                () = self.follow(inventory, &drifted) => {}
            }
        })
    }

    /// Publishes what `inventory` holds whenever it changes or `drifted` is notified; once
    /// its sender is gone, whenever `drifted` is notified.
    async fn follow(&self, mut inventory: watch::Receiver<NodeInventory>, drifted: &Notify) {
        let mut open = true;
        loop {
            let node = inventory.borrow_and_update().clone();
            if open {
                tokio::select! {
                    _ = self.publish(&node) => {}
                    changed = inventory.changed() => {
                        open = changed.is_ok();
                        continue;
                    }
                }
            } else {
                self.publish(&node).await;
            }
            if open {
                tokio::select! {
                    changed = inventory.changed() => {
                        open = changed.is_ok();
                        continue;
                    }
                    () = drifted.notified() => {}
                }
            } else {
                drifted.notified().await;
            }
            // Let the rest of a burst of deletions arrive: one publication answers all.
            tokio::time::sleep(self.config.drift_settle).await;
        }
    }
}
