//! The CDI spec of a prepared claim.
//!
//! The kubelet plugin prepares a claim by writing one transient CDI spec for it (kind
//! [`names::CDI_KIND`], file [`spec_file_name`]) and returning [`device_ids`] to the kubelet.
//! [`build_spec`] decides everything that goes into that file, as a pure function of typed
//! input: the claim's devices as discovery saw them, each device's share as the allocator
//! resolved it ([`PerDeviceShare`]), and the node's [`Enforcement`] backend. No string from a
//! user's opaque config reaches the spec; every number and path is re-checked here, and a bad
//! one is an [`Error::Cdi`] naming the claim and the rule.
//!
//! Layout of a spec:
//! * one CDI device per distinct allocated device, named `<claim uid>-<device>`, carrying the
//!   device nodes of that GPU or MIG instance;
//! * claim-wide edits, applied when the container gets any of the claim's devices:
//!   `NVIDIA_VISIBLE_DEVICES`, the control device nodes, and the enforcement backend's
//!   settings, so a container given all the claim's devices sees one consistent environment.
//!
//! The backend's settings include the claim's kernel priority, from the tiers of its shares:
//! the higher one only when every share of the claim is online (one process has one priority,
//! so a claim that holds any batch share runs all its work at the lower one).
//!
//! `docs/cdi.md` explains what each backend injects and why.

pub mod binds;
mod check;
pub mod device_plugin_env;
mod enforcement;
mod spec;

use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::names;
use crate::node::host_dir::HostDir;
use crate::node::mps::MpsDaemon;
use crate::node::prepared::{PreparedClaim, PreparedDevice};
use crate::rules::config::Tier;
use crate::rules::share::PerDeviceShare;

pub use enforcement::{
    Enforcement, HAMI_CACHE_DIR_IN_CONTAINER, HAMI_CACHE_FILE_IN_CONTAINER,
    HAMI_LIBRARY_IN_CONTAINER, HAMI_LOCK_DIR_IN_CONTAINER, MEMORY_LIMIT_ENV,
    MPS_PIPE_DIR_IN_CONTAINER, MPS_SHM_IN_CONTAINER, hami_task_priority, mps_client_priority,
};
pub use spec::{CDI_VERSION, CdiDevice, CdiSpec, ContainerEdits, DeviceNode, Hook, Mount};

/// Spec annotation: the claim as `namespace/name` (annotations never reach the container).
pub const ANNOTATION_CLAIM: &str = "gpu.tessera.dev/claim";
/// Spec annotation: the claim's UID.
pub const ANNOTATION_CLAIM_UID: &str = "gpu.tessera.dev/claim-uid";

/// Control nodes every CUDA container needs besides its GPUs.
const CONTROL_NODES: [&str; 3] = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"];
/// `/dev/nvidia-modeset` is minor 254 and `/dev/nvidiactl` 255; GPUs use the minors below.
const MAX_GPU_MINOR: u32 = 253;
/// Minors 1 and 2 of `nvidia-caps` are the MIG config and monitor capabilities; instance
/// access capabilities start at 3.
const MIN_MIG_CAP_MINOR: u32 = 3;
const MIB: u64 = 1 << 20;

/// A device as CUDA in the container numbers it: a GPU or MIG instance, with the claim's total
/// share of it (`None`: the whole device).
#[derive(Debug, Clone, PartialEq, Eq)]
struct CudaDevice {
    uuid: String,
    share: Option<PerDeviceShare>,
}

/// The validated shape of a claim: its distinct devices and the CUDA devices they expose.
struct Plan<'a> {
    /// Distinct devices by first appearance, keyed on their name.
    devices: Vec<&'a PreparedDevice>,
    /// CUDA devices in ordinal order (sorted by UUID).
    cuda: Vec<CudaDevice>,
    /// The claim's tier: batch when any of its shares is batch, else online.
    tier: Tier,
    /// Whether any share may use more memory than it is guaranteed (needs `hami-core`).
    memory_overcommitted: bool,
}

impl PreparedClaim {
    /// `namespace/name`, printable whatever the fields hold, for error messages.
    fn display_name(&self) -> String {
        format!(
            "{}/{}",
            self.namespace.escape_debug(),
            self.name.escape_debug()
        )
    }
}

fn cuda_uuid(d: &PreparedDevice) -> &str {
    d.mig
        .as_ref()
        .map_or(d.gpu.uuid.as_str(), |m| m.uuid.as_str())
}

fn check_share(who: &str, field: &str, share: &PerDeviceShare) -> Result<()> {
    let PerDeviceShare {
        memory_bytes,
        compute_percent,
    } = *share;
    if memory_bytes < MIB || memory_bytes % MIB != 0 {
        return Err(check::err(
            who,
            format!("{field}.memory {memory_bytes} bytes must be a positive whole number of MiB"),
        ));
    }
    if !(0..=100).contains(&compute_percent)
        || compute_percent % crate::rules::share::COMPUTE_STEP != 0
    {
        return Err(check::err(
            who,
            format!(
                "{field}.compute {compute_percent} must be 0 (not isolated) to 100 in steps of {}",
                crate::rules::share::COMPUTE_STEP
            ),
        ));
    }
    Ok(())
}

fn check_device(who: &str, field: &str, d: &PreparedDevice) -> Result<()> {
    check::request(who, &format!("{field}.request"), &d.request)?;
    check::pool(who, &format!("{field}.pool"), &d.pool)?;
    check::device(who, &format!("{field}.device"), &d.device)?;
    check::nvidia_uuid(who, &format!("{field}.gpu.uuid"), "GPU-", &d.gpu.uuid)?;
    if d.gpu.minor > MAX_GPU_MINOR {
        return Err(check::err(
            who,
            format!(
                "{field}.gpu.minor {} is above {MAX_GPU_MINOR}, the last minor of a GPU node",
                d.gpu.minor
            ),
        ));
    }
    if let Some(mig) = &d.mig {
        check::nvidia_uuid(who, &format!("{field}.mig.uuid"), "MIG-", &mig.uuid)?;
        let caps = [mig.gpu_instance_cap_minor, mig.compute_instance_cap_minor];
        if caps.iter().any(|&c| c < MIN_MIG_CAP_MINOR) || caps[0] == caps[1] {
            return Err(check::err(
                who,
                format!(
                    "{field}.mig capability minors {caps:?} must be two different minors of at \
                     least {MIN_MIG_CAP_MINOR}"
                ),
            ));
        }
        if d.share.is_some() {
            return Err(check::err(
                who,
                format!("{field} is a MIG instance with a share: shares apply to whole GPUs only"),
            ));
        }
    }
    if let Some(share) = &d.share {
        check_share(who, &format!("{field}.share"), share)?;
    }
    Ok(())
}

impl<'a> Plan<'a> {
    fn new(claim: &'a PreparedClaim) -> Result<Self> {
        let who = claim.display_name();
        check::uid(&who, &claim.uid)?;
        check::namespace(&who, &claim.namespace)?;
        check::object_name(&who, &claim.name)?;
        if claim.devices.is_empty() {
            return Err(check::err(&who, "devices: a prepared claim has no devices"));
        }
        let mut by_name: BTreeMap<&str, &PreparedDevice> = BTreeMap::new();
        let mut devices = Vec::new();
        let mut owner_of_uuid: BTreeMap<&str, &str> = BTreeMap::new();
        let mut uuid_of_minor: BTreeMap<u32, &str> = BTreeMap::new();
        let mut cuda: BTreeMap<&str, Option<PerDeviceShare>> = BTreeMap::new();
        let mut tier = Tier::Online;
        let mut memory_overcommitted = false;
        for (i, d) in claim.devices.iter().enumerate() {
            let field = format!("devices[{i}]");
            check_device(&who, &field, d)?;
            if d.share.is_some() {
                tier = tier.max(d.tier);
                memory_overcommitted |= d.memory_overcommitted;
            }
            if let Some(first) = by_name.get(d.device.as_str()) {
                if first.pool != d.pool || first.gpu != d.gpu || first.mig != d.mig {
                    return Err(check::err(
                        &who,
                        format!(
                            "{field}: device {:?} appears twice with a different pool or GPU",
                            d.device
                        ),
                    ));
                }
            } else {
                by_name.insert(&d.device, d);
                devices.push(d);
            }
            let uuid = cuda_uuid(d);
            if let Some(owner) = owner_of_uuid.insert(uuid, &d.device)
                && owner != d.device
            {
                return Err(check::err(
                    &who,
                    format!(
                        "{field}: devices {owner:?} and {:?} are both {uuid}",
                        d.device
                    ),
                ));
            }
            if let Some(other) = uuid_of_minor.insert(d.gpu.minor, &d.gpu.uuid)
                && other != d.gpu.uuid
            {
                return Err(check::err(
                    &who,
                    format!(
                        "{field}: GPUs {other} and {} both use minor {}",
                        d.gpu.uuid, d.gpu.minor
                    ),
                ));
            }
            let total = match (cuda.get(uuid), d.share) {
                (None, share) => share,
                (Some(None), None) => None,
                (Some(Some(a)), Some(b)) => Some(add_shares(&who, &field, uuid, a, &b)?),
                (Some(_), _) => {
                    return Err(check::err(
                        &who,
                        format!("{field}: {uuid} is allocated both whole and as a share"),
                    ));
                }
            };
            cuda.insert(uuid, total);
        }
        let cuda = cuda
            .into_iter()
            .map(|(uuid, share)| CudaDevice {
                uuid: uuid.to_owned(),
                share,
            })
            .collect();
        Ok(Self {
            devices,
            cuda,
            tier,
            memory_overcommitted,
        })
    }

    fn has_shares(&self) -> bool {
        self.cuda.iter().any(|d| d.share.is_some())
    }
}

/// Two shares of one GPU in the same claim (two requests) add up: the claim's processes share
/// one budget on that GPU.
fn add_shares(
    who: &str,
    field: &str,
    uuid: &str,
    a: &PerDeviceShare,
    b: &PerDeviceShare,
) -> Result<PerDeviceShare> {
    let memory_bytes = a.memory_bytes.checked_add(b.memory_bytes).ok_or_else(|| {
        check::err(
            who,
            format!("{field}: the shares of {uuid} overflow memory"),
        )
    })?;
    let compute_percent = a.compute_percent + b.compute_percent;
    if compute_percent > 100 {
        return Err(check::err(
            who,
            format!("{field}: the shares of {uuid} add up to compute {compute_percent}, over 100"),
        ));
    }
    Ok(PerDeviceShare {
        memory_bytes,
        compute_percent,
    })
}

/// The CDI device name of `device` in the claim `uid`.
fn cdi_device_name(uid: &str, device: &str) -> String {
    format!("{uid}-{device}")
}

fn device_nodes(d: &PreparedDevice) -> Vec<DeviceNode> {
    let mut nodes = vec![DeviceNode::at(format!("/dev/nvidia{}", d.gpu.minor))];
    if let Some(mig) = &d.mig {
        for cap in [mig.gpu_instance_cap_minor, mig.compute_instance_cap_minor] {
            nodes.push(DeviceNode::at(format!("/dev/nvidia-caps/nvidia-cap{cap}")));
        }
    }
    nodes
}

/// Everything the node makes for a prepared claim, decided at once: the CDI spec, the host
/// directories to create before its containers start (and remove at unprepare), and the MPS
/// daemon its containers connect to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    /// The claim's CDI spec.
    pub spec: CdiSpec,
    /// Host directories of the claim, each after the one it lies in (HAMi-core's per-claim
    /// directory, then the accounting and lock directories inside it).
    pub host_dirs: Vec<HostDir>,
    /// The MPS control daemon of the claim's GPUs, when the node enforces with MPS and the
    /// claim holds a share; the kubelet plugin starts it before answering kubelet.
    pub mps_daemon: Option<MpsDaemon>,
}

/// Renders a prepared claim for a node enforcing shares with `enforcement`.
///
/// Whole GPUs and MIG instances get their device nodes only; when the claim holds at least one
/// share, the backend's settings are added claim-wide (none for [`Enforcement::None`]). Under
/// MPS the claim's daemon serves any user ([`render_for_user`] names one).
pub fn render(claim: &PreparedClaim, enforcement: &Enforcement) -> Result<Rendered> {
    render_for_user(claim, enforcement, None)
}

/// [`render`], where under MPS the claim's daemon is the one of its GPU set for the Unix user
/// `mps_user` its containers run as (`crate::node::mps_user`; `None`: any user).
pub fn render_for_user(
    claim: &PreparedClaim,
    enforcement: &Enforcement,
    mps_user: Option<u32>,
) -> Result<Rendered> {
    let who = claim.display_name();
    let plan = Plan::new(claim)?;
    enforcement.validate(&who)?;
    let mut mps_daemon = None;
    let mut host_dirs = Vec::new();

    let devices = plan
        .devices
        .iter()
        .map(|d| CdiDevice {
            name: cdi_device_name(&claim.uid, &d.device),
            annotations: BTreeMap::new(),
            container_edits: ContainerEdits {
                device_nodes: device_nodes(d),
                ..ContainerEdits::default()
            },
        })
        .collect();

    let uuids: Vec<&str> = plan.cuda.iter().map(|d| d.uuid.as_str()).collect();
    let mut edits = ContainerEdits {
        env: vec![format!("NVIDIA_VISIBLE_DEVICES={}", uuids.join(","))],
        device_nodes: CONTROL_NODES.iter().map(|p| DeviceNode::at(*p)).collect(),
        ..ContainerEdits::default()
    };
    if plan.memory_overcommitted && !matches!(enforcement, Enforcement::HamiCore { .. }) {
        return Err(check::err(
            &who,
            "devices: a batch share may use more memory than it is guaranteed (its class \
             over-commits memory), which only a hami-core node can back (HAMi-core's \
             oversubscription); this node enforces shares otherwise, so the claim is refused \
             rather than given a limit its GPU cannot hold: delete its pod to allocate it again",
        ));
    }
    if plan.has_shares() {
        let backend = match enforcement {
            Enforcement::Mps {
                pipe_dir_root,
                log_dir_root,
            } => {
                let daemon =
                    enforcement::mps_daemon(pipe_dir_root, log_dir_root, &plan.cuda, mps_user);
                let edits = enforcement::mps_edits(&daemon, &plan.cuda, plan.tier);
                mps_daemon = Some(daemon);
                edits
            }
            Enforcement::HamiCore {
                library_path,
                cache_dir,
            } => {
                host_dirs = enforcement::hami_dirs(cache_dir, &claim.uid);
                let mut edits = enforcement::hami_edits(
                    library_path,
                    cache_dir,
                    &claim.uid,
                    &plan.cuda,
                    plan.tier,
                );
                if plan.memory_overcommitted {
                    edits.env.push("CUDA_OVERSUBSCRIBE=true".to_owned());
                }
                edits
            }
            Enforcement::None => ContainerEdits::default(),
        };
        edits.env.extend(enforcement::memory_limit_env(&plan.cuda));
        edits.env.extend(backend.env);
        edits.mounts.extend(backend.mounts);
    }

    let annotations = BTreeMap::from([
        (
            ANNOTATION_CLAIM.to_owned(),
            format!("{}/{}", claim.namespace, claim.name),
        ),
        (ANNOTATION_CLAIM_UID.to_owned(), claim.uid.clone()),
    ]);
    let spec = CdiSpec {
        cdi_version: CDI_VERSION.to_owned(),
        kind: names::CDI_KIND.to_owned(),
        annotations,
        devices,
        container_edits: Some(edits),
    };
    check_tenant_reach(&who, &spec, &host_dirs, mps_daemon.as_ref())?;
    if version_tuple(spec.minimum_version()) > version_tuple(&spec.cdi_version) {
        return Err(Error::Cdi {
            claim: who,
            message: format!(
                "the spec needs CDI {} but declares {}",
                spec.minimum_version(),
                spec.cdi_version
            ),
        });
    }
    Ok(Rendered {
        spec,
        host_dirs,
        mps_daemon,
    })
}

/// Applies [`binds::check_sources`] to a rendered spec: the mounts a container gets (the
/// claim-wide ones with each device's), and the host paths the node uses beside them (the
/// claim's own directories, the MPS daemon's log directory), so that no path the runtime or
/// the node resolves lies where a tenant can put a link.
fn check_tenant_reach(
    who: &str,
    spec: &CdiSpec,
    host_dirs: &[HostDir],
    daemon: Option<&MpsDaemon>,
) -> Result<()> {
    let mounts: Vec<&Mount> = spec
        .container_edits
        .iter()
        .chain(spec.devices.iter().map(|d| &d.container_edits))
        .flat_map(|e| &e.mounts)
        .collect();
    let mounted = |path: &str| mounts.iter().any(|m| m.host_path == path);
    let mut node_paths: Vec<&str> = host_dirs
        .iter()
        .map(|d| d.path.as_str())
        .filter(|p| !mounted(p))
        .collect();
    node_paths.extend(daemon.map(|d| d.log_dir.as_str()));
    binds::check_sources(who, &mounts, &node_paths)?;
    if let Some(dir) = host_dirs
        .iter()
        .find(|d| d.world_writable() && !mounted(&d.path))
    {
        return Err(check::err(
            who,
            format!(
                "host directory {:?} would be world-writable but no mount binds it",
                dir.path
            ),
        ));
    }
    Ok(())
}

/// The CDI spec alone of [`render`].
pub fn build_spec(claim: &PreparedClaim, enforcement: &Enforcement) -> Result<CdiSpec> {
    render(claim, enforcement).map(|r| r.spec)
}

fn version_tuple(v: &str) -> Vec<u64> {
    v.split('.').map(|p| p.parse().unwrap_or(0)).collect()
}

/// The fully qualified CDI device ids of a claim, grouped by request in allocation order
/// (`k8s.gpu.tessera.dev/claim=<uid>-<device>`): what `NodePrepareResources` returns for each
/// device. A device allocated twice to one request is listed once.
pub fn device_ids(claim: &PreparedClaim) -> Vec<(String, Vec<String>)> {
    let mut groups: Vec<(String, Vec<String>)> = Vec::new();
    for d in &claim.devices {
        let id = format!(
            "{}={}",
            names::CDI_KIND,
            cdi_device_name(&claim.uid, &d.device)
        );
        let pos = if let Some(pos) = groups.iter().position(|(r, _)| *r == d.request) {
            pos
        } else {
            groups.push((d.request.clone(), Vec::new()));
            groups.len() - 1
        };
        let group = &mut groups[pos].1;
        if !group.contains(&id) {
            group.push(id);
        }
    }
    groups
}

/// The file name of a claim's transient spec, following the CDI convention for transient specs
/// (`<vendor>-<class>_<id>`, `/` in the id replaced by `_`): `k8s.gpu.tessera.dev-claim_<uid>.json`.
pub fn spec_file_name(claim_uid: &str) -> String {
    format!(
        "{}-{}_{}.json",
        names::CDI_VENDOR,
        names::CDI_CLASS,
        claim_uid.replace('/', "_")
    )
}

#[cfg(test)]
mod tests;
