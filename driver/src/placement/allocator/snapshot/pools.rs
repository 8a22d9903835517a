//! Pool building: the newest generation of each pool gathered from the `ResourceSlices`, an
//! incomplete or invalid pool kept out with the reason, and each device of a usable pool
//! indexed as a [`DeviceEntry`] in kube-scheduler's search order.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::resource::v1 as res;

use super::super::capacity::{self, Amounts, Capacities};
use super::Snapshot;
use crate::error::{Error, Result};
use crate::names;
use crate::rules::cel::CelDevice;
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
    /// The memory and compute capacity names as the device spells them (computed once: hot in
    /// searches).
    pub(super) share_keys: (String, String),
    /// The slice that publishes the device, shared with whoever handed it in (the
    /// controller's view keeps the same one), and the device's position in its list: a
    /// device is held once, not once by the caller and again by the snapshot.
    pub(super) slice: Arc<PublishedSlice>,
    pub(super) at: usize,
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

    /// The memory and compute capacity names as the device spells them.
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

fn attr_text(device: &PublishedDevice, driver: &str, name: &str) -> Option<String> {
    device
        .attribute(name)
        .or_else(|| device.attribute(&format!("{driver}/{name}")))?
        .text()
}

impl Snapshot {
    pub(super) fn gather_pools(&mut self, slices: &[Arc<PublishedSlice>]) -> Result<()> {
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
        let capacity = capacity::parse_device_capacity(device, &object)?;
        let memory_name = capacity::declared_name(&capacity, names::CAP_MEMORY, driver);
        let compute_name = capacity::declared_name(&capacity, names::CAP_COMPUTE, driver);
        let tessera = driver == self.tessera_driver;
        // The API field is the truth: a device that allows multiple allocations is shared
        // whatever its informational `sharing` attribute says; without the field (1.32,
        // 1.33) the attribute is all there is.
        let tessera_shared = tessera
            && (device.allow_multiple_allocations == Some(true)
                || attr_text(device, driver, names::ATTR_SHARING).as_deref()
                    == Some(names::SHARING_SHARED));
        let memory = capacity
            .get(&memory_name)
            .and_then(|c| c.value.as_units())
            .and_then(|v| u64::try_from(v).ok())
            .unwrap_or(0);
        let compute = capacity
            .get(&compute_name)
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
            share_keys: (memory_name, compute_name),
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
}
