//! The snapshot: an indexed view of the cluster's devices and of what is already allocated.
//!
//! Built from `ResourceSlices`, `DeviceClasses` and allocated `ResourceClaims`; updated in place
//! with [`Snapshot::commit`] after a claim is placed and [`Snapshot::release`] when it goes.
//!
//! Pools follow Kubernetes: only the newest generation of a pool counts; a pool with fewer
//! slices at that generation than `resourceSliceCount` is incomplete and none of its devices
//! are used; a pool with duplicate device names or broken counter references is invalid and
//! skipped. Devices are kept in kube-scheduler's search order (pools by driver and name,
//! slices by name, devices as listed), so first-fit picks exactly what kube-scheduler picks.
//!
//! Use of a device comes from allocation results: a result with `adminAccess` consumes
//! nothing; a result with a `shareID` (or, on a Tessera `sharing=shared` GPU, one with an
//! `AllocatedShares` record) is a share and consumes its `consumedCapacity`, else the amounts
//! of Tessera's record, else the whole device's capacities (nothing when it has none, so a
//! device without capacities is shared by any number of claims, as in kube-scheduler); any
//! other result holds the device whole.
//!
//! The parts: [`pools`] builds the device index from the slices; [`usage`] tracks what
//! committed allocations hold; [`summary`] keeps each node's free figures; [`host`] tracks
//! nodes' CPU and memory; [`cache`] holds what allocations on the snapshot share.

mod cache;
mod host;
mod pools;
mod summary;
mod usage;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use k8s_openapi::api::resource::v1 as res;

pub(crate) use cache::{CandidateIds, MEMO_PER_NODE, SelectorCache};
pub(crate) use host::HostState;
pub(crate) use pools::{DeviceEntry, PoolEntry};
pub(crate) use summary::NodeSummary;
use usage::Contribution;
pub(crate) use usage::DeviceUse;

use super::capacity::Amounts;
use crate::error::{Error, Result};
use crate::names;
use crate::placement::fragmentation::{TaskShape, Workload};
use crate::placement::packing::{GapCounts, ModelFree};
use crate::rules::cel::CelCache;
use crate::rules::published::PublishedSlice;

/// An indexed view of devices and their use; see the module docs.
#[derive(Debug)]
pub struct Snapshot {
    pub(crate) tessera_driver: String,
    pub(crate) devices: Vec<DeviceEntry>,
    index: HashMap<(String, String, String), usize>,
    pub(crate) by_node: HashMap<String, Vec<usize>>,
    /// Devices usable from more than one node (allNodes or a node selector).
    pub(crate) global: Vec<usize>,
    pub(crate) pools: Vec<PoolEntry>,
    pub(crate) classes: HashMap<String, res::DeviceClass>,
    pub(crate) uses: Vec<DeviceUse>,
    /// Per pool: counter set -> counter -> consumed.
    pub(crate) counters_used: Vec<BTreeMap<String, Amounts>>,
    claims: HashMap<String, Vec<Contribution>>,
    /// Node name -> node id, for nodes with local devices.
    pub(crate) node_ids: HashMap<String, usize>,
    /// Per node id: its local devices, in kube-scheduler's order.
    pub(crate) local: Vec<Vec<usize>>,
    /// Per node id: what it has free.
    pub(crate) summaries: Vec<NodeSummary>,
    /// Per node id: bumped whenever what the node has free changes.
    pub(crate) node_versions: Vec<u64>,
    /// Per node id: CPU and memory, where the caller tracks them.
    pub(crate) hosts: Vec<Option<HostState>>,
    /// The task shapes seen so far (fragmentation-aware policies learn from them).
    pub(crate) workload: Workload,
    /// Each GPU model's share of the Tessera GPUs (devices never change in a snapshot).
    pub(crate) model_shares: Vec<(String, f64)>,
    /// Partly used Tessera GPUs by free milli-GPU, over all nodes.
    pub(crate) gaps: GapCounts,
    /// Free milli-GPU of Tessera GPUs, in total and by model.
    pub(crate) model_free: ModelFree,
    cel: CelCache,
    selectors: Mutex<SelectorCache>,
    /// Bumped whenever the use of some device changes.
    usage_changes: u64,
}

/// The key a claim is tracked by: its UID, else `namespace/name`.
pub fn claim_key(claim: &res::ResourceClaim) -> String {
    match claim.metadata.uid.as_deref() {
        Some(uid) if !uid.is_empty() => uid.to_owned(),
        _ => claim_name(claim),
    }
}

/// `namespace/name` of a claim, for messages.
pub fn claim_name(claim: &res::ResourceClaim) -> String {
    format!(
        "{}/{}",
        claim.metadata.namespace.as_deref().unwrap_or_default(),
        claim.metadata.name.as_deref().unwrap_or_default()
    )
}

impl Snapshot {
    /// A snapshot for Tessera's default driver name.
    pub fn new(
        slices: &[res::ResourceSlice],
        classes: &[res::DeviceClass],
        allocated: &[res::ResourceClaim],
    ) -> Result<Self> {
        Self::for_driver(names::DEFAULT_DRIVER_NAME, slices, classes, allocated)
    }

    /// A snapshot where `tessera_driver` is the name Tessera's devices are published under.
    /// Claims without `status.allocation` in `allocated` are ignored.
    pub fn for_driver(
        tessera_driver: &str,
        slices: &[res::ResourceSlice],
        classes: &[res::DeviceClass],
        allocated: &[res::ResourceClaim],
    ) -> Result<Self> {
        let shared: Vec<Arc<PublishedSlice>> = slices
            .iter()
            .map(|s| Arc::new(PublishedSlice::from(s)))
            .collect();
        Self::for_driver_shared(tessera_driver, &shared, classes, allocated)
    }

    /// [`Snapshot::for_driver`] over slices the caller keeps too: the snapshot refers to
    /// their devices instead of copying them (a long-lived holder such as the controller's
    /// cluster view then holds each device once).
    pub fn for_driver_shared(
        tessera_driver: &str,
        slices: &[Arc<PublishedSlice>],
        classes: &[res::DeviceClass],
        allocated: &[res::ResourceClaim],
    ) -> Result<Self> {
        let mut snap = Self {
            tessera_driver: tessera_driver.to_owned(),
            devices: Vec::new(),
            index: HashMap::new(),
            by_node: HashMap::new(),
            global: Vec::new(),
            pools: Vec::new(),
            classes: HashMap::new(),
            uses: Vec::new(),
            counters_used: Vec::new(),
            claims: HashMap::new(),
            node_ids: HashMap::new(),
            local: Vec::new(),
            summaries: Vec::new(),
            node_versions: Vec::new(),
            hosts: Vec::new(),
            workload: Workload::new(),
            model_shares: Vec::new(),
            gaps: GapCounts::new(),
            model_free: ModelFree::new(),
            cel: CelCache::new(),
            selectors: Mutex::new(SelectorCache::default()),
            usage_changes: 0,
        };
        for class in classes {
            let name = class.metadata.name.clone().unwrap_or_default();
            if snap.classes.insert(name.clone(), class.clone()).is_some() {
                return Err(Error::Snapshot(format!("two DeviceClasses named {name:?}")));
            }
        }
        snap.gather_pools(slices)?;
        snap.uses = vec![DeviceUse::default(); snap.devices.len()];
        snap.counters_used = vec![BTreeMap::new(); snap.pools.len()];
        let mut nodes: Vec<String> = snap.by_node.keys().cloned().collect();
        nodes.sort_unstable();
        for (id, node) in nodes.into_iter().enumerate() {
            let devices = snap.by_node.get(&node).cloned().unwrap_or_default();
            snap.node_ids.insert(node, id);
            snap.local.push(devices);
            snap.summaries.push(NodeSummary::default());
            snap.node_versions.push(0);
            snap.hosts.push(None);
            snap.refresh_summary(id);
        }
        let mut counts: Vec<(String, f64)> = Vec::new();
        for model in snap.devices.iter().filter_map(|d| d.gpu_model.as_ref()) {
            match counts.iter_mut().find(|(m, _)| m == model) {
                Some((_, n)) => *n += 1.0,
                None => counts.push((model.clone(), 1.0)),
            }
        }
        let total: f64 = counts.iter().map(|(_, n)| n).sum();
        snap.model_shares = counts
            .into_iter()
            .map(|(m, n)| (m, n / total.max(1.0)))
            .collect();
        for claim in allocated {
            if let Some(allocation) = claim.status.as_ref().and_then(|s| s.allocation.as_ref()) {
                snap.commit(claim, allocation);
            }
        }
        Ok(snap)
    }

    /// Records the shape of a task that arrived, for fragmentation-aware policies.
    pub fn observe(&mut self, shape: TaskShape) {
        self.workload.observe(shape);
    }

    /// Replaces what fragmentation-aware policies know of the workload (e.g. from history).
    pub fn set_workload(&mut self, workload: Workload) {
        self.workload = workload;
    }

    /// The task shapes seen so far.
    pub fn workload(&self) -> &Workload {
        &self.workload
    }
}
