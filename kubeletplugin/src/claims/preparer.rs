//! Preparing claims: the `ClaimPreparer` seam the gRPC layer calls, and `CdiPreparer`, which
//! prepares a claim by writing its CDI spec under a crash-safe checkpoint.
//!
//! A call's claims are prepared together: those the checkpoint records as prepared are
//! answered from it; the others are fetched on the async runtime (a few at a time), then
//! everything else runs on one blocking worker: `tessera_driver::node::prepare::prepare_and_render`
//! maps each allocation onto the node and decides its spec, host directories and MPS daemon,
//! and the writes below follow, each step once for the whole call rather than once per claim.
//! Under MPS with one daemon per GPU set and user ([`CdiPreparer::with_mps_users`]) the pods a
//! claim is reserved for are fetched with it, and a share claim whose user cannot be told
//! (`tessera_driver::node::mps_user`) is that claim's error.
//!
//! Order of writes for prepare: checkpoint "prepare started" (with the devices each claim will
//! hold), then the host directories and the CDI specs, then checkpoint "prepare completed" for
//! the claims that got that far; a claim that failed on the way has its files removed and its
//! entry dropped in that same write. For unprepare: checkpoint "unprepare started", the host
//! directories (moved aside, see [`crate::claims::reaper`]) and the CDI specs, then the entries go. A
//! crash between any two steps leaves a claim recorded as half done; the next start rolls every
//! such claim back to absent (kubelet never saw it prepared, or asked to remove it), removes
//! the temp files of interrupted writes and every spec no entry records, so after a restart
//! each claim is either fully prepared or cleanly absent, and kubelet's retry finishes the job.
//!
//! The phases live apart: preparing is here, [`recovery`] runs once at start, [`unprepare`]
//! removes claims, and [`outcome`] holds the per-claim answers of a call.
//!
//! The checkpoint's lock is only ever taken on blocking workers: it is held while the record is
//! written, and an async worker waiting on it would stall every call, `GetInfo` included.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use k8s_openapi::api::resource::v1::ResourceClaim;
use tessera_driver::names;
use tessera_driver::node::cdi::{self, Enforcement};
use tessera_driver::node::checkpoint::{Begin, Checkpoint, ClaimEntry, HeldDevice, PrepareState};
use tessera_driver::node::host_dir::HostDir;
use tessera_driver::node::inventory::NodeInventory;
use tessera_driver::node::mps::MpsDaemon;
use tessera_driver::node::prepare::prepare_and_render_for_user;
use tessera_driver::node::reconfigure::{Reconfigured, Refusal, reconfigure};
use tokio::task::JoinSet;
use tracing::{Instrument as _, debug, info, warn};

use crate::claims::atomic_file;
use crate::claims::cancel::Cancel;
use crate::claims::crash;
use crate::claims::input_file;
use crate::claims::reaper::Reaper;
use crate::claims::{ClaimRef, ClaimSource, PodSource};
use crate::error::{Error, Result};
use crate::mps::{DaemonKeeper, host_dirs};

mod outcome;
mod recovery;
mod unprepare;

pub(crate) use outcome::OneOutcome;
use outcome::{Outcomes, fail_unanswered, finish, shared};

/// File name of the checkpoint in the state directory.
pub const CHECKPOINT_FILE: &str = "checkpoint.json";

/// Claims of one call fetched from the API server at a time.
const FETCHES_AT_ONCE: usize = 16;

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
/// A call takes the claims kubelet sent together; one claim alone is a call for one.
#[tonic::async_trait]
pub trait ClaimPreparer: Send + Sync + 'static {
    /// Prepares the claims of one call: makes their devices ready for containers and returns
    /// them with their CDI ids, one outcome per claim, in order. Once `cancel` is set the
    /// claims not done yet are answered [`Error::Cancelled`].
    async fn prepare_all(
        self: Arc<Self>,
        claims: Vec<ClaimRef>,
        cancel: Cancel,
    ) -> Vec<Result<Vec<KubeletDevice>>>;

    /// Undoes [`ClaimPreparer::prepare_all`] for the claims of one call, as it prepares them;
    /// a claim that is not prepared is fine.
    async fn unprepare_all(
        self: Arc<Self>,
        claims: Vec<ClaimRef>,
        cancel: Cancel,
    ) -> Vec<Result<()>>;

    /// Prepares one claim (a call of [`ClaimPreparer::prepare_all`] for it alone).
    async fn prepare(self: Arc<Self>, claim: ClaimRef) -> Result<Vec<KubeletDevice>> {
        self.prepare_all(vec![claim], Cancel::new())
            .await
            .only_outcome()
    }

    /// Unprepares one claim (a call of [`ClaimPreparer::unprepare_all`] for it alone).
    async fn unprepare(self: Arc<Self>, claim: ClaimRef) -> Result<()> {
        self.unprepare_all(vec![claim], Cancel::new())
            .await
            .only_outcome()
    }
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
    users: Option<Arc<dyn PodSource>>,
    reaper: Reaper,
}

/// The Unix user a claim's containers run as, as far as the fetch could tell: used only when
/// the claim gets an MPS daemon. `Ok(None)`: any user.
type MpsUser = Result<Option<u32>>;

/// A claim recorded as "prepare started" in this call, with what is still to write for it.
struct Started {
    index: usize,
    claim: ClaimRef,
    uid: String,
    spec: String,
    host_dirs: Vec<HostDir>,
    daemon: Option<MpsDaemon>,
}

impl Started {
    fn dir_paths(&self) -> Vec<String> {
        self.host_dirs.iter().map(|d| d.path.clone()).collect()
    }
}

/// The host directories of `dirs` not inside another of them: removing these removes all.
fn top_dirs(dirs: &[String]) -> Vec<&String> {
    dirs.iter()
        .filter(|d| {
            !dirs
                .iter()
                .any(|o| o != *d && Path::new(d.as_str()).starts_with(o))
        })
        .collect()
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
        let record = match input_file::read(&path, "the checkpoint") {
            Ok(bytes) => Checkpoint::decode(&bytes, &config.boot_id)?,
            Err(e) if input_file::is_missing(&e) => Checkpoint::new(config.boot_id.clone()),
            Err(e) => return Err(e),
        };
        let preparer = Self {
            config,
            node: RwLock::new(node),
            source,
            record: Mutex::new(record),
            mps: None,
            users: None,
            reaper: Reaper::start()?,
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

    /// Runs one MPS daemon per GPU set and Unix user: the pods each claim is reserved for are
    /// read from `pods` when it is prepared, and a share claim's daemon is its set's daemon for
    /// the user its containers run as (`tessera_driver::node::mps_user::claim_user`; a claim
    /// whose user cannot be told is refused). Without this, a daemon serves every user of its set.
    #[must_use]
    pub fn with_mps_users(mut self, pods: Arc<dyn PodSource>) -> Self {
        self.users = Some(pods);
        self
    }

    /// The reaper removing the host directories of unprepared claims.
    pub fn reaper(&self) -> &Reaper {
        &self.reaper
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

    /// A copy of the checkpoint as it is now (for metrics and inventory changes). Blocking: it
    /// waits while the checkpoint is written.
    pub fn record(&self) -> Result<Checkpoint> {
        Ok(self.lock()?.clone())
    }

    /// The inventory claims are prepared against.
    pub fn inventory(&self) -> Result<NodeInventory> {
        Ok(self.node.read().map_err(|_| poisoned("inventory"))?.clone())
    }

    /// Prepares later claims against a re-discovered inventory, except that a GPU held by a
    /// recorded claim keeps its mode and MIG layout (`tessera_driver::node::reconfigure`); returns
    /// the refused changes. Claims already prepared keep their CDI specs. Blocking.
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
    /// Blocking.
    pub fn prepared(&self, claim: &ClaimRef) -> Result<Option<Vec<KubeletDevice>>> {
        prepared_in(&*self.lock()?, claim)
    }

    /// Prepares a claim from its fetched object (one claim of
    /// [`CdiPreparer::prepare_fetched_all`]). Blocking.
    pub fn prepare_fetched(
        &self,
        claim: &ClaimRef,
        object: &ResourceClaim,
    ) -> Result<Vec<KubeletDevice>> {
        self.prepare_fetched_all(&[(claim.clone(), object.clone())], &Cancel::new())
            .only_outcome()
    }

    /// Prepares the fetched claims of one call: one checkpoint write to record them started,
    /// their host directories and specs (the specs with one sync for all), their MPS daemons,
    /// and one write to record them completed. A claim that fails on the way is that claim's
    /// error and leaves nothing behind; once `cancel` is set, the claims not written yet are
    /// rolled back too. Blocking.
    pub fn prepare_fetched_all(
        &self,
        claims: &[(ClaimRef, ResourceClaim)],
        cancel: &Cancel,
    ) -> Vec<Result<Vec<KubeletDevice>>> {
        let claims: Vec<(ClaimRef, ResourceClaim, MpsUser)> = claims
            .iter()
            .map(|(c, o)| (c.clone(), o.clone(), Ok(None)))
            .collect();
        self.prepare_resolved_all(&claims, cancel)
    }

    /// [`CdiPreparer::prepare_fetched_all`], each claim with the user its MPS daemon serves.
    fn prepare_resolved_all(
        &self,
        claims: &[(ClaimRef, ResourceClaim, MpsUser)],
        cancel: &Cancel,
    ) -> Vec<Result<Vec<KubeletDevice>>> {
        let mut out: Outcomes<Vec<KubeletDevice>> = claims.iter().map(|_| None).collect();
        let started = match self.begin_all(claims, cancel, &mut out) {
            Ok(started) => started,
            Err(e) => return fail_unanswered(out, &e),
        };
        if started.is_empty() {
            return finish(out);
        }
        crash::point(crash::PREPARE_AFTER_CHECKPOINT_STARTED);
        let mut failed: Vec<(Started, Error)> = Vec::new();
        let mut writing: Vec<Started> = Vec::new();
        for s in started {
            let _span = s.claim.span("prepare").entered();
            if cancel.is_cancelled() {
                failed.push((s, Error::Cancelled));
                continue;
            }
            match create_host_dirs(&s.host_dirs) {
                Ok(()) => writing.push(s),
                Err(e) => failed.push((s, e)),
            }
        }
        crash::point(crash::PREPARE_AFTER_HOST_DIRS);
        let names: Vec<String> = writing
            .iter()
            .map(|s| cdi::spec_file_name(&s.uid))
            .collect();
        let files: Vec<(&str, &[u8])> = names
            .iter()
            .zip(&writing)
            .map(|(n, s)| (n.as_str(), s.spec.as_bytes()))
            .collect();
        let written = if cancel.is_cancelled() {
            files.iter().map(|_| Err(Error::Cancelled)).collect()
        } else {
            atomic_file::write_all(&self.config.cdi_dir, &files)
        };
        crash::point(crash::PREPARE_AFTER_CDI_WRITTEN);
        let mut done: Vec<Started> = Vec::new();
        for (s, result) in writing.into_iter().zip(written) {
            let _span = s.claim.span("prepare").entered();
            let result = result.and_then(|()| {
                if cancel.is_cancelled() {
                    return Err(Error::Cancelled);
                }
                match (&self.mps, &s.daemon) {
                    // Before "completed": kubelet starts the containers as soon as we answer,
                    // and their CUDA clients need the daemon's pipe.
                    (Some(supervisor), Some(daemon)) => supervisor.ensure(&s.uid, daemon),
                    _ => Ok(()),
                }
            });
            match result {
                Ok(()) => done.push(s),
                Err(e) => failed.push((s, e)),
            }
        }
        self.complete_all(done, failed, &mut out);
        finish(out)
    }

    /// Decides every claim against the inventory and records those to prepare as "prepare
    /// started" in one write; the others get their outcome in `out`. The inventory stays
    /// read-locked until the claims are recorded, so an inventory change (`reconfigure`) sees
    /// every claim prepared against the old one; the checkpoint is locked only to record.
    fn begin_all(
        &self,
        claims: &[(ClaimRef, ResourceClaim, MpsUser)],
        cancel: &Cancel,
        out: &mut Outcomes<Vec<KubeletDevice>>,
    ) -> Result<Vec<Started>> {
        let node = self.node.read().map_err(|_| poisoned("inventory"))?;
        let mut rendered = Vec::new();
        for (index, (claim, object, user)) in claims.iter().enumerate() {
            let _span = claim.span("prepare").entered();
            if cancel.is_cancelled() {
                out[index] = Some(Err(Error::Cancelled));
                continue;
            }
            let decided = claim.validate().and_then(|()| {
                let render = |mps_user| {
                    prepare_and_render_for_user(
                        object,
                        &self.config.driver_name,
                        &node,
                        &self.config.enforcement,
                        mps_user,
                    )
                };
                let (mut prepared, mut r) = render(None)?;
                // The user matters only to a claim that gets an MPS daemon.
                if r.mps_daemon.is_some() {
                    match user {
                        Ok(None) => {}
                        Ok(Some(uid)) => (prepared, r) = render(Some(*uid))?,
                        Err(Error::MpsUser(refusal)) => {
                            return Err(Error::MpsUser(refusal.clone()));
                        }
                        Err(e) => return Err(Error::Shared(e.to_string())),
                    }
                }
                let spec = r.spec.to_json()?;
                Ok((prepared, spec, r.host_dirs, r.mps_daemon))
            });
            match decided {
                Ok(d) => rendered.push((index, d)),
                Err(e) => out[index] = Some(Err(e)),
            }
        }
        let mut record = self.lock()?;
        let mut next = record.clone();
        let mut started = Vec::new();
        {
            let mut batch = next.batch();
            for (index, (prepared, spec, host_dirs, daemon)) in rendered {
                let claim = claims[index].0.clone();
                match prepared_in(batch.record(), &claim) {
                    Ok(None) => {}
                    Ok(Some(devices)) => {
                        out[index] = Some(Ok(devices));
                        continue;
                    }
                    Err(e) => {
                        out[index] = Some(Err(e));
                        continue;
                    }
                }
                let paths = host_dirs.iter().map(|d| d.path.clone()).collect();
                match batch.begin_prepare(&prepared, paths, daemon.clone()) {
                    Ok(Begin::AlreadyPrepared(devices)) => {
                        out[index] = Some(Ok(answer(&devices)));
                    }
                    Ok(Begin::Started) => {
                        started.push(Started {
                            index,
                            claim,
                            uid: prepared.uid.clone(),
                            spec,
                            host_dirs,
                            daemon,
                        });
                    }
                    Err(e) => out[index] = Some(Err(e.into())),
                }
            }
        }
        if !started.is_empty() {
            self.commit(&mut record, next)?;
        }
        Ok(started)
    }

    /// Records `done` as prepared and drops `failed` (their files removed first), in one write.
    fn complete_all(
        &self,
        done: Vec<Started>,
        failed: Vec<(Started, Error)>,
        out: &mut Outcomes<Vec<KubeletDevice>>,
    ) {
        let mut removing = Vec::new();
        for (s, _) in &failed {
            let _span = s.claim.span("prepare").entered();
            for dir in top_dirs(&s.dir_paths()) {
                if let Err(e) = self.reaper.discard(Path::new(dir)) {
                    warn!(claim = %s.claim, error = %e, "removing a failed claim's host directory failed");
                }
            }
            removing.push(cdi::spec_file_name(&s.uid));
        }
        let names: Vec<&str> = removing.iter().map(String::as_str).collect();
        for (result, (s, _)) in atomic_file::remove_all(&self.config.cdi_dir, &names)
            .into_iter()
            .zip(&failed)
        {
            let _span = s.claim.span("prepare").entered();
            if let Err(e) = result {
                warn!(claim = %s.claim, error = %e, "removing a failed claim's CDI spec failed; the next start removes it");
            }
        }
        let completed = (|| {
            let mut record = self.lock()?;
            let mut next = record.clone();
            let mut answers = Vec::new();
            for s in &done {
                answers.push(next.complete_prepare(&s.uid).map_err(Error::from));
            }
            for (s, _) in &failed {
                if next
                    .get(&s.uid)
                    .is_some_and(|e| e.state == PrepareState::PrepareStarted)
                {
                    next.remove(&s.uid);
                }
            }
            self.commit(&mut record, next)?;
            Ok::<_, Error>(answers)
        })();
        match completed {
            Ok(answers) => {
                crash::point(crash::PREPARE_AFTER_CHECKPOINT_COMPLETED);
                for (s, devices) in done.into_iter().zip(answers) {
                    let _span = s.claim.span("prepare").entered();
                    out[s.index] = Some(devices.map(|d| {
                        info!(claim = %s.claim, devices = d.len(), "prepared");
                        answer(&d)
                    }));
                }
            }
            Err(e) => {
                for s in done {
                    out[s.index] = Some(Err(shared(&e)));
                }
            }
        }
        for (s, e) in failed {
            out[s.index] = Some(Err(e));
        }
    }

    /// Fetches the claims the checkpoint does not answer, [`FETCHES_AT_ONCE`] at a time, each
    /// with the user of its containers when daemons are per user.
    async fn fetch_all(
        &self,
        claims: Vec<(usize, ClaimRef)>,
        out: &mut Outcomes<Vec<KubeletDevice>>,
    ) -> Vec<(usize, ClaimRef, ResourceClaim, MpsUser)> {
        let mut fetched = Vec::new();
        let mut waiting = claims.into_iter();
        let mut set = JoinSet::new();
        let users = match &self.config.enforcement {
            Enforcement::Mps { .. } => self.users.clone(),
            _ => None,
        };
        loop {
            while set.len() < FETCHES_AT_ONCE
                && let Some((index, claim)) = waiting.next()
            {
                let source = Arc::clone(&self.source);
                let users = users.clone();
                let span = claim.span("prepare");
                set.spawn(
                    async move {
                        let object = source.claim(&claim).await;
                        let user = match (&object, users) {
                            (Ok(object), Some(pods)) => claim_user(pods.as_ref(), object).await,
                            _ => Ok(None),
                        };
                        (index, claim, object.map(|o| (o, user)))
                    }
                    .instrument(span),
                );
            }
            match set.join_next().await {
                None => break,
                Some(Ok((index, claim, Ok((object, user))))) => {
                    fetched.push((index, claim, object, user));
                }
                Some(Ok((index, _, Err(e)))) => out[index] = Some(Err(e)),
                Some(Err(e)) => warn!(error = %Error::Task(e.to_string()), "claim fetch failed"),
            }
        }
        fetched.sort_by_key(|(index, _, _, _)| *index);
        fetched
    }
}

/// The Unix user the containers that use `claim` run as, from the pods it is reserved for
/// (`tessera_driver::node::mps_user::claim_user`). A pod that cannot be read is an error; a
/// pod that is gone is skipped.
async fn claim_user(pods: &dyn PodSource, claim: &ResourceClaim) -> MpsUser {
    let namespace = claim.metadata.namespace.as_deref().unwrap_or_default();
    let mut found = Vec::new();
    for consumer in tessera_driver::node::accounting::pod_consumers(claim) {
        if let Some(pod) = pods.pod(namespace, &consumer.name).await? {
            found.push(pod);
        }
    }
    tessera_driver::node::mps_user::claim_user(claim, &found).map_err(Error::MpsUser)
}

fn poisoned(what: &str) -> Error {
    Error::Task(format!("a thread panicked while holding the {what}"))
}

fn mismatch(claim: &ClaimRef, entry: &ClaimEntry) -> Error {
    Error::BadRequest(format!(
        "claim UID {} is prepared for {}/{}, not {}/{}",
        claim.uid.escape_debug(),
        entry.namespace,
        entry.name,
        claim.namespace.escape_debug(),
        claim.name.escape_debug()
    ))
}

/// The devices `record` holds for `claim` as prepared (`None`: not prepared); an error when
/// the UID is recorded for another namespace or name.
fn prepared_in(record: &Checkpoint, claim: &ClaimRef) -> Result<Option<Vec<KubeletDevice>>> {
    match record.get(&claim.uid) {
        Some(entry) if entry.state == PrepareState::PrepareCompleted => {
            if entry.namespace != claim.namespace || entry.name != claim.name {
                return Err(mismatch(claim, entry));
            }
            Ok(Some(answer(&entry.devices)))
        }
        _ => Ok(None),
    }
}

/// Creates a claim's host directories, each with its mode, through handles that never follow
/// a link ([`host_dirs::create`]).
fn create_host_dirs(dirs: &[HostDir]) -> Result<()> {
    dirs.iter().try_for_each(host_dirs::create)
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

/// Runs `work` on a blocking worker, inside the caller's span (the kubelet call's).
async fn blocking<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> Result<T> {
    let span = tracing::Span::current();
    tokio::task::spawn_blocking(move || span.in_scope(work))
        .await
        .map_err(|e| Error::Task(e.to_string()))
}

#[tonic::async_trait]
impl ClaimPreparer for CdiPreparer {
    async fn prepare_all(
        self: Arc<Self>,
        claims: Vec<ClaimRef>,
        cancel: Cancel,
    ) -> Vec<Result<Vec<KubeletDevice>>> {
        let mut out: Outcomes<Vec<KubeletDevice>> = claims.iter().map(|_| None).collect();
        // Answered from the checkpoint where it can, on a blocking worker (its lock is held
        // while it is written).
        let me = Arc::clone(&self);
        let known = blocking(move || {
            let record = me.lock()?;
            Ok::<_, Error>(
                claims
                    .into_iter()
                    .map(|claim| {
                        let known = claim.validate().and_then(|()| prepared_in(&record, &claim));
                        (claim, known)
                    })
                    .collect::<Vec<_>>(),
            )
        })
        .await
        .and_then(|r| r);
        let known = match known {
            Ok(known) => known,
            Err(e) => {
                for o in &mut out {
                    *o = Some(Err(shared(&e)));
                }
                return finish(out);
            }
        };
        let mut fetch = Vec::new();
        for (index, (claim, known)) in known.into_iter().enumerate() {
            match known {
                Ok(Some(devices)) => {
                    debug!(%claim, "already prepared");
                    out[index] = Some(Ok(devices));
                }
                Ok(None) => fetch.push((index, claim)),
                Err(e) => out[index] = Some(Err(e)),
            }
        }
        let fetched = self.fetch_all(fetch, &mut out).await;
        if fetched.is_empty() {
            return finish(out);
        }
        let (indices, items): (Vec<usize>, Vec<(ClaimRef, ResourceClaim, MpsUser)>) = fetched
            .into_iter()
            .map(|(i, c, o, u)| (i, (c, o, u)))
            .unzip();
        let me = Arc::clone(&self);
        match blocking(move || me.prepare_resolved_all(&items, &cancel)).await {
            Ok(results) => {
                for (index, result) in indices.into_iter().zip(results) {
                    out[index] = Some(result);
                }
            }
            Err(e) => {
                for index in indices {
                    out[index] = Some(Err(shared(&e)));
                }
            }
        }
        finish(out)
    }

    async fn unprepare_all(
        self: Arc<Self>,
        claims: Vec<ClaimRef>,
        cancel: Cancel,
    ) -> Vec<Result<()>> {
        let n = claims.len();
        match blocking(move || self.unprepare_all_blocking(&claims, &cancel)).await {
            Ok(results) => results,
            Err(e) => (0..n).map(|_| Err(shared(&e))).collect(),
        }
    }
}
