//! Holding each claim's processes together to its booking: the periodic pass that lists the
//! GPUs' processes, maps them to claims, asks `tessera_driver::node::accounting::judge` what to stop,
//! stops it and tells the pods.
//!
//! Each host part is a small seam with a deterministic fake:
//!
//! * [`GpuProcesses`]: the processes NVML lists on each GPU ([`crate::gpus::nvml::WrapperLibrary`],
//!   the discovery's NVML handle: both `nvmlDeviceGetComputeRunningProcesses` and
//!   `nvmlDeviceGetMPSComputeRunningProcesses`);
//! * [`HostProcesses`]: a process's cgroup and start time, and `SIGKILL` ([`ProcFs`], through a
//!   pidfd so that a reused pid is never hit);
//! * [`MpsControl`]: the daemon's `get_server_list`, `get_client_list` and `terminate_client`
//!   ([`BinaryMpsControl`] runs `nvidia-cuda-mps-control`; [`FakeMpsDaemon`] serves a real
//!   `SOCK_SEQPACKET` control socket, as the real daemon does);
//! * [`EventSink`]: the Event on the pod ([`KubeEvents`], through kube-runtime's `Recorder`;
//!   [`pod_event`] builds what it is handed).
//!
//! Who a process is comes from its cgroup (its pod), and which claims a pod uses from the
//! claims' `status.reservedFor`, fetched through the plugin's [`ClaimSource`] and cached; a
//! claim's consumers are fetched again (at most every [`CONSUMERS_REFRESH`]) when a pod nobody
//! knows uses a GPU the claim books. A pass that finds no booked GPU makes no NVML call.

mod events;
mod gpu_processes;
mod mps_control;
mod procfs;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tessera_driver::node::accounting::proc::{self, Skip};
use tessera_driver::node::accounting::{
    self, Consumer, Consumers, GpuProcess, Means, ProcessKey, Stop, Verdict,
};
use tessera_driver::node::checkpoint::Checkpoint;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use crate::claims::status::StatusReporter;
use crate::claims::{ClaimRef, ClaimSource};
use crate::error::{Error, Result};
use crate::ops::metrics::Metrics;

pub use events::{ACTION_STOP_PROCESSES, EventSink, KubeEvents, pod_event};
pub use gpu_processes::{GpuProcesses, ProcessUse};
pub use mps_control::{BinaryMpsControl, MpsControl};
pub use procfs::{HostProcesses, MAX_PROC_FILE, ProcFiles, ProcFs};
#[cfg(any(test, feature = "testing"))]
pub use {
    events::FakeEvents, events::RecordedEvent, gpu_processes::FakeGpu, mps_control::FakeMpsControl,
    mps_control::FakeMpsDaemon, procfs::FakeHostProcesses, procfs::stat_line,
};

/// How long a claim's cached consumers are trusted before an unknown pod on its GPU makes the
/// pass fetch them again.
pub const CONSUMERS_REFRESH: Duration = Duration::from_secs(30);

/// How long NVML may keep listing a process holding GPU memory after MPS said it terminated
/// the process's GPU work; then the process is killed.
pub const TERMINATE_CONFIRM: Duration = Duration::from_secs(5);

/// Where the pass reads the prepared claims from.
pub trait PreparedClaims: Send + Sync {
    /// The checkpoint as it is now.
    fn record(&self) -> Result<Checkpoint>;
}

impl PreparedClaims for crate::claims::preparer::CdiPreparer {
    fn record(&self) -> Result<Checkpoint> {
        crate::claims::preparer::CdiPreparer::record(self)
    }
}

/// The host parts the pass uses.
#[derive(Clone)]
pub struct Seams {
    /// The prepared claims.
    pub prepared: Arc<dyn PreparedClaims>,
    /// Claims, for their consumers.
    pub claims: Arc<dyn ClaimSource>,
    /// The GPUs' processes.
    pub gpus: Arc<dyn GpuProcesses>,
    /// `/proc`.
    pub host: Arc<dyn HostProcesses>,
    /// MPS control daemons.
    pub mps: Arc<dyn MpsControl>,
    /// Events on pods; `None` without an API server (then the log says it).
    pub events: Option<Arc<dyn EventSink>>,
}

/// What one pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PassReport {
    /// Processes NVML listed on booked GPUs (those that ended before they were read aside).
    pub processes: usize,
    /// Processes left out of the pass (their `/proc` files unreadable, or not saying whose
    /// they are), with the reason.
    pub skipped: Vec<(u32, Skip)>,
    /// Processes ended through MPS `terminate_client`.
    pub terminated: Vec<u32>,
    /// Processes killed.
    pub killed: Vec<u32>,
    /// Events recorded.
    pub events: usize,
}

#[derive(Debug, Default)]
struct State {
    consumers: BTreeMap<String, (Vec<Consumer>, Instant)>,
    asked: BTreeSet<ProcessKey>,
}

/// Runs accounting passes.
pub struct Accountant {
    seams: Seams,
    metrics: Option<Arc<Metrics>>,
    status: Option<Arc<StatusReporter>>,
    state: Mutex<State>,
    terminate_confirm: Duration,
}

impl std::fmt::Debug for Accountant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Accountant").finish_non_exhaustive()
    }
}

impl Accountant {
    /// An accountant over `seams`, counting into `metrics` when given.
    pub fn new(seams: Seams, metrics: Option<Arc<Metrics>>) -> Self {
        Self {
            seams,
            metrics,
            status: None,
            state: Mutex::new(State::default()),
            terminate_confirm: TERMINATE_CONFIRM,
        }
    }

    /// How long NVML may go on listing a process with memory after `terminate_client` before
    /// it is killed ([`TERMINATE_CONFIRM`] unless set).
    #[must_use]
    pub fn with_terminate_confirm(mut self, wait: Duration) -> Self {
        self.terminate_confirm = wait;
        self
    }

    /// Hands each pass's measure of every claim's use to `reporter` (the claims'
    /// `MemoryWithinBooking` condition).
    #[must_use]
    pub fn with_status(mut self, reporter: Arc<StatusReporter>) -> Self {
        self.status = Some(reporter);
        self
    }

    /// Measures each claim's use (`tessera_driver::node::accounting::usage`) for the metrics
    /// and the claims' status: every pass, so an ended claim's series go with it.
    fn report_use(&self, record: &Checkpoint, consumers: &Consumers, observed: &[GpuProcess]) {
        let measured = accounting::usage(record, consumers, observed);
        if let Some(m) = &self.metrics {
            m.observe_use(record, &measured, observed);
        }
        if let Some(reporter) = &self.status {
            reporter.observe_use(record, measured);
        }
    }

    fn state(&self) -> Result<MutexGuard<'_, State>> {
        self.state
            .lock()
            .map_err(|_| Error::Task("a thread panicked holding the accounting state".to_owned()))
    }

    /// One pass: list, map, judge, stop, tell.
    #[tracing::instrument(name = "accounting_pass", skip_all)]
    pub async fn pass(&self, now: Instant) -> Result<PassReport> {
        // The checkpoint's lock is held while a call writes the record: wait for it on a
        // blocking worker, never on an async one.
        let prepared = Arc::clone(&self.seams.prepared);
        let record = tokio::task::spawn_blocking(move || prepared.record())
            .await
            .map_err(|e| Error::Task(e.to_string()))??;
        let gpus = accounting::booked_gpus(&record);
        if gpus.is_empty() {
            self.state()?.asked.clear();
            self.report_use(&record, &Consumers::new(), &[]);
            return Ok(PassReport::default());
        }
        let seams = self.seams.clone();
        let Observed {
            processes: observed,
            skipped,
        } = tokio::task::spawn_blocking(move || observe(&seams, &gpus))
            .await
            .map_err(|e| Error::Task(e.to_string()))??;
        if let Some(m) = &self.metrics {
            for (_, skip) in &skipped {
                m.observe_accounting_skip(skip.label());
            }
        }
        let consumers = self.consumers(&record, &observed, now).await?;
        let asked = self.state()?.asked.clone();
        let verdict = accounting::judge(&record, &consumers, &observed, &asked);
        self.report_use(&record, &consumers, &observed);
        if !verdict.unattributed.is_empty() {
            debug!(pids = ?verdict.unattributed, "GPU processes of no claim that books their GPU");
        }
        let mut report = PassReport {
            processes: observed.len() + skipped.len(),
            skipped,
            ..PassReport::default()
        };
        if verdict.stops.is_empty() {
            self.forget_gone(&observed)?;
            return Ok(report);
        }
        let seams = self.seams.clone();
        let stops = verdict.stops.clone();
        let confirm = self.terminate_confirm;
        let done = tokio::task::spawn_blocking(move || {
            stops
                .iter()
                .map(|s| (s.clone(), stop(&seams, s, confirm)))
                .collect::<Vec<_>>()
        })
        .await
        .map_err(|e| Error::Task(e.to_string()))?;
        for (s, outcome) in done {
            match outcome {
                Ok(Some(how)) => {
                    warn!(pid = s.pid, gpu = %s.gpu_uuid, used_bytes = s.used_bytes, how = how.label(), "stopped a process of a claim over its GPU memory booking");
                    if let Some(m) = &self.metrics {
                        m.observe_accounting_stop(how.label());
                    }
                    match how {
                        Stopped::Terminated => {
                            self.state()?.asked.insert((s.pid, s.start_ticks));
                            report.terminated.push(s.pid);
                        }
                        Stopped::Killed => report.killed.push(s.pid),
                    }
                }
                Ok(None) => {
                    debug!(pid = s.pid, "the process ended before it was stopped");
                }
                Err(e) => {
                    warn!(pid = s.pid, gpu = %s.gpu_uuid, error = %e, "stopping a process over its claim's booking failed; trying again next pass");
                    if let Some(m) = &self.metrics {
                        m.observe_accounting_stop("failed");
                    }
                }
            }
        }
        report.events = self.tell(&verdict).await;
        self.forget_gone(&observed)?;
        Ok(report)
    }

    /// Keeps only the "asked to terminate" marks of processes still on a GPU.
    fn forget_gone(&self, observed: &[GpuProcess]) -> Result<()> {
        let live: BTreeSet<ProcessKey> = observed.iter().map(|p| (p.pid, p.start_ticks)).collect();
        let mut state = self.state()?;
        let asked = std::mem::take(&mut state.asked);
        state.asked = asked.intersection(&live).copied().collect();
        // Killed and terminated-this-pass processes stay marked until NVML stops listing them.
        Ok(())
    }

    async fn tell(&self, verdict: &Verdict) -> usize {
        let mut told = 0;
        for over in &verdict.over {
            let message = over.message();
            warn!(namespace = %over.namespace, pod = %over.pod_name, gpu = %over.gpu_uuid, booked_bytes = over.booked_bytes, used_bytes = over.used_bytes, "{message}");
            let Some(sink) = &self.seams.events else {
                continue;
            };
            match sink.record(over).await {
                Ok(()) => told += 1,
                Err(e) => {
                    warn!(namespace = %over.namespace, pod = %over.pod_name, error = %e, "recording the Event failed");
                }
            }
        }
        told
    }

    /// The consumers of every claim booking a listed GPU: cached, fetched when missing, and
    /// fetched again when a pod no consumer names uses a GPU the claim books.
    async fn consumers(
        &self,
        record: &Checkpoint,
        observed: &[GpuProcess],
        now: Instant,
    ) -> Result<Consumers> {
        let known: BTreeSet<String> = {
            let state = self.state()?;
            state
                .consumers
                .values()
                .flat_map(|(c, _)| c.iter().map(|c| c.uid.clone()))
                .collect()
        };
        let stranger_gpus: BTreeSet<&str> = observed
            .iter()
            .filter(|p| p.pod_uid.as_ref().is_some_and(|u| !known.contains(u)))
            .map(|p| p.gpu_uuid.as_str())
            .collect();
        let mut wanted = Vec::new();
        {
            let mut state = self.state()?;
            state
                .consumers
                .retain(|uid, _| record.claims.contains_key(uid));
            for (uid, entry) in &record.claims {
                let books: Vec<&str> = accounting::booked(entry).map(|(gpu, _)| gpu).collect();
                if books.is_empty() {
                    continue;
                }
                let refetch = match state.consumers.get(uid) {
                    None => true,
                    Some((_, at)) => {
                        now.saturating_duration_since(*at) >= CONSUMERS_REFRESH
                            && books.iter().any(|g| stranger_gpus.contains(g))
                    }
                };
                if refetch {
                    wanted.push(ClaimRef::new(&entry.namespace, &entry.name, uid));
                }
            }
        }
        for claim in wanted {
            match self.seams.claims.claim(&claim).await {
                Ok(object) => {
                    let found = accounting::pod_consumers(&object);
                    self.state()?
                        .consumers
                        .insert(claim.uid.clone(), (found, now));
                }
                Err(e) => {
                    warn!(claim = %claim, error = %e, "reading the claim's consumers failed; its processes stay unattributed until the next pass");
                }
            }
        }
        Ok(self
            .state()?
            .consumers
            .iter()
            .map(|(uid, (c, _))| (uid.clone(), c.clone()))
            .collect())
    }

    /// Runs a pass every `interval` until the task is aborted.
    pub fn spawn(self: Arc<Self>, interval: Duration) -> JoinHandle<()> {
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                if let Err(e) = self.pass(Instant::now()).await {
                    warn!(error = %e, "GPU memory accounting pass failed");
                }
            }
        })
    }
}

/// What a pass read about the booked GPUs' processes.
#[derive(Debug, Default)]
struct Observed {
    /// The processes to judge, with their pods and start times.
    processes: Vec<GpuProcess>,
    /// The processes left out of this pass, and why.
    skipped: Vec<(u32, Skip)>,
}

/// Lists the booked GPUs' processes with their pods and start times (blocking). A process whose
/// `/proc` files cannot be read, or whose bytes do not say whose it is
/// (`tessera_driver::node::accounting::proc::observe`), is left out of this pass with its
/// reason; it never fails the pass for the others.
fn observe(seams: &Seams, gpus: &BTreeSet<String>) -> Result<Observed> {
    let listed = seams.gpus.list(gpus)?;
    let mut out = Observed {
        processes: Vec::with_capacity(listed.len()),
        skipped: Vec::new(),
    };
    for p in listed {
        let files = match seams.host.read(p.pid) {
            Ok(Some(files)) => files,
            // A process that ended since NVML listed it is simply not there.
            Ok(None) => continue,
            Err(e) => {
                debug!(pid = p.pid, gpu = %p.gpu_uuid, error = %e, "cannot read the GPU process's /proc files; left out of this pass");
                out.skipped.push((p.pid, Skip::Unreadable));
                continue;
            }
        };
        match proc::observe(p.pid, &p.gpu_uuid, p.used_bytes, &files.stat, &files.cgroup) {
            Ok(process) => out.processes.push(process),
            Err(skip) => {
                debug!(pid = p.pid, gpu = %p.gpu_uuid, reason = skip.label(), "cannot tell whose the GPU process is; left out of this pass");
                out.skipped.push((p.pid, skip));
            }
        }
    }
    Ok(out)
}

/// How a process was stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stopped {
    Terminated,
    Killed,
}

impl Stopped {
    fn label(self) -> &'static str {
        match self {
            Self::Terminated => "mps_terminate",
            Self::Killed => "kill",
        }
    }
}

/// Stops one process (blocking): through the MPS daemon that serves it as a client, else by
/// `SIGKILL`. A `terminate_client` counts only once NVML confirms, within `confirm`, that the
/// process no longer holds GPU memory there; otherwise it is killed too. `None`: it was gone
/// already (or its pid now names another process).
fn stop(seams: &Seams, s: &Stop, confirm: Duration) -> Result<Option<Stopped>> {
    if let Means::MpsTerminate(daemons) = &s.means {
        match terminate(seams, daemons, s.pid) {
            Ok(true) => {
                if released(seams, s, confirm)? {
                    return Ok(Some(Stopped::Terminated));
                }
                warn!(
                    pid = s.pid,
                    gpu = %s.gpu_uuid,
                    "MPS said the client was terminated, but NVML still lists it holding GPU memory; killing it"
                );
            }
            Ok(false) => {
                info!(
                    pid = s.pid,
                    "no MPS server lists the process as its client; killing it"
                );
            }
            Err(e) => {
                warn!(pid = s.pid, error = %e, "MPS terminate_client failed; killing the process");
            }
        }
    }
    Ok(seams
        .host
        .kill(s.pid, s.start_ticks)?
        .then_some(Stopped::Killed))
}

/// Whether NVML stops listing `s`'s process on its GPU with memory held, within `wait`.
fn released(seams: &Seams, s: &Stop, wait: Duration) -> Result<bool> {
    let gpus = BTreeSet::from([s.gpu_uuid.clone()]);
    let deadline = Instant::now() + wait;
    loop {
        let holds = seams
            .gpus
            .list(&gpus)?
            .iter()
            .any(|p| p.pid == s.pid && p.gpu_uuid == s.gpu_uuid && p.used_bytes > 0);
        if !holds {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn terminate(
    seams: &Seams,
    daemons: &[tessera_driver::node::mps::MpsDaemon],
    pid: u32,
) -> Result<bool> {
    for daemon in daemons {
        for server in seams.mps.servers(daemon)? {
            if seams.mps.clients(daemon, server)?.contains(&pid) {
                seams.mps.terminate(daemon, server, pid)?;
                return Ok(true);
            }
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests;
