//! What the controller does for one node at one instant of a scheduled profile switch.
//!
//! The state of a switch lives on the node, in the annotation
//! [`names::ANNOTATION_PROFILE_SWITCH`] ([`SwitchRecord`]): which schedule, profile and window
//! start it is for, when it started, which pods it evicted, and when it finished. A controller
//! that restarts, or a new leader, reads it back and continues: a switch to the profile the
//! record names is never started again (a later start of the same profile continues it), its
//! start time (and so its deadline) stays, and a pod it has evicted is never evicted again.
//!
//! At each pass, [`decide`]:
//! * writes the profile's mode labels (idempotent; the plugin drains and switches);
//! * says for each GPU whether it is in the wanted mode, switches at once (no claim holds
//!   it), or drains (claims hold it: the plugin taints it `gpu.tessera.dev/draining`);
//! * once the profile's `drainDeadline` has passed since the switch started, names the
//!   holders of draining GPUs to evict: only preemptible ones ([`Disruption`]), not already
//!   terminating, not already evicted by this switch. Online holders are never evicted: the
//!   GPU waits for them;
//! * finishes the switch when every GPU is in its wanted mode.

use std::collections::{BTreeMap, BTreeSet};

use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1 as res;
use serde::{Deserialize, Serialize};

use super::{Active, Schedule};
use crate::names;
use crate::node::inventory::GpuMode;
use crate::rules::config::{self, TesseraConfig, Tier};

/// The record of a node's switch, kept in its [`names::ANNOTATION_PROFILE_SWITCH`] annotation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SwitchRecord {
    /// The schedule's name.
    pub schedule: String,
    /// The profile switched to.
    pub profile: String,
    /// When the window that started the profile started (RFC 3339).
    pub window_start: String,
    /// When the controller started the switch (RFC 3339); the drain deadline counts from it.
    pub started: String,
    /// `namespace/name` of each pod this switch evicted (an accepted eviction).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub evicted: Vec<String>,
    /// When every GPU was in its wanted mode (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished: Option<String>,
}

impl SwitchRecord {
    /// Reads a node's record; `None` when absent or unreadable (an unreadable record is
    /// replaced, as if none were there: the deadline then counts from now, never earlier).
    pub fn from_annotations(annotations: &BTreeMap<String, String>) -> Option<Self> {
        annotations
            .get(names::ANNOTATION_PROFILE_SWITCH)
            .and_then(|v| serde_json::from_str(v).ok())
    }

    /// The annotation value.
    pub fn to_annotation(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// When the switch started.
    pub fn started_at(&self) -> Option<Timestamp> {
        self.started.parse().ok()
    }

    /// Whether it is the switch to `schedule`'s profile in force (`active`). A later start of
    /// the same profile (the next day's window) continues the same switch: only a change of
    /// profile starts a new one.
    pub fn is_for(&self, schedule: &Schedule, active: Active) -> bool {
        self.schedule == schedule.name
            && schedule
                .profile(active.profile)
                .is_some_and(|p| p.name == self.profile)
    }
}

/// How a pod holding a GPU may be disrupted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Disruption {
    /// Online work: never evicted; the switch waits for it.
    Online,
    /// Every share it holds is recorded batch.
    Batch,
    /// Its class says so: annotated [`names::ANNOTATION_CLASS_PREEMPTIBLE`], batch by its
    /// `TierPolicy`, or delay-tolerant (a `TierPolicy` with a patience).
    Class,
}

impl Disruption {
    /// Whether a switch past its deadline may evict it.
    pub fn preemptible(self) -> bool {
        self != Self::Online
    }

    /// A word for messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Online => "online",
            Self::Batch => "batch",
            Self::Class => "preemptible by its class",
        }
    }
}

/// A pod holding devices of a GPU.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Holder {
    /// `namespace/name`.
    pub pod: String,
    /// Its UID, when known (an eviction names it as a precondition).
    pub uid: Option<String>,
    /// How it may be disrupted.
    pub disruption: Disruption,
    /// Whether it is already being deleted.
    pub terminating: bool,
}

/// One GPU of a node as the controller sees it: its published mode and who holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuState {
    /// The GPU's index.
    pub index: u32,
    /// Its mode as its ResourceSlice publishes it.
    pub mode: GpuMode,
    /// Whether it is published with the draining taint.
    pub draining: bool,
    /// The pods holding its devices.
    pub holders: Vec<Holder>,
}

/// What happens to one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuStep {
    /// It is in the wanted mode (or the profile chooses nothing for it).
    Done,
    /// No claim holds it: the plugin switches it as soon as it sees the label.
    SwitchesNow,
    /// Claims hold it: it drains; the holders are listed.
    Draining(Vec<Holder>),
    /// The profile wants MIG on or off, which the plugin never changes: it stays.
    Unchangeable,
}

/// One GPU's step, with the mode wanted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuPlan {
    /// The GPU's index.
    pub index: u32,
    /// Its mode now.
    pub mode: GpuMode,
    /// The mode the profile wants (`None`: the profile chooses nothing for it).
    pub wanted: Option<GpuMode>,
    /// What happens to it.
    pub step: GpuStep,
}

/// What the controller does on one node now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeDecision {
    /// The record as it must be stored (`changed` says whether it differs from the node's).
    pub record: SwitchRecord,
    /// Whether the record must be written (before anything else is done).
    pub record_changed: bool,
    /// Whether this decision starts the switch (it was not recorded before).
    pub starts: bool,
    /// Label changes to make (`None`: remove the label).
    pub labels: BTreeMap<String, Option<String>>,
    /// Each GPU's step.
    pub gpus: Vec<GpuPlan>,
    /// When the drain deadline passes (`None`: the profile waits for ever).
    pub deadline: Option<Timestamp>,
    /// The pods to evict now, each holding a draining GPU past the deadline.
    pub evict: Vec<Holder>,
    /// Online (or otherwise not preemptible) pods the switch waits for past the deadline.
    pub waiting_for: Vec<Holder>,
    /// Whether every GPU is done; with `record_changed`, the switch has just finished.
    pub finished: bool,
}

impl NodeDecision {
    /// How many GPUs are draining.
    pub fn draining(&self) -> usize {
        self.gpus
            .iter()
            .filter(|g| matches!(g.step, GpuStep::Draining(_)))
            .count()
    }
}

fn rfc3339(t: Timestamp) -> String {
    t.to_string()
}

/// What to do on a node with `labels`, `gpus` and `record`, following `schedule` whose
/// window `active` is in force at `now` (see the module docs). `None` when the active
/// window's profile is missing (it cannot be: [`Schedule::active_at`] names one).
pub fn decide(
    schedule: &Schedule,
    active: Active,
    labels: &BTreeMap<String, String>,
    gpus: &[GpuState],
    record: Option<&SwitchRecord>,
    now: Timestamp,
) -> Option<NodeDecision> {
    let profile = schedule.profile(active.profile)?;
    let (mut record, starts) = match record {
        Some(r) if r.is_for(schedule, active) => (r.clone(), false),
        _ => (
            SwitchRecord {
                schedule: schedule.name.clone(),
                profile: profile.name.clone(),
                window_start: rfc3339(active.since),
                started: rfc3339(now),
                evicted: Vec::new(),
                finished: None,
            },
            true,
        ),
    };
    let mut record_changed = starts;
    let started = record.started_at().unwrap_or(now);
    let deadline = profile.drain_deadline.map(|d| {
        started
            .checked_add(jiff::SignedDuration::from_secs(
                i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
            ))
            .unwrap_or(Timestamp::MAX)
    });
    let past_deadline = deadline.is_some_and(|d| now >= d);
    let evicted: BTreeSet<&str> = record.evicted.iter().map(String::as_str).collect();
    let mut plans = Vec::with_capacity(gpus.len());
    let mut evict = BTreeSet::new();
    let mut waiting_for = BTreeSet::new();
    for gpu in gpus {
        let wanted = profile.choice.mode_of(gpu.index);
        let step = match wanted {
            None => GpuStep::Done,
            Some(w) if w == gpu.mode => GpuStep::Done,
            Some(w) if w == GpuMode::Mig || gpu.mode == GpuMode::Mig => GpuStep::Unchangeable,
            Some(_) if gpu.holders.is_empty() => GpuStep::SwitchesNow,
            Some(_) => GpuStep::Draining(gpu.holders.clone()),
        };
        if let GpuStep::Draining(holders) = &step
            && past_deadline
        {
            for h in holders {
                if !h.disruption.preemptible() {
                    waiting_for.insert(h.clone());
                } else if !h.terminating && !evicted.contains(h.pod.as_str()) {
                    evict.insert(h.clone());
                }
            }
        }
        plans.push(GpuPlan {
            index: gpu.index,
            mode: gpu.mode,
            wanted,
            step,
        });
    }
    let finished = plans
        .iter()
        .all(|p| matches!(p.step, GpuStep::Done | GpuStep::Unchangeable));
    if finished && record.finished.is_none() {
        record.finished = Some(rfc3339(now));
        record_changed = true;
    }
    Some(NodeDecision {
        record,
        record_changed,
        starts,
        labels: profile.label_changes(labels),
        gpus: plans,
        deadline,
        evict: evict.into_iter().collect(),
        waiting_for: waiting_for.into_iter().collect(),
        finished,
    })
}

/// Each GPU's published mode and whether it drains, by index.
pub type PublishedModes = BTreeMap<u32, (GpuMode, bool)>;
/// The GPU index of each device, by (pool, device name).
pub type DeviceGpus = BTreeMap<(String, String), u32>;

/// The GPUs a node's ResourceSlices publish for `driver`: each GPU's index, mode and
/// draining taint. A GPU in MIG mode is published as its instances (`type: mig` with a
/// `parentIndex`); a whole GPU as `type: gpu` with `index` and `sharing`. Also returns the
/// GPU index of every device name, to find the GPU a claim's device is on.
pub fn published_gpus(
    slices: &[&res::ResourceSlice],
    driver: &str,
) -> (PublishedModes, DeviceGpus) {
    let mut gpus: BTreeMap<u32, (GpuMode, bool)> = BTreeMap::new();
    let mut devices = BTreeMap::new();
    for slice in slices.iter().filter(|s| s.spec.driver == driver) {
        let pool = slice.spec.pool.name.clone();
        for d in slice.spec.devices.iter().flatten() {
            let attr = |k: &str| d.attributes.as_ref().and_then(|a| a.get(k));
            let text = |k: &str| attr(k).and_then(|a| a.string.clone());
            let int = |k: &str| {
                attr(k)
                    .and_then(|a| a.int)
                    .and_then(|i| u32::try_from(i).ok())
            };
            let draining = d
                .taints
                .iter()
                .flatten()
                .any(|t| t.key == names::TAINT_DRAINING);
            let (index, mode) = match text(names::ATTR_TYPE).as_deref() {
                Some(names::TYPE_GPU) => {
                    let Some(index) = int(names::ATTR_INDEX) else {
                        continue;
                    };
                    let mode =
                        if text(names::ATTR_SHARING).as_deref() == Some(names::SHARING_SHARED) {
                            GpuMode::Shared
                        } else {
                            GpuMode::Exclusive
                        };
                    (index, mode)
                }
                Some(names::TYPE_MIG) => {
                    let Some(index) = int(names::ATTR_PARENT_INDEX) else {
                        continue;
                    };
                    (index, GpuMode::Mig)
                }
                _ => continue,
            };
            let entry = gpus.entry(index).or_insert((mode, false));
            entry.1 |= draining;
            devices.insert((pool.clone(), d.name.clone()), index);
        }
    }
    (gpus, devices)
}

/// The classes whose pods a switch or defragmentation may evict whatever their recorded tier:
/// annotated [`names::ANNOTATION_CLASS_PREEMPTIBLE`] `"true"`, or with a `TierPolicy` for
/// `driver` that makes them batch or delay-tolerant.
pub fn preemptible_classes(classes: &[res::DeviceClass], driver: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for class in classes {
        let Some(name) = class.metadata.name.clone() else {
            continue;
        };
        let annotated = class
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(names::ANNOTATION_CLASS_PREEMPTIBLE))
            .is_some_and(|v| v == "true");
        let by_policy = class
            .spec
            .config
            .iter()
            .flatten()
            .filter_map(|c| c.opaque.as_ref())
            .filter(|o| o.driver == driver)
            .any(|o| {
                matches!(
                    config::decode(&o.parameters.0, "class"),
                    Ok(TesseraConfig::TierPolicy(p))
                        if p.tier == Some(Tier::Batch) || p.patience.is_some_and(|p| !p.is_zero())
                )
            });
        if annotated || by_policy {
            out.insert(name);
        }
    }
    out
}

/// How a pod using `claim` may be disrupted: batch when every device of `driver` it holds is
/// recorded batch in the allocation's `AllocatedShares`, class-preemptible when every request
/// names a class in `preemptible`, online otherwise.
pub fn claim_disruption(
    claim: &res::ResourceClaim,
    driver: &str,
    preemptible: &BTreeSet<String>,
) -> Disruption {
    let Some(allocation) = claim.status.as_ref().and_then(|s| s.allocation.as_ref()) else {
        return Disruption::Online;
    };
    let mut batch: BTreeSet<(String, String, String)> = BTreeSet::new();
    for cfg in allocation
        .devices
        .as_ref()
        .and_then(|d| d.config.as_ref())
        .into_iter()
        .flatten()
    {
        let Some(o) = cfg.opaque.as_ref().filter(|o| o.driver == driver) else {
            continue;
        };
        if let Ok(TesseraConfig::AllocatedShares(record)) =
            config::decode(&o.parameters.0, "allocation")
        {
            batch.extend(
                record
                    .devices
                    .into_iter()
                    .filter(|d| d.tier == Tier::Batch)
                    .map(|d| (d.request, d.pool, d.device)),
            );
        }
    }
    let results: Vec<&res::DeviceRequestAllocationResult> = allocation
        .devices
        .as_ref()
        .and_then(|d| d.results.as_ref())
        .into_iter()
        .flatten()
        .filter(|r| r.driver == driver)
        .collect();
    if !results.is_empty()
        && results
            .iter()
            .all(|r| batch.contains(&(r.request.clone(), r.pool.clone(), r.device.clone())))
    {
        return Disruption::Batch;
    }
    let classes: Vec<&str> = claim
        .spec
        .devices
        .as_ref()
        .and_then(|d| d.requests.as_ref())
        .into_iter()
        .flatten()
        .flat_map(|r| {
            r.exactly
                .iter()
                .map(|e| e.device_class_name.as_str())
                .chain(
                    r.first_available
                        .iter()
                        .flatten()
                        .map(|s| s.device_class_name.as_str()),
                )
        })
        .collect();
    if !classes.is_empty() && classes.iter().all(|c| preemptible.contains(*c)) {
        return Disruption::Class;
    }
    Disruption::Online
}

/// The GPUs of node `node` with their holders: `slices` are the node's, `claims` every
/// allocated claim, `pods` by `namespace/name` (a pod named in a claim's `reservedFor` holds
/// its devices). A claim allocated but reserved for no pod holds its GPU too; it is listed as
/// an online holder named `claim <namespace>/<name>`, which is never evicted.
pub fn node_gpus<'a>(
    slices: &[&res::ResourceSlice],
    claims: impl IntoIterator<Item = &'a res::ResourceClaim>,
    pods: &BTreeMap<String, &Pod>,
    driver: &str,
    preemptible: &BTreeSet<String>,
) -> Vec<GpuState> {
    let (published, devices) = published_gpus(slices, driver);
    let mut holders: BTreeMap<u32, BTreeSet<Holder>> = BTreeMap::new();
    for claim in claims {
        let Some(allocation) = claim.status.as_ref().and_then(|s| s.allocation.as_ref()) else {
            continue;
        };
        let gpus: BTreeSet<u32> = allocation
            .devices
            .as_ref()
            .and_then(|d| d.results.as_ref())
            .into_iter()
            .flatten()
            .filter(|r| r.driver == driver)
            .filter_map(|r| devices.get(&(r.pool.clone(), r.device.clone())).copied())
            .collect();
        if gpus.is_empty() {
            continue;
        }
        let namespace = claim.metadata.namespace.as_deref().unwrap_or("default");
        let disruption = claim_disruption(claim, driver, preemptible);
        let reserved: Vec<&res::ResourceClaimConsumerReference> = claim
            .status
            .as_ref()
            .and_then(|s| s.reserved_for.as_ref())
            .into_iter()
            .flatten()
            .filter(|r| r.resource == names::POD.plural)
            .collect();
        let mut users: Vec<Holder> = reserved
            .iter()
            .map(|r| {
                let key = format!("{namespace}/{}", r.name);
                let pod = pods.get(&key);
                Holder {
                    pod: key,
                    uid: Some(r.uid.clone()),
                    disruption,
                    terminating: pod.is_some_and(|p| p.metadata.deletion_timestamp.is_some()),
                }
            })
            .collect();
        if users.is_empty() {
            users.push(Holder {
                pod: format!(
                    "claim {namespace}/{}",
                    claim.metadata.name.as_deref().unwrap_or_default()
                ),
                uid: None,
                disruption: Disruption::Online,
                terminating: false,
            });
        }
        for g in gpus {
            holders.entry(g).or_default().extend(users.iter().cloned());
        }
    }
    published
        .into_iter()
        .map(|(index, (mode, draining))| GpuState {
            index,
            mode,
            draining,
            holders: holders
                .remove(&index)
                .unwrap_or_default()
                .into_iter()
                .collect(),
        })
        .collect()
}
