//! GPU profiles on a schedule: a `GpuProfileSchedule` object says which nodes (a label
//! selector) take which GPU profile (each GPU's mode) in which time windows (cron expressions
//! in a time zone), and how long a switch may wait for claims to drain before preemptible pods
//! are evicted (`drainDeadline`).
//!
//! ```yaml
//! apiVersion: gpu.tessera.dev/v1alpha1
//! kind: GpuProfileSchedule
//! metadata: {name: day-night}
//! spec:
//!   nodeSelector: {matchLabels: {pool: inference}}
//!   timeZone: Europe/Berlin              # an IANA zone, bundled; default UTC
//!   profiles:
//!   - name: day                          # many small shares for online inference
//!     mode: shared
//!     drainDeadline: 30m                 # then preemptible holders are evicted
//!   - name: night                        # whole GPUs for training
//!     mode: exclusive
//!     gpus: [{index: 0, mode: shared}]   # one GPU stays shared
//!   windows:
//!   - {start: "0 8 * * mon-fri", profile: day}
//!   - {start: "0 20 * * *", profile: night}
//! ```
//!
//! A window starts its profile at each occurrence of its cron expression; the profile holds
//! until another window starts. The profile in force at an instant is the one of the window
//! that started last at or before it (a later window in the list wins a tie). A profile owns
//! every GPU-mode label of the nodes it applies to (`gpu.tessera.dev/mode` and its per-GPU
//! form): it writes the ones it names and removes the others, and the plugin then drains and
//! switches each GPU as it does for an admin's label ([`crate::node::reconfigure`]). MIG is a
//! hardware setting the plugin never changes: a profile may say `mig` only for GPUs that are
//! already in MIG mode.
//!
//! [`parse`] reads and validates such an object (every error names the object, the field and
//! the rule); [`Schedule::active_at`] and [`Schedule::next_switch`] say which profile applies
//! and when that changes; [`assign`] finds the one schedule of a node; [`switch::decide`] is
//! what the controller does for one node at one instant.

pub mod cron;
pub mod switch;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;

use jiff::Timestamp;
use jiff::tz::TimeZone;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use serde::Deserialize;

use crate::error::{Error, Result};
use crate::names;
use crate::node::gpu_mode::ModeChoice;
use crate::node::inventory::GpuMode;
use crate::rules::config::Patience;
use crate::rules::labelselect::Selector;
use cron::Cron;

/// The most profiles one schedule may have.
pub const MAX_PROFILES: usize = 16;
/// The most windows one schedule may have.
pub const MAX_WINDOWS: usize = 32;
/// The highest GPU index a profile may name.
pub const MAX_GPU_INDEX: u32 = 63;
/// How many window starts [`Schedule::next_switch`] looks through for one that changes the
/// profile (starts of the profile already in force change nothing).
pub const MAX_STARTS_SEARCHED: usize = 2048;

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Object {
    api_version: String,
    kind: String,
    #[serde(default)]
    metadata: Meta,
    spec: Spec,
    #[serde(default)]
    #[allow(dead_code)]
    // Reason: accepted as the API server stores it; the controller keeps none.
    status: Option<serde_json::Value>,
}

#[derive(Debug, Default, Deserialize)]
struct Meta {
    #[serde(default)]
    name: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Spec {
    #[serde(default)]
    node_selector: LabelSelector,
    #[serde(default)]
    time_zone: Option<String>,
    profiles: Vec<ProfileSpec>,
    windows: Vec<WindowSpec>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ProfileSpec {
    name: String,
    #[serde(default)]
    mode: Option<String>,
    #[serde(default)]
    gpus: Vec<GpuSpec>,
    #[serde(default)]
    drain_deadline: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct GpuSpec {
    index: u32,
    mode: String,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct WindowSpec {
    start: String,
    profile: String,
}

/// A validated schedule.
#[derive(Debug, Clone)]
pub struct Schedule {
    /// `metadata.name` (the object is cluster-scoped).
    pub name: String,
    /// Which nodes it applies to.
    pub selector: Selector,
    /// The zone its windows' times are in.
    pub zone: TimeZone,
    /// The zone's name as written (`UTC` when absent).
    pub zone_name: String,
    /// Its profiles, in the order written.
    pub profiles: Vec<Profile>,
    /// Its windows, in the order written.
    pub windows: Vec<Window>,
}

/// One GPU profile: the mode of each GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Profile {
    /// Its name, unique in the schedule.
    pub name: String,
    /// The modes it chooses, as the node labels say them.
    pub choice: ModeChoice,
    /// How long a switch to it waits for claims before preemptible holders are evicted;
    /// `None`: it waits for ever.
    pub drain_deadline: Option<Patience>,
}

/// A window: from each occurrence of `start`, the profile `profile` applies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Window {
    /// When it starts.
    pub start: Cron,
    /// The index of its profile in [`Schedule::profiles`].
    pub profile: usize,
}

/// The profile in force, and since when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Active {
    /// The index of the profile in [`Schedule::profiles`].
    pub profile: usize,
    /// When the window that started it started.
    pub since: Timestamp,
}

/// Whether `name` is a DNS-1123 label (a profile's name, so it can stand in a label value).
fn is_dns_label(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

fn parse_mode(text: &str) -> Option<GpuMode> {
    GpuMode::ALL.into_iter().find(|m| m.as_str() == text)
}

/// Reads and validates a `GpuProfileSchedule` object (JSON as the API server serves it).
#[allow(clippy::too_many_lines)] // Reason: every field's rule in spec order, each naming its field.
pub fn parse(value: &serde_json::Value) -> Result<Schedule> {
    let name_hint = value
        .pointer("/metadata/name")
        .and_then(serde_json::Value::as_str)
        .unwrap_or("(unnamed)")
        .to_owned();
    let object = format!("{} {name_hint}", names::GPU_PROFILE_SCHEDULE.kind);
    let invalid = |field: String, message: String| Error::Invalid {
        object: object.clone(),
        field,
        message,
    };
    let raw: Object = serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        invalid(path, e.inner().to_string())
    })?;
    if raw.api_version != names::CONFIG_API_VERSION {
        return Err(invalid(
            "apiVersion".into(),
            format!(
                "{:?} is not served; expected {}",
                raw.api_version,
                names::CONFIG_API_VERSION
            ),
        ));
    }
    if raw.kind != names::GPU_PROFILE_SCHEDULE.kind {
        return Err(invalid(
            "kind".into(),
            format!(
                "{:?}; expected {}",
                raw.kind,
                names::GPU_PROFILE_SCHEDULE.kind
            ),
        ));
    }
    let name = raw
        .metadata
        .name
        .filter(|n| !n.is_empty())
        .ok_or_else(|| invalid("metadata.name".into(), "is required".into()))?;
    let spec = raw.spec;
    let selector = Selector::from_spec(&spec.node_selector, "spec.nodeSelector")
        .map_err(|(field, message)| invalid(field, message))?;
    let zone_name = spec.time_zone.unwrap_or_else(|| "UTC".to_owned());
    let zone = TimeZone::get(&zone_name).map_err(|_| {
        invalid(
            "spec.timeZone".into(),
            format!(
                "{zone_name:?} is not a time zone of the IANA database (e.g. Europe/Berlin, UTC)"
            ),
        )
    })?;
    if spec.profiles.is_empty() || spec.profiles.len() > MAX_PROFILES {
        return Err(invalid(
            "spec.profiles".into(),
            format!(
                "has {} profiles; a schedule has 1 to {MAX_PROFILES}",
                spec.profiles.len()
            ),
        ));
    }
    let mut profiles: Vec<Profile> = Vec::with_capacity(spec.profiles.len());
    for (i, p) in spec.profiles.into_iter().enumerate() {
        let field = format!("spec.profiles[{i}]");
        if !is_dns_label(&p.name) {
            return Err(invalid(
                format!("{field}.name"),
                format!(
                    "{:?} must be a DNS label: lower-case letters, digits and '-', at most 63",
                    p.name
                ),
            ));
        }
        if profiles.iter().any(|q| q.name == p.name) {
            return Err(invalid(
                format!("{field}.name"),
                format!("profile {:?} is named twice", p.name),
            ));
        }
        let bad_mode = |f: String, m: &str| {
            invalid(
                f,
                format!("{m:?} is not a GPU mode; expected exclusive, shared or mig"),
            )
        };
        let node = match p.mode.as_deref() {
            Some(m) => Some(parse_mode(m).ok_or_else(|| bad_mode(format!("{field}.mode"), m))?),
            None => None,
        };
        let mut gpus = BTreeMap::new();
        for (j, g) in p.gpus.iter().enumerate() {
            let gfield = format!("{field}.gpus[{j}]");
            if g.index > MAX_GPU_INDEX {
                return Err(invalid(
                    format!("{gfield}.index"),
                    format!(
                        "{} is above the highest GPU index, {MAX_GPU_INDEX}",
                        g.index
                    ),
                ));
            }
            let mode =
                parse_mode(&g.mode).ok_or_else(|| bad_mode(format!("{gfield}.mode"), &g.mode))?;
            if gpus.insert(g.index, mode).is_some() {
                return Err(invalid(
                    format!("{gfield}.index"),
                    format!("GPU {} is named twice", g.index),
                ));
            }
        }
        if node.is_none() && gpus.is_empty() {
            return Err(invalid(
                field,
                format!(
                    "profile {:?} chooses nothing: set mode, gpus, or both",
                    p.name
                ),
            ));
        }
        let drain_deadline = match p.drain_deadline.as_deref() {
            Some(text) => Some(
                Patience::parse(text).map_err(|m| invalid(format!("{field}.drainDeadline"), m))?,
            ),
            None => None,
        };
        profiles.push(Profile {
            name: p.name,
            choice: ModeChoice { node, gpus },
            drain_deadline,
        });
    }
    if spec.windows.is_empty() || spec.windows.len() > MAX_WINDOWS {
        return Err(invalid(
            "spec.windows".into(),
            format!(
                "has {} windows; a schedule has 1 to {MAX_WINDOWS}",
                spec.windows.len()
            ),
        ));
    }
    let mut windows = Vec::with_capacity(spec.windows.len());
    for (i, w) in spec.windows.iter().enumerate() {
        let field = format!("spec.windows[{i}]");
        let start = Cron::parse(&w.start).map_err(|m| invalid(format!("{field}.start"), m))?;
        let profile = profiles
            .iter()
            .position(|p| p.name == w.profile)
            .ok_or_else(|| {
                invalid(
                    format!("{field}.profile"),
                    format!("no profile is named {:?}", w.profile),
                )
            })?;
        windows.push(Window { start, profile });
    }
    Ok(Schedule {
        name,
        selector,
        zone,
        zone_name,
        profiles,
        windows,
    })
}

impl Schedule {
    /// The profile in force at `now`: the one of the window that started last at or before
    /// it; `None` when no window started within the search bound ([`cron::SEARCH_DAYS`]).
    pub fn active_at(&self, now: Timestamp) -> Option<Active> {
        let mut best: Option<Active> = None;
        for w in &self.windows {
            let Some(since) = w.start.latest_at_or_before(now, &self.zone) else {
                continue;
            };
            // `>=`: a later window wins a tie.
            if best.is_none_or(|b| since >= b.since) {
                best = Some(Active {
                    profile: w.profile,
                    since,
                });
            }
        }
        best
    }

    /// The winner among the windows starting at the earliest instant after `after`.
    fn next_start(&self, after: Timestamp) -> Option<Active> {
        let mut best: Option<Active> = None;
        for w in &self.windows {
            let Some(at) = w.start.next_after(after, &self.zone) else {
                continue;
            };
            if best.is_none_or(|b| at <= b.since) {
                best = Some(Active {
                    profile: w.profile,
                    since: at,
                });
            }
        }
        best
    }

    /// The next switch after `now`: when a window starts a profile other than the one in force
    /// at `now`, and which. `None` when none is found within [`MAX_STARTS_SEARCHED`] starts.
    pub fn next_switch(&self, now: Timestamp) -> Option<Active> {
        let current = self.active_at(now).map(|a| a.profile);
        if self.windows.iter().all(|w| Some(w.profile) == current) {
            // Every window starts the profile in force: it never changes.
            return None;
        }
        let mut cursor = now;
        for _ in 0..MAX_STARTS_SEARCHED {
            let next = self.next_start(cursor)?;
            if Some(next.profile) != current {
                return Some(next);
            }
            cursor = next.since;
        }
        None
    }

    /// The profile at `index` (as [`Active::profile`] names it).
    pub fn profile(&self, index: usize) -> Option<&Profile> {
        self.profiles.get(index)
    }
}

impl Profile {
    /// The GPU-mode labels this profile wants on a node.
    pub fn labels(&self) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        if let Some(mode) = self.choice.node {
            out.insert(names::LABEL_GPU_MODE.to_owned(), mode.as_str().to_owned());
        }
        for (index, mode) in &self.choice.gpus {
            out.insert(
                format!("{}{index}", names::LABEL_GPU_MODE_PER_GPU_PREFIX),
                mode.as_str().to_owned(),
            );
        }
        out
    }

    /// The label changes that make a node with `labels` carry this profile's modes: a value
    /// to set, or `None` to remove (a mode label the profile does not name).
    pub fn label_changes(
        &self,
        labels: &BTreeMap<String, String>,
    ) -> BTreeMap<String, Option<String>> {
        let wanted = self.labels();
        let mut out: BTreeMap<String, Option<String>> = wanted
            .iter()
            .filter(|(k, v)| labels.get(*k) != Some(*v))
            .map(|(k, v)| (k.clone(), Some(v.clone())))
            .collect();
        for key in labels.keys() {
            let ours = key == names::LABEL_GPU_MODE
                || key.starts_with(names::LABEL_GPU_MODE_PER_GPU_PREFIX);
            if ours && !wanted.contains_key(key) {
                out.insert(key.clone(), None);
            }
        }
        out
    }
}

/// Which schedule a node follows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Assignment<'a> {
    /// No schedule selects the node: its modes are the admin's.
    None,
    /// Exactly one does.
    One(&'a Schedule),
    /// Several do: none is applied, and the node is reported (names of the schedules).
    Conflict(Vec<String>),
}

impl PartialEq for Schedule {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}
impl Eq for Schedule {}

/// The schedule a node with `labels` follows among `schedules`.
pub fn assign<'a>(schedules: &'a [Schedule], labels: &BTreeMap<String, String>) -> Assignment<'a> {
    let matching: Vec<&Schedule> = schedules
        .iter()
        .filter(|s| s.selector.matches(labels))
        .collect();
    match matching.as_slice() {
        [] => Assignment::None,
        [one] => Assignment::One(one),
        many => Assignment::Conflict(many.iter().map(|s| s.name.clone()).collect()),
    }
}
