//! What a prepared claim is: a claim allocated to this node, its devices joined with what
//! discovery knows of each GPU or MIG instance, and each device's resolved share.
//!
//! A leaf of the node wing: `prepare` builds these values from a claim, `cdi` renders them, the
//! `checkpoint` records them and `isolation` builds its probe's claim as one. It imports nothing
//! of the wing, so every arrow between those modules points one way.

use crate::rules::config::Tier;
use crate::rules::share::PerDeviceShare;

/// A claim allocated to this node, as the kubelet plugin prepares it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedClaim {
    /// The claim's UID; names the spec file and the CDI devices.
    pub uid: String,
    /// The claim's namespace.
    pub namespace: String,
    /// The claim's name.
    pub name: String,
    /// The claim's allocated devices on this node, in allocation order.
    pub devices: Vec<PreparedDevice>,
}

/// One allocation result of a claim, joined with what discovery knows about the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedDevice {
    /// The request (`request` or `request/subrequest`) the device was allocated for.
    pub request: String,
    /// The pool the device belongs to.
    pub pool: String,
    /// The device name within the pool, e.g. `gpu-0`.
    pub device: String,
    /// The physical GPU (for a MIG instance: its parent).
    pub gpu: GpuNode,
    /// The MIG instance, when the device is one.
    pub mig: Option<MigNode>,
    /// The resolved share, when the device is a share of a GPU; `None` for a whole device.
    pub share: Option<PerDeviceShare>,
    /// The share's tier as the allocator recorded it; online for a whole device.
    pub tier: Tier,
    /// Whether the share may use more memory than it is guaranteed (a batch share whose class
    /// over-commits memory, [`crate::rules::overcommit`]): only a `hami-core` node can back that.
    pub memory_overcommitted: bool,
    /// The allocation result's `shareID`, for a device that allows several allocations;
    /// returned to kubelet with the device.
    pub share_id: Option<String>,
}

/// A GPU as discovery saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuNode {
    /// The GPU's index on the node.
    pub index: u32,
    /// `GPU-…` UUID.
    pub uuid: String,
    /// Minor number of `/dev/nvidia<minor>`.
    pub minor: u32,
}

/// A MIG instance as discovery saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigNode {
    /// `MIG-…` UUID.
    pub uuid: String,
    /// GPU instance id.
    pub gpu_instance: u32,
    /// Compute instance id.
    pub compute_instance: u32,
    /// Minor of `/dev/nvidia-caps/nvidia-cap<minor>` granting access to the GPU instance.
    pub gpu_instance_cap_minor: u32,
    /// Minor of `/dev/nvidia-caps/nvidia-cap<minor>` granting access to the compute instance.
    pub compute_instance_cap_minor: u32,
}
