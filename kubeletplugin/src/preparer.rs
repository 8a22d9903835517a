//! Preparing claims: the `ClaimPreparer` seam the gRPC layer calls, and `CdiPreparer`, which
//! prepares a claim by writing its CDI spec under a crash-safe checkpoint.
//!
//! A prepare call answers from the checkpoint when the claim is already prepared; otherwise it
//! fetches the claim on the async runtime, then does everything else on one blocking worker:
//! `tessera_driver::node::prepare::prepare_and_render` maps the allocation onto the node and decides the spec,
//! host directories and MPS daemon at once, and the writes below follow.
//!
//! Order of writes for prepare: checkpoint "prepare started" (with the devices it will hold),
//! then the CDI spec, then checkpoint "prepare completed". For unprepare: checkpoint
//! "unprepare started", the enforcement directories and the CDI spec, then the checkpoint
//! entry. A crash between any two steps leaves a claim recorded as half done; the next start
//! rolls every such claim back to absent (kubelet never saw it prepared, or asked to remove
//! it) and removes the temp files of interrupted writes, so after a restart each claim is
//! either fully prepared or cleanly absent, and kubelet's retry finishes the job.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use k8s_openapi::api::resource::v1::ResourceClaim;
use tessera_driver::names;
use tessera_driver::node::cdi::{self, Enforcement};
use tessera_driver::node::checkpoint::{Begin, Checkpoint, ClaimEntry, HeldDevice, PrepareState};
use tessera_driver::node::inventory::NodeInventory;
use tessera_driver::node::prepare::prepare_and_render;
use tessera_driver::node::reconfigure::{Reconfigured, Refusal, reconfigure};
use tracing::{debug, info, warn};

use crate::atomic_file;
use crate::claims::{ClaimRef, ClaimSource};
use crate::crash;
use crate::error::{Error, Result};
use crate::mps::DaemonKeeper;

/// File name of the checkpoint in the state directory.
pub const CHECKPOINT_FILE: &str = "checkpoint.json";

/// One device of a prepared claim, as kubelet gets it back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeletDevice {
    /// The claim's requests the device serves.
    pub requests: Vec<String>,
    /// The device's pool.
    pub pool: String,
    /// The device's name in its pool.
    pub device: String,
    /// The CDI device ids the runtime injects.
    pub cdi_ids: Vec<String>,
    /// The allocation's `shareID` of the device, when it allows several allocations (sent to
    /// kubelet in v1 answers).
    pub share_id: Option<String>,
}

/// Prepares and unprepares claims on this node. Both calls are idempotent per claim UID and
/// safe to call concurrently for different claims; blocking work runs off the async runtime.
#[tonic::async_trait]
pub trait ClaimPreparer: Send + Sync {
    /// Makes the claim's devices ready for containers; returns them with their CDI ids.
    async fn prepare(self: Arc<Self>, claim: ClaimRef) -> Result<Vec<KubeletDevice>>;
    /// Undoes [`ClaimPreparer::prepare`]; a claim that is not prepared is fine.
    async fn unprepare(self: Arc<Self>, claim: ClaimRef) -> Result<()>;
}

/// Where and how [`CdiPreparer`] works.
#[derive(Debug, Clone)]
pub struct CdiPreparerConfig {
    /// The driver name; only allocation results of this driver are prepared.
    pub driver_name: String,
    /// The directory the container runtime reads CDI specs from.
    pub cdi_dir: PathBuf,
    /// The directory of the checkpoint (must survive plugin restarts).
    pub state_dir: PathBuf,
    /// How shares are enforced inside containers.
    pub enforcement: Enforcement,
    /// The current boot's id: a checkpoint from another boot is dropped.
    pub boot_id: String,
}

/// The real preparer: CDI specs and a checkpoint on disk.
pub struct CdiPreparer {
    config: CdiPreparerConfig,
    node: RwLock<NodeInventory>,
    source: Arc<dyn ClaimSource>,
    record: Mutex<Checkpoint>,
    mps: Option<Arc<dyn DaemonKeeper>>,
}

impl CdiPreparer {
    /// A preparer for `node`'s GPUs, loading the checkpoint left by a previous run. Creates the
    /// CDI and state directories when missing; a damaged checkpoint is an error (starting
    /// empty would forget prepared claims).
    pub fn new(
        config: CdiPreparerConfig,
        node: NodeInventory,
        source: Arc<dyn ClaimSource>,
    ) -> Result<Self> {
        for dir in [&config.cdi_dir, &config.state_dir] {
            std::fs::create_dir_all(dir).map_err(|e| Error::io("creating", dir, e))?;
        }
        let path = config.state_dir.join(CHECKPOINT_FILE);
        let record = match std::fs::read(&path) {
            Ok(bytes) => Checkpoint::decode(&bytes, &config.boot_id)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Checkpoint::new(config.boot_id.clone())
            }
            Err(e) => return Err(Error::io("reading", path, e)),
        };
        let preparer = Self {
            config,
            node: RwLock::new(node),
            source,
            record: Mutex::new(record),
            mps: None,
        };
        preparer.recover()?;
        info!(
            node = %preparer.inventory()?.name,
            claims = preparer.lock()?.claims.len(),
            "loaded checkpoint"
        );
        Ok(preparer)
    }

    /// Makes sure of the MPS control daemons of share claims through `supervisor`: the
    /// daemons the checkpoint's claims need are started (or adopted) now, and each later
    /// claim's daemon answers before the claim is reported prepared. Without one, specs still
    /// point at the daemons but nothing waits for them. Blocking.
    pub fn with_mps(mut self, supervisor: Arc<dyn DaemonKeeper>) -> Result<Self> {
        let record = self.record()?;
        supervisor.restore(&record)?;
        self.mps = Some(supervisor);
        Ok(self)
    }

    /// Finishes what a crash interrupted: temp files of interrupted writes go, and every claim
    /// recorded as half prepared or half unprepared is rolled back to absent.
    fn recover(&self) -> Result<()> {
        let temps = atomic_file::remove_temp_files(&self.config.state_dir, CHECKPOINT_FILE)?
            + atomic_file::remove_temp_files(&self.config.cdi_dir, &cdi_spec_prefix())?;
        if temps > 0 {
            info!(files = temps, "removed temp files of interrupted writes");
        }
        let mut record = self.lock()?;
        let unfinished = record.unfinished();
        if unfinished.is_empty() {
            return Ok(());
        }
        let mut next = record.clone();
        for uid in &unfinished {
            if let Some(entry) = next.get(uid) {
                self.remove_files(uid, entry)?;
            }
            next.remove(uid);
            info!(claim = %uid, "rolled back a claim a crash left half done");
        }
        self.commit(&mut record, next)
    }

    /// Removes what preparing `uid` made on disk: its host directories and its CDI spec.
    fn remove_files(&self, uid: &str, entry: &ClaimEntry) -> Result<()> {
        for dir in &entry.host_dirs {
            match std::fs::remove_dir_all(dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io("removing", dir, e)),
            }
        }
        crash::point(crash::UNPREPARE_AFTER_HOST_DIRS_REMOVED);
        atomic_file::remove(&self.config.cdi_dir, &cdi::spec_file_name(uid))?;
        crash::point(crash::UNPREPARE_AFTER_CDI_REMOVED);
        Ok(())
    }

    /// UIDs of the claims the checkpoint records, with how far each got.
    pub fn claims(&self) -> Result<Vec<(String, PrepareState)>> {
        Ok(self
            .lock()?
            .claims
            .iter()
            .map(|(uid, e)| (uid.clone(), e.state))
            .collect())
    }

    fn lock(&self) -> Result<MutexGuard<'_, Checkpoint>> {
        self.record.lock().map_err(|_| poisoned("checkpoint"))
    }

    /// A copy of the checkpoint as it is now (for metrics and inventory changes).
    pub fn record(&self) -> Result<Checkpoint> {
        Ok(self.lock()?.clone())
    }

    /// The inventory claims are prepared against.
    pub fn inventory(&self) -> Result<NodeInventory> {
        Ok(self.node.read().map_err(|_| poisoned("inventory"))?.clone())
    }

    /// Prepares later claims against a re-discovered inventory, except that a GPU held by a
    /// recorded claim keeps its mode and MIG layout (`tessera_driver::node::reconfigure`); returns
    /// the refused changes. Claims already prepared keep their CDI specs.
    pub fn reconfigure(&self, discovered: &NodeInventory) -> Result<Vec<Refusal>> {
        let mut node = self.node.write().map_err(|_| poisoned("inventory"))?;
        let record = self.lock()?;
        let Reconfigured {
            inventory,
            refusals,
        } = reconfigure(&node, discovered, &record);
        *node = inventory;
        Ok(refusals)
    }

    /// Writes `next` and, once it is durable, makes it the current record.
    fn commit(&self, current: &mut Checkpoint, next: Checkpoint) -> Result<()> {
        atomic_file::write(&self.config.state_dir, CHECKPOINT_FILE, &next.encode()?)?;
        *current = next;
        Ok(())
    }

    /// The devices of a claim the checkpoint records as prepared (`None`: not prepared).
    pub fn prepared(&self, claim: &ClaimRef) -> Result<Option<Vec<KubeletDevice>>> {
        let record = self.lock()?;
        match record.get(&claim.uid) {
            Some(entry) if entry.state == PrepareState::PrepareCompleted => {
                if entry.namespace != claim.namespace || entry.name != claim.name {
                    return Err(Error::BadRequest(format!(
                        "claim UID {} is prepared for {}/{}, not {}/{}",
                        claim.uid, entry.namespace, entry.name, claim.namespace, claim.name
                    )));
                }
                Ok(Some(answer(&entry.devices)))
            }
            _ => Ok(None),
        }
    }

    /// Prepares a claim from its fetched object (what [`ClaimPreparer::prepare`] does once the
    /// claim is fetched). Blocking.
    pub fn prepare_fetched(
        &self,
        claim: &ClaimRef,
        object: &ResourceClaim,
    ) -> Result<Vec<KubeletDevice>> {
        claim.validate()?;
        if let Some(devices) = self.prepared(claim)? {
            debug!(%claim, "already prepared");
            return Ok(devices);
        }
        // The inventory stays read-locked until the claim is recorded, so an inventory change
        // (`reconfigure`) sees every claim prepared against the old one.
        let node = self.node.read().map_err(|_| poisoned("inventory"))?;
        let (
            prepared,
            cdi::Rendered {
                spec,
                host_dirs,
                mps_daemon: daemon,
            },
        ) = prepare_and_render(
            object,
            &self.config.driver_name,
            &node,
            &self.config.enforcement,
        )?;
        let spec = spec.to_json()?;
        {
            let mut record = self.lock()?;
            let mut next = record.clone();
            if let Begin::AlreadyPrepared(devices) =
                next.begin_prepare(&prepared, host_dirs.clone())?
            {
                return Ok(answer(&devices));
            }
            next.set_mps_daemon(&prepared.uid, daemon.clone());
            self.commit(&mut record, next)?;
        }
        drop(node);
        crash::point(crash::PREPARE_AFTER_CHECKPOINT_STARTED);
        for dir in &host_dirs {
            std::fs::create_dir_all(dir).map_err(|e| Error::io("creating", dir, e))?;
        }
        crash::point(crash::PREPARE_AFTER_HOST_DIRS);
        atomic_file::write(
            &self.config.cdi_dir,
            &cdi::spec_file_name(&prepared.uid),
            spec.as_bytes(),
        )?;
        crash::point(crash::PREPARE_AFTER_CDI_WRITTEN);
        if let (Some(supervisor), Some(daemon)) = (&self.mps, &daemon) {
            // Before "completed": kubelet starts the containers as soon as we answer, and
            // their CUDA clients need the daemon's pipe.
            supervisor.ensure(&prepared.uid, daemon)?;
        }
        let mut record = self.lock()?;
        let mut next = record.clone();
        let devices = next.complete_prepare(&prepared.uid)?;
        self.commit(&mut record, next)?;
        drop(record);
        crash::point(crash::PREPARE_AFTER_CHECKPOINT_COMPLETED);
        info!(%claim, devices = devices.len(), "prepared");
        Ok(answer(&devices))
    }

    /// Unprepares a claim (what [`ClaimPreparer::unprepare`] runs). Blocking.
    pub fn unprepare_blocking(&self, claim: &ClaimRef) -> Result<()> {
        claim.validate()?;
        let mut record = self.lock()?;
        let Some(entry) = record.get(&claim.uid).cloned() else {
            debug!(%claim, "not prepared; nothing to undo");
            return Ok(());
        };
        if entry.state != PrepareState::UnprepareStarted {
            let mut next = record.clone();
            next.begin_unprepare(&claim.uid);
            self.commit(&mut record, next)?;
        }
        crash::point(crash::UNPREPARE_AFTER_CHECKPOINT_STARTED);
        self.remove_files(&claim.uid, &entry)?;
        let mut next = record.clone();
        next.remove(&claim.uid);
        self.commit(&mut record, next)?;
        drop(record);
        crash::point(crash::UNPREPARE_AFTER_CHECKPOINT_REMOVED);
        if let Some(supervisor) = &self.mps {
            // The claim is gone from the record either way; a daemon that does not stop
            // cleanly is killed and forgotten by the supervisor.
            if let Err(e) = supervisor.release(&claim.uid) {
                warn!(%claim, error = %e, "stopping the claim's MPS daemon failed");
            }
        }
        info!(%claim, "unprepared");
        Ok(())
    }
}

fn poisoned(what: &str) -> Error {
    Error::Task(format!("a thread panicked while holding the {what}"))
}

/// What every claim's CDI spec file name starts with.
fn cdi_spec_prefix() -> String {
    format!("{}-{}_", names::CDI_VENDOR, names::CDI_CLASS)
}

fn answer(devices: &[HeldDevice]) -> Vec<KubeletDevice> {
    devices
        .iter()
        .map(|d| KubeletDevice {
            requests: vec![d.request.clone()],
            pool: d.pool.clone(),
            device: d.device.clone(),
            cdi_ids: d.cdi_ids.clone(),
            share_id: d.share_id.clone(),
        })
        .collect()
}

#[tonic::async_trait]
impl ClaimPreparer for CdiPreparer {
    async fn prepare(self: Arc<Self>, claim: ClaimRef) -> Result<Vec<KubeletDevice>> {
        claim.validate()?;
        if let Some(devices) = self.prepared(&claim)? {
            debug!(%claim, "already prepared");
            return Ok(devices);
        }
        let object = self.source.claim(&claim).await?;
        tokio::task::spawn_blocking(move || self.prepare_fetched(&claim, &object))
            .await
            .map_err(|e| Error::Task(e.to_string()))?
    }

    async fn unprepare(self: Arc<Self>, claim: ClaimRef) -> Result<()> {
        tokio::task::spawn_blocking(move || self.unprepare_blocking(&claim))
            .await
            .map_err(|e| Error::Task(e.to_string()))?
    }
}
