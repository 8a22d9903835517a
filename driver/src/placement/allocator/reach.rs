//! Which devices a node reaches and which a request's class selects: the lookups the node
//! loop, the pod's ask and the failure diagnosis share. What a class selects is cached on the
//! snapshot's selector cache (devices never change in a snapshot).

use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;

use super::request::ReqSpec;
use super::snapshot::{CandidateIds, SelectorCache, Snapshot};

/// The devices a node can use, in kube-scheduler's order (`id`: the node's id, if it has
/// local devices).
pub(super) fn node_devices(snap: &Snapshot, node: &Node, id: Option<usize>) -> Vec<usize> {
    let local = id.map(|i| snap.local[i].as_slice()).unwrap_or_default();
    if snap.global.is_empty() {
        return local.to_vec();
    }
    let mut all: Vec<usize> = local
        .iter()
        .copied()
        .chain(
            snap.global
                .iter()
                .copied()
                .filter(|&d| snap.devices[d].scope.matches(node)),
        )
        .collect();
    all.sort_unstable();
    all
}

/// Which devices the candidates reach, and how many.
pub(super) fn reachable(
    snap: &Snapshot,
    candidates: &[Node],
    ids: &CandidateIds,
) -> (Vec<bool>, u32) {
    let mut reachable = vec![false; snap.devices.len()];
    let mut count = 0u32;
    let mut mark = |d: usize| {
        if !reachable[d] {
            reachable[d] = true;
            count += 1;
        }
    };
    for (pos, node) in candidates.iter().enumerate() {
        let id = ids.get(snap, candidates, pos);
        for &d in id.map(|i| snap.local[i].as_slice()).unwrap_or_default() {
            mark(d);
        }
        for &d in &snap.global {
            if snap.devices[d].scope.matches(node) {
                mark(d);
            }
        }
    }
    (reachable, count)
}

/// Whether a request's class selectors select device `dev`. A selector that fails to
/// evaluate ends the check with the device kept: its error is reported only if the device is
/// reachable.
fn class_selects(snap: &Snapshot, cache: &mut SelectorCache, req: &ReqSpec, dev: usize) -> bool {
    for &e in &req.class_selectors {
        match snap.eval(cache, e, dev) {
            Ok(true) => {}
            Ok(false) => return false,
            Err(_) => break,
        }
    }
    true
}

/// Whether a request's class selects any device with `allowMultipleAllocations` (cached).
pub(super) fn class_matches_multi(
    snap: &Snapshot,
    cache: &mut SelectorCache,
    req: &ReqSpec,
) -> bool {
    if let Some(&hit) = cache.class_matches_multi.get(&req.class) {
        return hit;
    }
    let mut hit = false;
    for (idx, d) in snap.devices.iter().enumerate() {
        if (d.multi || d.tessera_shared) && class_selects(snap, cache, req, idx) {
            hit = true;
            break;
        }
    }
    cache.class_matches_multi.insert(req.class.clone(), hit);
    hit
}

/// The devices a request's class selects (cached per class for the snapshot's life).
pub(super) fn class_devices(
    snap: &Snapshot,
    cache: &mut SelectorCache,
    req: &ReqSpec,
) -> Arc<Vec<usize>> {
    if let Some(list) = cache.class_devices.get(&req.class) {
        return Arc::clone(list);
    }
    let list: Vec<usize> = (0..snap.devices.len())
        .filter(|&dev| class_selects(snap, cache, req, dev))
        .collect();
    let list = Arc::new(list);
    cache
        .class_devices
        .insert(req.class.clone(), Arc::clone(&list));
    list
}
