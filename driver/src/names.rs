//! Every Kubernetes-facing string Tessera uses, in one place.
//!
//! Attribute and capacity names are the wire contract with admins' CEL selectors and with
//! kube-scheduler, so they must never be spelled inline elsewhere.

/// The default DRA driver name; also the domain of Tessera's device attributes and capacities.
pub const DEFAULT_DRIVER_NAME: &str = "gpu.tessera.dev";

/// API group and version of Tessera's opaque configuration objects.
pub const CONFIG_API_VERSION: &str = "gpu.tessera.dev/v1alpha1";
/// Kind of the opaque config a user writes to ask for a share of a GPU.
pub const GPU_SHARE_KIND: &str = "GpuShare";
/// Kind of the opaque config the allocator writes into an allocation: the resolved per-device share.
pub const ALLOCATED_SHARES_KIND: &str = "AllocatedShares";
/// `kind` of a DeviceClass's tier setting (online or batch, and whether claims may raise it).
pub const TIER_POLICY_KIND: &str = "TierPolicy";

/// `DeviceClass` for whole GPUs.
pub const CLASS_GPU: &str = "gpu.tessera.dev";
/// `DeviceClass` for fractional shares of a GPU.
pub const CLASS_SHARED_GPU: &str = "shared.gpu.tessera.dev";
/// `DeviceClass` for MIG instances.
pub const CLASS_MIG_GPU: &str = "mig.gpu.tessera.dev";

/// Device attribute: `gpu` or `mig`.
pub const ATTR_TYPE: &str = "type";
/// Device attribute: the GPU's (or MIG instance's) UUID.
pub const ATTR_UUID: &str = "uuid";
/// Device attribute: the GPU's index on its node.
pub const ATTR_INDEX: &str = "index";
/// Device attribute: the product name NVML reports, e.g. `NVIDIA A100-SXM4-80GB`.
pub const ATTR_PRODUCT_NAME: &str = "productName";
/// Device attribute: the short lower-case model, e.g. `a100-80g`.
pub const ATTR_MODEL: &str = "model";
/// Device attribute: the brand, e.g. `Tesla`, `GeForce`.
pub const ATTR_BRAND: &str = "brand";
/// Device attribute: the architecture, e.g. `Ampere`.
pub const ATTR_ARCHITECTURE: &str = "architecture";
/// Device attribute: the CUDA compute capability as a version.
pub const ATTR_CUDA_COMPUTE_CAPABILITY: &str = "cudaComputeCapability";
/// Device attribute: the NVIDIA driver version as a version.
pub const ATTR_DRIVER_VERSION: &str = "driverVersion";
/// Device attribute: the CUDA driver version as a version.
pub const ATTR_CUDA_DRIVER_VERSION: &str = "cudaDriverVersion";
/// Device attribute: whether the GPU can be split into MIG instances.
pub const ATTR_MIG_CAPABLE: &str = "migCapable";
/// Device attribute: `exclusive` or `shared`.
pub const ATTR_SHARING: &str = "sharing";
/// Device attribute: an id shared by GPUs NVLink-connected to each other.
pub const ATTR_NVLINK_DOMAIN: &str = "nvlinkDomain";
/// Device attribute: the NUMA node the GPU is attached to.
pub const ATTR_NUMA_NODE: &str = "numaNode";
/// Device attribute of MIG instances: the MIG profile, e.g. `1g.10gb`.
pub const ATTR_MIG_PROFILE: &str = "profile";
/// Device attribute of MIG instances: the UUID of the parent GPU.
pub const ATTR_PARENT_UUID: &str = "parentUUID";
/// Device attribute of MIG instances: the index of the parent GPU.
pub const ATTR_PARENT_INDEX: &str = "parentIndex";
/// Standard attribute (fully qualified): the PCI bus id.
pub const ATTR_STD_PCI_BUS_ID: &str = "resource.kubernetes.io/pciBusID";
/// Standard attribute (fully qualified): the `PCIe` root complex.
pub const ATTR_STD_PCIE_ROOT: &str = "resource.kubernetes.io/pcieRoot";

/// Value of [`ATTR_TYPE`] for a whole GPU.
pub const TYPE_GPU: &str = "gpu";
/// Value of [`ATTR_TYPE`] for a MIG instance.
pub const TYPE_MIG: &str = "mig";
/// Value of [`ATTR_SHARING`] for a GPU given whole to one claim.
pub const SHARING_EXCLUSIVE: &str = "exclusive";
/// Value of [`ATTR_SHARING`] for a GPU many claims share.
pub const SHARING_SHARED: &str = "shared";
/// Attribute of a shared GPU: how its node enforces shares (`mps`, `hami-core`, `none`),
/// published when the kubelet plugin knows it. Batch memory over-commit needs `hami-core`.
pub const ATTR_ENFORCEMENT: &str = "enforcement";
/// Value of [`ATTR_ENFORCEMENT`] on nodes that enforce shares with HAMi-core.
pub const ENFORCEMENT_HAMI_CORE: &str = "hami-core";
/// Value of [`ATTR_ENFORCEMENT`] on nodes that enforce shares with MPS.
pub const ENFORCEMENT_MPS: &str = "mps";
/// Value of [`ATTR_ENFORCEMENT`] on nodes that enforce nothing (time-slicing).
pub const ENFORCEMENT_NONE: &str = "none";
/// Attribute of a shared GPU: whether its node proved there that its enforcement backend
/// holds a limit ([`ISOLATION_VERIFIED`], [`ISOLATION_UNVERIFIED`],
/// [`ISOLATION_ACCEPTED`]; `crate::node::isolation`). The shipped share classes select verified
/// and accepted GPUs only.
pub const ATTR_ISOLATION: &str = "isolation";
/// Attribute of a shared GPU: why its [`ATTR_ISOLATION`] is what it is, a short code
/// (`probe-held`, `not-probed`, `limit-not-enforced`, … ; `crate::node::isolation::REASON_*`).
pub const ATTR_ISOLATION_REASON: &str = "isolationReason";
/// Value of [`ATTR_ISOLATION`]: the node's probe was refused past a limit and served under it.
pub const ISOLATION_VERIFIED: &str = "verified";
/// Value of [`ATTR_ISOLATION`]: not proven (the probe failed, timed out or has not run, or
/// the backend limits nothing); such a GPU offers no shares through the shipped classes.
pub const ISOLATION_UNVERIFIED: &str = "unverified";
/// Value of [`ATTR_ISOLATION`]: not proven, and the admin accepted that explicitly
/// (`--accept-unverified-isolation`); the shipped share classes select it.
pub const ISOLATION_ACCEPTED: &str = "unverified-accepted";

/// Capacity: memory in bytes.
pub const CAP_MEMORY: &str = "memory";
/// Capacity: compute in percent of a whole GPU.
pub const CAP_COMPUTE: &str = "compute";
/// Capacity: streaming multiprocessors.
pub const CAP_MULTIPROCESSORS: &str = "multiprocessors";

/// CDI vendor of the specs the kubelet plugin writes.
pub const CDI_VENDOR: &str = "k8s.gpu.tessera.dev";
/// CDI class of the specs the kubelet plugin writes.
pub const CDI_CLASS: &str = "claim";
/// CDI kind, `vendor/class`.
pub const CDI_KIND: &str = "k8s.gpu.tessera.dev/claim";

/// Scheduling gate on pods whose claims Tessera's controller allocates.
pub const SCHEDULING_GATE: &str = "gpu.tessera.dev/allocation";
/// Finalizer kube-scheduler puts on claims before allocating them; the controller does the same.
pub const CLAIM_FINALIZER: &str = "resource.kubernetes.io/delete-protection";
/// Node label choosing the mode of every non-MIG GPU of the node: `exclusive` or `shared`
/// (`mig` is accepted and changes nothing: MIG mode comes from the hardware).
pub const LABEL_GPU_MODE: &str = "gpu.tessera.dev/mode";
/// Prefix of the node labels choosing one GPU's mode, followed by the GPU's index:
/// `gpu.tessera.dev/mode.gpu-3: shared`. Wins over [`LABEL_GPU_MODE`].
pub const LABEL_GPU_MODE_PER_GPU_PREFIX: &str = "gpu.tessera.dev/mode.gpu-";
/// Well-known node label holding the node's name.
pub const LABEL_HOSTNAME: &str = "kubernetes.io/hostname";

/// Annotation on a DeviceClass marking it as a class of Tessera shares (value `"true"`).
pub const ANNOTATION_SHARE_CLASS: &str = "gpu.tessera.dev/share-class";
/// Annotation on a DeviceClass choosing whether pods using it are allocated by Tessera's
/// controller (they get the scheduling gate at admission): `"true"` marks a class, `"false"`
/// opts out one of the classes marked by default ([`CLASS_SHARED_GPU`], [`CLASS_MIG_GPU`]).
pub const ANNOTATION_ALLOCATE: &str = "gpu.tessera.dev/allocate";
/// Device taint key the kubelet plugin puts on GPUs it finds unhealthy.
pub const TAINT_UNHEALTHY: &str = "gpu.tessera.dev/unhealthy";
/// Device taint key the kubelet plugin puts on a GPU (and its MIG instances) whose mode change
/// waits for the claims holding it to go; the value is the mode it switches to.
pub const TAINT_DRAINING: &str = "gpu.tessera.dev/draining";
/// Device taint effect: do not allocate the device to claims that do not tolerate the taint.
pub const TAINT_EFFECT_NO_SCHEDULE: &str = "NoSchedule";
/// The `resource.k8s.io/v1` API version (Kubernetes 1.34+).
pub const RESOURCE_API_V1: &str = "resource.k8s.io/v1";
/// The `resource.k8s.io/v1beta2` API version (Kubernetes 1.33).
pub const RESOURCE_API_V1BETA2: &str = "resource.k8s.io/v1beta2";
/// The `resource.k8s.io/v1beta1` API version (Kubernetes 1.32).
pub const RESOURCE_API_V1BETA1: &str = "resource.k8s.io/v1beta1";
/// The core `v1` API version (Nodes, Pods).
pub const CORE_API_V1: &str = "v1";
/// API version of Evictions (the `pods/eviction` subresource).
pub const POLICY_API_V1: &str = "policy/v1";

/// A Kubernetes resource the binaries read or write: its `kind`, and its plural, the path
/// segment of its URLs (`/apis/<group>/<version>/<plural>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ResourceKind {
    /// The `kind` of its objects.
    pub kind: &'static str,
    /// The resource name in URLs, and in an admission review's `resource.resource`.
    pub plural: &'static str,
}

impl ResourceKind {
    const fn new(kind: &'static str, plural: &'static str) -> Self {
        Self { kind, plural }
    }
}

/// resource.k8s.io DeviceClasses (cluster-scoped).
pub const DEVICE_CLASS: ResourceKind = ResourceKind::new("DeviceClass", "deviceclasses");
/// resource.k8s.io ResourceSlices (cluster-scoped).
pub const RESOURCE_SLICE: ResourceKind = ResourceKind::new("ResourceSlice", "resourceslices");
/// resource.k8s.io ResourceClaims.
pub const RESOURCE_CLAIM: ResourceKind = ResourceKind::new("ResourceClaim", "resourceclaims");
/// resource.k8s.io ResourceClaimTemplates.
pub const RESOURCE_CLAIM_TEMPLATE: ResourceKind =
    ResourceKind::new("ResourceClaimTemplate", "resourceclaimtemplates");
/// Core v1 Pods.
pub const POD: ResourceKind = ResourceKind::new("Pod", "pods");
/// Core v1 Nodes (cluster-scoped).
pub const NODE: ResourceKind = ResourceKind::new("Node", "nodes");
/// policy/v1 Evictions, posted to a pod's `eviction` subresource.
pub const EVICTION: ResourceKind = ResourceKind::new("Eviction", "eviction");
/// Tessera's GPU profile schedules (cluster-scoped, [`CONFIG_API_VERSION`]).
pub const GPU_PROFILE_SCHEDULE: ResourceKind =
    ResourceKind::new("GpuProfileSchedule", "gpuprofileschedules");
/// The API group of Tessera's own objects (the group of [`CONFIG_API_VERSION`]).
pub const TESSERA_GROUP: &str = "gpu.tessera.dev";
/// The version of Tessera's own objects (the version of [`CONFIG_API_VERSION`]).
pub const TESSERA_VERSION: &str = "v1alpha1";
/// Node annotation: the controller's record of the profile switch in progress or last done
/// on the node (JSON, `tessera_driver::node::schedule::switch::SwitchRecord`).
pub const ANNOTATION_PROFILE_SWITCH: &str = "gpu.tessera.dev/profile-switch";
/// Event reason: a node starts switching to a scheduled GPU profile.
pub const REASON_PROFILE_SWITCH: &str = "ProfileSwitch";
/// Event reason: every GPU of a node is in its scheduled profile's mode.
pub const REASON_PROFILE_SWITCHED: &str = "ProfileSwitched";
/// Event reason: a pod is evicted because its GPU must switch profile and the deadline passed.
pub const REASON_PROFILE_EVICTION: &str = "ProfileDrainEviction";
/// Annotation the controller's leader writes on a node where it made room by
/// defragmentation (before it evicts anything): whom the room is for and the evictions of the
/// last hour, JSON ([`crate::placement::defrag::record::DefragRecord`]). A restarted or new
/// leader counts its budget from these records.
pub const ANNOTATION_DEFRAG: &str = "gpu.tessera.dev/defrag";
/// Event reason on a pod evicted by defragmentation, and on the node where room was made.
pub const REASON_DEFRAGMENTED: &str = "Defragmented";
/// Condition and Event reason on a pending pod that waits for the room defragmentation makes
/// for it.
pub const REASON_DEFRAGMENTING: &str = "Defragmenting";
/// Event reason: a GPU's switch waits for a pod that may not be evicted.
pub const REASON_PROFILE_WAITING: &str = "ProfileDrainWaiting";
/// Event reason: a pod is evicted to make contiguous room for a pending claim.
pub const REASON_DEFRAG_EVICTION: &str = "DefragEviction";
/// Annotation on a DeviceClass: `"true"` says that pods holding its devices may be evicted
/// for a profile switch or defragmentation, whatever their tier.
pub const ANNOTATION_CLASS_PREEMPTIBLE: &str = "gpu.tessera.dev/preemptible";

/// Plugin type a DRA driver reports to kubelet's plugin registration.
pub const PLUGIN_TYPE_DRA: &str = "DRAPlugin";
/// Supported-version entry for the DRA node API v1 (kubelet 1.34 and later).
pub const DRA_SERVICE_V1: &str = "v1.DRAPlugin";
/// Supported-version entry for the DRA node API v1beta1 (kubelet 1.32 and 1.33).
pub const DRA_SERVICE_V1BETA1: &str = "v1beta1.DRAPlugin";
/// Supported-version entry for the DRA resource health API v1alpha1.
pub const DRA_HEALTH_SERVICE_V1ALPHA1: &str = "v1alpha1.DRAResourceHealth";
/// File name of the DRA socket inside the plugin directory.
pub const DRA_SOCKET_NAME: &str = "dra.sock";
/// Suffix after the driver name of the registration socket in kubelet's plugin registry.
pub const REGISTRATION_SOCKET_SUFFIX: &str = "-reg.sock";
/// Default directory kubelet watches for plugin registration sockets.
pub const DEFAULT_REGISTRATION_DIR: &str = "/var/lib/kubelet/plugins_registry";
/// Default parent of the per-driver plugin directory.
pub const DEFAULT_PLUGINS_DIR: &str = "/var/lib/kubelet/plugins";
/// Default directory of CDI specs read by the container runtime.
pub const DEFAULT_CDI_DIR: &str = "/var/run/cdi";
/// Label the kubelet plugin sets on the ResourceSlices it publishes, to find them again.
pub const LABEL_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
/// Value of [`LABEL_MANAGED_BY`] on the kubelet plugin's ResourceSlices.
pub const KUBELET_PLUGIN_MANAGER: &str = "tessera-kubelet-plugin";
/// Annotation the controller puts on a claim (with the finalizer, before allocating it): the
/// allocation is the controller's, to release when its gated pod goes. Value: the name of the
/// pod (in the claim's namespace) it was allocated for.
pub const ANNOTATION_ALLOCATED_BY: &str = "gpu.tessera.dev/allocated-by";
/// Component name the controller reports in Events and the allocated-by annotation.
pub const CONTROLLER_COMPONENT: &str = "tessera-controller";
/// `action` of the controller's Events about placing a pod's claims: why it could not place them
/// yet, or that an allocation it made is not bound.
pub const ACTION_ALLOCATE: &str = "Allocate";
/// `action` of the controller's Events on a pod it evicted to make room for a higher tier.
pub const ACTION_PREEMPT: &str = "Preempt";
/// `action` of the controller's Events about a node's scheduled GPU profile switch: the switch
/// starting or finishing, a pod it waits for or could not evict, a pod it evicted.
pub const ACTION_SWITCH_PROFILE: &str = "SwitchProfile";
/// `action` of the controller's Events about defragmentation: a pod evicted so that a pending
/// claim finds contiguous room, or an eviction a `PodDisruptionBudget` blocked.
pub const ACTION_DEFRAGMENT: &str = "Defragment";
/// Pod condition the controller sets on a gated pod it cannot place (status `False`, with the
/// allocator's reason) and once it placed it (status `True`).
pub const CONDITION_ALLOCATED: &str = "gpu.tessera.dev/Allocated";
/// Reason of [`CONDITION_ALLOCATED`] (and of the Event) when the controller refused a pod's
/// claims for a fault only their owner can fix; it tries again only when the pod or one of its
/// claims changes.
pub const REASON_ALLOCATION_REFUSED: &str = "AllocationRefused";
/// Reason of [`CONDITION_ALLOCATED`] (and of a Normal Event) while a delay-tolerant pod waits
/// for a GPU that is already partly used; the message says until when.
pub const REASON_WAITING_FOR_FRAGMENT: &str = "WaitingForFragment";
/// Reason of [`CONDITION_ALLOCATED`] (and of a Normal Event) on an online pod for which the
/// controller evicted batch pods, while it waits for them to terminate.
pub const REASON_PREEMPTING: &str = "Preempting";
/// Reason of the Event on a batch pod the controller evicted; the message names the pod it
/// made room for.
pub const REASON_PREEMPTED: &str = "Preempted";
/// Name of the Lease the controller replicas elect their leader on.
pub const LEADER_LEASE: &str = "tessera-controller";
/// Annotation the pod webhook puts on a pod it rewrote from device-plugin resource names: the
/// original request (JSON), from which the controller makes the claim templates the pod needs.
pub const ANNOTATION_DEVICE_PLUGIN_REQUEST: &str = "gpu.tessera.dev/device-plugin-request";
/// Label on the ResourceClaimTemplates the controller makes for rewritten pods (value `true`);
/// the controller deletes such a template when no pod uses it.
pub const LABEL_DEVICE_PLUGIN_TEMPLATE: &str = "gpu.tessera.dev/device-plugin-template";
/// Annotation on the claims made from those templates: the device-plugin forms the claim stands
/// for (comma-separated: `nvidia`, `mig`, `time-slicing`, `baidu`, `aliyun`, `hami`), read by
/// the node to give the container the environment those products set.
pub const ANNOTATION_DEVICE_PLUGIN_FORMS: &str = "gpu.tessera.dev/device-plugin-forms";
/// Value of [`LABEL_MANAGED_BY`] on the objects the controller creates.
pub const CONTROLLER_MANAGER: &str = "tessera-controller";
/// Pod label that keeps a pod's device-plugin resource names as they are (value `true`): the
/// webhook leaves the pod to a device plugin still running on some nodes during a migration.
pub const LABEL_KEEP_DEVICE_PLUGIN_NAMES: &str = "gpu.tessera.dev/keep-device-plugin-names";
/// Reason of the Warning Event on a pod whose processes used more GPU memory than their claim
/// booked, and which lost processes for it; the message names the claim, the booking and the use.
pub const REASON_GPU_MEMORY_OVER_BOOKING: &str = "GpuMemoryOverBooking";
/// Component name the kubelet plugin reports in Events.
pub const KUBELET_PLUGIN_COMPONENT: &str = "tessera-kubelet-plugin";
