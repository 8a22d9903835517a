//! Profiles on a schedule, the controller's edge (docs/controller.md, "GPU profiles on a
//! schedule"): the leader applies each `GpuProfileSchedule` to the nodes it selects.
//!
//! Every decision is [`tessera_driver::node::schedule`]'s (pure); this module reads the
//! schedules, the nodes and their ResourceSlices, and writes:
//! * the node's record of the switch (annotation `gpu.tessera.dev/profile-switch`) and its
//!   GPU-mode labels, in one merge patch with the node's resourceVersion as a precondition, so
//!   the record is on the node before anything else happens, and a lost race is a 409 that
//!   leaves the node for the next pass;
//! * past the profile's drain deadline, the evictions of preemptible holders of draining GPUs
//!   through the Eviction API (a 429 from a `PodDisruptionBudget` is an answer: the pod stays and
//!   is tried again at a later pass); each accepted eviction is added to the record;
//! * Events on the node (the switch starts, finishes) and on each pod (evicted, blocked,
//!   waited for), and the metrics (GPUs per mode, GPUs draining, switch duration).
//!
//! A restart or a new leader reads the record back: the switch continues (same start, same
//! deadline), its start Event is not repeated, and a pod it evicted (or one already
//! terminating) is never evicted again.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1 as res;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::{Value, json};
use tessera_driver::apiversion::{self, ApiVersion, Object};
use tessera_driver::names;
use tessera_driver::node::schedule::switch::{self, NodeDecision, SwitchRecord};
use tessera_driver::node::schedule::{self, Assignment, Schedule};
use tessera_kubeapi::JsonObject;
use tracing::{Instrument as _, info, info_span, warn};

use crate::cluster::ClusterView;
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::writer::{Eviction, Writes};

/// The API resource of `GpuProfileSchedule` objects.
pub fn schedule_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(
            names::TESSERA_GROUP,
            names::TESSERA_VERSION,
            names::GPU_PROFILE_SCHEDULE.kind,
        ),
        names::GPU_PROFILE_SCHEDULE.plural,
    )
}

/// What one sync did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TidalReport {
    /// Nodes whose switch started in this sync.
    pub started: usize,
    /// Nodes whose switch finished in this sync.
    pub finished: usize,
    /// Pods evicted in this sync.
    pub evicted: usize,
    /// When the next thing is due (a deadline or a window start), from now.
    pub wake_in: Option<Duration>,
}

/// Applies the profile schedules; one per controller, run by the leader after each pass.
pub struct TidalKeeper<W: Writes> {
    client: kube::Client,
    version: ApiVersion,
    driver: String,
    writes: W,
    metrics: Arc<Metrics>,
    /// Whether the missing CRD was reported (once).
    reported_missing: bool,
}

impl<W: Writes> std::fmt::Debug for TidalKeeper<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TidalKeeper")
            .field("driver", &self.driver)
            .finish_non_exhaustive()
    }
}

fn node_name(node: &Node) -> &str {
    node.metadata.name.as_deref().unwrap_or_default()
}

impl<W: Writes> TidalKeeper<W> {
    /// A keeper writing through `client` (nodes, node Events) and `writes` (evictions, pod
    /// Events), reading resource.k8s.io in `version`.
    pub fn new(
        client: kube::Client,
        version: ApiVersion,
        driver: &str,
        writes: W,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            client,
            version,
            driver: driver.to_owned(),
            writes,
            metrics,
            reported_missing: false,
        }
    }

    /// The schedules as stored; an invalid one (the webhook refuses them, but one may predate
    /// it) is reported and skipped. Empty when the CRD is not installed.
    async fn schedules(&mut self) -> Result<Vec<Schedule>> {
        let ar = schedule_resource();
        let api: Api<JsonObject> = Api::all_with(self.client.clone(), &ar);
        let list = match api.list(&ListParams::default()).await {
            Ok(l) => l,
            Err(kube::Error::Api(status)) if status.code == 404 => {
                if !self.reported_missing {
                    info!("the GpuProfileSchedule CRD is not installed; no profile schedules");
                    self.reported_missing = true;
                }
                return Ok(Vec::new());
            }
            Err(e) => return Err(Error::api("listing GpuProfileSchedules", &e)),
        };
        let mut out = Vec::new();
        for item in list.items {
            match schedule::parse(&item.into_value(&ar)) {
                Ok(s) => out.push(s),
                Err(e) => warn!(error = %e, "skipping a GpuProfileSchedule that breaks a rule"),
            }
        }
        Ok(out)
    }

    async fn slices(&self) -> Result<Vec<res::ResourceSlice>> {
        let ar = tessera_kubeapi::resource(self.version, names::RESOURCE_SLICE);
        let api: Api<JsonObject> = Api::all_with(self.client.clone(), &ar);
        let list = api
            .list(&ListParams::default())
            .await
            .map_err(|e| Error::api("listing ResourceSlices", &e))?;
        Ok(list
            .items
            .into_iter()
            .filter_map(
                |o| match apiversion::decode_document(o.into_value(&ar), "ResourceSlice") {
                    Ok(Object::ResourceSlice(s)) => Some(s),
                    _ => None,
                },
            )
            .collect())
    }

    async fn classes(&self) -> Result<Vec<res::DeviceClass>> {
        let ar = tessera_kubeapi::resource(self.version, names::DEVICE_CLASS);
        let api: Api<JsonObject> = Api::all_with(self.client.clone(), &ar);
        let list = api
            .list(&ListParams::default())
            .await
            .map_err(|e| Error::api("listing DeviceClasses", &e))?;
        Ok(list
            .items
            .into_iter()
            .filter_map(
                |o| match apiversion::decode_document(o.into_value(&ar), "DeviceClass") {
                    Ok(Object::DeviceClass(c)) => Some(c),
                    _ => None,
                },
            )
            .collect())
    }

    /// One sync: every node a schedule selects gets its decision applied.
    pub async fn sync(&mut self, view: &ClusterView) -> Result<TidalReport> {
        let schedules = self.schedules().await?;
        let mut report = TidalReport::default();
        if schedules.is_empty() {
            return Ok(report);
        }
        let now = Timestamp::now();
        let nodes = Api::<Node>::all(self.client.clone())
            .list(&ListParams::default())
            .await
            .map_err(|e| Error::api("listing Nodes", &e))?
            .items;
        let slices = self.slices().await?;
        let preemptible = switch::preemptible_classes(&self.classes().await?, &self.driver);
        let pods: BTreeMap<String, &Pod> = view
            .pods()
            .iter()
            .map(|(k, p)| (k.clone(), p.as_ref()))
            .collect();
        let mut by_mode: BTreeMap<&'static str, i64> = BTreeMap::new();
        let mut draining = 0i64;
        let mut wake: Option<Timestamp> = None;
        let mut soonest = |t: Timestamp| {
            if t > now && wake.is_none_or(|w| t < w) {
                wake = Some(t);
            }
        };
        for s in &schedules {
            if let Some(next) = s.next_switch(now) {
                soonest(next.since);
            }
        }
        for node in &nodes {
            let name = node_name(node).to_owned();
            let labels = node.metadata.labels.clone().unwrap_or_default();
            let schedule = match schedule::assign(&schedules, &labels) {
                Assignment::None => continue,
                Assignment::One(s) => s,
                Assignment::Conflict(names) => {
                    warn!(node = %name, schedules = ?names, "several GpuProfileSchedules select the node; none is applied");
                    continue;
                }
            };
            let Some(active) = schedule.active_at(now) else {
                continue;
            };
            let own: Vec<&res::ResourceSlice> = slices
                .iter()
                .filter(|s| s.spec.node_name.as_deref() == Some(name.as_str()))
                .collect();
            let gpus = switch::node_gpus(
                &own,
                view.claims().values(),
                &pods,
                &self.driver,
                &preemptible,
            );
            let record = node
                .metadata
                .annotations
                .as_ref()
                .and_then(SwitchRecord::from_annotations);
            let Some(decision) =
                switch::decide(schedule, active, &labels, &gpus, record.as_ref(), now)
            else {
                continue;
            };
            for g in &decision.gpus {
                *by_mode.entry(g.mode.as_str()).or_default() += 1;
            }
            draining += i64::try_from(decision.draining()).unwrap_or(i64::MAX);
            if let Some(d) = decision.deadline.filter(|_| !decision.finished) {
                soonest(d);
            }
            let span = info_span!("profile_switch", node = %name, schedule = %schedule.name, profile = %decision.record.profile);
            match self
                .apply(node, decision, &pods, now)
                .instrument(span)
                .await
            {
                Ok(done) => {
                    report.started += done.started;
                    report.finished += done.finished;
                    report.evicted += done.evicted;
                }
                Err(e) if e.is_conflict() => {
                    info!(node = %name, "the node changed while its switch was written; next pass");
                }
                Err(e) => warn!(node = %name, error = %e, "applying the profile failed; next pass"),
            }
        }
        self.metrics.set_profile_state(&by_mode, draining);
        report.wake_in =
            wake.map(|w| Duration::try_from(now.duration_until(w)).unwrap_or(Duration::ZERO));
        Ok(report)
    }

    /// Writes one node's decision: record and labels first, then evictions, then the record
    /// again with the evictions the server accepted.
    #[allow(clippy::too_many_lines)] // Reason: one node's writes in the order they must happen.
    async fn apply(
        &self,
        node: &Node,
        decision: NodeDecision,
        pods: &BTreeMap<String, &Pod>,
        now: Timestamp,
    ) -> Result<TidalReport> {
        let mut done = TidalReport::default();
        let name = node_name(node);
        let mut version = node.metadata.resource_version.clone();
        if decision.record_changed || !decision.labels.is_empty() {
            let stored = self
                .patch_node(name, version.as_deref(), &decision.labels, &decision.record)
                .await?;
            version = stored.metadata.resource_version;
        }
        if decision.starts {
            done.started = 1;
            let draining = decision.draining();
            let now_switching = decision
                .gpus
                .iter()
                .filter(|g| g.step == switch::GpuStep::SwitchesNow)
                .count();
            let deadline = decision
                .deadline
                .map_or_else(|| "none: it waits for them".to_owned(), |d| d.to_string());
            let message = format!(
                "switching to profile {} of GpuProfileSchedule {}: {now_switching} GPU(s) switch now, {draining} drain (drain deadline {deadline})",
                decision.record.profile, decision.record.schedule
            );
            info!(%message, "profile switch started");
            self.node_event(node, false, names::REASON_PROFILE_SWITCH, &message)
                .await;
        }
        if decision.finished && decision.record_changed {
            done.finished = 1;
            let took = decision
                .record
                .started_at()
                .map(|s| Duration::try_from(s.duration_until(now)).unwrap_or(Duration::ZERO))
                .unwrap_or_default();
            self.metrics.profile_switched(took);
            let message = format!(
                "every GPU is in profile {} of GpuProfileSchedule {} ({}s after the switch started)",
                decision.record.profile,
                decision.record.schedule,
                took.as_secs()
            );
            info!(%message, "profile switch finished");
            self.node_event(node, false, names::REASON_PROFILE_SWITCHED, &message)
                .await;
        }
        for h in &decision.waiting_for {
            if let Some(pod) = pods.get(&h.pod) {
                let message = format!(
                    "node {name} switches to profile {}; this pod is {} and is never evicted: the GPU switches when it ends",
                    decision.record.profile,
                    h.disruption.as_str()
                );
                self.pod_event(pod, false, names::REASON_PROFILE_WAITING, &message)
                    .await;
            }
        }
        let mut record = decision.record.clone();
        let mut evicted_now = Vec::new();
        for h in &decision.evict {
            let Some(pod) = pods.get(&h.pod) else {
                continue;
            };
            match self.writes.evict(pod, false).await? {
                Eviction::Evicted => {
                    let message = format!(
                        "evicted: node {name} switches to profile {} of GpuProfileSchedule {} and the drain deadline passed; this pod is {}",
                        record.profile,
                        record.schedule,
                        h.disruption.as_str()
                    );
                    info!(pod = %h.pod, "evicted for a profile switch");
                    self.pod_event(pod, false, names::REASON_PROFILE_EVICTION, &message)
                        .await;
                    self.node_event(
                        node,
                        false,
                        names::REASON_PROFILE_EVICTION,
                        &format!("evicted {} ({message})", h.pod),
                    )
                    .await;
                    self.metrics.profile_evicted();
                    evicted_now.push(h.pod.clone());
                }
                Eviction::Blocked(why) => {
                    let message = format!(
                        "not evicted for the switch of node {name} to profile {}: {why}; tried again later",
                        record.profile
                    );
                    info!(pod = %h.pod, %why, "a PodDisruptionBudget blocks a profile eviction");
                    self.pod_event(pod, true, names::REASON_PROFILE_WAITING, &message)
                        .await;
                }
                Eviction::Gone => {}
            }
        }
        if !evicted_now.is_empty() {
            done.evicted = evicted_now.len();
            record.evicted.extend(evicted_now);
            self.patch_node(name, version.as_deref(), &BTreeMap::new(), &record)
                .await?;
        }
        Ok(done)
    }

    /// Patches the node's mode labels and switch record, with `version` as a precondition.
    async fn patch_node(
        &self,
        name: &str,
        version: Option<&str>,
        labels: &BTreeMap<String, Option<String>>,
        record: &SwitchRecord,
    ) -> Result<Node> {
        let labels: serde_json::Map<String, Value> = labels
            .iter()
            .map(|(k, v)| (k.clone(), v.as_ref().map_or(Value::Null, |v| json!(v))))
            .collect();
        let body = json!({"metadata": {
            "resourceVersion": version,
            "labels": labels,
            "annotations": {names::ANNOTATION_PROFILE_SWITCH: record.to_annotation()},
        }});
        Api::<Node>::all(self.client.clone())
            .patch(name, &PatchParams::default(), &Patch::Merge(&body))
            .await
            .map_err(|e| Error::api(format!("writing the profile switch of Node {name}"), &e))
    }

    /// Records an Event on the node through the controller's Recorder; a failure is logged
    /// (an Event is never worth a retry).
    async fn node_event(&self, node: &Node, warning: bool, reason: &str, message: &str) {
        if let Err(e) = self
            .writes
            .node_event(node, warning, names::ACTION_SWITCH_PROFILE, reason, message)
            .await
        {
            warn!(node = %node_name(node), reason, error = %e, "recording an Event on the node failed");
        }
    }

    /// Records an Event on the pod through the controller's Recorder; a failure is logged.
    async fn pod_event(&self, pod: &Pod, warning: bool, reason: &str, message: &str) {
        if let Err(e) = self
            .writes
            .event(pod, warning, names::ACTION_SWITCH_PROFILE, reason, message)
            .await
        {
            warn!(reason, error = %e, "recording an Event on the pod failed");
        }
    }
}
