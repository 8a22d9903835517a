//! The processes NVML lists on each GPU: the [`GpuProcesses`] seam (NVML's is
//! [`crate::gpus::nvml::WrapperLibrary`], the plugin's one NVML handle) and a fake GPU ([`FakeGpu`])
//! whose processes tests start, and whose memory `SIGKILL` and MPS `terminate_client` free, as
//! on the hardware.

#[cfg(any(test, feature = "testing"))]
use std::collections::BTreeMap;
use std::collections::BTreeSet;
#[cfg(any(test, feature = "testing"))]
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::Result;

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

#[cfg(any(test, feature = "testing"))]
/// A fake node's GPUs and processes: tests start processes on GPUs; killing a process or
/// terminating an MPS client frees its memory. Clones share the same GPUs.
#[derive(Debug, Clone, Default)]
pub struct FakeGpu {
    processes: Arc<Mutex<BTreeMap<u32, ProcessUse>>>,
}

#[cfg(any(test, feature = "testing"))]
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

#[cfg(any(test, feature = "testing"))]
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
