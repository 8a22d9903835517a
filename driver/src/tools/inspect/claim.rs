//! One claim as its user sees it (`tessera inspect claim NS/NAME`): what it booked, what the
//! node that prepared it says it got and uses (its `status.devices` entries of this driver,
//! `crate::node::claim_status`), and the Events the node's plugin posted about it or its pods.

use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::resource::v1 as res;
use serde::Serialize;
use serde_json::Value;

use crate::names;
use crate::node::claim_status::{CONDITION_MEMORY_WITHIN_BOOKING, CONDITION_READY};
use crate::rules::quantity::Quantity;

/// The longest Event note or condition message the view keeps, in bytes.
pub const TEXT_LIMIT: usize = 512;

/// One device of the claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimDevice {
    /// The request it serves.
    pub request: String,
    /// `pool/device`.
    pub device: String,
    /// Memory booked (the allocation's consumed capacity, else the node's enforced limit).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_booked: Option<Quantity>,
    /// Compute booked, in percent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compute_booked: Option<i64>,
    /// The backend the node enforces it with (`mps`, `hami-core`, `none`, `whole`, `mig`);
    /// `None` until the node wrote the claim's status.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// The GPU's isolation as the node wrote it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub isolation: Option<String>,
    /// The memory its processes use, as the node last wrote it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_used: Option<Quantity>,
    /// The `Ready` condition's status.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ready: Option<String>,
    /// The `MemoryWithinBooking` condition's status and message.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_within_booking: Option<(String, String)>,
}

/// An Event of the node's plugin about the claim or one of its pods.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimEvent {
    /// `Normal` or `Warning`.
    pub kind: String,
    /// Its reason.
    pub reason: String,
    /// What it is about, `Kind/name`.
    pub regarding: String,
    /// Its note, cut at [`TEXT_LIMIT`] bytes.
    pub note: String,
    /// How often it happened (1, or the series' count).
    pub count: i32,
}

/// One claim, explained.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimView {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Whether it is allocated.
    pub allocated: bool,
    /// The pods it is reserved for.
    pub pods: Vec<String>,
    /// Its devices of this driver, in allocation order.
    pub devices: Vec<ClaimDevice>,
    /// The node plugin's Events about it or its pods, oldest first as listed.
    pub events: Vec<ClaimEvent>,
}

fn bounded(text: &str) -> String {
    let mut end = text.len().min(TEXT_LIMIT);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

fn capacity(result: &res::DeviceRequestAllocationResult, name: &str) -> Option<Quantity> {
    result
        .consumed_capacity
        .as_ref()?
        .get(name)
        .and_then(|q| Quantity::from_k8s(q).ok())
}

/// This driver's `status.devices` entry of allocation result `r` of `claim`, if the node wrote
/// one.
fn written_entry<'a>(
    claim: &'a res::ResourceClaim,
    r: &res::DeviceRequestAllocationResult,
) -> Option<&'a res::AllocatedDeviceStatus> {
    claim
        .status
        .as_ref()
        .and_then(|s| s.devices.as_ref())?
        .iter()
        .find(|s| {
            s.driver == r.driver
                && s.pool == r.pool
                && s.device == r.device
                && s.share_id == r.share_id
        })
}

/// The memory allocation result `r` of `claim` booked (its consumed capacity, else the limit the
/// node enforces) and uses (as the node last wrote it).
pub fn memory_booked_and_used(
    claim: &res::ResourceClaim,
    r: &res::DeviceRequestAllocationResult,
) -> (Option<Quantity>, Option<Quantity>) {
    let data = written_entry(claim, r)
        .and_then(|e| e.data.as_ref())
        .map(|d| &d.0);
    let bytes = |key: &str| {
        data.and_then(|d| d.get(key))
            .and_then(Value::as_u64)
            .map(Quantity::from_bytes)
    };
    (
        capacity(r, names::CAP_MEMORY).or_else(|| bytes("memoryLimitBytes")),
        bytes("memoryUsedBytes"),
    )
}

/// Explains `claim` for `driver`, with the `events` of its namespace (the node plugin's about
/// the claim or the pods it is reserved for are kept).
pub fn explain_claim(driver: &str, claim: &res::ResourceClaim, events: &[Event]) -> ClaimView {
    let status = claim.status.as_ref();
    let pods: Vec<String> = status
        .and_then(|s| s.reserved_for.as_ref())
        .into_iter()
        .flatten()
        .filter(|r| r.resource == names::POD.plural)
        .map(|r| r.name.clone())
        .collect();
    let results: &[res::DeviceRequestAllocationResult] = status
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_deref())
        .unwrap_or_default();
    let devices = results
        .iter()
        .filter(|r| r.driver == driver)
        .map(|r| {
            let entry = written_entry(claim, r);
            let (memory_booked, memory_used) = memory_booked_and_used(claim, r);
            let data = entry.and_then(|e| e.data.as_ref()).map(|d| &d.0);
            let field = |key: &str| data.and_then(|d| d.get(key));
            let condition = |type_: &str| {
                entry
                    .and_then(|e| e.conditions.as_ref())
                    .and_then(|cs| cs.iter().find(|c| c.type_ == type_))
            };
            ClaimDevice {
                request: r.request.clone(),
                device: format!("{}/{}", r.pool, r.device),
                memory_booked,
                compute_booked: capacity(r, names::CAP_COMPUTE)
                    .and_then(Quantity::as_units)
                    .or_else(|| field("computePercent").and_then(Value::as_i64)),
                backend: field("backend").and_then(Value::as_str).map(bounded),
                isolation: field("isolation").and_then(Value::as_str).map(bounded),
                memory_used,
                ready: condition(CONDITION_READY).map(|c| bounded(&c.status)),
                memory_within_booking: condition(CONDITION_MEMORY_WITHIN_BOOKING)
                    .map(|c| (bounded(&c.status), bounded(&c.message))),
            }
        })
        .collect();
    let name = claim.metadata.name.clone().unwrap_or_default();
    let events = events
        .iter()
        .filter(|e| e.reporting_controller.as_deref() == Some(names::KUBELET_PLUGIN_COMPONENT))
        .filter_map(|e| {
            let about = e.regarding.as_ref()?;
            let kind = about.kind.as_deref()?;
            let object = about.name.as_deref()?;
            let ours = (kind == names::RESOURCE_CLAIM.kind && object == name)
                || (kind == names::POD.kind && pods.iter().any(|p| p == object));
            ours.then(|| ClaimEvent {
                kind: bounded(e.type_.as_deref().unwrap_or_default()),
                reason: bounded(e.reason.as_deref().unwrap_or_default()),
                regarding: bounded(&format!("{kind}/{object}")),
                note: bounded(e.note.as_deref().unwrap_or_default()),
                count: e.series.as_ref().map_or(1, |s| s.count),
            })
        })
        .collect();
    ClaimView {
        namespace: claim.metadata.namespace.clone().unwrap_or_default(),
        name,
        allocated: status.is_some_and(|s| s.allocation.is_some()),
        pods,
        devices,
        events,
    }
}
