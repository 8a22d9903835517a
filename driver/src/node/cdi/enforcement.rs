//! What each share-enforcement backend puts into a container, and the MPS daemon a claim
//! needs (the daemon's type and id are the MPS module's, `crate::node::mps`). See `docs/cdi.md` for the reasoning behind every edit.

use std::fmt::Write as _;

use crate::error::Result;
use crate::node::host_dir::HostDir;
use crate::rules::config::Tier;

use super::spec::{ContainerEdits, Mount};
use super::{CudaDevice, check};
use crate::node::mps::{MpsDaemon, mps_user_daemon_id};

/// Where the MPS pipe directory of a claim's daemon appears in the container.
pub const MPS_PIPE_DIR_IN_CONTAINER: &str = "/tmp/nvidia-mps";
/// MPS clients and their server exchange memory through `/dev/shm`.
pub const MPS_SHM_IN_CONTAINER: &str = "/dev/shm";
/// Where the HAMi-core library appears in the container.
pub const HAMI_LIBRARY_IN_CONTAINER: &str = "/usr/local/tessera/hami/libvgpu.so";
/// Where the claim's HAMi-core cache directory appears in the container.
pub const HAMI_CACHE_DIR_IN_CONTAINER: &str = "/run/tessera/hami";
/// The HAMi-core shared accounting file, inside [`HAMI_CACHE_DIR_IN_CONTAINER`].
pub const HAMI_CACHE_FILE_IN_CONTAINER: &str = "/run/tessera/hami/vgpu.cache";
/// HAMi-core's lock directory, a fixed path inside the library.
pub const HAMI_LOCK_DIR_IN_CONTAINER: &str = "/tmp/vgpulock";

const MIB: u64 = 1 << 20;

/// `CUDA_MPS_CLIENT_PRIORITY` of a tier: 0 is MPS's normal priority, 1 its below-normal one.
pub const fn mps_client_priority(tier: Tier) -> u8 {
    match tier {
        Tier::Online => 0,
        Tier::Batch => 1,
    }
}

/// HAMi-core's `CUDA_TASK_PRIORITY` of a tier: 0 is its high priority, 1 its low one (and
/// the library's default when the variable is unset).
pub const fn hami_task_priority(tier: Tier) -> u8 {
    match tier {
        Tier::Online => 0,
        Tier::Batch => 1,
    }
}

/// How a node enforces shares inside containers; chosen by the admin per node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Enforcement {
    /// NVIDIA MPS: one control daemon per shared GPU set, started by the kubelet plugin.
    Mps {
        /// Host directory under which each daemon gets `<id>/pipe` and `<id>/shm`.
        pipe_dir_root: String,
        /// Host directory under which each daemon logs to `<id>`.
        log_dir_root: String,
    },
    /// HAMi-core's `libvgpu.so`, preloaded into every process of the container.
    HamiCore {
        /// Host path of the installed `libvgpu.so`.
        library_path: String,
        /// Host directory under which each claim gets its directory `<claim uid>`, holding
        /// the accounting directory `cache` and the lock directory `vgpulock` its containers
        /// write.
        cache_dir: String,
    },
    /// Time-slicing: shares are bookkeeping only, nothing is limited in the container.
    None,
}

impl Enforcement {
    /// Checks the admin's paths: absolute, normalised, and made of plain characters only.
    pub(super) fn validate(&self, claim: &str) -> Result<()> {
        let paths = match self {
            Self::Mps {
                pipe_dir_root,
                log_dir_root,
            } => [
                ("mps.pipeDirRoot", pipe_dir_root),
                ("mps.logDirRoot", log_dir_root),
            ],
            Self::HamiCore {
                library_path,
                cache_dir,
            } => [
                ("hamiCore.libraryPath", library_path),
                ("hamiCore.cacheDir", cache_dir),
            ],
            Self::None => return Ok(()),
        };
        paths
            .into_iter()
            .try_for_each(|(field, path)| check::host_path(claim, field, path))
    }
}

pub(super) fn mps_daemon(
    pipe_dir_root: &str,
    log_dir_root: &str,
    devices: &[CudaDevice],
    user: Option<u32>,
) -> MpsDaemon {
    let uuids: Vec<String> = devices.iter().map(|d| d.uuid.clone()).collect();
    let id = mps_user_daemon_id(&uuids, user);
    MpsDaemon {
        pipe_dir: format!("{}/{id}/pipe", pipe_dir_root.trim_end_matches('/')),
        shm_dir: format!("{}/{id}/shm", pipe_dir_root.trim_end_matches('/')),
        log_dir: format!("{}/{id}", log_dir_root.trim_end_matches('/')),
        id,
        devices: uuids,
        user,
    }
}

/// The smallest non-zero compute percent: one value covers every device of a process, and
/// the smallest never lets a device use more than its grant (0 means not isolated).
fn thread_percent(devices: &[CudaDevice]) -> Option<i64> {
    devices
        .iter()
        .filter_map(|d| d.share)
        .map(|s| s.compute_percent)
        .filter(|&c| c > 0)
        .min()
}

/// Calls `each(ordinal, MiB)` for every shared device, ordinals counted over all devices.
fn per_ordinal(devices: &[CudaDevice], mut each: impl FnMut(usize, u64)) {
    for (ordinal, d) in devices.iter().enumerate() {
        if let Some(share) = d.share {
            each(ordinal, share.memory_bytes / MIB);
        }
    }
}

/// The variable that tells a workload its memory limit in bytes: the smallest limit of the
/// claim's shared devices (for a one-GPU share, its limit). Under MPS `cudaMemGetInfo` reports
/// the whole GPU as total, so frameworks that size their pools from it over-ask.
pub const MEMORY_LIMIT_ENV: &str = "TESSERA_GPU_MEMORY_LIMIT_BYTES";

/// `TESSERA_GPU_MEMORY_LIMIT_BYTES_<ordinal>=<bytes>` for every shared device, and
/// [`MEMORY_LIMIT_ENV`] with the smallest of them; nothing when the claim holds no share.
pub(super) fn memory_limit_env(devices: &[CudaDevice]) -> Vec<String> {
    let mut env = Vec::new();
    let mut smallest: Option<u64> = None;
    for (ordinal, d) in devices.iter().enumerate() {
        if let Some(share) = d.share {
            env.push(format!(
                "{MEMORY_LIMIT_ENV}_{ordinal}={}",
                share.memory_bytes
            ));
            smallest = Some(smallest.map_or(share.memory_bytes, |s| s.min(share.memory_bytes)));
        }
    }
    if let Some(bytes) = smallest {
        env.insert(0, format!("{MEMORY_LIMIT_ENV}={bytes}"));
    }
    env
}

pub(super) fn mps_edits(daemon: &MpsDaemon, devices: &[CudaDevice], tier: Tier) -> ContainerEdits {
    let mut env = vec![
        format!("CUDA_MPS_PIPE_DIRECTORY={MPS_PIPE_DIR_IN_CONTAINER}"),
        format!("CUDA_MPS_CLIENT_PRIORITY={}", mps_client_priority(tier)),
    ];
    if let Some(pct) = thread_percent(devices) {
        env.push(format!("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={pct}"));
    }
    let mut limits = String::new();
    per_ordinal(devices, |ordinal, mib| {
        if !limits.is_empty() {
            limits.push(',');
        }
        let _ = write!(limits, "{ordinal}={mib}M");
    });
    if !limits.is_empty() {
        env.push(format!("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={limits}"));
    }
    ContainerEdits {
        env,
        mounts: vec![
            bind(&daemon.pipe_dir, MPS_PIPE_DIR_IN_CONTAINER, "rw", true),
            bind(&daemon.shm_dir, MPS_SHM_IN_CONTAINER, "rw", false),
        ],
        ..ContainerEdits::default()
    }
}

/// The claim's HAMi-core directories, each after the one it lies in: its own directory
/// `<cache_dir>/<claim uid>` (the node's, never mounted into a container), and inside it, side by
/// side so that neither lies inside the other (see [`super::binds`]), the accounting directory
/// `cache` (mounted read-write at [`HAMI_CACHE_DIR_IN_CONTAINER`]) and the lock directory
/// `vgpulock` (at [`HAMI_LOCK_DIR_IN_CONTAINER`]).
pub(super) fn hami_dirs(cache_dir: &str, uid: &str) -> Vec<HostDir> {
    vec![
        HostDir::node(cache_dir, uid),
        HostDir::container(cache_dir, &format!("{uid}/cache")),
        HostDir::container(cache_dir, &format!("{uid}/vgpulock")),
    ]
}

pub(super) fn hami_edits(
    library_path: &str,
    cache_dir: &str,
    uid: &str,
    devices: &[CudaDevice],
    tier: Tier,
) -> ContainerEdits {
    let dirs = hami_dirs(cache_dir, uid);
    let uuids: Vec<&str> = devices.iter().map(|d| d.uuid.as_str()).collect();
    let mut env = vec![
        format!("CUDA_VISIBLE_DEVICES={}", uuids.join(",")),
        format!("LD_PRELOAD={HAMI_LIBRARY_IN_CONTAINER}"),
        format!("CUDA_DEVICE_MEMORY_SHARED_CACHE={HAMI_CACHE_FILE_IN_CONTAINER}"),
        format!("CUDA_TASK_PRIORITY={}", hami_task_priority(tier)),
    ];
    per_ordinal(devices, |ordinal, mib| {
        env.push(format!("CUDA_DEVICE_MEMORY_LIMIT_{ordinal}={mib}m"));
    });
    if let Some(pct) = thread_percent(devices) {
        env.push(format!("CUDA_DEVICE_SM_LIMIT={pct}"));
    }
    ContainerEdits {
        env,
        mounts: vec![
            bind(library_path, HAMI_LIBRARY_IN_CONTAINER, "ro", false),
            bind(&dirs[1].path, HAMI_CACHE_DIR_IN_CONTAINER, "rw", true),
            bind(&dirs[2].path, HAMI_LOCK_DIR_IN_CONTAINER, "rw", true),
        ],
        ..ContainerEdits::default()
    }
}

fn bind(host: &str, container: &str, access: &str, noexec: bool) -> Mount {
    let mut options = vec![access.to_owned(), "nosuid".into(), "nodev".into()];
    if noexec {
        options.push("noexec".into());
    }
    options.push("bind".into());
    Mount {
        host_path: host.to_owned(),
        container_path: container.to_owned(),
        options,
        mount_type: None,
    }
}
