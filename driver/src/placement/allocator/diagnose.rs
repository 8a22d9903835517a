//! Why a pod fits on no candidate node: per request, how the reachable devices its class
//! selects fare on their own (the counts of [`DeviceCounts`]); when each request fits alone,
//! the constraint no node can meet, or else that the requests do not fit together.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Node;

use super::reach::{class_devices, node_devices, reachable};
use super::reason::{ClaimFailure, DeviceCounts, FailureKind, Unsatisfiable, Wanted};
use super::request::{ClaimSpec, ReqSpec};
use super::search::{self, Abort, Outcome};
use super::snapshot::{CandidateIds, SelectorCache, Snapshot};
use crate::rules::quantity::Quantity;

fn wanted(req: &ReqSpec) -> Wanted {
    // Native capacity requests, as asked: each device books them by its own policies.
    if req.share.is_none()
        && let Some(asked) = req.capacity.as_ref().filter(|c| !c.is_empty())
    {
        let list: Vec<String> = asked.iter().map(|(k, v)| format!("{k} {v}")).collect();
        return Wanted::Capacity {
            room: format!("with room for {}", list.join(" and ")),
        };
    }
    match req.share.as_ref() {
        Some(share) => {
            let memory = match share.memory {
                crate::rules::share::MemoryAsk::Bytes(b) => {
                    format!("{} free", Quantity::from_bytes(b))
                }
                crate::rules::share::MemoryAsk::Percent(p) => format!("{p}% of its memory free"),
            };
            let room = if share.compute > 0 {
                format!("with {memory} and {}% compute", share.compute)
            } else {
                format!("with {memory}")
            };
            Wanted::Gpu { room }
        }
        None => Wanted::Device,
    }
}

/// How one request fares on the reachable devices: the counts, and the devices that fit alone.
fn tally(
    snap: &Snapshot,
    cache: &mut SelectorCache,
    req: &ReqSpec,
    reachable: &[bool],
    reachable_count: u32,
) -> Result<(DeviceCounts, Vec<usize>), FailureKind> {
    let abort = |a: Abort| match a {
        Abort::Cel(e) => FailureKind::CelRuntime(e.to_string()),
        Abort::Fatal(m) | Abort::Error(m) => FailureKind::Invalid(m),
        Abort::Budget => FailureKind::SearchLimit(0),
    };
    let selected = class_devices(snap, cache, req);
    let mut counts = DeviceCounts {
        considered: reachable_count,
        class_mismatch: reachable_count,
        ..DeviceCounts::default()
    };
    let mut fitting = Vec::new();
    for &dev in selected.iter().filter(|&&d| reachable[d]) {
        counts.class_mismatch -= 1;
        let outcome = search::classify(snap, cache, req, dev).map_err(abort)?;
        match outcome {
            Outcome::ClassMismatch => {}
            Outcome::SelectorMismatch => counts.selector_mismatch += 1,
            Outcome::NotShared => counts.not_shared += 1,
            Outcome::Tainted => counts.tainted += 1,
            Outcome::InUse => counts.in_use += 1,
            Outcome::TooFull => counts.too_full += 1,
            Outcome::TooSmall => counts.too_small += 1,
            Outcome::Undeclared => counts.undeclared += 1,
            Outcome::Counters => counts.counters_exhausted += 1,
            Outcome::Fits => {
                counts.fit += 1;
                fitting.push(dev);
            }
        }
    }
    Ok((counts, fitting))
}

/// A constraint no candidate node can meet even with every device that fits on its own:
/// `(attribute, distinct, needed, best)`.
fn unmeetable_constraint(
    snap: &Snapshot,
    claim: &ClaimSpec,
    fitting: &[Option<Vec<usize>>],
    candidates: &[Node],
    ids: &CandidateIds,
) -> Option<(String, bool, u32, u32)> {
    for k in &claim.constraints {
        let mut needed = 0usize;
        let mut devices: Vec<usize> = Vec::new();
        let mut bounded = true;
        for ((alts, &fa), fit) in claim
            .requests
            .iter()
            .zip(&claim.first_available)
            .zip(fitting)
        {
            let Some(req) = alts.first() else { continue };
            if !k.applies(&req.base, &req.full) {
                continue;
            }
            match (fa, req.all, fit) {
                (false, false, Some(list)) => {
                    needed += req.count;
                    devices.extend(list);
                }
                _ => bounded = false,
            }
        }
        // A device allowing several allocations may serve several picks: no sound bound.
        if !bounded || needed < 2 || devices.iter().any(|&d| snap.devices[d].multi) {
            continue;
        }
        devices.sort_unstable();
        devices.dedup();
        let mut best = 0usize;
        for (pos, node) in candidates.iter().enumerate() {
            let id = ids.get(snap, candidates, pos);
            let mut per_value: BTreeMap<String, usize> = BTreeMap::new();
            let mut on_node = 0usize;
            for d in node_devices(snap, node, id) {
                if devices.binary_search(&d).is_err() {
                    continue;
                }
                let Some(values) = search::lookup_attr(snap, d, &k.attribute) else {
                    continue;
                };
                on_node += 1;
                for key in values.keys() {
                    *per_value.entry(key).or_default() += 1;
                }
            }
            // Devices sharing one value, or (distinct) at most one device per value.
            let offer = if k.distinct {
                on_node.min(per_value.len())
            } else {
                per_value.values().copied().max().unwrap_or(0)
            };
            best = best.max(offer);
            if best >= needed {
                break;
            }
        }
        if best < needed {
            let attribute = k
                .attribute
                .rsplit_once('/')
                .map_or(k.attribute.as_str(), |(_, id)| id)
                .to_owned();
            let as_u32 = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
            return Some((attribute, k.distinct, as_u32(needed), as_u32(best)));
        }
    }
    None
}

/// Explains a failure: per request, how the reachable devices its class selects fare on
/// their own; when each request fits alone, whether a constraint is what cannot be met.
pub(super) fn diagnose(
    snap: &Snapshot,
    cache: &mut SelectorCache,
    specs: &[ClaimSpec],
    candidates: &[Node],
    ids: &CandidateIds,
) -> Unsatisfiable {
    let (reachable, reachable_count) = reachable(snap, candidates, ids);
    let notes: Vec<String> = snap
        .pools
        .iter()
        .filter(|p| {
            p.unusable.is_some()
                && p.scopes
                    .iter()
                    .any(|s| candidates.iter().any(|n| s.matches(n)))
        })
        .filter_map(|p| p.unusable.clone())
        .collect();
    let mut failures = Vec::new();
    for claim in specs {
        let mut fallback = None;
        let mut failure = None;
        let mut fitting: Vec<Option<Vec<usize>>> = Vec::with_capacity(claim.requests.len());
        for alts in &claim.requests {
            let Some(req) = alts.last() else {
                fitting.push(None);
                continue;
            };
            let (counts, fits) = match tally(snap, cache, req, &reachable, reachable_count) {
                Ok(t) => t,
                Err(kind) => {
                    failure = Some((req, kind, DeviceCounts::default()));
                    break;
                }
            };
            let needed = if req.all {
                1
            } else {
                u32::try_from(req.count).unwrap_or(u32::MAX)
            };
            if counts.fit < needed {
                failure = Some((
                    req,
                    FailureKind::NoDevice {
                        wanted: wanted(req),
                        needed,
                    },
                    counts,
                ));
                break;
            }
            if fallback.is_none() {
                fallback = Some((req, counts));
            }
            fitting.push(Some(fits));
        }
        let (request, kind, counts) = match (failure, fallback) {
            (Some((req, kind, counts)), _) => (Some(req.base.clone()), kind, counts),
            (None, Some((req, counts))) => {
                let kind = match unmeetable_constraint(snap, claim, &fitting, candidates, ids) {
                    Some((attribute, distinct, needed, best)) => FailureKind::Constraint {
                        attribute,
                        distinct,
                        needed,
                        best,
                    },
                    None => FailureKind::NotTogether,
                };
                (Some(req.base.clone()), kind, counts)
            }
            (None, None) => (None, FailureKind::NotTogether, DeviceCounts::default()),
        };
        failures.push(ClaimFailure {
            claim: claim.name.clone(),
            request,
            kind,
            counts,
            notes: notes.clone(),
        });
    }
    if failures.iter().any(|f| f.kind != FailureKind::NotTogether) {
        failures.retain(|f| f.kind != FailureKind::NotTogether);
    }
    Unsatisfiable { failures }
}
