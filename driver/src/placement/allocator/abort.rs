//! Errors that abort the pod's scheduling attempt, wherever they happen.
//!
//! kube-scheduler runs its DRA Filter on every candidate node (after the filters before it,
//! such as CPU and memory, turned some away), and the structured allocator's errors, other than
//! `ErrFailedAllocationOnNode`, are not "this node does not fit": one on any node aborts the
//! attempt, the pod stays pending and is tried again. Tessera's allocator stops at the first
//! node that fits, so before it answers it searches the other nodes where such an error could
//! happen ([`Hazards::on`]): a node that reaches a device where a selector of the pod's
//! requests fails at runtime, and, for a pod with an "all devices" request, every node
//! (pools being updated, selectors over all its devices, constraints are checked there).
//! Where neither can happen (the usual case) no other node is searched.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;

use super::reach::class_devices;
use super::reason::FailureKind;
use super::request::{ClaimSpec, ReqSpec};
use super::snapshot::{SelectorCache, Snapshot};

/// kube-scheduler's allocator failed with `error` on `node`: the attempt is aborted.
pub(super) fn aborted(node: &Node, error: String) -> FailureKind {
    FailureKind::Aborted {
        node: node.metadata.name.clone().unwrap_or_default(),
        error,
    }
}

/// What could make a search of the pod's claims end in an error on some node.
#[derive(Debug, Default)]
pub(super) struct Hazards {
    /// The pod has an "all devices" request (or subrequest).
    all: bool,
    /// Devices where a selector of one of its requests fails at runtime.
    devices: Vec<usize>,
}

impl Hazards {
    /// The hazards of `specs` on `snap`.
    pub(super) fn of(snap: &Snapshot, cache: &mut SelectorCache, specs: &[ClaimSpec]) -> Self {
        let mut out = Self::default();
        for req in specs.iter().flat_map(|c| c.requests.iter().flatten()) {
            out.all |= req.all;
            for &d in error_devices(snap, cache, req).iter() {
                if !out.devices.contains(&d) {
                    out.devices.push(d);
                }
            }
        }
        out
    }

    /// Whether no search of these claims can end in an error on any node.
    pub(super) fn none(&self) -> bool {
        !self.all && self.devices.is_empty()
    }

    /// Whether a search of these claims on `node` could end in an error.
    pub(super) fn on(&self, snap: &Snapshot, node: &Node) -> bool {
        self.all
            || self
                .devices
                .iter()
                .any(|&d| snap.devices[d].scope.matches(node))
    }
}

/// The devices where a selector of `req` fails at runtime, evaluated in kube-scheduler's order
/// (the class's selectors, then the request's, each only while the ones before matched);
/// found once per class and selectors on a snapshot.
fn error_devices(snap: &Snapshot, cache: &mut SelectorCache, req: &ReqSpec) -> Arc<Vec<usize>> {
    let key = (req.class.clone(), req.selectors.clone());
    if let Some(list) = cache.error_devices.get(&key) {
        return Arc::clone(list);
    }
    let mut list = Vec::new();
    // The class's devices include those where a class selector failed.
    for &dev in class_devices(snap, cache, req).iter() {
        for &e in req.class_selectors.iter().chain(&req.selectors) {
            match snap.eval(cache, e, dev) {
                Ok(true) => {}
                Ok(false) => break,
                Err(_) => {
                    list.push(dev);
                    break;
                }
            }
        }
    }
    let list = Arc::new(list);
    cache.error_devices.insert(key, Arc::clone(&list));
    list
}
