//! Building a claim's allocation result from the devices the search picked: one result per
//! device (consumed capacity and `shareID` where the device allows several allocations),
//! class then claim configs as kube-scheduler copies them, Tessera's `AllocatedShares` record,
//! and the result's node selector.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorRequirement, NodeSelectorTerm};
use k8s_openapi::api::resource::v1 as res;
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;

use super::request::{ClaimSpec, ReqSpec};
use super::search::Pick;
use super::snapshot::Snapshot;
use crate::rules::config::{AllocatedShares, DeviceShare};
use crate::rules::nodeselect::{FIELD_NODE_NAME, NodeScope};
use crate::rules::quantity::Quantity;

/// Source of a config copied from a `DeviceClass`.
const SOURCE_CLASS: &str = "FromClass";
/// Source of a config copied from the claim.
const SOURCE_CLAIM: &str = "FromClaim";

/// The allocation of one claim on `node`: the devices `picks` (the alternatives `selected`),
/// with `driver`'s share records.
pub(super) fn build(
    driver: &str,
    snap: &Snapshot,
    spec: &ClaimSpec,
    claim: &res::ResourceClaim,
    picks: &[Pick],
    selected: &[usize],
    node: &str,
) -> res::AllocationResult {
    let mut results = Vec::with_capacity(picks.len());
    let mut shares = Vec::new();
    let mut share_requests: Vec<String> = Vec::new();
    for (i, pick) in picks.iter().enumerate() {
        let req = &spec.requests[pick.req][pick.alt];
        let entry = &snap.devices[pick.device];
        let consumed = pick.consumed.as_ref().map(|c| {
            c.iter()
                .map(|(k, v)| (k.clone(), v.to_k8s()))
                .collect::<BTreeMap<_, _>>()
        });
        // kube-scheduler leaves the field out when nothing was consumed.
        let consumed = consumed.filter(|c| !c.is_empty());
        let share_id = (entry.multi && !req.admin).then(|| {
            let name = format!("{}/{}/{}/{i}", spec.uid, req.full, entry.id());
            uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_URL, name.as_bytes()).to_string()
        });
        results.push(res::DeviceRequestAllocationResult {
            request: req.full.clone(),
            driver: entry.driver.clone(),
            pool: entry.pool.clone(),
            device: entry.device().name.clone(),
            admin_access: req.admin.then_some(true),
            tolerations: (!req.tolerations.is_empty()).then(|| req.tolerations.clone()),
            share_id,
            consumed_capacity: consumed,
            binding_conditions: entry.device().binding_conditions.clone(),
            binding_failure_conditions: entry.device().binding_failure_conditions.clone(),
        });
        if let Some(per) = pick.share.filter(|_| entry.tessera_shared && !req.admin) {
            let (over_memory, over_compute) = pick.over.unwrap_or_default();
            shares.push(DeviceShare {
                request: req.full.clone(),
                pool: entry.pool.clone(),
                device: entry.device().name.clone(),
                memory: Quantity::from_bytes(per.memory_bytes),
                compute: per.compute_percent,
                tier: req.tier,
                guaranteed_memory: (over_memory > 0)
                    .then(|| Quantity::from_bytes(per.memory_bytes.saturating_sub(over_memory))),
                guaranteed_compute: (over_compute > 0)
                    .then(|| per.compute_percent.saturating_sub(over_compute)),
            });
            if !share_requests.contains(&req.full) {
                share_requests.push(req.full.clone());
            }
        }
    }
    let mut config = config_for(snap, spec, claim, selected);
    if !shares.is_empty()
        && let Ok(parameters) = serde_json::to_value(AllocatedShares::new(shares))
    {
        config.push(res::DeviceAllocationConfiguration {
            source: SOURCE_CLAIM.to_owned(),
            requests: Some(share_requests),
            opaque: Some(res::OpaqueDeviceConfiguration {
                driver: driver.to_owned(),
                parameters: RawExtension(parameters),
            }),
        });
    }
    res::AllocationResult {
        allocation_timestamp: None,
        devices: Some(res::DeviceAllocationResult {
            config: (!config.is_empty()).then_some(config),
            results: Some(results),
        }),
        node_selector: result_node_selector(snap, picks, node),
    }
}

/// Class configs once per class (naming the requests that use it), then claim configs that
/// apply to an allocated request or subrequest, as kube-scheduler writes them.
fn config_for(
    snap: &Snapshot,
    spec: &ClaimSpec,
    claim: &res::ResourceClaim,
    selected: &[usize],
) -> Vec<res::DeviceAllocationConfiguration> {
    let mut out: Vec<res::DeviceAllocationConfiguration> = Vec::new();
    let mut class_ranges: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    let chosen: Vec<&ReqSpec> = spec
        .requests
        .iter()
        .zip(selected)
        .filter_map(|(alts, &a)| alts.get(a))
        .collect();
    for req in &chosen {
        if let Some(&(start, end)) = class_ranges.get(req.class.as_str()) {
            for cfg in &mut out[start..end] {
                cfg.requests
                    .get_or_insert_with(Vec::new)
                    .push(req.full.clone());
            }
            continue;
        }
        let start = out.len();
        if let Some(class) = snap.classes.get(&req.class) {
            for cfg in class.spec.config.iter().flatten() {
                out.push(res::DeviceAllocationConfiguration {
                    source: SOURCE_CLASS.to_owned(),
                    requests: Some(vec![req.full.clone()]),
                    opaque: cfg.opaque.clone(),
                });
            }
        }
        class_ranges.insert(req.class.as_str(), (start, out.len()));
    }
    let devices = claim.spec.devices.as_ref();
    for cfg in devices
        .and_then(|d| d.config.as_ref())
        .into_iter()
        .flatten()
    {
        let names = cfg.requests.as_deref().unwrap_or_default();
        let entry = || res::DeviceAllocationConfiguration {
            source: SOURCE_CLAIM.to_owned(),
            requests: cfg.requests.clone(),
            opaque: cfg.opaque.clone(),
        };
        if names.is_empty() {
            out.push(entry());
            continue;
        }
        for req in &chosen {
            if names.contains(&req.base) || (req.sub.is_some() && names.contains(&req.full)) {
                out.push(entry());
            }
        }
    }
    out
}

/// The node selector of an allocation: the node when any device is local to it; else the
/// requirements of node-selector slices; none for devices every node reaches.
fn result_node_selector(snap: &Snapshot, picks: &[Pick], node: &str) -> Option<NodeSelector> {
    let mut fields: Vec<NodeSelectorRequirement> = Vec::new();
    let mut exprs: Vec<NodeSelectorRequirement> = Vec::new();
    for pick in picks {
        let entry = &snap.devices[pick.device];
        if matches!(entry.scope, NodeScope::Node(_)) || entry.device().binds_to_node == Some(true) {
            return Some(NodeSelector {
                node_selector_terms: vec![NodeSelectorTerm {
                    match_expressions: None,
                    match_fields: Some(vec![NodeSelectorRequirement {
                        key: FIELD_NODE_NAME.to_owned(),
                        operator: "In".to_owned(),
                        values: Some(vec![node.to_owned()]),
                    }]),
                }],
            });
        }
        if let NodeScope::Selector(s) = &entry.scope
            && let [term] = s.node_selector_terms.as_slice()
        {
            for r in term.match_fields.iter().flatten() {
                if !fields.contains(r) {
                    fields.push(r.clone());
                }
            }
            for r in term.match_expressions.iter().flatten() {
                if !exprs.contains(r) {
                    exprs.push(r.clone());
                }
            }
        }
    }
    if fields.is_empty() && exprs.is_empty() {
        return None;
    }
    Some(NodeSelector {
        node_selector_terms: vec![NodeSelectorTerm {
            match_expressions: (!exprs.is_empty()).then_some(exprs),
            match_fields: (!fields.is_empty()).then_some(fields),
        }],
    })
}
