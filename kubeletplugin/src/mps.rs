//! Starting and supervising MPS control daemons: one per set of GPUs that prepared share claims
//! use (`tessera_driver::node::cdi::mps_daemon`), started before such a claim is reported prepared,
//! restarted with backoff when it dies, stopped when the last claim using it is unprepared,
//! and started again from the checkpoint after a restart. A daemon that already answers on its
//! control socket (left by an earlier run) is adopted, clients and all, never told to quit.
//!
//! Nothing is sent on a control socket, and no daemon is adopted, before the process listening
//! there is known to be the daemon: the supervisor records each daemon it starts ([`record`]),
//! and every probe, adoption and command first checks the socket's peer (`SO_PEERCRED`)
//! against that record (`tessera_driver::node::mps_peer`). The pipe directory is mounted
//! read-write into the share containers, so a tenant can replace the socket; such a socket is
//! an error for its GPU set, logged, and never spoken to.
//!
//! The supervisor runs in the node's `tessera-mps host` ([`host`]), outside the plugin's
//! container, so that neither a plugin restart nor a rollout of the plugin's `DaemonSet` touches
//! the daemons; with `--mps-daemons local` the plugin runs one itself.
//!
//! Processes are host behaviour, behind [`ProcessHost`]: [`OsProcessHost`] spawns real ones,
//! [`FakeProcessHost`] records the calls for unit tests.
//!
//! The host directories the node makes, the daemons' and the claims' alike, are made here
//! ([`host_dirs`]), through handles that never follow a link: the bottom wing, so that the
//! claims and the GPUs wings use the same code.

pub mod exec;
#[cfg(any(test, feature = "testing"))]
pub mod fake_control;
pub mod host;
pub mod host_dirs;
mod process;
pub mod record;
pub mod socket;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tessera_driver::node::checkpoint::Checkpoint;
use tessera_driver::node::mps::{self, ControlSocket, Launch, MpsDaemon, StartAction};
use tessera_driver::node::mps_peer::{self, PeerMismatch};
use tokio::task::JoinHandle;
use tracing::{error, info, warn};

use crate::error::{Error, Result};

use process::poll_until;
#[cfg(any(test, feature = "testing"))]
pub use process::{FakeProcessHost, HostCall};
pub use process::{OsProcessHost, ProcessHost, ProcessSpec};

/// How the supervisor runs daemons.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsConfig {
    /// The control binary, and the wrapper that gives it its mount namespace
    /// (`tessera_driver::node::mps::daemon_command`).
    pub launch: Launch,
    /// How long a starting daemon may take to answer on its control socket.
    pub ready_timeout: Duration,
    /// How long `quit` and the daemon's exit after it may take.
    pub quit_timeout: Duration,
}

impl MpsConfig {
    /// Defaults: 10 s to become ready, 10 s to quit, the control binary run directly (in the
    /// caller's mount namespace).
    pub fn new(control_binary: impl Into<PathBuf>) -> Self {
        Self {
            launch: Launch {
                control_binary: control_binary.into().display().to_string(),
                wrapper: None,
            },
            ready_timeout: Duration::from_secs(10),
            quit_timeout: Duration::from_secs(10),
        }
    }
}

/// A daemon that runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Process {
    /// Our child, with its id.
    Child(u32),
    /// A daemon an earlier run started, found answering on its control socket; alive while it
    /// answers.
    Adopted,
}

#[derive(Debug)]
struct Supervised {
    daemon: MpsDaemon,
    claims: BTreeSet<String>,
    process: Option<Process>,
    failures: u32,
    restart_at: Option<Instant>,
}

/// Whether the process listening on `daemon`'s control socket is the daemon `host` recorded:
/// `Ok(Ok(()))` then, `Ok(Err(why))` when someone else listens, an error when the socket or the
/// record cannot be read.
fn peer_of(
    host: &dyn ProcessHost,
    daemon: &MpsDaemon,
) -> Result<std::result::Result<(), PeerMismatch>> {
    let control = PathBuf::from(mps::control_socket(daemon));
    let peer = host.peer(&control)?;
    let record = host.record(daemon)?;
    Ok(mps_peer::check_peer(&daemon.id, record.as_ref(), &peer))
}

/// [`peer_of`], where a listener that is not the daemon is [`Error::MpsPeer`], logged.
fn check_peer(host: &dyn ProcessHost, daemon: &MpsDaemon) -> Result<()> {
    peer_of(host, daemon)?.map_err(|mismatch| {
        let socket = PathBuf::from(mps::control_socket(daemon));
        error!(daemon = %daemon.id, socket = %socket.display(), reason = %mismatch, "the MPS control socket is not answered by its daemon; nothing is sent to it");
        Error::MpsPeer {
            daemon: daemon.id.clone(),
            socket,
            mismatch,
        }
    })
}

/// How the preparer makes sure a claim's daemon runs: [`MpsSupervisor`] runs it itself,
/// [`HostedDaemons`] waits for the node's `tessera-mps host` to run it.
pub trait DaemonKeeper: Send + Sync {
    /// Returns once `daemon` answers for `claim` (the claim is already in the checkpoint).
    /// Blocking.
    fn ensure(&self, claim: &str, daemon: &MpsDaemon) -> Result<()>;
    /// `claim` no longer uses its daemon (it is gone from the checkpoint). Blocking.
    fn release(&self, claim: &str) -> Result<()>;
    /// The daemons `record`'s claims need, at start. Blocking.
    fn restore(&self, record: &Checkpoint) -> Result<()>;
}

/// Daemons run by the node's `tessera-mps host`, which follows the checkpoint: the plugin
/// only waits until a claim's daemon answers on its control socket.
#[derive(Debug)]
pub struct HostedDaemons {
    host: Arc<dyn ProcessHost>,
    ready_timeout: Duration,
}

impl HostedDaemons {
    /// Waits up to `ready_timeout` for each daemon, probing through `host`.
    pub fn new(host: Arc<dyn ProcessHost>, ready_timeout: Duration) -> Self {
        Self {
            host,
            ready_timeout,
        }
    }
}

impl DaemonKeeper for HostedDaemons {
    fn ensure(&self, claim: &str, daemon: &MpsDaemon) -> Result<()> {
        let control = PathBuf::from(mps::control_socket(daemon));
        // The host records a daemon as soon as it started it, before the daemon listens; a
        // socket that answers with no record yet is waited for, anyone else listening is not.
        let ready = poll_until(self.ready_timeout, || {
            if self.host.probe(&control) != ControlSocket::Answers {
                return Ok(false);
            }
            match peer_of(self.host.as_ref(), daemon)? {
                Ok(()) => Ok(true),
                Err(PeerMismatch::NoRecord) => Ok(false),
                Err(_) => check_peer(self.host.as_ref(), daemon).map(|()| true),
            }
        })?;
        if ready {
            return Ok(());
        }
        if self.host.probe(&control) == ControlSocket::Answers {
            check_peer(self.host.as_ref(), daemon)?;
        }
        Err(Error::Mps(format!(
            "MPS control daemon {} of claim {claim} did not answer on {} within {:?}: is the \
             tessera-mps host running on this node (its DaemonSet), and is its log clean?",
            daemon.id,
            control.display(),
            self.ready_timeout
        )))
    }

    fn release(&self, _claim: &str) -> Result<()> {
        // The host stops the daemon once the checkpoint no longer records a claim using it.
        Ok(())
    }

    fn restore(&self, _record: &Checkpoint) -> Result<()> {
        Ok(())
    }
}

impl DaemonKeeper for MpsSupervisor {
    fn ensure(&self, claim: &str, daemon: &MpsDaemon) -> Result<()> {
        MpsSupervisor::ensure(self, claim, daemon)
    }

    fn release(&self, claim: &str) -> Result<()> {
        MpsSupervisor::release(self, claim)
    }

    fn restore(&self, record: &Checkpoint) -> Result<()> {
        MpsSupervisor::restore(self, record)
    }
}

/// Keeps one MPS control daemon running per GPU set that prepared claims use.
#[derive(Debug)]
pub struct MpsSupervisor {
    config: MpsConfig,
    host: Arc<dyn ProcessHost>,
    daemons: Mutex<BTreeMap<String, Supervised>>,
}

impl MpsSupervisor {
    /// A supervisor running daemons on `host`.
    pub fn new(config: MpsConfig, host: Arc<dyn ProcessHost>) -> Self {
        Self {
            config,
            host,
            daemons: Mutex::new(BTreeMap::new()),
        }
    }

    fn lock(&self) -> Result<MutexGuard<'_, BTreeMap<String, Supervised>>> {
        self.daemons
            .lock()
            .map_err(|_| Error::Task("a thread panicked holding the MPS daemons".to_owned()))
    }

    /// Runs one control command (`get_server_list`, `ps`, `terminate_client <server> <pid>`,
    /// ...) against `daemon` through the control binary, as NVIDIA documents it; returns its
    /// output. Nothing is sent unless the recorded daemon listens on the socket
    /// ([`Error::MpsPeer`] otherwise). Blocking.
    pub fn control(&self, daemon: &MpsDaemon, command: &str) -> Result<String> {
        check_peer(self.host.as_ref(), daemon)?;
        let (program, args) = mps::control_command(&self.config.launch, daemon);
        let spec = ProcessSpec {
            program: PathBuf::from(program),
            args,
            env: mps::daemon_env(daemon),
        };
        self.host
            .run(&spec, &format!("{command}\n"), self.config.quit_timeout)
    }

    /// Sends `quit` to whatever daemon listens on `daemon`'s pipe directory.
    fn quit(&self, daemon: &MpsDaemon) -> Result<()> {
        self.control(daemon, mps::QUIT_COMMAND.trim_end()).map(drop)
    }

    /// Whether the daemon's process still runs: our child until it exits, an adopted daemon
    /// while it answers on its socket itself (a socket someone else took over is logged).
    fn alive(&self, daemon: &MpsDaemon, process: Process) -> Result<bool> {
        Ok(match process {
            Process::Child(pid) => !self.host.has_exited(pid)?,
            Process::Adopted => {
                self.host.probe(Path::new(&mps::control_socket(daemon))) == ControlSocket::Answers
                    && check_peer(self.host.as_ref(), daemon).is_ok()
            }
        })
    }

    /// Starts `daemon` and waits until it accepts clients; a daemon an earlier run of the
    /// plugin left that still answers is adopted instead (its clients keep working).
    fn start(&self, daemon: &MpsDaemon) -> Result<Process> {
        for dir in mps::daemon_dirs(daemon) {
            self.host.create_dir(&dir)?;
        }
        let control = PathBuf::from(mps::control_socket(daemon));
        match mps::start_action(self.host.probe(&control)) {
            StartAction::Adopt => {
                // Only the daemon an earlier run recorded is adopted; a tenant's listener on
                // the socket is an error for this GPU set (and it is not replaced: it is alive).
                check_peer(self.host.as_ref(), daemon)?;
                info!(daemon = %daemon.id, "adopted the MPS control daemon that answers on its socket");
                return Ok(Process::Adopted);
            }
            StartAction::Start { remove_stale } => {
                if remove_stale {
                    // A socket nobody accepts on: its daemon died. No `quit` (nothing would
                    // read it); the file goes so the new daemon can listen there.
                    info!(daemon = %daemon.id, "removing the socket of a daemon that died");
                    self.host.remove_file(&control)?;
                }
            }
        }
        // No record while no daemon runs: whoever answers before the new one is recorded is
        // waited for, never taken for it.
        self.host.set_record(daemon, None)?;
        let (program, args) = mps::daemon_command(&self.config.launch, daemon);
        let pid = self.host.spawn(&ProcessSpec {
            program: PathBuf::from(program),
            args,
            env: mps::daemon_env(daemon),
        })?;
        if let Err(e) = self.host.set_record(daemon, Some(pid)) {
            let _ = self.host.stop(pid, Duration::ZERO);
            return Err(e);
        }
        let mut exited = false;
        let ready = poll_until(self.config.ready_timeout, || {
            exited = self.host.has_exited(pid)?;
            Ok(exited || self.host.probe(&control) == ControlSocket::Answers)
        })?;
        if ready && !exited {
            // Whoever answers must be the child just started, not a listener that got there
            // first.
            if let Err(e) = check_peer(self.host.as_ref(), daemon) {
                let _ = self.host.stop(pid, Duration::ZERO);
                return Err(e);
            }
            info!(daemon = %daemon.id, pid, devices = %daemon.devices.join(","), "MPS control daemon started");
            return Ok(Process::Child(pid));
        }
        let _ = self.host.stop(pid, Duration::ZERO);
        Err(Error::Mps(format!(
            "MPS control daemon {} ({}) {}",
            daemon.id,
            self.config.launch.control_binary,
            if exited {
                format!(
                    "exited while starting; see its log directory {} and the supervisor's log{}",
                    daemon.log_dir,
                    if self.config.launch.wrapper.is_some() {
                        " (its mount namespace needs CAP_SYS_ADMIN)"
                    } else {
                        ""
                    }
                )
            } else {
                format!(
                    "did not answer on {} within {:?}",
                    control.display(),
                    self.config.ready_timeout
                )
            }
        )))
    }

    /// Makes sure `daemon` runs for `claim`: starts it (and waits until it accepts clients)
    /// unless it already runs. Blocking.
    pub fn ensure(&self, claim: &str, daemon: &MpsDaemon) -> Result<()> {
        let mut daemons = self.lock()?;
        let running = match daemons.get(&daemon.id).and_then(|s| s.process) {
            Some(process) => self.alive(daemon, process)?,
            None => false,
        };
        if !running {
            let process = self.start(daemon)?;
            let entry = daemons
                .entry(daemon.id.clone())
                .or_insert_with(|| Supervised {
                    daemon: daemon.clone(),
                    claims: BTreeSet::new(),
                    process: None,
                    failures: 0,
                    restart_at: None,
                });
            entry.process = Some(process);
            entry.restart_at = None;
        }
        if let Some(entry) = daemons.get_mut(&daemon.id) {
            entry.claims.insert(claim.to_owned());
        }
        Ok(())
    }

    /// Forgets `claim`; a daemon no claim uses any more is stopped (`quit`, then killed if it
    /// does not exit). Blocking; failures to stop are logged, the daemon is forgotten anyway.
    pub fn release(&self, claim: &str) -> Result<()> {
        let mut daemons = self.lock()?;
        let idle: Vec<String> = daemons
            .iter_mut()
            .filter_map(|(id, s)| {
                (s.claims.remove(claim) && s.claims.is_empty()).then(|| id.clone())
            })
            .collect();
        for id in idle {
            let Some(s) = daemons.remove(&id) else {
                continue;
            };
            let quit = self.quit(&s.daemon);
            if let Err(e) = &quit {
                warn!(daemon = %id, error = %e, "quit failed; stopping the process");
            }
            let stopped = match s.process {
                Some(Process::Child(pid)) => {
                    self.host.stop(pid, self.config.quit_timeout)?;
                    true
                }
                _ => quit.is_ok(),
            };
            // The record goes with the daemon; an adopted daemon that was not reached keeps
            // it (it may still run, and only its record lets anyone speak to it again).
            if stopped {
                self.host.set_record(&s.daemon, None)?;
            }
            info!(daemon = %id, "MPS control daemon stopped: no claim uses it");
        }
        Ok(())
    }

    /// Starts every daemon `record`'s claims need (after a plugin restart). A daemon that does
    /// not start is retried by [`MpsSupervisor::check`]. Blocking.
    pub fn restore(&self, record: &Checkpoint) -> Result<()> {
        let now = Instant::now();
        for (id, wanted) in mps::wanted_daemons(record.mps_daemons()) {
            let process = match self.start(&wanted.daemon) {
                Ok(process) => Some(process),
                Err(e) => {
                    warn!(daemon = %id, error = %e, "MPS control daemon did not start; will retry");
                    None
                }
            };
            self.lock()?.insert(
                id,
                Supervised {
                    daemon: wanted.daemon,
                    claims: wanted.claims,
                    failures: u32::from(process.is_none()),
                    restart_at: process.is_none().then(|| now + mps::restart_delay(1)),
                    process,
                },
            );
        }
        Ok(())
    }

    /// Restarts the daemons that died, each after its backoff delay. Blocking.
    pub fn check(&self, now: Instant) -> Result<()> {
        let mut daemons = self.lock()?;
        for (id, s) in daemons.iter_mut() {
            if let Some(process) = s.process {
                if self.alive(&s.daemon, process)? {
                    continue;
                }
                s.process = None;
                s.failures = s.failures.saturating_add(1);
                let delay = mps::restart_delay(s.failures);
                warn!(daemon = %id, ?process, failures = s.failures, ?delay, "MPS control daemon died; restarting");
                s.restart_at = Some(now + delay);
            }
            if s.restart_at.is_some_and(|at| now >= at) {
                match self.start(&s.daemon) {
                    Ok(process) => {
                        s.process = Some(process);
                        s.restart_at = None;
                    }
                    Err(e) => {
                        s.failures = s.failures.saturating_add(1);
                        let delay = mps::restart_delay(s.failures);
                        warn!(daemon = %id, error = %e, ?delay, "MPS control daemon restart failed");
                        s.restart_at = Some(now + delay);
                    }
                }
            }
        }
        Ok(())
    }

    /// The claims whose daemons are supervised now.
    pub fn claims(&self) -> Result<BTreeSet<String>> {
        Ok(self
            .lock()?
            .values()
            .flat_map(|s| s.claims.iter().cloned())
            .collect())
    }

    /// The daemons supervised now, by id, with the claims using each.
    pub fn daemons(&self) -> Result<BTreeMap<String, BTreeSet<String>>> {
        Ok(self
            .lock()?
            .iter()
            .map(|(id, s)| (id.clone(), s.claims.clone()))
            .collect())
    }

    /// A daemon that stayed up resets its failure count: backoff is for crash loops.
    fn settle(&self) -> Result<()> {
        for s in self.lock()?.values_mut() {
            if s.process.is_some() {
                s.failures = 0;
            }
        }
        Ok(())
    }

    /// Checks the daemons every `interval` on a blocking worker, until the task is aborted.
    pub fn spawn_watchdog(self: Arc<Self>, interval: Duration) -> JoinHandle<()> {
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut ticks: u32 = 0;
            loop {
                ticker.tick().await;
                ticks = ticks.wrapping_add(1);
                let me = Arc::clone(&self);
                let settle = ticks.is_multiple_of(60);
                let outcome = tokio::task::spawn_blocking(move || {
                    me.check(Instant::now())?;
                    if settle { me.settle() } else { Ok(()) }
                })
                .await;
                match outcome {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => warn!(error = %e, "checking MPS daemons failed"),
                    Err(e) => warn!(error = %e, "MPS watchdog worker failed"),
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {

    use tessera_driver::node::checkpoint::{ClaimEntry, PrepareState};
    use tessera_driver::testing::mps_daemon as daemon;

    use super::*;

    fn supervisor(host: &Arc<FakeProcessHost>) -> MpsSupervisor {
        let mut config = MpsConfig::new("/usr/bin/nvidia-cuda-mps-control");
        config.ready_timeout = Duration::from_millis(100);
        MpsSupervisor::new(config, Arc::clone(host) as Arc<dyn ProcessHost>)
    }

    /// A prepared claim `name` using `daemon`.
    fn entry(name: &str, daemon: MpsDaemon) -> ClaimEntry {
        ClaimEntry {
            namespace: "ns".to_owned(),
            name: name.to_owned(),
            state: PrepareState::PrepareCompleted,
            devices: Vec::new(),
            host_dirs: Vec::new(),
            mps_daemon: Some(daemon),
        }
    }

    /// A host where an earlier run left the daemon of `GPU-1`, its socket answering or not.
    fn with_leftover(answers: bool) -> Arc<FakeProcessHost> {
        let host = Arc::new(FakeProcessHost::new());
        host.leftover_daemon(&daemon(&["GPU-1"]), answers);
        host
    }

    /// A supervisor on `host` that has ensured the daemon of `GPU-1` for claim `a`; and that
    /// daemon.
    fn ensured_for_a(host: &Arc<FakeProcessHost>) -> (MpsDaemon, MpsSupervisor) {
        let sup = supervisor(host);
        let d = daemon(&["GPU-1"]);
        sup.ensure("a", &d).unwrap();
        (d, sup)
    }

    fn spawns(host: &FakeProcessHost) -> Vec<(ProcessSpec, u32)> {
        host.calls()
            .into_iter()
            .filter_map(|c| match c {
                HostCall::Spawn(s, pid) => Some((s, pid)),
                _ => None,
            })
            .collect()
    }

    fn quits(host: &FakeProcessHost) -> usize {
        host.calls()
            .iter()
            .filter(|c| matches!(c, HostCall::Run(_, input) if input == "quit\n"))
            .count()
    }

    #[test]
    fn the_first_claim_starts_the_daemon_and_the_last_one_stops_it() {
        let host = Arc::new(FakeProcessHost::new());
        let (d, sup) = ensured_for_a(&host);
        sup.ensure("b", &d).unwrap();
        let started = spawns(&host);
        assert_eq!(started.len(), 1, "one daemon per GPU set");
        let (spec, pid) = &started[0];
        assert_eq!(spec.args, ["-f"]);
        assert!(
            spec.env
                .contains(&("CUDA_VISIBLE_DEVICES".to_owned(), "GPU-1".to_owned()))
        );
        assert!(
            host.calls()
                .contains(&HostCall::CreateDir(PathBuf::from(&d.pipe_dir)))
        );

        sup.release("a").unwrap();
        assert_eq!(quits(&host), 0);
        sup.release("b").unwrap();
        assert_eq!(quits(&host), 1);
        assert!(host.calls().contains(&HostCall::Stop(*pid)));
        assert!(sup.daemons().unwrap().is_empty());
    }

    #[test]
    fn with_a_wrapper_the_daemon_starts_through_it_with_its_shm_directory() {
        let host = Arc::new(FakeProcessHost::new());
        let mut config = MpsConfig::new("/usr/bin/nvidia-cuda-mps-control");
        config.launch.wrapper = Some(mps::Wrapper {
            program: "/usr/local/bin/tessera-mps".to_owned(),
            driver_root: "/driver-root".to_owned(),
        });
        let sup = MpsSupervisor::new(config, Arc::clone(&host) as Arc<dyn ProcessHost>);
        let d = daemon(&["GPU-1"]);
        sup.ensure("a", &d).unwrap();
        let (spec, _) = &spawns(&host)[0];
        assert_eq!(spec.program, PathBuf::from("/usr/local/bin/tessera-mps"));
        assert!(spec.args.contains(&d.shm_dir));
        assert!(
            host.calls()
                .contains(&HostCall::CreateDir(PathBuf::from(&d.shm_dir)))
        );
        sup.release("a").unwrap();
        let quit = host
            .calls()
            .into_iter()
            .find_map(|c| match c {
                HostCall::Run(spec, _) => Some(spec),
                _ => None,
            })
            .unwrap();
        assert_eq!(quit.program, PathBuf::from("/usr/local/bin/tessera-mps"));
        assert!(quit.args.contains(&d.pipe_dir), "{:?}", quit.args);
    }

    #[test]
    fn a_daemon_that_dies_is_restarted_after_its_backoff() {
        let host = Arc::new(FakeProcessHost::new());
        let (_d, sup) = ensured_for_a(&host);
        let pid = spawns(&host)[0].1;
        host.kill(pid);
        let t0 = Instant::now();
        sup.check(t0).unwrap();
        assert_eq!(spawns(&host).len(), 1, "not before the delay");
        sup.check(t0 + Duration::from_millis(999)).unwrap();
        assert_eq!(spawns(&host).len(), 1);
        sup.check(t0 + Duration::from_secs(1)).unwrap();
        assert_eq!(spawns(&host).len(), 2);

        host.kill(spawns(&host)[1].1);
        let t1 = t0 + Duration::from_secs(2);
        sup.check(t1).unwrap();
        sup.check(t1 + Duration::from_secs(1)).unwrap();
        assert_eq!(spawns(&host).len(), 2, "the second death waits 2 s");
        sup.check(t1 + Duration::from_secs(2)).unwrap();
        assert_eq!(spawns(&host).len(), 3);
    }

    #[test]
    fn a_daemon_that_never_gets_ready_fails_the_claim() {
        let host = Arc::new(FakeProcessHost::new());
        host.never_ready();
        let sup = supervisor(&host);
        let err = sup.ensure("a", &daemon(&["GPU-1"])).unwrap_err();
        assert!(err.to_string().contains("did not answer"), "{err}");
        assert!(host.alive().is_empty(), "the stuck process is stopped");
        assert!(sup.daemons().unwrap().is_empty());
    }

    #[test]
    fn a_restart_starts_the_daemons_the_checkpoint_records() {
        let host = Arc::new(FakeProcessHost::new());
        let sup = supervisor(&host);
        let mut record = Checkpoint::new("b");
        for (uid, d) in [
            ("a", daemon(&["GPU-1"])),
            ("b", daemon(&["GPU-1", "GPU-2"])),
        ] {
            record.claims.insert(uid.to_owned(), entry(uid, d));
        }
        sup.restore(&record).unwrap();
        assert_eq!(spawns(&host).len(), 2);
        sup.release("b").unwrap();
        assert_eq!(quits(&host), 1);
        assert_eq!(sup.daemons().unwrap().len(), 1);
    }

    #[test]
    fn a_daemon_an_earlier_run_left_is_adopted_when_it_answers() {
        let host = with_leftover(true);
        let (d, sup) = ensured_for_a(&host);
        sup.ensure("b", &d).unwrap();
        assert!(spawns(&host).is_empty(), "its clients keep their server");
        assert_eq!(
            quits(&host),
            0,
            "a daemon that answers is never told to quit"
        );
        sup.check(Instant::now()).unwrap();
        assert!(
            spawns(&host).is_empty(),
            "an adopted daemon that answers is alive"
        );
        sup.release("a").unwrap();
        assert_eq!(quits(&host), 0, "claim b still uses it");
        sup.release("b").unwrap();
        assert_eq!(quits(&host), 1, "stopped after its last claim");
    }

    #[test]
    fn a_dead_daemons_socket_is_removed_without_quit_and_a_new_daemon_starts() {
        let host = with_leftover(false);
        let (d, _sup) = ensured_for_a(&host);
        assert_eq!(quits(&host), 0);
        assert!(
            host.calls()
                .contains(&HostCall::RemoveFile(PathBuf::from(mps::control_socket(
                    &d
                ))))
        );
        assert_eq!(spawns(&host).len(), 1);
    }

    #[test]
    fn an_adopted_daemon_that_stops_answering_is_restarted() {
        let host = with_leftover(true);
        let (_d, sup) = ensured_for_a(&host);
        host.kill(1);
        let t0 = Instant::now();
        sup.check(t0).unwrap();
        sup.check(t0 + Duration::from_secs(1)).unwrap();
        assert_eq!(spawns(&host).len(), 1);
    }

    #[test]
    fn a_started_daemon_is_recorded_and_its_record_goes_when_it_stops() {
        let host = Arc::new(FakeProcessHost::new());
        let (d, sup) = ensured_for_a(&host);
        let pid = spawns(&host)[0].1;
        assert_eq!(host.record(&d).unwrap().map(|r| r.pid), Some(pid));
        sup.release("a").unwrap();
        assert_eq!(host.record(&d).unwrap(), None);
    }

    #[test]
    fn a_tenant_listening_on_a_leftover_daemons_socket_is_not_adopted_nor_sent_anything() {
        let host = with_leftover(true);
        let d = daemon(&["GPU-1"]);
        host.impostor(&d, 666);
        let sup = supervisor(&host);
        let err = sup.ensure("a", &d).unwrap_err();
        assert!(
            matches!(
                &err,
                Error::MpsPeer {
                    mismatch: PeerMismatch::OtherProcess { found: 666, .. },
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("nothing was sent"), "{err}");
        assert!(host.commands().is_empty(), "{:?}", host.commands());
        assert!(
            spawns(&host).is_empty(),
            "its socket is taken: no second daemon"
        );
        assert!(sup.daemons().unwrap().is_empty());
    }

    #[test]
    fn quit_is_never_sent_to_a_tenant_that_took_over_the_socket_and_the_daemon_still_stops() {
        let host = Arc::new(FakeProcessHost::new());
        let (d, sup) = ensured_for_a(&host);
        let pid = spawns(&host)[0].1;
        host.impostor(&d, 666);
        sup.release("a").unwrap();
        assert!(host.commands().is_empty(), "{:?}", host.commands());
        assert!(host.calls().contains(&HostCall::Stop(pid)));
        assert!(!host.alive().contains(&pid));
    }

    #[test]
    fn an_adopted_daemon_whose_socket_a_tenant_took_over_is_not_alive_and_not_readopted() {
        let host = with_leftover(true);
        let (d, sup) = ensured_for_a(&host);
        host.impostor(&d, 666);
        let t0 = Instant::now();
        sup.check(t0).unwrap();
        sup.check(t0 + Duration::from_secs(1)).unwrap();
        assert!(spawns(&host).is_empty());
        assert!(host.commands().is_empty());
        assert_eq!(
            sup.daemons().unwrap().len(),
            1,
            "still supervised, retried with backoff"
        );
    }

    #[test]
    fn the_plugin_waits_for_the_hosts_daemon_and_refuses_a_tenants_listener() {
        let host = Arc::new(FakeProcessHost::new());
        let d = daemon(&["GPU-1"]);
        host.leftover_daemon(&d, true);
        let hosted = HostedDaemons::new(
            Arc::clone(&host) as Arc<dyn ProcessHost>,
            Duration::from_millis(100),
        );
        hosted.ensure("a", &d).unwrap();
        host.impostor(&d, 666);
        let err = hosted.ensure("a", &d).unwrap_err();
        assert!(matches!(err, Error::MpsPeer { .. }), "{err}");
    }

    #[test]
    fn a_missing_binary_is_retried_by_the_watchdog() {
        let host = Arc::new(FakeProcessHost::new());
        host.fail_spawns(true);
        let sup = supervisor(&host);
        let mut record = Checkpoint::new("b");
        record
            .claims
            .insert("a".to_owned(), entry("a", daemon(&["GPU-1"])));
        let t0 = Instant::now();
        sup.restore(&record).unwrap();
        host.fail_spawns(false);
        sup.check(t0 + Duration::from_secs(2)).unwrap();
        assert_eq!(spawns(&host).len(), 1);
    }
}
