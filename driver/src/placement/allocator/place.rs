//! Placing one pod, the one way every caller does it: learn the pod's task shape (for the
//! fragmentation-aware policies), pick a node and devices for all its claims together, and
//! commit the pick to the snapshot — the devices and the pod's CPU and memory — so the next pod
//! already sees it as used. `tessera allocate` ([`crate::tools::batch`]), the trace replay
//! ([`crate::tools::simulate`]) and the controller's reconcile loop all call [`Allocator::place_pod`];
//! what node use they start from comes from one function too ([`crate::placement::nodefit::node_usage`]
//! with [`Snapshot::track_hosts`]).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1 as res;

use super::{Allocator, Placement, Snapshot, Unsatisfiable};
use crate::placement::fragmentation::{HostResources, TaskShape};
use crate::placement::nodefit::{self, Resources};

/// What the policy learns from the pod before it is placed.
#[derive(Debug, Clone)]
pub enum Learn {
    /// This shape (the trace replay knows each task's shape from its record).
    Shape(TaskShape),
    /// The shape of its claims and host request ([`Allocator::task_shape`]); nothing when a
    /// claim is malformed.
    FromClaims,
    /// Nothing: the pod has taught its shape before (a retried pod counts once).
    Known,
}

/// What placing one pod did.
#[derive(Debug)]
pub struct PodPlacement {
    /// The shape the snapshot learned, when it learned one (callers that rebuild snapshots
    /// keep it, see [`Snapshot::set_workload`]).
    pub learned: Option<TaskShape>,
    /// Where the claims went (already committed to the snapshot), or why they fit nowhere.
    pub result: Result<Placement, Unsatisfiable>,
}

impl Allocator {
    /// Places a pod that requests `host` CPU and memory and has `claims` (possibly none) on
    /// one of `candidates`, and commits the placement to `snapshot`; see the module docs.
    pub fn place_pod(
        &self,
        snapshot: &mut Snapshot,
        claims: &[&res::ResourceClaim],
        candidates: &[Node],
        host: &HostResources,
        learn: Learn,
    ) -> PodPlacement {
        let learned = match learn {
            Learn::Shape(shape) => Some(shape),
            Learn::FromClaims => self.task_shape(snapshot, claims, host),
            Learn::Known => None,
        };
        if let Some(shape) = &learned {
            snapshot.observe(shape.clone());
        }
        let result = self.allocate_pod(snapshot, claims, candidates, host);
        if let Ok(placement) = &result {
            for (claim, allocation) in claims.iter().zip(&placement.allocations) {
                snapshot.commit(claim, allocation);
            }
            snapshot.add_host_use(&placement.node, host);
        }
        PodPlacement { learned, result }
    }
}

impl Snapshot {
    /// Gives placement policies each node's CPU and memory: `status.allocatable` of every
    /// node that reports it, less `usage` (what the pods on it request, see
    /// [`nodefit::node_usage`]). Nodes without allocatable amounts stay untracked.
    pub fn track_hosts<'a>(
        &mut self,
        nodes: impl IntoIterator<Item = &'a Node>,
        usage: &BTreeMap<String, Resources>,
    ) {
        for node in nodes {
            let Some(name) = node.metadata.name.as_deref() else {
                continue;
            };
            if let Some(allocatable) = nodefit::node_allocatable(node).host() {
                let used = usage.get(name).and_then(|u| u.host()).unwrap_or_default();
                self.set_host(name, allocatable, used);
            }
        }
    }
}
