//! The controller service: reflectors feed the cluster view, the leader runs reconcile passes
//! whenever the view changed, and the operations endpoint reports on it all.
//!
//! Every replica keeps its view warm; only the replica holding the Lease writes. A new leader
//! needs nothing but the cluster: half-done work is recognised from the claims themselves
//! (the allocated-by annotation, the finalizer, the allocation's node).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::core::ApiResource;
use tessera_driver::admission::device_plugin_names;
use tessera_driver::apiversion::ApiVersion;
use tessera_driver::placement::allocator::Policy;
use tessera_kubeapi::DefaultBackoff;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tracing::{info, warn};

use crate::cluster::{Change, ClusterView, Resource, reflector};
use crate::device_plugin_templates::{SyncReport, TemplateKeeper};
use crate::error::Result;
use crate::health_http::OpsServer;
use crate::leader::{self, LeaderConfig};
use crate::metrics::Metrics;
use crate::reconcile::{Reconciler, ReconcilerConfig};
use crate::tidal::TidalKeeper;
use crate::writer::Writer;

/// How many reflected changes may wait for the view.
const EVENT_QUEUE: usize = 64;
/// Pause before a pass retries what failed for a passing reason (API errors, lost races).
const RETRY_SOON: Duration = Duration::from_secs(1);
/// How often the leader applies the GPU profile schedules at the latest (sooner when a window
/// starts or a drain deadline passes, and at every resync when that is shorter).
const TIDAL_EVERY: Duration = Duration::from_secs(10);

/// Everything the service needs besides a client.
#[derive(Debug, Clone)]
pub struct ControllerConfig {
    /// Tessera's DRA driver name.
    pub driver_name: String,
    /// The placement policy.
    pub policy: Policy,
    /// After how long an allocation whose pod has not bound is reported.
    pub unbound_after: Duration,
    /// How often everything not placed is tried again even if nothing seemed to change.
    pub resync: Duration,
    /// Leader election, or `None` to lead unconditionally (one replica only).
    pub leader: Option<LeaderConfig>,
    /// Where to serve `/metrics`, `/healthz` and `/readyz`, if anywhere.
    pub metrics_addr: Option<SocketAddr>,
    /// Time-sliced replicas per GPU (`nvidia.com/gpu.shared`), as the webhook maps them.
    pub shared_replicas: u32,
    /// Whether fast-path pods get their claims reserved in the allocation write
    /// ([`tessera_driver::placement::fast_path`]).
    pub fast_path: bool,
    /// Whether an online pod that fits nowhere may evict batch pods (docs/controller.md).
    pub preemption: bool,
    /// How many batch pods defragmentation may evict per hour; 0 (the default) turns it off
    /// (docs/controller.md).
    pub defrag_per_hour: u32,
}

/// What a running service shares with its caller.
#[derive(Debug, Clone)]
pub struct Handles {
    /// The metrics.
    pub metrics: Arc<Metrics>,
    /// Whether the view is synced.
    pub synced: watch::Receiver<bool>,
    /// Whether this replica leads.
    pub leading: watch::Receiver<bool>,
}

/// Runs the controller until `shutdown` completes (or forever).
pub async fn run(
    client: kube::Client,
    config: ControllerConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<()> {
    let metrics = Arc::new(Metrics::new(&config.policy.to_string()));
    let (synced_tx, synced) = watch::channel(false);
    let _ops = match config.metrics_addr {
        Some(addr) => Some(OpsServer::start(addr, Arc::clone(&metrics), synced.clone()).await?),
        None => None,
    };
    run_with(client, config, metrics, synced_tx, shutdown).await
}

/// [`run`] with metrics and the synced flag made by the caller (tests read them).
pub async fn run_with(
    client: kube::Client,
    config: ControllerConfig,
    metrics: Arc<Metrics>,
    synced_tx: watch::Sender<bool>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<()> {
    let version = tessera_kubeapi::served_resource_version(&client).await?;
    info!(%version, policy = %config.policy, driver = %config.driver_name, "starting the controller");
    let mut tasks = JoinSet::new();
    let (leading_tx, mut leading) = watch::channel(config.leader.is_none());
    metrics.set_leader(*leading.borrow());
    if let Some(leader_config) = config.leader.clone() {
        leader_config.validate()?;
        tasks.spawn(leader::run(client.clone(), leader_config, leading_tx));
    }
    // A short queue: events wait in the watch streams (as bytes) rather than here as decoded
    // objects, which bounds the controller's peak memory when thousands arrive at once.
    let (tx, mut rx) = mpsc::channel(EVENT_QUEUE);
    spawn_reflectors(&mut tasks, &client, version, &tx);
    drop(tx);
    let mut view = ClusterView::new(&config.driver_name);
    let mut reconciler = Reconciler::new(
        ReconcilerConfig {
            driver_name: config.driver_name.clone(),
            policy: config.policy,
            unbound_after: config.unbound_after,
            fast_path: config.fast_path,
            preemption: config.preemption,
            defrag_per_hour: config.defrag_per_hour,
        },
        Writer::new(client.clone(), version),
        Arc::clone(&metrics),
        leading.clone(),
    );
    let mut tidal = tidal_keeper(&client, version, &config.driver_name, &metrics);
    let mut tidal_due = tokio::time::Instant::now();
    let mut templates = TemplateKeeper::new(
        client,
        version,
        device_plugin_names::Options {
            driver: config.driver_name.clone(),
            shared_replicas: config.shared_replicas,
        },
        config.resync,
    );
    let mut resync = tokio::time::interval(config.resync);
    resync.tick().await;
    let retry = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(retry);
    let mut retry_armed = false;
    tokio::pin!(shutdown);
    // Every wake-up below is a reason to reconcile: a change, leadership, a resync, a retry.
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            got = rx.recv() => {
                let Some((resource, change)) = got else { break };
                view.apply(resource, change);
                while let Ok((resource, change)) = rx.try_recv() {
                    view.apply(resource, change);
                }
            }
            changed = leading.changed() => {
                if changed.is_err() {
                    break;
                }
            }
            _ = resync.tick() => {
                view.bump();
            }
            () = &mut retry, if retry_armed => {
                retry_armed = false;
                view.bump();
            }
        }
        synced_tx.send_replace(view.is_synced());
        metrics.set_leader(*leading.borrow());
        if view.is_synced() && *leading.borrow() {
            let report = Box::pin(reconciler.pass(&mut view)).await;
            if report.placed > 0 || report.released > 0 {
                info!(
                    placed = report.placed,
                    pending = report.pending,
                    released = report.released,
                    "reconciled"
                );
            }
            let retry_soon = !keep_templates(&mut templates, &view).await || report.retry_soon;
            // Retry soon after a passing failure, and when a waiting pod's patience ends.
            let start = tokio::time::Instant::now();
            tidal_due = keep_schedules(&mut tidal, &view, start, tidal_due, config.resync).await;
            let soon = (retry_soon && !retry_armed).then(|| start + RETRY_SOON);
            let wake = report
                .wake_in
                .map(|w| start + w)
                .into_iter()
                .chain([tidal_due])
                .min();
            if let Some(at) = soon.into_iter().chain(wake).min()
                && (!retry_armed || at < retry.deadline())
            {
                retry.as_mut().reset(at);
                retry_armed = true;
            }
        }
    }
    tasks.abort_all();
    Ok(())
}

/// Starts one reflector per resource, each feeding `tx` and backing off with kube-runtime's
/// `DefaultBackoff`; resource.k8s.io kinds are watched in the served `version`.
fn spawn_reflectors(
    tasks: &mut JoinSet<()>,
    client: &kube::Client,
    version: ApiVersion,
    tx: &mpsc::Sender<(Resource, Change)>,
) {
    for resource in Resource::ALL {
        let api = match resource {
            Resource::Slices => {
                tessera_kubeapi::resource(version, tessera_driver::names::RESOURCE_SLICE)
            }
            Resource::Classes => {
                tessera_kubeapi::resource(version, tessera_driver::names::DEVICE_CLASS)
            }
            Resource::Claims => {
                tessera_kubeapi::resource(version, tessera_driver::names::RESOURCE_CLAIM)
            }
            Resource::Pods => ApiResource::erase::<Pod>(&()),
            Resource::Nodes => ApiResource::erase::<Node>(&()),
        };
        tasks.spawn(reflector::run(
            client.clone(),
            resource,
            api,
            tx.clone(),
            DefaultBackoff::default(),
        ));
    }
}

/// The leader's keeper of the GPU profile schedules.
fn tidal_keeper(
    client: &kube::Client,
    version: ApiVersion,
    driver: &str,
    metrics: &Arc<Metrics>,
) -> TidalKeeper<Writer> {
    let writes = Writer::new(client.clone(), version);
    TidalKeeper::new(client.clone(), version, driver, writes, Arc::clone(metrics))
}

/// Applies the GPU profile schedules when due (`due`); returns when they are due next: at most
/// [`TIDAL_EVERY`] (or `resync`) later, sooner at a window start or a drain deadline.
async fn keep_schedules(
    tidal: &mut TidalKeeper<Writer>,
    view: &ClusterView,
    start: tokio::time::Instant,
    due: tokio::time::Instant,
    resync: Duration,
) -> tokio::time::Instant {
    if start < due {
        return due;
    }
    let mut next = start + TIDAL_EVERY.min(resync);
    match tidal.sync(view).await {
        Ok(done) => {
            if let Some(w) = done.wake_in {
                next = next.min(start + w);
            }
        }
        Err(e) => warn!(error = %e, "applying the GPU profile schedules failed; retrying"),
    }
    next
}

/// One sync of the device-plugin claim templates; `false` when it failed (retry soon).
async fn keep_templates(templates: &mut TemplateKeeper, view: &ClusterView) -> bool {
    match templates.sync(view.pods()).await {
        Ok(done) => {
            if done != SyncReport::default() {
                info!(
                    created = done.created,
                    deleted = done.deleted,
                    "device-plugin claim templates"
                );
            }
            true
        }
        Err(e) => {
            warn!(error = %e, "keeping the device-plugin claim templates failed; retrying");
            false
        }
    }
}
