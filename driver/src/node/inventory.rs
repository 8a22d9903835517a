//! The GPU inventory model, and the fake-inventory file format that fills it.
//!
//! [`Inventory`], [`NodeInventory`], [`Gpu`] and [`MigInstance`] are plain resolved data with
//! every field known: the NVML backend fills them from a real node, and
//! [`Inventory::from_yaml`] fills them from a fake-inventory file (documented in
//! docs/inventory.md), defaulting every field that file leaves out deterministically.

pub mod brand;
pub mod discovered;
mod file;
mod mig;
pub mod mig_minors;
pub mod models;

use std::collections::BTreeMap;
use std::fmt;

use crate::error::{Error, Result};
use crate::names;

pub use mig_minors::MigMinors;
pub use models::{GpuModel, MigProfile};

/// Every node of an inventory.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Inventory {
    /// The nodes, in file order.
    pub nodes: Vec<NodeInventory>,
}

impl Inventory {
    /// Reads a fake-inventory file (YAML, format in docs/inventory.md).
    ///
    /// Errors are [`Error::Inventory`] naming the field (`nodes[1].gpus[0].model`) and the rule.
    pub fn from_yaml(text: &str) -> Result<Self> {
        file::parse(text)
    }

    /// The node with this name.
    pub fn node(&self, name: &str) -> Option<&NodeInventory> {
        self.nodes.iter().find(|n| n.name == name)
    }
}

/// The GPUs of one node.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeInventory {
    /// The Kubernetes node name; also the name of the node's resource pool.
    pub name: String,
    /// Node labels the inventory declares (used by simulations and demos).
    pub labels: BTreeMap<String, String>,
    /// The GPUs, ordered by index.
    pub gpus: Vec<Gpu>,
    /// The capability minors of the node's MIG instances, from the NVIDIA driver's
    /// `/proc/driver/nvidia-caps/mig-minors` (a fake-inventory file gets the driver's layout,
    /// [`MigMinors::driver_layout`]). `None` when the node has no such table: then it
    /// prepares no MIG device (docs/cdi.md).
    pub mig_minors: Option<MigMinors>,
}

/// What grants a container access to one MIG instance and no other: NVML's ids for it and
/// the capability minors the driver's table lists for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigAccess {
    /// NVML's GPU instance and compute instance ids.
    pub ids: MigIds,
    /// The access minor of the GPU instance (`/dev/nvidia-caps/nvidia-cap<minor>`).
    pub gpu_instance_minor: u32,
    /// The access minor of the compute instance.
    pub compute_instance_minor: u32,
}

impl NodeInventory {
    /// The access to MIG instance `mig` of `gpu`: the minors the node's table lists for the
    /// GPU's minor and the instance's NVML ids. The one rule for whether a MIG instance can be
    /// handed to a container: the node publishes only the instances it can name, and prepares
    /// only those. Fail closed: without the ids, without the table, or without the instance in
    /// it, the minors cannot be told, and a guess could hand the container another instance's
    /// access. The error says which, naming the instance.
    pub fn mig_access(
        &self,
        gpu: &Gpu,
        mig: &MigInstance,
    ) -> std::result::Result<MigAccess, String> {
        let ids = mig.ids.ok_or_else(|| {
            format!(
                "NVML did not report the GPU and compute instance ids of MIG device {}, so the \
                 capability minors that grant access to it cannot be told; the node offers no \
                 MIG instance it cannot name (see docs/cdi.md)",
                mig.uuid
            )
        })?;
        let table = self.mig_minors.as_ref().ok_or_else(|| {
            format!(
                "node {} has no MIG capability table ({} is absent or unreadable; see the \
                 plugin's log), so the minors that grant access to MIG device {} cannot be \
                 told; the node offers no MIG instance without it (see docs/cdi.md)",
                self.name,
                mig_minors::MIG_MINORS_PATH,
                mig.uuid
            )
        })?;
        let (gpu_instance_minor, compute_instance_minor) = table
            .minors(gpu.minor, ids.gpu_instance, ids.compute_instance)
            .ok_or_else(|| {
                format!(
                    "{} lists no access minors for gpu{}/gi{}/ci{} (MIG device {}), so none can \
                     be granted; the driver's table and NVML disagree, or the instance was \
                     recreated since discovery",
                    mig_minors::MIG_MINORS_PATH,
                    gpu.minor,
                    ids.gpu_instance,
                    ids.compute_instance,
                    mig.uuid
                )
            })?;
        Ok(MigAccess {
            ids,
            gpu_instance_minor,
            compute_instance_minor,
        })
    }
}

/// How a GPU is offered to claims.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum GpuMode {
    /// The whole GPU goes to one claim.
    #[default]
    Exclusive,
    /// Many claims share the GPU, each with a share of memory and compute.
    Shared,
    /// The GPU is split into MIG instances; the instances are the devices.
    Mig,
}

impl GpuMode {
    /// Every mode, in declaration order.
    pub const ALL: [Self; 3] = [Self::Exclusive, Self::Shared, Self::Mig];

    /// The mode as written in inventory files and plugin configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Exclusive => "exclusive",
            Self::Shared => "shared",
            Self::Mig => "mig",
        }
    }
}

impl fmt::Display for GpuMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for GpuMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|mode| mode.as_str() == s)
            .ok_or_else(|| Error::Inventory {
                field: "mode".into(),
                message: format!("unknown mode {s:?}; expected exclusive, shared or mig"),
            })
    }
}

/// One physical GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    /// Index on the node (NVML's index), unique per node.
    pub index: u32,
    /// The minor number of the GPU's device node (`/dev/nvidia<minor>`), as NVML reports it;
    /// it may differ from `index`. The MIG capability minors are keyed by it too.
    pub minor: u32,
    /// NVML UUID, `GPU-<uuid>`.
    pub uuid: String,
    /// Short lower-case model id, e.g. `a100-80g` (see [`models::MODELS`]).
    pub model: String,
    /// Product name as NVML reports it.
    pub product_name: String,
    /// Brand as NVML reports it.
    pub brand: String,
    /// Architecture, e.g. `Ampere`.
    pub architecture: String,
    /// CUDA compute capability, `major.minor` (e.g. `8.0`).
    pub compute_capability: String,
    /// Usable memory in bytes.
    pub memory_bytes: u64,
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// Whether the GPU can be split into MIG instances.
    pub mig_capable: bool,
    /// PCI bus id, `dddd:bb:dd.f`, lower case.
    pub pci_bus_id: String,
    /// `PCIe` root complex, `pci<domain>:<bus>` (e.g. `pci0000:00`).
    pub pcie_root: String,
    /// NUMA node the GPU is attached to, when known.
    pub numa_node: Option<u32>,
    /// Id shared by the GPUs NVLink-connected to this one; `None` when it is on no island.
    pub nvlink_domain: Option<String>,
    /// How the GPU is offered.
    pub mode: GpuMode,
    /// The MIG instances (only in [`GpuMode::Mig`]), ordered by placement.
    pub mig_instances: Vec<MigInstance>,
    /// NVIDIA driver version, as the driver reports it (e.g. `550.54.15`).
    pub driver_version: String,
    /// CUDA driver version, as the driver reports it (e.g. `12.4`).
    pub cuda_driver_version: String,
    /// Whether the GPU is healthy; unhealthy GPUs are published with a taint.
    pub healthy: bool,
    /// The mode the GPU switches to once the claims holding it are gone: set while a change of
    /// its configuration waits for them (`reconfigure`), when it is published with the
    /// draining taint. Discovery never sets it.
    pub draining_to: Option<GpuMode>,
    /// Whether the node proved its share isolation on this GPU (`crate::node::isolation`);
    /// published on shared GPUs only. NVML discovery finds every GPU unverified until the kubelet
    /// plugin's probe says otherwise; a fake-inventory file states what the probe finds.
    pub isolation: Isolation,
    /// Why, as a short code ([`REASON_NOT_PROBED`] until a probe, then
    /// `crate::node::isolation::REASON_*`), published as `isolationReason` on shared GPUs when
    /// not empty.
    pub isolation_reason: String,
}

/// Reason code of a GPU that no probe of the node's backend on its driver has judged yet: what
/// discovery gives every GPU (the probe's own codes are `crate::node::isolation::REASON_*`).
pub const REASON_NOT_PROBED: &str = "not-probed";

/// What a shared GPU publishes as its `isolation` attribute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Isolation {
    /// The node's probe held there: refused past the limit, served under it.
    Verified,
    /// Not proven (not probed yet, failed, timed out, or a backend that limits nothing).
    #[default]
    Unverified,
    /// Not proven, and the admin accepted that explicitly.
    Accepted,
}

impl Isolation {
    /// Every value, in the order errors list them.
    pub const ALL: [Self; 3] = [Self::Verified, Self::Unverified, Self::Accepted];

    /// The published value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Verified => names::ISOLATION_VERIFIED,
            Self::Unverified => names::ISOLATION_UNVERIFIED,
            Self::Accepted => names::ISOLATION_ACCEPTED,
        }
    }

    /// Whether shares may be prepared on the GPU.
    pub fn offers_shares(self) -> bool {
        self != Self::Unverified
    }
}

impl fmt::Display for Isolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Isolation {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|i| i.as_str() == s)
            .ok_or_else(|| Error::Inventory {
                field: "isolation".into(),
                message: format!(
                    "unknown isolation {s:?}; expected {}, {} or {}",
                    names::ISOLATION_VERIFIED,
                    names::ISOLATION_UNVERIFIED,
                    names::ISOLATION_ACCEPTED
                ),
            })
    }
}

/// One MIG instance (a GPU instance with its full compute instance).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigInstance {
    /// Profile name, e.g. `1g.10gb`.
    pub profile: String,
    /// Start placement, in memory slices.
    pub placement: u32,
    /// NVML UUID, `MIG-<uuid>`.
    pub uuid: String,
    /// The GPU instance and compute instance ids NVML gives the MIG device; `None` when NVML
    /// did not report them, and then the node refuses to prepare the instance (its capability
    /// minors cannot be told).
    pub ids: Option<MigIds>,
    /// Usable memory in bytes.
    pub memory_bytes: u64,
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// Compute slices the instance takes.
    pub compute_slices: u32,
    /// The instance's share of the parent's compute in percent: its compute slices over the
    /// parent's, rounded down to a multiple of 5 (so a `1g` of 7 is 10, a `7g` is 100).
    pub compute_percent: u32,
}

/// The ids NVML gives a MIG device: its GPU instance's id on the GPU, and its compute
/// instance's id within that GPU instance (`nvmlDeviceGetGpuInstanceId`,
/// `nvmlDeviceGetComputeInstanceId`). They key the capability minors that grant access to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MigIds {
    /// The GPU instance id.
    pub gpu_instance: u32,
    /// The compute instance id, within the GPU instance.
    pub compute_instance: u32,
}

impl Gpu {
    /// The device name this GPU is published under: `gpu-<index>`. Stable across restarts.
    pub fn device_name(&self) -> String {
        format!("gpu-{}", self.index)
    }
}

impl MigInstance {
    /// The device name this instance is published under:
    /// `gpu-<parent index>-mig-<profile>-<placement>`, the profile made a DNS label
    /// (`1g.10gb` becomes `1g-10gb`). Stable across restarts.
    pub fn device_name(&self, gpu_index: u32) -> String {
        let profile: String = self
            .profile
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_lowercase()
                } else {
                    '-'
                }
            })
            .collect();
        format!("gpu-{gpu_index}-mig-{profile}-{}", self.placement)
    }

    /// The compute percent of `compute_slices` out of `total_slices`, rounded down to a
    /// multiple of 5 (the share step), at most 100.
    pub fn compute_percent_of(compute_slices: u32, total_slices: u32) -> u32 {
        if total_slices == 0 {
            return 0;
        }
        let raw = u64::from(compute_slices) * 100 / u64::from(total_slices);
        let stepped = (raw / 5 * 5).min(100);
        u32::try_from(stepped).unwrap_or(100)
    }
}

#[cfg(test)]
mod tests;
