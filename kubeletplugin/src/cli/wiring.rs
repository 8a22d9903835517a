//! The wiring of the kubelet plugin: from the parsed [`Args`] to the running process (logs,
//! the async runtime, discovery, the claim source, the preparer, the sockets, the accounting,
//! the publisher, the operations tasks), and its stop on SIGTERM or SIGINT.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use tessera_driver::node::cdi::Enforcement;
use tessera_driver::node::gpu_mode::ModeChoice;
use tessera_driver::node::health::GpuHealthTracker;
use tessera_driver::node::inventory::NodeInventory;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::accounting::{
    Accountant, BinaryMpsControl, EventSink, GpuProcesses, KubeEvents, PreparedClaims, ProcFs,
    Seams,
};
use crate::claims::apiserver::ApiClaimSource;
use crate::claims::preparer::{CdiPreparer, CdiPreparerConfig, ClaimPreparer};
use crate::claims::status::{KubeClaimStatus, PreparedState, StatusReporter, StatusReporting};
use crate::claims::{ClaimSource, FakeClaimSource, PodSource};
use crate::cli::args::{Args, EnforcementKind, GpuBackend, MpsDaemons, MpsUsers};
use crate::cli::ops_tasks::{Ops, OpsConfig};
use crate::gpus::discovery::{ChosenModes, FakeDiscovery, GpuDiscovery};
use crate::gpus::driver_files;
use crate::gpus::inventory_poller::WakeOnRelease;
use crate::gpus::isolation::{ChildProbe, FakeProbe, IsolationProbe, Verified};
use crate::gpus::mig_minors::ProcMigMinors;
use crate::gpus::node_labels;
use crate::gpus::nvml::{NvmlDiscovery, NvmlHealthWatcher, NvmlLibrary, WrapperLibrary};
use crate::kubelet::health_stream::{self, HealthReporter};
use crate::kubelet::server::{self, PluginConfig};
use crate::mps::{DaemonKeeper, HostedDaemons, MpsConfig, MpsSupervisor, OsProcessHost};
use crate::ops::init_logs;
use crate::ops::metrics::{MeteredPreparer, Metrics};
use crate::publisher::{PublisherConfig, SlicePublisher};

/// A background task of the plugin, aborted at shutdown.
type Task = JoinHandle<()>;

/// The NVML library and the GPUs' health, shared by discovery and the event watcher (the
/// library also by the accounting: one NVML handle in the process).
pub type NvmlParts = (Arc<WrapperLibrary>, Arc<Mutex<GpuHealthTracker>>);

/// Where claims and the pods they are reserved for come from (one object, two seams), and
/// the slice publisher that runs beside an API source.
type Sources = (Arc<dyn ClaimSource>, Arc<dyn PodSource>, Option<Task>);

impl Args {
    /// Parses the command line and runs the plugin until SIGTERM or SIGINT.
    pub fn parse_and_run() -> anyhow::Result<()> {
        let args = Self::parse();
        init_logs(args.log_format);
        // A node agent serves a handful of kubelet calls: two workers and a small blocking
        // pool (prepare runs there) keep its footprint small on many-core nodes.
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .max_blocking_threads(16)
            .enable_all()
            .build()
            .context("starting the async runtime")?
            // The stop signal is watched before anything serves (tessera_kubeapi::signals).
            .block_on(async { args.run(tessera_kubeapi::signals::shutdown()).await })
    }

    /// The NVML library to open: a bare file name is looked for under a `--driver-root` other
    /// than `/` (the chart mounts the host's driver root there), else opened as given.
    pub fn nvml_library_path(&self) -> anyhow::Result<PathBuf> {
        let bare = self.nvml_library.parent() == Some(Path::new(""));
        if bare && self.launch.driver_root != Path::new("/") {
            let found = driver_files::find(
                &self.launch.driver_root,
                &tessera_driver::node::driver_root::LIBRARY_DIRS,
                &self.nvml_library.display().to_string(),
            )?;
            info!(library = %found.outside.display(), "NVML from the driver root");
            return Ok(found.outside);
        }
        Ok(self.nvml_library.clone())
    }

    /// The GPU discovery the flags choose, and for NVML the library and the GPUs' health the
    /// event watcher feeds.
    pub fn discovery(&self) -> anyhow::Result<(Arc<dyn GpuDiscovery>, Option<NvmlParts>)> {
        match self.gpu_backend {
            GpuBackend::Nvml => {
                let lib = Arc::new(WrapperLibrary::open(&self.nvml_library_path()?)?);
                let discovery = NvmlDiscovery::new(
                    Arc::clone(&lib) as Arc<dyn NvmlLibrary>,
                    self.node_name.clone(),
                    &self.sysfs_root,
                    Arc::new(ProcMigMinors::new(&self.mig_minors_file)),
                );
                let health = discovery.health();
                Ok((Arc::new(discovery), Some((lib, health))))
            }
            GpuBackend::Fake => {
                let path = self
                    .fake_inventory
                    .clone()
                    .context("--gpu-backend fake needs --fake-inventory")?;
                Ok((
                    Arc::new(FakeDiscovery::new(path, self.node_name.clone())),
                    None,
                ))
            }
        }
    }

    /// The mode choice of the flags, and the effective choice with the node's labels over
    /// them (read before the first discovery, so the first publication has the chosen modes; a
    /// Node that cannot be read now is read again at every poll).
    async fn initial_modes(
        &self,
        client: Option<&kube::Client>,
    ) -> anyhow::Result<(ModeChoice, Arc<RwLock<ModeChoice>>)> {
        let flags = self.mode_flags()?;
        let choice = Arc::new(RwLock::new(flags.clone()));
        if let Some(client) = client {
            match node_labels::read(client, &self.node_name).await {
                Ok(labels) => {
                    node_labels::take(&choice, &flags, &labels);
                }
                Err(e) => {
                    warn!(error = %e, "reading the node's GPU mode labels failed; using the flags");
                }
            }
        }
        Ok((flags, choice))
    }

    /// Where claims come from: the `--fake-claims` file, or the API server (then the slice
    /// publisher follows `inventory` too).
    fn claim_source(
        &self,
        client: Option<&kube::Client>,
        inventory: tokio::sync::watch::Receiver<NodeInventory>,
    ) -> anyhow::Result<Sources> {
        if let Some(path) = &self.fake_claims {
            let text = crate::claims::input_file::read_text(path, "--fake-claims")?;
            let source = Arc::new(FakeClaimSource::from_yaml(
                &text,
                &path.display().to_string(),
            )?);
            return Ok((Arc::clone(&source) as Arc<dyn ClaimSource>, source, None));
        }
        let client = client
            .cloned()
            .context("an API client exists without --fake-claims")?;
        let publisher = SlicePublisher::new(
            client.clone(),
            PublisherConfig {
                enforcement: Some(self.enforcement.as_str().to_owned()),
                ..PublisherConfig::new(self.driver_name.clone(), self.node_name.clone())
            },
        );
        let publishing = Arc::new(publisher).spawn(inventory);
        let source = Arc::new(ApiClaimSource::new(client));
        Ok((
            Arc::clone(&source) as Arc<dyn ClaimSource>,
            source,
            Some(publishing),
        ))
    }

    /// The isolation probe's own MPS daemons under `--enforcement mps`: started by the plugin
    /// itself, the way `--mps-daemons local` starts them, whichever keeper serves containers
    /// (a node's `tessera-mps host` follows the checkpoint, where no probe is recorded).
    fn probe_daemons(&self) -> anyhow::Result<Option<Arc<dyn DaemonKeeper>>> {
        if self.enforcement != EnforcementKind::Mps {
            return Ok(None);
        }
        let mut config = MpsConfig::new("");
        config.launch = self.launch.launch()?;
        config.ready_timeout = Duration::from_secs(self.mps_ready_seconds);
        Ok(Some(Arc::new(MpsSupervisor::new(
            config,
            Arc::new(OsProcessHost::new()),
        ))))
    }

    /// The probe that proves the node's isolation: the fake inventory's answers with
    /// `--gpu-backend fake`, else the plugin's own binary as a child in a claim's environment.
    /// Under MPS the probe has daemons of its own (`<pipe dir root>/probe/…`), so it never
    /// starts, adopts or quits a daemon that serves containers.
    fn isolation_probe(&self) -> anyhow::Result<Arc<dyn IsolationProbe>> {
        Ok(match self.gpu_backend {
            GpuBackend::Fake => Arc::new(FakeProbe::new()),
            GpuBackend::Nvml => {
                let enforcement = match self.enforcement() {
                    Enforcement::Mps {
                        pipe_dir_root,
                        log_dir_root,
                    } => Enforcement::Mps {
                        pipe_dir_root: format!("{}/probe", pipe_dir_root.trim_end_matches('/')),
                        log_dir_root: format!("{}/probe", log_dir_root.trim_end_matches('/')),
                    },
                    other => other,
                };
                Arc::new(
                    ChildProbe::of_this_binary(
                        enforcement,
                        self.probe_daemons()?,
                        Duration::from_secs(self.isolation_probe_timeout_seconds),
                    )
                    .context("finding the plugin's own binary for the isolation probe")?,
                )
            }
        })
    }

    /// The node's discovery: `backend` with the chosen modes, every shared GPU's isolation
    /// proven (`crate::gpus::isolation`) before the inventory is published or prepared from.
    fn verified_discovery(
        &self,
        backend: Arc<dyn GpuDiscovery>,
        choice: &Arc<RwLock<ModeChoice>>,
        metrics: &Arc<Metrics>,
    ) -> anyhow::Result<Arc<Verified>> {
        Ok(Arc::new(
            Verified::new(
                Arc::new(ChosenModes::new(backend, Arc::clone(choice))),
                self.isolation_probe()?,
                self.enforcement.as_str(),
                self.accept_unverified_isolation,
            )
            .with_metrics(Arc::clone(metrics)),
        ))
    }

    /// The preparer, with its MPS supervisor (and the supervisor's watchdog) under
    /// `--enforcement mps`.
    fn preparer(
        &self,
        node: NodeInventory,
        source: Arc<dyn ClaimSource>,
        pods: Arc<dyn PodSource>,
        plugin_dir: &Path,
    ) -> anyhow::Result<(Arc<CdiPreparer>, Option<Task>)> {
        let boot_id = crate::claims::input_file::read_text(&self.boot_id_file, "the boot id file")?
            .trim()
            .to_owned();
        let mut preparer = CdiPreparer::new(
            CdiPreparerConfig {
                driver_name: self.driver_name.clone(),
                cdi_dir: self.cdi_dir.clone(),
                state_dir: self
                    .state_dir
                    .clone()
                    .unwrap_or_else(|| plugin_dir.to_owned()),
                enforcement: self.enforcement(),
                boot_id,
            },
            node,
            source,
        )?;
        let mut watchdog = None;
        if self.enforcement == EnforcementKind::Mps {
            if self.mps_users == MpsUsers::Separate {
                preparer = preparer.with_mps_users(pods);
            }
            let ready = Duration::from_secs(self.mps_ready_seconds);
            match self.mps_daemons {
                MpsDaemons::Host => {
                    let hosted: Arc<dyn DaemonKeeper> =
                        Arc::new(HostedDaemons::new(Arc::new(OsProcessHost::new()), ready));
                    preparer = preparer.with_mps(hosted)?;
                }
                MpsDaemons::Local => {
                    let mut config = MpsConfig::new("");
                    config.launch = self.launch.launch()?;
                    config.ready_timeout = ready;
                    let supervisor =
                        Arc::new(MpsSupervisor::new(config, Arc::new(OsProcessHost::new())));
                    preparer =
                        preparer.with_mps(Arc::clone(&supervisor) as Arc<dyn DaemonKeeper>)?;
                    watchdog = Some(supervisor.spawn_watchdog(Duration::from_secs(1)));
                }
            }
        }
        Ok((Arc::new(preparer), watchdog))
    }

    /// The GPU memory accounting loop (`--accounting-interval-seconds`), on NVML nodes, with
    /// the discovery's NVML handle (`nvml`, none with `--gpu-backend fake`).
    fn accounting(
        &self,
        nvml: Option<&NvmlParts>,
        preparer: &Arc<CdiPreparer>,
        claims: Arc<dyn ClaimSource>,
        client: Option<&kube::Client>,
        metrics: &Arc<Metrics>,
        status: Option<Arc<StatusReporter>>,
    ) -> anyhow::Result<Option<Task>> {
        if self.accounting_interval_seconds == 0 {
            info!("GPU memory accounting is off (--accounting-interval-seconds 0)");
            return Ok(None);
        }
        let Some((lib, _)) = nvml else {
            info!("GPU memory accounting is off: --gpu-backend fake has no GPU processes");
            return Ok(None);
        };
        let events: Option<Arc<dyn EventSink>> = if let Some(client) = client {
            Some(Arc::new(KubeEvents::new(
                client.clone(),
                self.node_name.clone(),
            )))
        } else {
            warn!("no API server (--fake-claims): over-booking is logged, not sent as Events");
            None
        };
        let seams = Seams {
            prepared: Arc::clone(preparer) as Arc<dyn PreparedClaims>,
            claims,
            gpus: Arc::clone(lib) as Arc<dyn GpuProcesses>,
            host: Arc::new(ProcFs::default()),
            mps: Arc::new(if self.enforcement == EnforcementKind::Mps {
                // As the daemons run: from the driver root, through `tessera-mps exec`.
                BinaryMpsControl::with_launch(self.launch.launch()?, Duration::from_secs(10))
            } else {
                // No MPS daemons to ask.
                BinaryMpsControl::new(
                    tessera_driver::node::driver_root::MPS_CONTROL_BINARY,
                    Duration::from_secs(10),
                )
            }),
            events,
        };
        let mut accountant = Accountant::new(seams, Some(Arc::clone(metrics)));
        if let Some(reporter) = status {
            accountant = accountant.with_status(reporter);
        }
        let accountant = Arc::new(accountant);
        Ok(Some(accountant.spawn(Duration::from_secs(
            self.accounting_interval_seconds,
        ))))
    }

    /// The writer of prepared claims' `status.devices` (none without an API server), with
    /// every claim of the checkpoint queued once, and its running task.
    async fn claim_status(
        &self,
        client: Option<&kube::Client>,
        preparer: &Arc<CdiPreparer>,
    ) -> anyhow::Result<(Option<Arc<StatusReporter>>, Option<Task>)> {
        let Some(client) = client else {
            return Ok((None, None));
        };
        let reporter = Arc::new(StatusReporter::new(
            Arc::new(KubeClaimStatus::new(ApiClaimSource::new(client.clone()))),
            Arc::clone(preparer) as Arc<dyn PreparedState>,
            self.driver_name.clone(),
            self.enforcement(),
        ));
        let reading = Arc::clone(preparer);
        let record = tokio::task::spawn_blocking(move || reading.record()).await??;
        reporter.resync(&record);
        let task = Arc::clone(&reporter).spawn();
        Ok((Some(reporter), Some(task)))
    }

    /// Runs the plugin until `shutdown` completes, then stops cleanly.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
        let client = match &self.fake_claims {
            Some(_) => None,
            None => Some(tessera_kubeapi::client(self.kubeconfig.as_deref()).await?),
        };
        let (flags, choice) = self.initial_modes(client.as_ref()).await?;
        let (backend, nvml) = self.discovery()?;
        let metrics = Arc::new(Metrics::new());
        let discovery = self.verified_discovery(backend, &choice, &metrics)?;
        let node = {
            let discovery = Arc::clone(&discovery);
            tokio::task::spawn_blocking(move || discovery.discover()).await??
        };
        // The sender stays alive for the whole run: publishing follows what it holds.
        let (inventory_tx, inventory_rx) = tokio::sync::watch::channel(node.clone());
        let (source, pods, publishing) = self.claim_source(client.as_ref(), inventory_rx)?;
        let plugin_dir = self.plugin_dir();
        let (preparer, watchdog) = self.preparer(node, Arc::clone(&source), pods, &plugin_dir)?;
        let (status, status_task) = self.claim_status(client.as_ref(), &preparer).await?;
        let accounting = self.accounting(
            nvml.as_ref(),
            &preparer,
            source,
            client.as_ref(),
            &metrics,
            status.clone(),
        )?;
        let health = HealthReporter::spawn(inventory_tx.subscribe());
        // Wakes the inventory watcher: NVML events, mode label changes, and unprepares that
        // free a draining GPU.
        let wake = Arc::new(Notify::new());
        let plugin = server::start_with_health(
            PluginConfig {
                driver_name: self.driver_name.clone(),
                registration_dir: self.registration_dir.clone(),
                plugin_dir: plugin_dir.clone(),
            },
            kubelet_preparer(&preparer, &metrics, &wake, status),
            Some(health.service(health_stream::DEFAULT_REFRESH)),
        )?;
        let interval = Duration::from_secs(self.inventory_poll_seconds);
        let file = match self.gpu_backend {
            GpuBackend::Fake => self.fake_inventory.clone(),
            GpuBackend::Nvml => None,
        };
        let events = match nvml {
            Some((lib, health)) => Some(NvmlHealthWatcher::start(
                lib,
                health,
                Arc::clone(&wake),
                Duration::from_secs(1),
            )?),
            None => None,
        };
        let labels = match &client {
            Some(client) if !interval.is_zero() => Some(node_labels::spawn_watcher(
                client.clone(),
                self.node_name.clone(),
                flags,
                Arc::clone(&choice),
                Arc::clone(&wake),
                interval,
            )),
            _ => None,
        };
        let ops = Ops::start(
            OpsConfig {
                metrics_addr: self.metrics_addr,
                watch: Some((file, interval)),
                wake,
                publish: Some(inventory_tx),
            },
            Box::new(discovery),
            preparer,
            metrics,
            &plugin,
        )
        .await?;
        shutdown.await;
        info!("shutting down");
        if let Some(task) = publishing {
            task.abort();
        }
        if let Some(task) = labels {
            task.abort();
        }
        if let Some(task) = accounting {
            task.abort();
        }
        if let Some(task) = status_task {
            // Claims still queued are queued again by the next start's resync.
            task.abort();
        }
        if let Some(events) = events {
            tokio::task::spawn_blocking(move || events.shutdown()).await?;
        }
        if let Some(task) = watchdog {
            // The daemons keep running: containers of prepared claims still use them, and a
            // restarted plugin finds them through the checkpoint.
            task.abort();
        }
        ops.shutdown().await?;
        // Health streams run until their board goes: end them first, or the servers' graceful
        // shutdown would wait for kubelet's stream forever.
        drop(health);
        plugin.shutdown().await?;
        Ok(())
    }
}

/// What kubelet's calls reach: `preparer`, measured into `metrics`, waking the inventory
/// watcher when a claim goes, and with its claims' status written afterwards when there is a
/// reporter.
fn kubelet_preparer(
    preparer: &Arc<CdiPreparer>,
    metrics: &Arc<Metrics>,
    wake: &Arc<Notify>,
    status: Option<Arc<StatusReporter>>,
) -> Arc<dyn ClaimPreparer> {
    let preparer: Arc<dyn ClaimPreparer> = Arc::new(WakeOnRelease::new(
        Arc::new(MeteredPreparer::new(
            Arc::clone(preparer),
            Arc::clone(metrics),
        )),
        Arc::clone(preparer),
        Arc::clone(wake),
    ));
    match status {
        Some(reporter) => Arc::new(StatusReporting::new(preparer, reporter)),
        None => preparer,
    }
}
