//! Rendering one node's inventory into the `ResourceSlices` of its pool (resource.k8s.io/v1).
//!
//! Pure: the same inventory and options always give the same slices, byte for byte, so the
//! kubelet plugin can compare before it writes. What a device publishes is the contract of
//! DESIGN.md §2; docs/inventory.md shows rendered examples. Every validation limit of the API
//! is checked here, and an inventory that would break one is an [`Error::Invalid`], never an
//! object the API server would reject.

pub mod drift;

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity,
    DeviceTaint, ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::error::{Error, Result};
use crate::names;
use crate::node::inventory::{Gpu, GpuMode, MigInstance, NodeInventory};
use crate::rules::quantity::Quantity;

use crate::rules::limits::{self, normalize_version};

const GIB: u64 = 1024 * 1024 * 1024;

/// How to render a node's slices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderOptions {
    /// The DRA driver name, also the domain of the attributes (default `gpu.tessera.dev`).
    pub driver_name: String,
    /// The pool generation; bump it whenever the devices change.
    pub pool_generation: i64,
    /// Whether the cluster has consumable capacity (Kubernetes 1.34+): shared GPUs are then
    /// published with `allowMultipleAllocations` and request policies.
    pub consumable_capacity: bool,
    /// Devices per slice, at most the API's limit (128, or 64 when a device has taints); a
    /// lower value only makes more, smaller slices.
    pub max_devices_per_slice: usize,
    /// How the node enforces shares (`mps`, `hami-core`, `none`), published on shared GPUs as
    /// the `enforcement` attribute; `None` publishes nothing. Batch memory over-commit is
    /// allowed only on GPUs that say `hami-core` ([`crate::rules::overcommit`]).
    pub enforcement: Option<String>,
}

impl Default for RenderOptions {
    fn default() -> Self {
        Self {
            driver_name: names::DEFAULT_DRIVER_NAME.to_owned(),
            pool_generation: 1,
            consumable_capacity: false,
            max_devices_per_slice: limits::MAX_DEVICES_PER_SLICE,
            enforcement: None,
        }
    }
}

/// Renders the slices of `node`'s pool: one pool named after the node, its devices split over
/// as many slices as the per-slice limit needs (at least one, so an empty pool is visible).
pub fn render(node: &NodeInventory, opts: &RenderOptions) -> Result<Vec<ResourceSlice>> {
    let object = format!("ResourceSlice pool {}", node.name);
    let invalid = |field: &str, message: String| Error::invalid(&object, field, message);
    if !limits::is_dns_subdomain(&opts.driver_name, limits::MAX_DOMAIN_LENGTH) {
        return Err(invalid(
            "spec.driver",
            format!(
                "driver name {:?} must be a lower-case DNS subdomain of at most {} characters",
                opts.driver_name,
                limits::MAX_DOMAIN_LENGTH
            ),
        ));
    }
    if !limits::is_dns_subdomain(&node.name, limits::MAX_DNS_SUBDOMAIN) {
        return Err(invalid(
            "spec.nodeName",
            format!("node name {:?} must be a DNS subdomain", node.name),
        ));
    }
    if opts.pool_generation < 0 {
        return Err(invalid(
            "spec.pool.generation",
            format!("{} must not be negative", opts.pool_generation),
        ));
    }

    let mut devices = Vec::new();
    let mut gpus: Vec<&Gpu> = node.gpus.iter().collect();
    gpus.sort_by_key(|g| g.index);
    for pair in gpus.windows(2) {
        if pair[0].index == pair[1].index {
            return Err(invalid(
                "spec.devices",
                format!("two GPUs have index {}", pair[0].index),
            ));
        }
    }
    for gpu in gpus {
        devices.extend(offered(node, gpu, opts));
    }
    let mut seen = std::collections::BTreeSet::new();
    for d in &devices {
        check_device(d, &object)?;
        if !seen.insert(d.name.as_str()) {
            return Err(invalid(
                "spec.devices",
                format!("device name {:?} appears twice", d.name),
            ));
        }
    }

    let tainted = devices
        .iter()
        .any(|d| d.taints.as_ref().is_some_and(|t| !t.is_empty()));
    let api_limit = if tainted {
        limits::MAX_DEVICES_PER_SLICE_WITH_TAINTS
    } else {
        limits::MAX_DEVICES_PER_SLICE
    };
    if opts.max_devices_per_slice == 0 {
        return Err(invalid(
            "spec.devices",
            "max_devices_per_slice must be at least 1".to_owned(),
        ));
    }
    let per_slice = opts.max_devices_per_slice.min(api_limit);
    let chunks: Vec<Vec<Device>> = if devices.is_empty() {
        vec![Vec::new()]
    } else {
        devices.chunks(per_slice).map(<[Device]>::to_vec).collect()
    };
    let count = i64::try_from(chunks.len())
        .map_err(|_| invalid("spec.pool.resourceSliceCount", "too many slices".to_owned()))?;
    chunks
        .into_iter()
        .enumerate()
        .map(|(k, devices)| {
            Ok(ResourceSlice {
                metadata: ObjectMeta {
                    name: Some(slice_name(&node.name, &opts.driver_name, k)),
                    ..ObjectMeta::default()
                },
                spec: ResourceSliceSpec {
                    driver: opts.driver_name.clone(),
                    node_name: Some(node.name.clone()),
                    pool: ResourcePool {
                        name: node.name.clone(),
                        generation: opts.pool_generation,
                        resource_slice_count: count,
                    },
                    devices: (!devices.is_empty()).then_some(devices),
                    ..ResourceSliceSpec::default()
                },
            })
        })
        .collect()
}

/// The devices `gpu` of `node` is offered as: the GPU itself, or in MIG mode the instances
/// the node can name (one it could not prepare is not offered: `NodeInventory::mig_access`;
/// [`unoffered`] says why).
fn offered(node: &NodeInventory, gpu: &Gpu, opts: &RenderOptions) -> Vec<Device> {
    match gpu.mode {
        GpuMode::Mig => gpu
            .mig_instances
            .iter()
            .filter(|mig| node.mig_access(gpu, mig).is_ok())
            .map(|mig| mig_device(gpu, mig))
            .collect(),
        GpuMode::Exclusive | GpuMode::Shared => vec![gpu_device(gpu, opts)],
    }
}

/// The MIG instances of `node` that [`render`] leaves out because the node cannot name them
/// ([`NodeInventory::mig_access`]), each as its device name and the reason: what the plugin
/// logs at discovery, so an admin learns why a MIG layout offers fewer devices than it has.
pub fn unoffered(node: &NodeInventory) -> Vec<(String, String)> {
    node.gpus
        .iter()
        .filter(|g| g.mode == GpuMode::Mig)
        .flat_map(|gpu| {
            gpu.mig_instances.iter().filter_map(move |mig| {
                node.mig_access(gpu, mig)
                    .err()
                    .map(|why| (mig.device_name(gpu.index), why))
            })
        })
        .collect()
}

/// `<node>-<driver with dots as dashes>-<k>`, shortened with a hash when it would exceed the
/// 253 characters of an object name.
fn slice_name(node: &str, driver: &str, k: usize) -> String {
    let base = format!("{node}-{}", driver.replace('.', "-"));
    let suffix = format!("-{k}");
    if base.len() + suffix.len() <= limits::MAX_DNS_SUBDOMAIN {
        return format!("{base}{suffix}");
    }
    let hash = limits::name_hash(&base);
    let keep = limits::MAX_DNS_SUBDOMAIN - suffix.len() - hash.len() - 1;
    let head = base[..keep].trim_end_matches(['-', '.']);
    format!("{head}-{hash}{suffix}")
}

fn string(s: &str) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(s.to_owned()),
        ..DeviceAttribute::default()
    }
}

fn int(i: u32) -> DeviceAttribute {
    DeviceAttribute {
        int: Some(i64::from(i)),
        ..DeviceAttribute::default()
    }
}

fn boolean(b: bool) -> DeviceAttribute {
    DeviceAttribute {
        bool: Some(b),
        ..DeviceAttribute::default()
    }
}

/// A version attribute; a value that is not a version is kept as given so `check_device`
/// reports it with the attribute's name.
fn version(v: &str) -> DeviceAttribute {
    DeviceAttribute {
        version: Some(normalize_version(v).unwrap_or_else(|| v.to_owned())),
        ..DeviceAttribute::default()
    }
}

fn capacity(q: Quantity) -> DeviceCapacity {
    DeviceCapacity {
        value: q.to_k8s(),
        request_policy: None,
    }
}

/// A map of attributes or capacities from `(name, value)` rows.
fn named<V>(rows: impl IntoIterator<Item = (&'static str, V)>) -> BTreeMap<String, V> {
    rows.into_iter()
        .map(|(name, value)| (name.to_owned(), value))
        .collect()
}

/// Attributes a GPU and its MIG instances share.
fn common_attributes(gpu: &Gpu) -> BTreeMap<String, DeviceAttribute> {
    let optional = [
        gpu.nvlink_domain
            .as_deref()
            .map(|domain| (names::ATTR_NVLINK_DOMAIN, string(domain))),
        gpu.numa_node.map(|numa| (names::ATTR_NUMA_NODE, int(numa))),
    ];
    named(
        [
            (names::ATTR_PRODUCT_NAME, string(&gpu.product_name)),
            (names::ATTR_MODEL, string(&gpu.model)),
            (names::ATTR_BRAND, string(&gpu.brand)),
            (names::ATTR_ARCHITECTURE, string(&gpu.architecture)),
            (
                names::ATTR_CUDA_COMPUTE_CAPABILITY,
                version(&gpu.compute_capability),
            ),
            (names::ATTR_DRIVER_VERSION, version(&gpu.driver_version)),
            (
                names::ATTR_CUDA_DRIVER_VERSION,
                version(&gpu.cuda_driver_version),
            ),
            (names::ATTR_STD_PCIE_ROOT, string(&gpu.pcie_root)),
        ]
        .into_iter()
        .chain(optional.into_iter().flatten()),
    )
}

/// The taints of a GPU's devices: unhealthy, and draining (value: the mode it switches to).
fn taints(gpu: &Gpu) -> Option<Vec<DeviceTaint>> {
    let mut taints = Vec::new();
    if !gpu.healthy {
        taints.push(DeviceTaint {
            key: names::TAINT_UNHEALTHY.to_owned(),
            effect: names::TAINT_EFFECT_NO_SCHEDULE.to_owned(),
            ..DeviceTaint::default()
        });
    }
    if let Some(mode) = gpu.draining_to {
        taints.push(DeviceTaint {
            key: names::TAINT_DRAINING.to_owned(),
            value: Some(mode.as_str().to_owned()),
            effect: names::TAINT_EFFECT_NO_SCHEDULE.to_owned(),
            ..DeviceTaint::default()
        });
    }
    (!taints.is_empty()).then_some(taints)
}

fn gpu_device(gpu: &Gpu, opts: &RenderOptions) -> Device {
    let shared = gpu.mode == GpuMode::Shared;
    let mut a = common_attributes(gpu);
    a.extend(named([
        (names::ATTR_TYPE, string(names::TYPE_GPU)),
        (names::ATTR_UUID, string(&gpu.uuid)),
        (names::ATTR_INDEX, int(gpu.index)),
        (names::ATTR_MIG_CAPABLE, boolean(gpu.mig_capable)),
        (
            names::ATTR_SHARING,
            string(if shared {
                names::SHARING_SHARED
            } else {
                names::SHARING_EXCLUSIVE
            }),
        ),
        (names::ATTR_STD_PCI_BUS_ID, string(&gpu.pci_bus_id)),
    ]));
    if let Some(enforcement) = opts.enforcement.as_deref().filter(|_| shared) {
        a.insert(names::ATTR_ENFORCEMENT.to_owned(), string(enforcement));
    }
    if shared {
        a.insert(
            names::ATTR_ISOLATION.to_owned(),
            string(gpu.isolation.as_str()),
        );
        if !gpu.isolation_reason.is_empty() {
            a.insert(
                names::ATTR_ISOLATION_REASON.to_owned(),
                string(&gpu.isolation_reason),
            );
        }
    }

    let consumable = shared && opts.consumable_capacity;
    let mut c = BTreeMap::new();
    let mut memory = capacity(Quantity::from_bytes(gpu.memory_bytes));
    let mut compute = capacity(Quantity::from_units(100));
    if consumable {
        memory.request_policy = Some(policy(
            Quantity::from_bytes(GIB),
            Quantity::from_bytes(GIB),
            None,
            Quantity::from_bytes(GIB),
        ));
        compute.request_policy = Some(policy(
            Quantity::ZERO,
            Quantity::ZERO,
            Some(Quantity::from_units(100)),
            Quantity::from_units(5),
        ));
    } else {
        // A shareable device's every capacity is consumed by every share, so one without a
        // policy would let only one share in (DESIGN.md §2): leave it off shared devices.
        c.insert(
            names::CAP_MULTIPROCESSORS.to_owned(),
            capacity(Quantity::from_units(i64::from(gpu.multiprocessors))),
        );
    }
    c.insert(names::CAP_MEMORY.to_owned(), memory);
    c.insert(names::CAP_COMPUTE.to_owned(), compute);

    Device {
        name: gpu.device_name(),
        attributes: Some(a),
        capacity: Some(c),
        allow_multiple_allocations: consumable.then_some(true),
        taints: taints(gpu),
        ..Device::default()
    }
}

fn policy(
    default: Quantity,
    min: Quantity,
    max: Option<Quantity>,
    step: Quantity,
) -> CapacityRequestPolicy {
    CapacityRequestPolicy {
        default: Some(default.to_k8s()),
        valid_range: Some(CapacityRequestPolicyRange {
            min: min.to_k8s(),
            max: max.map(Quantity::to_k8s),
            step: Some(step.to_k8s()),
        }),
        valid_values: None,
    }
}

fn mig_device(gpu: &Gpu, mig: &MigInstance) -> Device {
    let mut a = common_attributes(gpu);
    a.extend(named([
        (names::ATTR_TYPE, string(names::TYPE_MIG)),
        (names::ATTR_UUID, string(&mig.uuid)),
        (names::ATTR_MIG_PROFILE, string(&mig.profile)),
        (names::ATTR_PARENT_UUID, string(&gpu.uuid)),
        (names::ATTR_PARENT_INDEX, int(gpu.index)),
        (names::ATTR_SHARING, string(names::SHARING_EXCLUSIVE)),
    ]));
    let c = named([
        (
            names::CAP_MEMORY,
            capacity(Quantity::from_bytes(mig.memory_bytes)),
        ),
        (
            names::CAP_COMPUTE,
            capacity(Quantity::from_units(i64::from(mig.compute_percent))),
        ),
        (
            names::CAP_MULTIPROCESSORS,
            capacity(Quantity::from_units(i64::from(mig.multiprocessors))),
        ),
    ]);
    Device {
        name: mig.device_name(gpu.index),
        attributes: Some(a),
        capacity: Some(c),
        taints: taints(gpu),
        ..Device::default()
    }
}

/// Checks one device against the API's per-device rules.
fn check_device(d: &Device, object: &str) -> Result<()> {
    let field = |rest: &str| format!("spec.devices[{}]{rest}", d.name);
    // `count` of `what` at `rest` past the API's `limit`.
    let at_most = |count: usize, limit: usize, what: &str, rest: &str| {
        if count > limit {
            return Err(Error::invalid(
                object,
                field(rest),
                format!("{count} {what}; at most {limit} are allowed"),
            ));
        }
        Ok(())
    };
    if !limits::is_dns_label(&d.name) {
        return Err(Error::invalid(
            object,
            "spec.devices[].name",
            format!(
                "device name {:?} must be a DNS label of at most {} characters",
                d.name,
                limits::MAX_DNS_LABEL
            ),
        ));
    }
    let attributes = d.attributes.as_ref();
    let capacities = d.capacity.as_ref();
    at_most(
        attributes.map_or(0, BTreeMap::len) + capacities.map_or(0, BTreeMap::len),
        limits::MAX_ATTRIBUTES_AND_CAPACITIES,
        "attributes and capacities",
        "",
    )?;
    for (name, value) in attributes.into_iter().flatten() {
        let f = || field(&format!(".attributes[{name}]"));
        limits::check_qualified_name(name).map_err(|m| Error::invalid(object, f(), m))?;
        for s in value.string.iter().chain(value.version.iter()) {
            if s.len() > limits::MAX_VALUE_LENGTH {
                return Err(Error::invalid(
                    object,
                    f(),
                    format!(
                        "value {s:?} is longer than {} characters",
                        limits::MAX_VALUE_LENGTH
                    ),
                ));
            }
        }
        if let Some(v) = &value.version
            && !limits::is_semver(v)
        {
            return Err(Error::invalid(
                object,
                f(),
                format!("{v:?} is not a semantic version (semver.org 2.0.0)"),
            ));
        }
    }
    for (name, cap) in capacities.into_iter().flatten() {
        limits::check_qualified_name(name)
            .map_err(|m| Error::invalid(object, field(&format!(".capacity[{name}]")), m))?;
        if cap.request_policy.is_some() && d.allow_multiple_allocations != Some(true) {
            return Err(Error::invalid(
                object,
                field(&format!(".capacity[{name}].requestPolicy")),
                "a request policy needs allowMultipleAllocations".to_owned(),
            ));
        }
    }
    at_most(
        d.taints.as_ref().map_or(0, Vec::len),
        limits::MAX_TAINTS_PER_DEVICE,
        "taints",
        ".taints",
    )
}

#[cfg(test)]
mod tests;
