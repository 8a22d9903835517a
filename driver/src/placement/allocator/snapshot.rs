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

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1 as res;

use super::capacity::{self, Amounts, Capacities};
use crate::error::{Error, Result};
use crate::names;
use crate::placement::fragmentation::{HostResources, TaskShape, WHOLE_GPU, Workload};
use crate::placement::packing::{GapCounts, ModelFree};
use crate::rules::cel::{CelCache, CelDevice, CompiledExpression};
use crate::rules::config::{self, TesseraConfig, Tier};
use crate::rules::nodeselect::NodeScope;
use crate::rules::published::{PublishedDevice, PublishedSlice};
use crate::rules::quantity::Quantity;

/// Taint effects that keep a device from new allocations unless tolerated.
const BLOCKING_EFFECTS: [&str; 2] = ["NoSchedule", "NoExecute"];

/// One device of a complete, valid pool.
#[derive(Debug)]
#[allow(clippy::struct_excessive_bools)] // Reason: independent facts about a device, read in hot search loops.
pub(crate) struct DeviceEntry {
    pub(crate) driver: String,
    pub(crate) pool: String,
    pub(crate) pool_idx: usize,
    pub(crate) scope: NodeScope,
    pub(crate) capacity: Capacities,
    /// `allowMultipleAllocations`.
    pub(crate) multi: bool,
    /// Published by Tessera's driver.
    pub(crate) tessera: bool,
    /// A Tessera GPU many claims may share: `allowMultipleAllocations`, or `sharing=shared`.
    pub(crate) tessera_shared: bool,
    /// Tessera memory capacity in bytes (0 when not declared).
    pub(crate) memory: u64,
    /// Tessera compute capacity in percent (100 when not declared).
    pub(crate) compute: i64,
    pub(crate) taints: Vec<res::DeviceTaint>,
    pub(crate) consumes: Vec<(String, Amounts)>,
    pub(crate) nvlink: Option<String>,
    pub(crate) numa: Option<String>,
    /// For a Tessera whole GPU (`type=gpu`): its `model` attribute (empty when absent).
    pub(crate) gpu_model: Option<String>,
    /// Its node can back over-committed memory (`enforcement: hami-core`, `isolation:
    /// verified`).
    pub(crate) backs_memory_overcommit: bool,
    /// Fully qualified memory and compute capacity names (computed once: hot in searches).
    share_keys: (String, String),
    /// The slice that publishes the device, shared with whoever handed it in (the
    /// controller's view keeps the same one), and the device's position in its list: a
    /// device is held once, not once by the caller and again by the snapshot.
    slice: Arc<PublishedSlice>,
    at: usize,
}

/// What [`DeviceEntry::device`] answers should its position not be found (it always is:
/// entries are made from the devices of their own slice, which nobody changes).
static NO_DEVICE: std::sync::LazyLock<PublishedDevice> =
    std::sync::LazyLock::new(PublishedDevice::default);

impl DeviceEntry {
    /// `driver/pool/device`, for messages.
    pub(crate) fn id(&self) -> String {
        format!("{}/{}/{}", self.driver, self.pool, self.device().name)
    }

    /// The device as its slice lists it.
    pub(crate) fn device(&self) -> &PublishedDevice {
        self.slice.devices.get(self.at).unwrap_or(&NO_DEVICE)
    }

    /// The CEL view of the device. Built for each evaluation and dropped after it: every
    /// (expression, device) result is cached by the snapshot, so each is built once per
    /// distinct expression, and a snapshot of thousands of devices does not keep a second
    /// copy of every attribute in CEL form.
    pub(crate) fn cel(&self) -> CelDevice {
        CelDevice::new(&self.driver, self.device())
    }

    /// Fully qualified memory and compute capacity names of this device's driver.
    pub(crate) fn share_names(&self) -> (String, String) {
        self.share_keys.clone()
    }
}

/// A pool as gathered from its newest generation.
#[derive(Debug)]
pub(crate) struct PoolEntry {
    /// Why the pool is not used, if it is not.
    pub(crate) unusable: Option<String>,
    /// Node scopes of the pool's slices, to tell which nodes an unusable pool concerns.
    pub(crate) scopes: Vec<NodeScope>,
    /// Shared counter sets: set name -> counter -> total.
    pub(crate) counters: BTreeMap<String, Amounts>,
}

/// What is held on one device.
#[derive(Debug, Clone, Default)]
pub(crate) struct DeviceUse {
    /// Allocations holding the whole device.
    pub(crate) exclusive: u32,
    /// Share allocations.
    pub(crate) shares: u32,
    /// Capacity consumed by shares, by fully qualified name: what they are guaranteed.
    pub(crate) consumed: Amounts,
    /// What batch shares were booked beyond their guarantee ([`crate::rules::overcommit`]), by name.
    pub(crate) over: Amounts,
    /// The SM percentages the shares may use, together ([`crate::rules::overcommit::threads`]).
    pub(crate) threads: i64,
    /// Online shares holding an SM guarantee ([`crate::rules::overcommit::guards_sms`]): while any
    /// is on the GPU, `threads` stays within 100.
    pub(crate) guarded: u32,
}

impl DeviceUse {
    pub(crate) fn holders(&self) -> u32 {
        self.exclusive + self.shares
    }
}

/// A share as the allocator recorded it: what it may use and what it is guaranteed.
#[derive(Debug, Clone, Copy)]
struct RecordedShare {
    memory: Quantity,
    compute: i64,
    guaranteed_memory: Quantity,
    guaranteed_compute: i64,
    tier: Tier,
}

impl RecordedShare {
    /// What was booked beyond the guarantee, by fully qualified capacity name of `entry`.
    fn over(&self, entry: &DeviceEntry) -> Amounts {
        let (mem, comp) = entry.share_names();
        let mut over = Amounts::new();
        let memory = self.memory.saturating_sub(self.guaranteed_memory);
        if memory.nanos() > 0 {
            over.insert(mem, memory);
        }
        let compute = self.compute.saturating_sub(self.guaranteed_compute);
        if compute > 0 {
            over.insert(comp, Quantity::from_units(compute));
        }
        over
    }
}

/// The SM percentage a committed share may use and whether it guards its SMs: from the
/// allocator's record where there is one (what it may use, its tier), else from the compute it
/// consumes, counted as online (a share kube-scheduler booked without a record).
fn share_threads(
    record: Option<&RecordedShare>,
    consumed: &Amounts,
    entry: &DeviceEntry,
) -> (i64, bool) {
    let (compute, tier) = if let Some(r) = record {
        (r.compute, r.tier)
    } else {
        let (_, comp) = entry.share_names();
        let compute = consumed.get(&comp).map_or(0, |q| q.ceil_units());
        (compute, Tier::Online)
    };
    (
        crate::rules::overcommit::threads(compute),
        crate::rules::overcommit::guards_sms(tier, compute),
    )
}

/// One device's part of a committed allocation.
#[derive(Debug, Clone)]
struct Contribution {
    device: usize,
    exclusive: bool,
    consumed: Amounts,
    /// Over-committed amounts of a batch share (empty for every other result).
    over: Amounts,
    /// The SM percentage the share may use, and whether it guards its SMs (an online share
    /// with compute); `(0, false)` for whole devices.
    threads: (i64, bool),
}

/// Per-node figures that let the allocator skip nodes that cannot fit a claim.
#[derive(Debug, Clone, Default)]
pub(crate) struct NodeSummary {
    /// Devices on the node.
    pub(crate) devices: u32,
    /// Devices without `allowMultipleAllocations` that nobody holds.
    pub(crate) free_plain: u32,
    /// Tessera shared GPUs not held whole with some memory free.
    pub(crate) share_avail: u32,
    /// The most free memory on one Tessera shared GPU.
    pub(crate) share_max_free: u64,
    /// Sum of each device's fullness in permille.
    pub(crate) used_permille: u64,
    /// Free milli-GPU of each Tessera GPU (not MIG instances), in device order.
    pub(crate) gpu_free: Vec<u32>,
    /// The device index of each entry of `gpu_free`.
    pub(crate) gpu_devices: Vec<usize>,
    /// The `model` attribute of the node's first Tessera GPU.
    pub(crate) model: Option<String>,
    /// Per Tessera shared GPU not held whole: (free memory bytes, memory bytes).
    pub(crate) share_free: Vec<(u64, u64)>,
}

/// CPU and memory of a node whose host resources the caller tracks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct HostState {
    pub(crate) allocatable: HostResources,
    pub(crate) used: HostResources,
}

impl HostState {
    pub(crate) fn free(&self) -> HostResources {
        self.allocatable.minus(&self.used)
    }
}

/// Cached node scores of one policy, valid while node, pod ask and workload stay the same.
#[derive(Debug, Default)]
pub(crate) struct ScoreMemo {
    pub(crate) policy: String,
    pub(crate) workload: u64,
    /// Per node id: the node version the entries belong to, and (ask, score) pairs.
    pub(crate) nodes: Vec<(u64, Vec<(crate::placement::allocator::PodAsk, i64)>)>,
}

/// Most asks remembered per node before its entries are dropped.
pub(crate) const MEMO_PER_NODE: usize = 64;

/// Compiled selectors and their per-device results, shared by every allocation on a snapshot.
#[derive(Debug, Default)]
pub(crate) struct SelectorCache {
    ids: HashMap<String, usize>,
    exprs: Vec<Arc<CompiledExpression>>,
    /// Per expression, per device: 0 unknown, 1 false, 2 true, 3 error.
    results: Vec<Vec<u8>>,
    errors: HashMap<(usize, usize), Error>,
    /// Per class: whether its selectors match any device with `allowMultipleAllocations`.
    pub(crate) class_matches_multi: HashMap<String, bool>,
    /// Per class: the devices its selectors select (devices never change in a snapshot).
    pub(crate) class_devices: HashMap<String, Arc<Vec<usize>>>,
    /// Per class and request selectors: the GPU models of the devices they select.
    pub(crate) request_models: HashMap<(String, Vec<usize>), Arc<Vec<String>>>,
    candidate_names: Arc<Vec<String>>,
    candidate_ids: Arc<Vec<Option<usize>>>,
    /// Node scores of cacheable policies.
    pub(crate) scores: ScoreMemo,
}

/// The node ids of the last candidate list seen; trusted per position only where the name
/// still matches, so a stale list costs lookups, never a wrong node.
#[derive(Debug, Clone)]
pub(crate) struct CandidateIds {
    names: Arc<Vec<String>>,
    ids: Arc<Vec<Option<usize>>>,
    /// Checked against this very candidate list: every position is right.
    exact: bool,
}

impl CandidateIds {
    /// The node id of candidate `pos` (`None` for a node without local devices).
    pub(crate) fn get(&self, snap: &Snapshot, candidates: &[Node], pos: usize) -> Option<usize> {
        if self.exact {
            return self.ids.get(pos).copied().flatten();
        }
        let name = candidates[pos].metadata.name.as_deref().unwrap_or_default();
        match (self.names.get(pos), self.ids.get(pos)) {
            (Some(cached), Some(&id)) if cached == name => id,
            _ => snap.node_ids.get(name).copied(),
        }
    }
}

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

fn attr_text(device: &PublishedDevice, driver: &str, name: &str) -> Option<String> {
    device
        .attribute(name)
        .or_else(|| device.attribute(&format!("{driver}/{name}")))?
        .text()
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

    fn gather_pools(&mut self, slices: &[Arc<PublishedSlice>]) -> Result<()> {
        let mut seen_names = std::collections::HashSet::new();
        let mut groups: BTreeMap<(&str, &str), Vec<&Arc<PublishedSlice>>> = BTreeMap::new();
        for slice in slices {
            if !slice.name.is_empty() && !seen_names.insert(slice.name.as_str()) {
                return Err(Error::Snapshot(format!(
                    "two ResourceSlices named {:?}",
                    slice.name
                )));
            }
            let key = (slice.driver.as_str(), slice.pool.name.as_str());
            groups.entry(key).or_default().push(slice);
        }
        for ((driver, pool_name), group) in groups {
            let newest = group
                .iter()
                .map(|s| s.pool.generation)
                .max()
                .unwrap_or_default();
            let mut current: Vec<&Arc<PublishedSlice>> = group
                .into_iter()
                .filter(|s| s.pool.generation == newest)
                .collect();
            current.sort_by(|a, b| a.name.cmp(&b.name));
            let pool_idx = self.pools.len();
            let mut pool = PoolEntry {
                unusable: None,
                scopes: current.iter().map(|s| s.scope.clone()).collect(),
                counters: BTreeMap::new(),
            };
            let expected = current[0].pool.resource_slice_count;
            if i64::try_from(current.len()).ok() != Some(expected) {
                pool.unusable = Some(format!(
                    "resource pool {driver}/{pool_name} is currently being updated ({} of {expected} slices at generation {newest})",
                    current.len()
                ));
                self.pools.push(pool);
                continue;
            }
            let plain: Vec<&PublishedSlice> = current.iter().map(|s| &***s).collect();
            if let Err(why) = Self::check_pool(&plain, &mut pool.counters) {
                pool.unusable = Some(format!(
                    "resource pool {driver}/{pool_name} is invalid: {why}"
                ));
                self.pools.push(pool);
                continue;
            }
            self.pools.push(pool);
            for slice in current {
                let object = format!("ResourceSlice {}", slice.name);
                for (at, device) in slice.devices.iter().enumerate() {
                    let scope = device.scope.clone().unwrap_or_else(|| slice.scope.clone());
                    let place = (pool_idx, Arc::clone(slice), at);
                    self.add_device(&object, driver, pool_name, place, device, scope)?;
                }
            }
        }
        Ok(())
    }

    /// Checks device names and counter references of a pool's newest slices.
    fn check_pool(
        slices: &[&PublishedSlice],
        counters: &mut BTreeMap<String, Amounts>,
    ) -> std::result::Result<(), String> {
        for slice in slices {
            for set in &slice.shared_counters {
                let mut amounts = Amounts::new();
                for (name, c) in &set.counters {
                    let q = Quantity::from_k8s(&c.value).map_err(|e| e.to_string())?;
                    amounts.insert(name.clone(), q);
                }
                if counters.insert(set.name.clone(), amounts).is_some() {
                    return Err(format!("duplicate counter set name {}", set.name));
                }
            }
        }
        let mut names = std::collections::HashSet::new();
        for slice in slices {
            for device in &slice.devices {
                if !names.insert(device.name.as_str()) {
                    return Err(format!("duplicate device name {}", device.name));
                }
                for consumption in &device.consumes_counters {
                    let Some(set) = counters.get(&consumption.counter_set) else {
                        return Err(format!("counter set {} not found", consumption.counter_set));
                    };
                    for name in consumption.counters.keys() {
                        if !set.contains_key(name) {
                            return Err(format!(
                                "counter {name} not found in counter set {}",
                                consumption.counter_set
                            ));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn add_device(
        &mut self,
        object: &str,
        driver: &str,
        pool: &str,
        (pool_idx, slice, at): (usize, Arc<PublishedSlice>, usize),
        device: &PublishedDevice,
        scope: NodeScope,
    ) -> Result<()> {
        let object = format!("{object}: device {}", device.name);
        let capacity = capacity::parse_device_capacity(device, driver, &object)?;
        let tessera = driver == self.tessera_driver;
        // The API field is the truth: a device that allows multiple allocations is shared
        // whatever its informational `sharing` attribute says; without the field (1.32,
        // 1.33) the attribute is all there is.
        let tessera_shared = tessera
            && (device.allow_multiple_allocations == Some(true)
                || attr_text(device, driver, names::ATTR_SHARING).as_deref()
                    == Some(names::SHARING_SHARED));
        let memory = capacity
            .get(&capacity::qualify(names::CAP_MEMORY, driver))
            .and_then(|c| c.value.as_units())
            .and_then(|v| u64::try_from(v).ok())
            .unwrap_or(0);
        let compute = capacity
            .get(&capacity::qualify(names::CAP_COMPUTE, driver))
            .and_then(|c| c.value.as_units())
            .unwrap_or(100);
        let mut consumes = Vec::new();
        for c in &device.consumes_counters {
            let mut amounts = Amounts::new();
            for (name, v) in &c.counters {
                let q = Quantity::from_k8s(&v.value).map_err(|e| {
                    Error::invalid(&object, format!("consumesCounters.{name}"), e.to_string())
                })?;
                amounts.insert(name.clone(), q);
            }
            consumes.push((c.counter_set.clone(), amounts));
        }
        let idx = self.devices.len();
        let key = (driver.to_owned(), pool.to_owned(), device.name.clone());
        if self.index.insert(key, idx).is_some() {
            return Err(Error::Snapshot(format!("{object}: listed twice")));
        }
        match &scope {
            NodeScope::Node(n) => self.by_node.entry(n.clone()).or_default().push(idx),
            NodeScope::All | NodeScope::Selector(_) => self.global.push(idx),
            NodeScope::Unknown => {}
        }
        self.devices.push(DeviceEntry {
            driver: driver.to_owned(),
            pool: pool.to_owned(),
            pool_idx,
            scope,
            capacity,
            multi: device.allow_multiple_allocations == Some(true),
            tessera,
            tessera_shared,
            memory,
            compute,
            taints: device
                .taints
                .iter()
                .filter(|t| BLOCKING_EFFECTS.contains(&t.effect.as_str()))
                .cloned()
                .collect(),
            consumes,
            nvlink: attr_text(device, driver, names::ATTR_NVLINK_DOMAIN),
            numa: attr_text(device, driver, names::ATTR_NUMA_NODE),
            gpu_model: (tessera
                && attr_text(device, driver, names::ATTR_TYPE).as_deref() == Some(names::TYPE_GPU))
            .then(|| attr_text(device, driver, names::ATTR_MODEL).unwrap_or_default()),
            // HAMi-core backs it only where the node's probe proved it holds there (accepted
            // unverified isolation is not enough to lend memory).
            backs_memory_overcommit: tessera
                && attr_text(device, driver, names::ATTR_ENFORCEMENT).as_deref()
                    == Some(names::ENFORCEMENT_HAMI_CORE)
                && attr_text(device, driver, names::ATTR_ISOLATION).as_deref()
                    == Some(names::ISOLATION_VERIFIED),
            share_keys: (
                capacity::qualify(names::CAP_MEMORY, driver),
                capacity::qualify(names::CAP_COMPUTE, driver),
            ),
            slice,
            at,
        });
        Ok(())
    }

    /// The index of a device, if the snapshot has it.
    pub(crate) fn device_index(&self, driver: &str, pool: &str, device: &str) -> Option<usize> {
        self.index
            .get(&(driver.to_owned(), pool.to_owned(), device.to_owned()))
            .copied()
    }

    /// Records `allocation` as held by `claim` (replacing what the claim held before).
    /// Results naming devices the snapshot does not know are kept out of the accounting.
    pub fn commit(&mut self, claim: &res::ResourceClaim, allocation: &res::AllocationResult) {
        let key = claim_key(claim);
        self.release(&key);
        let records = self.share_records(allocation);
        let mut contributions = Vec::new();
        let Some(devices) = allocation.devices.as_ref() else {
            return;
        };
        for result in devices.results.iter().flatten() {
            if result.admin_access == Some(true) {
                continue;
            }
            let Some(idx) = self.device_index(&result.driver, &result.pool, &result.device) else {
                continue;
            };
            let entry = &self.devices[idx];
            let record = records.get(&(
                result.request.clone(),
                result.pool.clone(),
                result.device.clone(),
            ));
            let shared = result.share_id.is_some() || (entry.tessera_shared && record.is_some());
            let over = record.map(|r| r.over(entry)).unwrap_or_default();
            let contribution = if !shared {
                Contribution {
                    device: idx,
                    exclusive: true,
                    consumed: Amounts::new(),
                    over: Amounts::new(),
                    threads: (0, false),
                }
            } else if let Some(cc) = result.consumed_capacity.as_ref().filter(|c| !c.is_empty()) {
                let mut consumed = Amounts::new();
                for (name, q) in cc {
                    // A value we cannot read counts as the whole capacity.
                    let key = capacity::qualify(name, &entry.driver);
                    let value = Quantity::from_k8s(q)
                        .ok()
                        .or_else(|| entry.capacity.get(&key).map(|c| c.value));
                    if let Some(v) = value {
                        consumed.insert(key, v);
                    }
                }
                Contribution {
                    device: idx,
                    exclusive: false,
                    threads: share_threads(record, &consumed, entry),
                    consumed,
                    over,
                }
            } else if let Some(rec) = record {
                let (mem, comp) = entry.share_names();
                let consumed: Amounts = [
                    (mem, rec.guaranteed_memory),
                    (comp, Quantity::from_units(rec.guaranteed_compute)),
                ]
                .into();
                Contribution {
                    device: idx,
                    exclusive: false,
                    threads: share_threads(record, &consumed, entry),
                    consumed,
                    over,
                }
            } else if entry.capacity.is_empty() {
                // A share of a device without capacities consumes nothing: kube-scheduler
                // gives any number of claims their own shareID of it.
                Contribution {
                    device: idx,
                    exclusive: false,
                    consumed: Amounts::new(),
                    over: Amounts::new(),
                    threads: (0, false),
                }
            } else {
                let consumed = entry
                    .capacity
                    .iter()
                    .map(|(k, c)| (k.clone(), c.value))
                    .collect();
                Contribution {
                    device: idx,
                    exclusive: false,
                    threads: share_threads(None, &consumed, entry),
                    consumed,
                    over: Amounts::new(),
                }
            };
            contributions.push(contribution);
        }
        for c in &contributions {
            self.apply(c, true);
        }
        self.claims.insert(key, contributions);
    }

    /// Tessera's `AllocatedShares` records in an allocation: (request, pool, device) ->
    /// what the share may use and what it is guaranteed.
    fn share_records(
        &self,
        allocation: &res::AllocationResult,
    ) -> HashMap<(String, String, String), RecordedShare> {
        let mut out = HashMap::new();
        let configs = allocation.devices.as_ref().and_then(|d| d.config.as_ref());
        for cfg in configs.into_iter().flatten() {
            let Some(opaque) = cfg
                .opaque
                .as_ref()
                .filter(|o| o.driver == self.tessera_driver)
            else {
                continue;
            };
            if let Ok(TesseraConfig::AllocatedShares(rec)) =
                config::decode(&opaque.parameters.0, "allocation")
            {
                for d in rec.devices {
                    let share = RecordedShare {
                        memory: d.memory,
                        compute: d.compute,
                        guaranteed_memory: d.guaranteed_memory(),
                        guaranteed_compute: d.guaranteed_compute(),
                        tier: d.tier,
                    };
                    out.insert((d.request, d.pool, d.device), share);
                }
            }
        }
        out
    }

    /// Forgets what the claim with this key (its UID, else `namespace/name`) held.
    pub fn release(&mut self, claim_key: &str) {
        if let Some(contributions) = self.claims.remove(claim_key) {
            for c in &contributions {
                self.apply(c, false);
            }
        }
    }

    /// Whether the snapshot tracks an allocation for this claim key.
    pub fn is_allocated(&self, claim_key: &str) -> bool {
        self.claims.contains_key(claim_key)
    }

    /// Number of devices in usable pools.
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// Reasons why pools are not used (incomplete or invalid), one line each.
    pub fn unusable_pools(&self) -> Vec<String> {
        self.pools
            .iter()
            .filter_map(|p| p.unusable.clone())
            .collect()
    }

    /// A number that changes whenever the use of some device changes (a commit or release
    /// that touched a device), so that figures derived from device use (gauges) are worked
    /// out again only when they can differ.
    pub fn usage_version(&self) -> u64 {
        self.usage_changes
    }

    fn apply(&mut self, c: &Contribution, add: bool) {
        self.usage_changes += 1;
        let before = self.uses[c.device].holders();
        let u = &mut self.uses[c.device];
        match (c.exclusive, add) {
            (true, true) => u.exclusive += 1,
            (true, false) => u.exclusive = u.exclusive.saturating_sub(1),
            (false, true) => {
                u.shares += 1;
                capacity::add_into(&mut u.consumed, &c.consumed);
                capacity::add_into(&mut u.over, &c.over);
                u.threads = u.threads.saturating_add(c.threads.0);
                u.guarded += u32::from(c.threads.1);
            }
            (false, false) => {
                u.shares = u.shares.saturating_sub(1);
                capacity::sub_from(&mut u.consumed, &c.consumed);
                capacity::sub_from(&mut u.over, &c.over);
                u.threads = u.threads.saturating_sub(c.threads.0);
                u.guarded = u.guarded.saturating_sub(u32::from(c.threads.1));
            }
        }
        let after = self.uses[c.device].holders();
        let entry = &self.devices[c.device];
        // Counters are consumed while anybody holds the device.
        if (before == 0) != (after == 0) && !entry.consumes.is_empty() {
            let used = &mut self.counters_used[entry.pool_idx];
            for (set, amounts) in &entry.consumes {
                let slot = used.entry(set.clone()).or_default();
                if after > 0 {
                    capacity::add_into(slot, amounts);
                } else {
                    capacity::sub_from(slot, amounts);
                }
            }
        }
        if let NodeScope::Node(node) = &self.devices[c.device].scope
            && let Some(&id) = self.node_ids.get(node)
        {
            self.refresh_summary(id);
        }
    }

    /// Fullness of a device in permille: 1000 when held whole.
    pub(crate) fn fullness(&self, idx: usize) -> u64 {
        let u = &self.uses[idx];
        let e = &self.devices[idx];
        if u.exclusive > 0 || (!e.multi && !e.tessera_shared && u.holders() > 0) {
            return 1000;
        }
        let mut worst = 0;
        for (name, used) in &u.consumed {
            if let Some(cap) = e.capacity.get(name)
                && cap.value.nanos() > 0
            {
                let p = used.nanos().saturating_mul(1000) / cap.value.nanos();
                worst = worst.max(u64::try_from(p.clamp(0, 1000)).unwrap_or(1000));
            }
        }
        if worst == 0 && u.shares > 0 {
            worst = 1;
        }
        worst
    }

    /// Free Tessera memory (bytes) and compute (percent) of a shared GPU, committed use only.
    pub(crate) fn share_free(&self, idx: usize, inflight: Option<&Amounts>) -> (u64, i64) {
        let e = &self.devices[idx];
        let (mem, comp) = &e.share_keys;
        let used = |name: &str| {
            let a = self.uses[idx]
                .consumed
                .get(name)
                .copied()
                .unwrap_or(Quantity::ZERO);
            let b = inflight
                .and_then(|i| i.get(name))
                .copied()
                .unwrap_or(Quantity::ZERO);
            a.saturating_add(b).ceil_units()
        };
        let mem_used = u64::try_from(used(mem)).unwrap_or(0);
        (e.memory.saturating_sub(mem_used), e.compute - used(comp))
    }

    /// The SM percentages the shares of a shared GPU may use together, and how many of them
    /// guard their SMs: committed use plus `inflight` ([`crate::rules::overcommit::threads_fit`]).
    pub(crate) fn share_threads(&self, idx: usize, inflight: Option<(i64, u32)>) -> (i64, u32) {
        let u = &self.uses[idx];
        let (t, g) = inflight.unwrap_or_default();
        (u.threads.saturating_add(t), u.guarded.saturating_add(g))
    }

    /// What batch shares of a shared GPU were booked beyond their guarantee: memory bytes and
    /// compute percent, committed use plus `inflight` ([`crate::rules::overcommit`]).
    pub(crate) fn share_over(&self, idx: usize, inflight: Option<(u64, i64)>) -> (u64, i64) {
        let (mem, comp) = &self.devices[idx].share_keys;
        let over = &self.uses[idx].over;
        let get = |name: &str| {
            over.get(name)
                .copied()
                .unwrap_or(Quantity::ZERO)
                .ceil_units()
        };
        let (m, c) = inflight.unwrap_or_default();
        (
            u64::try_from(get(mem)).unwrap_or(0).saturating_add(m),
            get(comp).saturating_add(c),
        )
    }

    fn refresh_summary(&mut self, node: usize) {
        let mut s = NodeSummary::default();
        for &idx in &self.local[node] {
            let e = &self.devices[idx];
            let u = &self.uses[idx];
            s.devices += 1;
            if !e.multi && u.holders() == 0 {
                s.free_plain += 1;
            }
            if e.tessera_shared && u.exclusive == 0 {
                let (free, _) = self.share_free(idx, None);
                if free > 0 {
                    s.share_avail += 1;
                    s.share_max_free = s.share_max_free.max(free);
                }
            }
            s.used_permille += self.fullness(idx);
            if let Some(model) = &e.gpu_model {
                if s.model.is_none() && !model.is_empty() {
                    s.model = Some(model.clone());
                }
                s.gpu_free.push(self.gpu_free_milli(idx));
                s.gpu_devices.push(idx);
            }
            if e.tessera_shared && u.exclusive == 0 {
                let (free, _) = self.share_free(idx, None);
                s.share_free.push((free, e.memory));
            }
        }
        let old = &self.summaries[node];
        for &free in &old.gpu_free {
            self.gaps.remove(free);
        }
        let idle = |free: &[u32]| free.iter().map(|&f| u64::from(f)).sum::<u64>();
        self.model_free
            .remove(old.model.as_deref(), idle(&old.gpu_free));
        for &free in &s.gpu_free {
            self.gaps.add(free);
        }
        self.model_free.add(s.model.as_deref(), idle(&s.gpu_free));
        self.summaries[node] = s;
        self.node_versions[node] += 1;
    }

    /// Partly used Tessera GPUs by free milli-GPU, over all nodes.
    pub fn gaps(&self) -> &GapCounts {
        &self.gaps
    }

    /// Free milli-GPU of Tessera GPUs, in total and by model.
    pub fn model_free(&self) -> &ModelFree {
        &self.model_free
    }

    /// Free milli-GPU of a Tessera GPU: 1000 when nobody holds it, 0 when held whole, else
    /// its free memory in milli of its memory (rounded down).
    fn gpu_free_milli(&self, idx: usize) -> u32 {
        let e = &self.devices[idx];
        let u = &self.uses[idx];
        if u.holders() == 0 {
            return WHOLE_GPU;
        }
        if u.exclusive > 0 || !e.tessera_shared || e.memory == 0 {
            return 0;
        }
        let (free, compute) = self.share_free(idx, None);
        let by_memory = u128::from(free) * u128::from(WHOLE_GPU) / u128::from(e.memory);
        let by_compute = u128::try_from(compute.clamp(0, 100)).unwrap_or(0) * 10;
        u32::try_from(by_memory.min(by_compute)).unwrap_or(0)
    }

    /// Tracks a node's CPU and memory: what it has allocatable, and what pods already use.
    /// Nodes never set here are not limited by CPU or memory. Unknown nodes are ignored.
    pub fn set_host(&mut self, node: &str, allocatable: HostResources, used: HostResources) {
        if let Some(&id) = self.node_ids.get(node) {
            let state = Some(HostState { allocatable, used });
            // Unchanged amounts keep the node's cached scores.
            if self.hosts[id] != state {
                self.hosts[id] = state;
                self.node_versions[id] += 1;
            }
        }
    }

    /// Adds a placed pod's CPU and memory to a tracked node's use.
    pub fn add_host_use(&mut self, node: &str, ask: &HostResources) {
        if let Some(&id) = self.node_ids.get(node)
            && let Some(h) = self.hosts[id].as_mut()
        {
            h.used = h.used.plus(ask);
            self.node_versions[id] += 1;
        }
    }

    /// Removes a departed pod's CPU and memory from a tracked node's use.
    pub fn remove_host_use(&mut self, node: &str, ask: &HostResources) {
        if let Some(&id) = self.node_ids.get(node)
            && let Some(h) = self.hosts[id].as_mut()
        {
            h.used = h.used.minus(ask);
            self.node_versions[id] += 1;
        }
    }

    /// Free CPU and memory of a tracked node.
    pub fn host_free(&self, node: &str) -> Option<HostResources> {
        let id = *self.node_ids.get(node)?;
        self.hosts[id].map(|h| h.free())
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

    /// The model and free milli-GPU of each Tessera GPU of one node.
    pub fn node_gpu_free(&self, node: &str) -> Option<(Option<&str>, &[u32])> {
        let s = &self.summaries[*self.node_ids.get(node)?];
        Some((s.model.as_deref(), s.gpu_free.as_slice()))
    }

    /// Free milli-GPU of every Tessera GPU, node by node (nodes by name), for bookkeeping
    /// checks and fragmentation reports.
    pub fn gpu_free_by_node(&self) -> Vec<(&str, Option<&str>, &[u32])> {
        let mut names: Vec<(&String, &usize)> = self.node_ids.iter().collect();
        names.sort_unstable();
        names
            .into_iter()
            .map(|(n, &id)| {
                let s = &self.summaries[id];
                (n.as_str(), s.model.as_deref(), s.gpu_free.as_slice())
            })
            .collect()
    }

    /// The node ids of `candidates`, refreshing the cached list when it differs (every
    /// position is then exact); with `refresh` false the last list is reused as it is.
    pub(crate) fn candidate_ids(
        &self,
        cache: &mut SelectorCache,
        candidates: &[Node],
        refresh: bool,
    ) -> CandidateIds {
        let same = || {
            cache.candidate_names.len() == candidates.len()
                && cache
                    .candidate_names
                    .iter()
                    .zip(candidates)
                    .all(|(a, n)| a.as_str() == n.metadata.name.as_deref().unwrap_or_default())
        };
        let exact = refresh;
        if refresh && !same() {
            let names: Vec<String> = candidates
                .iter()
                .map(|n| n.metadata.name.clone().unwrap_or_default())
                .collect();
            cache.candidate_ids = Arc::new(
                names
                    .iter()
                    .map(|n| self.node_ids.get(n).copied())
                    .collect(),
            );
            cache.candidate_names = Arc::new(names);
        }
        CandidateIds {
            names: Arc::clone(&cache.candidate_names),
            ids: Arc::clone(&cache.candidate_ids),
            exact,
        }
    }

    /// Locks the selector cache for one allocation run.
    pub(crate) fn selectors(&self) -> MutexGuard<'_, SelectorCache> {
        self.selectors
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Compiles (once) an expression and returns its id in the cache.
    pub(crate) fn compile(&self, cache: &mut SelectorCache, expression: &str) -> Result<usize> {
        if let Some(&id) = cache.ids.get(expression) {
            return Ok(id);
        }
        let compiled = self.cel.compile(expression)?;
        let id = cache.exprs.len();
        cache.exprs.push(compiled);
        cache.results.push(vec![0; self.devices.len()]);
        cache.ids.insert(expression.to_owned(), id);
        Ok(id)
    }

    /// Whether expression `expr` selects device `idx` (evaluated once, then cached).
    pub(crate) fn eval(&self, cache: &mut SelectorCache, expr: usize, idx: usize) -> Result<bool> {
        match cache.results[expr][idx] {
            1 => return Ok(false),
            2 => return Ok(true),
            3 => {
                if let Some(e) = cache.errors.get(&(expr, idx)) {
                    return Err(e.clone());
                }
            }
            _ => {}
        }
        match cache.exprs[expr].evaluate(&self.devices[idx].cel()) {
            Ok(b) => {
                cache.results[expr][idx] = if b { 2 } else { 1 };
                Ok(b)
            }
            Err(e) => {
                cache.results[expr][idx] = 3;
                cache.errors.insert((expr, idx), e.clone());
                Err(e)
            }
        }
    }
}
