//! What a prepared claim says about itself on the API server: the entries of
//! `ResourceClaim.status.devices` the node writes for its driver's devices.
//!
//! Kubernetes gives each driver the entries of its own devices in `status.devices`
//! (`AllocatedDeviceStatus`, keyed by driver, pool, device and share ID; every entry must name a
//! device of the claim's allocation). The node that prepared a claim writes, for each of the
//! claim's devices of this driver:
//!
//! * `data`: what is enforced there (`memoryLimitBytes`, `computePercent`, `tier`), by which
//!   `backend` (`mps`, `hami-core`, `none` for shares; `whole`; `mig`), the GPU's `isolation`
//!   verdict, the MPS daemon the claim's containers talk to, and, once the accounting measured
//!   it, `memoryUsedBytes`;
//! * `conditions`: `Ready` (the device is prepared for the claim's containers) and, for a share
//!   with a memory booking on a whole GPU, `MemoryWithinBooking` (`False` while the claim's
//!   processes together hold more than it booked, `Unknown` until a pass measured them).
//!
//! Entries of other drivers are kept as they are; this driver's are replaced; an unprepared
//! claim loses them. [`status_write`] answers whether the claim on the API server differs from
//! what the node knows, so the plugin writes only a change. A condition keeps its
//! `lastTransitionTime` while its status stays; the reported use moves only by a twentieth of the
//! booking or across it ([`reported_use`]), so a busy share does not rewrite its claim at every
//! pass.
//!
//! No text of the claim's containers reaches a message: the messages hold numbers, the GPU's UUID
//! (from NVML) and the node's own codes, each bounded.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::resource::v1::{AllocatedDeviceStatus, ResourceClaim};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
use serde_json::{Map, Value, json};

use crate::names;
use crate::node::accounting::GpuUse;
use crate::node::cdi::Enforcement;
use crate::node::checkpoint::{ClaimEntry, HeldDevice, PrepareState};
use crate::node::inventory::NodeInventory;

/// The `kind` of the `data` the node writes (under [`names::CONFIG_API_VERSION`]).
pub const DATA_KIND: &str = "PreparedDevice";
/// Condition type: the device is prepared for the claim's containers.
pub const CONDITION_READY: &str = "Ready";
/// Condition type: the claim's processes hold no more GPU memory than the claim booked.
pub const CONDITION_MEMORY_WITHIN_BOOKING: &str = "MemoryWithinBooking";
/// The longest condition message the node writes (the API allows 32768 bytes).
pub const MESSAGE_LIMIT: usize = 1024;

/// How a device's share is enforced, as `data.backend` says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// A share limited by NVIDIA MPS.
    Mps,
    /// A share limited by HAMi-core's preloaded library.
    HamiCore,
    /// A share the node books but nothing limits (time-slicing).
    None,
    /// A whole GPU, held by this claim alone.
    Whole,
    /// A MIG instance: a hardware partition.
    Mig,
}

impl Backend {
    /// The written value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Mps => "mps",
            Self::HamiCore => "hami-core",
            Self::None => "none",
            Self::Whole => "whole",
            Self::Mig => "mig",
        }
    }

    /// The backend of `device` on a node enforcing shares with `enforcement`.
    pub fn of(device: &HeldDevice, enforcement: &Enforcement) -> Self {
        if device.mig {
            return Self::Mig;
        }
        if device.exclusive || device.share_memory_bytes.is_none() {
            return Self::Whole;
        }
        match enforcement {
            Enforcement::Mps { .. } => Self::Mps,
            Enforcement::HamiCore { .. } => Self::HamiCore,
            Enforcement::None => Self::None,
        }
    }
}

/// What the node knows besides the claim's checkpoint entry.
#[derive(Debug, Clone, Copy)]
pub struct NodeFacts<'a> {
    /// The driver's name: the entries the node owns.
    pub driver: &'a str,
    /// The node's GPUs, with each one's isolation verdict.
    pub node: &'a NodeInventory,
    /// How the node enforces shares.
    pub enforcement: &'a Enforcement,
}

/// The use to report, given the use written last (`previous`) and the one just measured: the
/// measured use once it moved by at least a twentieth of the booking, or crossed the booking;
/// else the previous one, so that small moves do not rewrite the claim.
pub fn reported_use(previous: Option<u64>, measured: &GpuUse) -> u64 {
    let Some(previous) = previous else {
        return measured.used_bytes;
    };
    let step = (measured.booked_bytes / 20).max(1);
    let crossed = (previous <= measured.booked_bytes) != measured.within_booking();
    if crossed || previous.abs_diff(measured.used_bytes) >= step {
        measured.used_bytes
    } else {
        previous
    }
}

/// How long to wait before writing a claim's status again after `failures` failed attempts:
/// 200 ms, doubling, at most 30 s.
pub fn retry_delay(failures: u32) -> Duration {
    let base = Duration::from_millis(200);
    base.saturating_mul(1u32 << failures.min(8))
        .min(Duration::from_secs(30))
}

fn mib(bytes: u64) -> String {
    format!("{} MiB", bytes / (1 << 20))
}

/// Cuts `text` to [`MESSAGE_LIMIT`] bytes at a character boundary.
fn bounded(mut text: String) -> String {
    if text.len() > MESSAGE_LIMIT {
        let mut end = MESSAGE_LIMIT;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

fn is_ours(status: &AllocatedDeviceStatus, driver: &str, device: &HeldDevice) -> bool {
    status.driver == driver
        && status.pool == device.pool
        && status.device == device.device
        && status.share_id == device.share_id
}

/// A condition, keeping the transition time of `previous` when its status is the same.
fn condition(
    previous: Option<&AllocatedDeviceStatus>,
    type_: &str,
    status: &str,
    reason: &str,
    message: String,
    generation: Option<i64>,
    now: &Time,
) -> Condition {
    let before = previous
        .and_then(|p| p.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == type_))
        .filter(|c| c.status == status);
    Condition {
        last_transition_time: before
            .map_or_else(|| now.clone(), |c| c.last_transition_time.clone()),
        message: bounded(message),
        observed_generation: generation,
        reason: reason.to_owned(),
        status: status.to_owned(),
        type_: type_.to_owned(),
    }
}

/// The memory condition of a share device booked on a whole GPU (`None` for other devices).
fn memory_condition(
    device: &HeldDevice,
    measured: Option<&GpuUse>,
    used: Option<u64>,
    previous: Option<&AllocatedDeviceStatus>,
    generation: Option<i64>,
    now: &Time,
) -> Option<Condition> {
    let booked = device.share_memory_bytes.filter(|_| !device.mig)?;
    let gpu = &device.gpu_uuid;
    let written = previous.and_then(|p| p.conditions.as_ref()).and_then(|cs| {
        cs.iter()
            .find(|c| c.type_ == CONDITION_MEMORY_WITHIN_BOOKING)
    });
    if let (None, Some(written)) = (measured, written) {
        // Not measured since the plugin started: what was written stays until a pass says
        // otherwise.
        return Some(written.clone());
    }
    let (status, reason, message) = match (measured, used) {
        (Some(m), Some(used)) => {
            let together = if m.counted_with == 0 {
                String::new()
            } else {
                format!(
                    " (counted together with {} other claim(s) of the same pod, which books {} \
                     there with them)",
                    m.counted_with,
                    mib(m.booked_bytes)
                )
            };
            if used <= m.booked_bytes {
                (
                    "True",
                    "WithinBooking",
                    format!(
                        "the claim's processes use {} of the {} booked on GPU {gpu}{together}",
                        mib(used),
                        mib(booked)
                    ),
                )
            } else {
                (
                    "False",
                    "OverBooking",
                    format!(
                        "the claim's processes use {}, more than the {} booked on GPU {gpu}{together}; \
                         the node stops the newest of them until the claim fits",
                        mib(used),
                        mib(booked)
                    ),
                )
            }
        }
        _ => (
            "Unknown",
            "NotMeasured",
            format!("no accounting pass has measured the claim's processes on GPU {gpu} yet"),
        ),
    };
    Some(condition(
        previous,
        CONDITION_MEMORY_WITHIN_BOOKING,
        status,
        reason,
        message,
        generation,
        now,
    ))
}

/// The `data` of one device.
fn data(
    device: &HeldDevice,
    entry: &ClaimEntry,
    facts: &NodeFacts<'_>,
    used: Option<u64>,
) -> Value {
    let backend = Backend::of(device, facts.enforcement);
    let mut out = Map::new();
    out.insert("apiVersion".into(), json!(names::CONFIG_API_VERSION));
    out.insert("kind".into(), json!(DATA_KIND));
    out.insert("gpu".into(), json!(device.gpu_uuid));
    out.insert("backend".into(), json!(backend.as_str()));
    let isolation = match backend {
        // Held alone, or a hardware partition: nothing is shared with another claim's processes.
        Backend::Whole | Backend::Mig => "hardware".to_owned(),
        Backend::Mps | Backend::HamiCore | Backend::None => facts
            .node
            .gpus
            .iter()
            .find(|g| g.uuid == device.gpu_uuid)
            .map_or_else(
                || {
                    crate::node::inventory::Isolation::Unverified
                        .as_str()
                        .to_owned()
                },
                |g| g.isolation.as_str().to_owned(),
            ),
    };
    out.insert("isolation".into(), json!(isolation));
    if let Some(bytes) = device.share_memory_bytes {
        out.insert("memoryLimitBytes".into(), json!(bytes));
    }
    if let Some(percent) = device.share_compute_percent {
        out.insert("computePercent".into(), json!(percent));
    }
    if backend != Backend::Whole && backend != Backend::Mig {
        out.insert(
            "tier".into(),
            json!(device.share_tier.unwrap_or_default().as_str()),
        );
    }
    if let Some(daemon) = entry
        .mps_daemon
        .as_ref()
        .filter(|d| d.devices.contains(&device.gpu_uuid))
    {
        out.insert("mpsDaemon".into(), json!(daemon.id));
    }
    if let Some(used) = used {
        out.insert("memoryUsedBytes".into(), json!(used));
    }
    Value::Object(out)
}

/// The `memoryUsedBytes` an entry reports.
fn written_use(status: &AllocatedDeviceStatus) -> Option<u64> {
    status
        .data
        .as_ref()
        .and_then(|d| d.0.get("memoryUsedBytes"))
        .and_then(Value::as_u64)
}

/// The entries this node owns for a prepared claim: one per device of `entry`, given the entries
/// the claim has now (`current`, for transition times and the use written last), the use the
/// accounting measured (`measured`, by GPU UUID; `None`: not measured) and the time.
pub fn device_statuses(
    entry: &ClaimEntry,
    current: &[AllocatedDeviceStatus],
    measured: Option<&BTreeMap<String, GpuUse>>,
    facts: &NodeFacts<'_>,
    generation: Option<i64>,
    now: &Time,
) -> Vec<AllocatedDeviceStatus> {
    entry
        .devices
        .iter()
        .map(|device| {
            let previous = current.iter().find(|s| is_ours(s, facts.driver, device));
            let gpu_use = measured
                .and_then(|m| m.get(&device.gpu_uuid))
                .filter(|_| device.share_memory_bytes.is_some() && !device.mig);
            let used = match gpu_use {
                Some(m) => Some(reported_use(previous.and_then(written_use), m)),
                None => previous.and_then(written_use),
            };
            let mut conditions = vec![condition(
                previous,
                CONDITION_READY,
                "True",
                "Prepared",
                format!(
                    "prepared on this node for the claim's containers ({} backend)",
                    Backend::of(device, facts.enforcement).as_str()
                ),
                generation,
                now,
            )];
            conditions.extend(memory_condition(
                device, gpu_use, used, previous, generation, now,
            ));
            AllocatedDeviceStatus {
                conditions: Some(conditions),
                data: Some(RawExtension(data(device, entry, facts, used))),
                device: device.device.clone(),
                driver: facts.driver.to_owned(),
                network_data: None,
                pool: device.pool.clone(),
                share_id: device.share_id.clone(),
            }
        })
        .collect()
}

/// `current` with every entry of `driver` replaced by `ours`: other drivers' entries stay, in
/// their order, and ours follow them.
pub fn merge_devices(
    current: &[AllocatedDeviceStatus],
    driver: &str,
    ours: Vec<AllocatedDeviceStatus>,
) -> Vec<AllocatedDeviceStatus> {
    current
        .iter()
        .filter(|s| s.driver != driver)
        .cloned()
        .chain(ours)
        .collect()
}

/// Whether two lists of entries say the same: the same devices with the same data and the same
/// conditions, whatever their transition times and observed generations.
pub fn same_report(a: &[AllocatedDeviceStatus], b: &[AllocatedDeviceStatus]) -> bool {
    fn said(s: &AllocatedDeviceStatus) -> impl PartialEq + '_ {
        (
            (&s.driver, &s.pool, &s.device, &s.share_id, &s.data),
            s.conditions
                .iter()
                .flatten()
                .map(|c| (&c.type_, &c.status, &c.reason, &c.message))
                .collect::<Vec<_>>(),
        )
    }
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| said(x) == said(y))
}

/// What `status.devices` of `claim` must become, or `None` when it already says what the node
/// knows. `entry` is the claim's checkpoint entry (a claim not recorded as prepared gets no
/// entries of this driver); `measured` is the accounting's last measure of the claim.
pub fn status_write(
    claim: &ResourceClaim,
    entry: Option<&ClaimEntry>,
    measured: Option<&BTreeMap<String, GpuUse>>,
    facts: &NodeFacts<'_>,
    now: &Time,
) -> Option<Vec<AllocatedDeviceStatus>> {
    let current: &[AllocatedDeviceStatus] = claim
        .status
        .as_ref()
        .and_then(|s| s.devices.as_deref())
        .unwrap_or_default();
    let ours = entry
        .filter(|e| e.state == PrepareState::PrepareCompleted)
        .map(|e| device_statuses(e, current, measured, facts, claim.metadata.generation, now))
        .unwrap_or_default();
    let next = merge_devices(current, facts.driver, ours);
    (next != current).then_some(next)
}

#[cfg(test)]
mod tests;
