//! The processes NVML lists on each GPU: the [`GpuProcesses`] seam, NVML ([`NvmlProcesses`])
//! and a fake GPU ([`FakeGpu`]) whose processes tests start, and whose memory `SIGKILL` and MPS
//! `terminate_client` free, as on the hardware.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::ProcessInfo;

use crate::error::{Error, NvmlErrorKind, Result};

/// One process on one GPU, as NVML lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessUse {
    /// The GPU's UUID.
    pub gpu_uuid: String,
    /// The process's pid (host PID namespace).
    pub pid: u32,
    /// GPU memory it holds, in bytes.
    pub used_bytes: u64,
}

/// The processes running on GPUs.
pub trait GpuProcesses: Send + Sync {
    /// The processes on each of `gpus` (UUIDs); a GPU NVML does not know is an error. A
    /// process may be listed twice (NVML's plain and MPS lists): the rule counts it once.
    fn list(&self, gpus: &BTreeSet<String>) -> Result<Vec<ProcessUse>>;
}

/// NVML's view, through its own handle on `libnvidia-ml.so.1` (NVML counts its users).
pub struct NvmlProcesses {
    nvml: Nvml,
}

impl std::fmt::Debug for NvmlProcesses {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlProcesses").finish_non_exhaustive()
    }
}

fn nvml_err(call: &'static str, e: &NvmlError) -> Error {
    Error::Nvml {
        call,
        kind: match e {
            NvmlError::NotSupported | NvmlError::FunctionNotFound => NvmlErrorKind::NotSupported,
            NvmlError::NotFound | NvmlError::InvalidArg => NvmlErrorKind::NotFound,
            NvmlError::GpuLost => NvmlErrorKind::GpuLost,
            _ => NvmlErrorKind::Other,
        },
        message: e.to_string(),
    }
}

impl NvmlProcesses {
    /// Loads NVML from `library`.
    pub fn open(library: &Path) -> Result<Self> {
        let nvml = Nvml::builder()
            .lib_path(OsStr::new(library.as_os_str()))
            .init()
            .map_err(|e| Error::Nvml {
                call: "nvmlInit",
                kind: NvmlErrorKind::Unavailable,
                message: format!("cannot load NVML from {}: {e}", library.display()),
            })?;
        Ok(Self { nvml })
    }
}

fn used(info: &ProcessInfo) -> u64 {
    match info.used_gpu_memory {
        UsedGpuMemory::Used(bytes) => bytes,
        // Only Windows' WDDM reports no value.
        UsedGpuMemory::Unavailable => 0,
    }
}

impl GpuProcesses for NvmlProcesses {
    fn list(&self, gpus: &BTreeSet<String>) -> Result<Vec<ProcessUse>> {
        let mut out = Vec::new();
        for uuid in gpus {
            let device = self
                .nvml
                .device_by_uuid(uuid.as_str())
                .map_err(|e| nvml_err("nvmlDeviceGetHandleByUUID", &e))?;
            let mut infos = device
                .running_compute_processes()
                .map_err(|e| nvml_err("nvmlDeviceGetComputeRunningProcesses", &e))?;
            // MPS clients; a GPU or driver without MPS says "not supported".
            match device.mps_running_compute_processes() {
                Ok(mps) => infos.extend(mps),
                Err(NvmlError::NotSupported | NvmlError::FunctionNotFound) => {}
                Err(e) => return Err(nvml_err("nvmlDeviceGetMPSComputeRunningProcesses", &e)),
            }
            out.extend(infos.iter().map(|info| ProcessUse {
                gpu_uuid: uuid.clone(),
                pid: info.pid,
                used_bytes: used(info),
            }));
        }
        Ok(out)
    }
}

/// A fake node's GPUs and processes: tests start processes on GPUs; killing a process or
/// terminating an MPS client frees its memory. Clones share the same GPUs.
#[derive(Debug, Clone, Default)]
pub struct FakeGpu {
    processes: Arc<Mutex<BTreeMap<u32, ProcessUse>>>,
}

impl FakeGpu {
    /// No processes on any GPU.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<u32, ProcessUse>> {
        self.processes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Process `pid` holds `used_bytes` on `gpu_uuid`.
    pub fn run(&self, pid: u32, gpu_uuid: &str, used_bytes: u64) {
        self.lock().insert(
            pid,
            ProcessUse {
                gpu_uuid: gpu_uuid.to_owned(),
                pid,
                used_bytes,
            },
        );
    }

    /// Process `pid` ended (its memory is free).
    pub fn end(&self, pid: u32) {
        self.lock().remove(&pid);
    }

    /// The pids on any GPU.
    pub fn pids(&self) -> BTreeSet<u32> {
        self.lock().keys().copied().collect()
    }
}

impl GpuProcesses for FakeGpu {
    fn list(&self, gpus: &BTreeSet<String>) -> Result<Vec<ProcessUse>> {
        Ok(self
            .lock()
            .values()
            .filter(|p| gpus.contains(&p.gpu_uuid))
            .cloned()
            .collect())
    }
}
