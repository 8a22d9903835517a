//! Writing what a prepared claim got into its `status.devices`, and keeping it true.
//!
//! What the entries say is `tessera_driver::node::claim_status`'s decision; this module fetches
//! the claim, asks it, and writes the answer. [`StatusReporter`] keeps a queue of claims to bring
//! up to date: a prepare or unprepare of a claim ([`StatusReporting`], around the preparer) and
//! an accounting pass whose measure changes what a claim would say
//! ([`StatusReporter::observe_use`]) put it there, and a background task works through it. So
//! kubelet's call never waits for the API server: the claim is answered as soon as it is
//! prepared, and its status follows.
//!
//! Each write fetches the claim and sends a JSON merge patch of the `status` subresource that
//! carries the fetched `resourceVersion` (a precondition: another writer in between is a
//! conflict, and the write starts again from a fresh read) and the whole `status.devices` list,
//! with every other driver's entries as they were read. A claim that is gone (404, or another
//! UID under its name) is done with, not an error. A failed write is tried again after
//! `claim_status::retry_delay` (200 ms doubling to 30 s); prepare has long succeeded by then.
//! At start every claim of the checkpoint is queued once, so a restarted plugin puts right what
//! changed while it was away.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use k8s_openapi::api::resource::v1::{AllocatedDeviceStatus, ResourceClaim};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use serde_json::{Value, json};
use tessera_driver::names;
use tessera_driver::node::accounting::{GpuUse, Usage};
use tessera_driver::node::cdi::Enforcement;
use tessera_driver::node::checkpoint::{Checkpoint, PrepareState};
use tessera_driver::node::claim_status::{self, NodeFacts};
use tessera_driver::node::inventory::NodeInventory;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tracing::{Instrument as _, debug, info, warn};

use crate::claims::ClaimRef;
use crate::claims::apiserver::ApiClaimSource;
use crate::claims::cancel::Cancel;
use crate::claims::preparer::{CdiPreparer, ClaimPreparer, KubeletDevice};
use crate::error::{Error, Result};

/// Conflicts in a row one attempt rides out before it waits its retry delay.
const CONFLICTS_PER_ATTEMPT: usize = 4;

/// The claim as the API server stores it now.
#[derive(Debug, Clone)]
pub struct StoredClaim {
    /// The claim, in the v1 model.
    pub claim: ResourceClaim,
    /// Its `metadata.resourceVersion`: the precondition of the write.
    pub resource_version: String,
}

/// What a write answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    /// Stored.
    Done,
    /// The claim changed since it was read.
    Conflict,
    /// The claim is gone.
    Gone,
}

/// The API server, as far as claim status goes.
#[tonic::async_trait]
pub trait ClaimStatusApi: Send + Sync {
    /// The claim as stored; `None` when there is none under its name.
    async fn get(&self, claim: &ClaimRef) -> Result<Option<StoredClaim>>;

    /// Sets the claim's `status.devices` to `devices`, if it is still at `resource_version`.
    async fn put_devices(
        &self,
        claim: &ClaimRef,
        resource_version: &str,
        devices: &[AllocatedDeviceStatus],
    ) -> Result<Written>;
}

/// [`ClaimStatusApi`] on a real API server, in the resource.k8s.io version it serves.
#[derive(Debug, Clone)]
pub struct KubeClaimStatus {
    source: ApiClaimSource,
}

impl KubeClaimStatus {
    /// Reads and writes through `source`'s client and served version.
    pub fn new(source: ApiClaimSource) -> Self {
        Self { source }
    }
}

#[tonic::async_trait]
impl ClaimStatusApi for KubeClaimStatus {
    async fn get(&self, claim: &ClaimRef) -> Result<Option<StoredClaim>> {
        match self.source.fetch(claim).await {
            Ok(found) => {
                let resource_version = found.metadata.resource_version.clone().unwrap_or_default();
                Ok(Some(StoredClaim {
                    claim: found,
                    resource_version,
                }))
            }
            Err(Error::ClaimNotFound { .. } | Error::ClaimUidMismatch { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    async fn put_devices(
        &self,
        claim: &ClaimRef,
        resource_version: &str,
        devices: &[AllocatedDeviceStatus],
    ) -> Result<Written> {
        let version = self.source.version().await?;
        let api: Api<DynamicObject> = Api::namespaced_with(
            self.source.client().clone(),
            &claim.namespace,
            &tessera_kubeapi::resource(version, names::RESOURCE_CLAIM),
        );
        // A merge patch replaces a list whole: `devices` carries the other drivers' entries as
        // read at `resource_version`, which the patch holds as its precondition.
        let list = if devices.is_empty() {
            Value::Null
        } else {
            serde_json::to_value(devices).map_err(|e| {
                Error::Driver(tessera_driver::Error::Decode {
                    context: format!("status.devices of claim {claim}"),
                    message: e.to_string(),
                })
            })?
        };
        let patch = json!({
            "metadata": {"resourceVersion": resource_version, "uid": claim.uid},
            "status": {"devices": list},
        });
        match api
            .patch_status(&claim.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => Ok(Written::Done),
            Err(e) => {
                let error = Error::api(format!("writing the status of claim {claim}"), &e);
                if error.is_not_found() {
                    Ok(Written::Gone)
                } else if error.is_conflict() {
                    Ok(Written::Conflict)
                } else {
                    Err(error)
                }
            }
        }
    }
}

/// Where the reporter reads what the node prepared.
pub trait PreparedState: Send + Sync {
    /// The checkpoint as it is now (blocking).
    fn record(&self) -> Result<Checkpoint>;
    /// The inventory claims are prepared against.
    fn inventory(&self) -> Result<NodeInventory>;
}

impl PreparedState for CdiPreparer {
    fn record(&self) -> Result<Checkpoint> {
        CdiPreparer::record(self)
    }

    fn inventory(&self) -> Result<NodeInventory> {
        CdiPreparer::inventory(self)
    }
}

#[derive(Debug, Clone)]
struct Queued {
    claim: ClaimRef,
    due: Instant,
    failures: u32,
}

#[derive(Debug, Default)]
struct Inner {
    queue: BTreeMap<String, Queued>,
    measured: Usage,
    /// This driver's entries of each claim as last read or written.
    written: BTreeMap<String, Vec<AllocatedDeviceStatus>>,
    failed_writes: u64,
}

/// How one claim's sync ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Synced {
    Written,
    Unchanged,
    Gone,
}

/// Keeps prepared claims' `status.devices` up to date (see the module's rule).
pub struct StatusReporter {
    api: Arc<dyn ClaimStatusApi>,
    state: Arc<dyn PreparedState>,
    driver: String,
    enforcement: Enforcement,
    inner: Mutex<Inner>,
    wake: Notify,
}

impl std::fmt::Debug for StatusReporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StatusReporter")
            .field("driver", &self.driver)
            .finish_non_exhaustive()
    }
}

impl StatusReporter {
    /// A reporter writing through `api` the entries of `driver` for what `state` prepared under
    /// `enforcement`.
    pub fn new(
        api: Arc<dyn ClaimStatusApi>,
        state: Arc<dyn PreparedState>,
        driver: impl Into<String>,
        enforcement: Enforcement,
    ) -> Self {
        Self {
            api,
            state,
            driver: driver.into(),
            enforcement,
            inner: Mutex::new(Inner::default()),
            wake: Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // The state is a queue and caches: a panic elsewhere leaves nothing half-changed here.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Queues `claim` to be written now (a claim waiting out a failure keeps its delay).
    pub fn claim_changed(&self, claim: ClaimRef) {
        let now = Instant::now();
        self.lock()
            .queue
            .entry(claim.uid.clone())
            .or_insert(Queued {
                claim,
                due: now,
                failures: 0,
            });
        self.wake.notify_one();
    }

    /// Queues every claim `record` holds (at start: what changed while the plugin was away).
    pub fn resync(&self, record: &Checkpoint) {
        for (uid, entry) in &record.claims {
            self.claim_changed(ClaimRef::new(&entry.namespace, &entry.name, uid));
        }
    }

    /// Takes one accounting pass's measure: queues each prepared claim whose entries would say
    /// something else than they did when last written (a condition turned, or the use moved by
    /// a twentieth of the booking).
    pub fn observe_use(&self, record: &Checkpoint, measured: Usage) {
        let node = match self.state.inventory() {
            Ok(node) => node,
            Err(e) => {
                warn!(error = %e, "reading the inventory for claim status failed");
                return;
            }
        };
        let facts = NodeFacts {
            driver: &self.driver,
            node: &node,
            enforcement: &self.enforcement,
        };
        let now = now();
        let mut changed = Vec::new();
        {
            let mut inner = self.lock();
            for (uid, entry) in &record.claims {
                if entry.state != PrepareState::PrepareCompleted {
                    continue;
                }
                let Some(gpus) = measured.get(uid) else {
                    continue;
                };
                let written = inner
                    .written
                    .get(uid)
                    .map(Vec::as_slice)
                    .unwrap_or_default();
                let next =
                    claim_status::device_statuses(entry, written, Some(gpus), &facts, None, &now);
                if !claim_status::same_report(written, &next) {
                    changed.push(ClaimRef::new(&entry.namespace, &entry.name, uid));
                }
            }
            inner.measured = measured;
        }
        for claim in changed {
            self.claim_changed(claim);
        }
    }

    /// Claims waiting to be written.
    pub fn pending(&self) -> usize {
        self.lock().queue.len()
    }

    /// Write attempts that failed so far (each is tried again).
    pub fn failed_writes(&self) -> u64 {
        self.lock().failed_writes
    }

    /// When the next queued claim is due.
    fn next_due(&self) -> Option<Instant> {
        self.lock().queue.values().map(|q| q.due).min()
    }

    /// Writes every claim due at `now`; returns how many stay queued (failed, or not due).
    pub async fn run_due(&self, now: Instant) -> usize {
        let due: Vec<Queued> = {
            let mut inner = self.lock();
            let uids: Vec<String> = inner
                .queue
                .iter()
                .filter(|(_, q)| q.due <= now)
                .map(|(uid, _)| uid.clone())
                .collect();
            uids.iter()
                .filter_map(|uid| inner.queue.remove(uid))
                .collect()
        };
        for queued in due {
            let span = queued.claim.span("status");
            let outcome = self.sync(&queued.claim).instrument(span.clone()).await;
            let _span = span.entered();
            match outcome {
                Ok(Synced::Written) => debug!("claim status written"),
                Ok(Synced::Unchanged) => debug!("claim status already up to date"),
                Ok(Synced::Gone) => {
                    debug!("the claim is gone; nothing to write");
                    self.lock().written.remove(&queued.claim.uid);
                }
                Err(e) => {
                    let failures = queued.failures.saturating_add(1);
                    let delay = claim_status::retry_delay(queued.failures);
                    warn!(error = %e, failures, retry_in = ?delay, "writing the claim's status failed; trying again");
                    let mut inner = self.lock();
                    inner.failed_writes = inner.failed_writes.saturating_add(1);
                    // A newer request for the claim waits for the delay too.
                    inner.queue.insert(
                        queued.claim.uid.clone(),
                        Queued {
                            due: now + delay,
                            failures,
                            claim: queued.claim,
                        },
                    );
                }
            }
        }
        self.pending()
    }

    /// Brings one claim's entries up to date.
    async fn sync(&self, claim: &ClaimRef) -> Result<Synced> {
        for _ in 0..CONFLICTS_PER_ATTEMPT {
            let Some(stored) = self.api.get(claim).await? else {
                return Ok(Synced::Gone);
            };
            let state = Arc::clone(&self.state);
            let (record, node) = tokio::task::spawn_blocking(move || {
                Ok::<_, Error>((state.record()?, state.inventory()?))
            })
            .await
            .map_err(|e| Error::Task(e.to_string()))??;
            let entry = record
                .get(&claim.uid)
                .filter(|e| e.namespace == claim.namespace && e.name == claim.name);
            let measured: Option<BTreeMap<String, GpuUse>> =
                self.lock().measured.get(&claim.uid).cloned();
            let facts = NodeFacts {
                driver: &self.driver,
                node: &node,
                enforcement: &self.enforcement,
            };
            let Some(devices) =
                claim_status::status_write(&stored.claim, entry, measured.as_ref(), &facts, &now())
            else {
                self.remember(claim, stored_ours(&stored.claim, &self.driver));
                return Ok(Synced::Unchanged);
            };
            match self
                .api
                .put_devices(claim, &stored.resource_version, &devices)
                .await?
            {
                Written::Done => {
                    let ours: Vec<AllocatedDeviceStatus> = devices
                        .into_iter()
                        .filter(|d| d.driver == self.driver)
                        .collect();
                    info!(devices = ours.len(), "wrote the claim's device status");
                    self.remember(claim, ours);
                    return Ok(Synced::Written);
                }
                Written::Gone => return Ok(Synced::Gone),
                Written::Conflict => debug!("the claim changed since it was read; reading again"),
            }
        }
        Err(Error::Api {
            action: format!("writing the status of claim {claim}"),
            code: Some(409),
            message: format!("{CONFLICTS_PER_ATTEMPT} conflicts in a row"),
        })
    }

    fn remember(&self, claim: &ClaimRef, ours: Vec<AllocatedDeviceStatus>) {
        let mut inner = self.lock();
        if ours.is_empty() {
            inner.written.remove(&claim.uid);
        } else {
            inner.written.insert(claim.uid.clone(), ours);
        }
    }

    /// Works through the queue until the task is aborted: each claim when it is due, woken by
    /// new work.
    pub fn spawn(self: Arc<Self>) -> JoinHandle<()> {
        tokio::spawn(async move {
            loop {
                let notified = self.wake.notified();
                self.run_due(Instant::now()).await;
                match self.next_due() {
                    Some(due) => {
                        tokio::select! {
                            () = tokio::time::sleep_until(due.into()) => {}
                            () = notified => {}
                        }
                    }
                    None => notified.await,
                }
            }
        })
    }
}

/// This driver's entries of `claim` as stored.
fn stored_ours(claim: &ResourceClaim, driver: &str) -> Vec<AllocatedDeviceStatus> {
    claim
        .status
        .as_ref()
        .and_then(|s| s.devices.as_ref())
        .map(|ds| ds.iter().filter(|d| d.driver == driver).cloned().collect())
        .unwrap_or_default()
}

fn now() -> Time {
    Time(k8s_openapi::jiff::Timestamp::now())
}

/// A preparer whose prepared and unprepared claims get their status written afterwards, off
/// kubelet's call.
pub struct StatusReporting {
    inner: Arc<dyn ClaimPreparer>,
    reporter: Arc<StatusReporter>,
}

impl StatusReporting {
    /// Reports what `inner` prepares through `reporter`.
    pub fn new(inner: Arc<dyn ClaimPreparer>, reporter: Arc<StatusReporter>) -> Self {
        Self { inner, reporter }
    }

    fn queue<T>(&self, claims: Vec<ClaimRef>, results: &[Result<T>]) {
        for (claim, result) in claims.into_iter().zip(results) {
            if result.is_ok() {
                self.reporter.claim_changed(claim);
            }
        }
    }
}

#[tonic::async_trait]
impl ClaimPreparer for StatusReporting {
    async fn prepare_all(
        self: Arc<Self>,
        claims: Vec<ClaimRef>,
        cancel: Cancel,
    ) -> Vec<Result<Vec<KubeletDevice>>> {
        let results = Arc::clone(&self.inner)
            .prepare_all(claims.clone(), cancel)
            .await;
        self.queue(claims, &results);
        results
    }

    async fn unprepare_all(
        self: Arc<Self>,
        claims: Vec<ClaimRef>,
        cancel: Cancel,
    ) -> Vec<Result<()>> {
        let results = Arc::clone(&self.inner)
            .unprepare_all(claims.clone(), cancel)
            .await;
        self.queue(claims, &results);
        results
    }
}
