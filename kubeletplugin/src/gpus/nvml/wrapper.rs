//! The NVML traits implemented with `nvml-wrapper`, which loads `libnvidia-ml.so.1` at run
//! time; and the processes NVML lists ([`GpuProcesses`]) through the same handle.

use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::path::Path;
use std::time::Duration;

use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::ProcessInfo;
use tracing::warn;

use super::{NvmlDevice, NvmlEvents, NvmlLibrary, XidEvent};
use crate::accounting::{GpuProcesses, ProcessUse};
use crate::error::{Error, NvmlErrorKind, Result};

fn kind_of(e: &NvmlError) -> NvmlErrorKind {
    match e {
        NvmlError::LibloadingError(_)
        | NvmlError::DriverNotLoaded
        | NvmlError::LibraryNotFound
        | NvmlError::FailedToLoadSymbol(_)
        | NvmlError::Uninitialized
        | NvmlError::NoPermission => NvmlErrorKind::Unavailable,
        NvmlError::NotSupported | NvmlError::FunctionNotFound => NvmlErrorKind::NotSupported,
        NvmlError::NotFound | NvmlError::InvalidArg => NvmlErrorKind::NotFound,
        NvmlError::GpuLost => NvmlErrorKind::GpuLost,
        NvmlError::Timeout => NvmlErrorKind::Timeout,
        _ => NvmlErrorKind::Other,
    }
}

fn nvml_err(call: &'static str) -> impl Fn(NvmlError) -> Error {
    move |e| Error::Nvml {
        call,
        kind: kind_of(&e),
        message: e.to_string(),
    }
}

/// NVML through `nvml-wrapper`.
pub struct WrapperLibrary {
    nvml: Nvml,
}

impl std::fmt::Debug for WrapperLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WrapperLibrary").finish_non_exhaustive()
    }
}

impl WrapperLibrary {
    /// Loads and initialises NVML from `library` (a file name searched the usual way, or a
    /// path). A node without the NVIDIA driver gets an error that says so.
    pub fn open(library: &Path) -> Result<Self> {
        let nvml = Nvml::builder()
            .lib_path(OsStr::new(library.as_os_str()))
            .init()
            .map_err(|e| Error::Nvml {
                call: "nvmlInit",
                kind: NvmlErrorKind::Unavailable,
                message: format!(
                    "cannot load NVML from {}: {e}; is the NVIDIA driver installed and its \
                     library mounted into the plugin's container? (--nvml-library names \
                     another path; --gpu-backend fake runs without GPUs)",
                    library.display()
                ),
            })?;
        Ok(Self { nvml })
    }
}

struct WrapperDevice<'n>(nvml_wrapper::Device<'n>);

impl NvmlDevice for WrapperDevice<'_> {
    fn name(&self) -> Result<String> {
        self.0.name().map_err(nvml_err("nvmlDeviceGetName"))
    }
    fn uuid(&self) -> Result<String> {
        self.0.uuid().map_err(nvml_err("nvmlDeviceGetUUID"))
    }
    fn brand(&self) -> Result<String> {
        self.0
            .brand()
            .map(|b| tessera_driver::node::inventory::brand::brand_name(b.as_c()).to_owned())
            .map_err(nvml_err("nvmlDeviceGetBrand"))
    }
    fn architecture(&self) -> Result<String> {
        self.0
            .architecture()
            .map(|a| a.to_string())
            .map_err(nvml_err("nvmlDeviceGetArchitecture"))
    }
    fn compute_capability(&self) -> Result<(i32, i32)> {
        self.0
            .cuda_compute_capability()
            .map(|c| (c.major, c.minor))
            .map_err(nvml_err("nvmlDeviceGetCudaComputeCapability"))
    }
    fn memory_total(&self) -> Result<u64> {
        self.0
            .memory_info()
            .map(|m| m.total)
            .map_err(nvml_err("nvmlDeviceGetMemoryInfo"))
    }
    fn attributes(&self) -> Result<(u32, u32)> {
        self.0
            .attributes()
            .map(|a| (a.multiprocessor_count, a.gpu_instance_slice_count))
            .map_err(nvml_err("nvmlDeviceGetAttributes"))
    }
    fn pci_bus_id(&self) -> Result<String> {
        self.0
            .pci_info()
            .map(|p| p.bus_id)
            .map_err(nvml_err("nvmlDeviceGetPciInfo"))
    }
    fn numa_node(&self) -> Result<u32> {
        self.0
            .numa_node_id()
            .map_err(nvml_err("nvmlDeviceGetNumaNodeId"))
    }
    fn minor_number(&self) -> Result<u32> {
        self.0
            .minor_number()
            .map_err(nvml_err("nvmlDeviceGetMinorNumber"))
    }
    // nvml-wrapper 0.13 has no safe method for these two: `tessera-nvml-mig-ids` makes the
    // raw calls (the workspace's one crate allowed `unsafe`).
    fn gpu_instance_id(&self) -> Result<u32> {
        tessera_nvml_mig_ids::gpu_instance_id(&self.0)
            .map_err(nvml_err("nvmlDeviceGetGpuInstanceId"))
    }
    fn compute_instance_id(&self) -> Result<u32> {
        tessera_nvml_mig_ids::compute_instance_id(&self.0)
            .map_err(nvml_err("nvmlDeviceGetComputeInstanceId"))
    }
    fn mig_enabled(&self) -> Result<bool> {
        self.0
            .mig_mode()
            .map(|m| m.current == 1)
            .map_err(nvml_err("nvmlDeviceGetMigMode"))
    }
    fn max_mig_devices(&self) -> Result<u32> {
        self.0
            .mig_device_count()
            .map_err(nvml_err("nvmlDeviceGetMaxMigDeviceCount"))
    }
    fn mig_device(&self, index: u32) -> Result<Box<dyn NvmlDevice + '_>> {
        self.0
            .mig_device_by_index(index)
            .map(|d| Box::new(WrapperDevice(d)) as Box<dyn NvmlDevice + '_>)
            .map_err(nvml_err("nvmlDeviceGetMigDeviceHandleByIndex"))
    }
    fn nvlink_remote(&self, link: u32) -> Result<Option<String>> {
        let link = self.0.link_wrapper_for(link);
        if !link
            .is_active()
            .map_err(nvml_err("nvmlDeviceGetNvLinkState"))?
        {
            return Ok(None);
        }
        link.remote_pci_info()
            .map(|p| Some(p.bus_id))
            .map_err(nvml_err("nvmlDeviceGetNvLinkRemotePciInfo"))
    }
}

struct WrapperEvents<'n> {
    set: nvml_wrapper::EventSet<'n>,
}

impl NvmlEvents for WrapperEvents<'_> {
    fn wait(&mut self, timeout: Duration) -> Result<Option<XidEvent>> {
        let ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
        match self.set.wait(ms) {
            Ok(data) => {
                let uuid = data.device.uuid().map_err(nvml_err("nvmlDeviceGetUUID"))?;
                // NVML reports "unknown" when it cannot say which XID: count it as fatal
                // (the health model takes unknown XIDs as fatal) with an XID no table uses.
                let xid = match data.event_data {
                    Some(XidError::Value(x)) => x,
                    Some(XidError::Unknown) | None => u64::MAX,
                };
                Ok(Some(XidEvent { uuid, xid }))
            }
            Err(NvmlError::Timeout) => Ok(None),
            Err(e) => Err(nvml_err("nvmlEventSetWait")(e)),
        }
    }
}

impl NvmlLibrary for WrapperLibrary {
    fn driver_version(&self) -> Result<String> {
        self.nvml
            .sys_driver_version()
            .map_err(nvml_err("nvmlSystemGetDriverVersion"))
    }
    fn cuda_driver_version(&self) -> Result<i32> {
        self.nvml
            .sys_cuda_driver_version()
            .map_err(nvml_err("nvmlSystemGetCudaDriverVersion"))
    }
    fn device_count(&self) -> Result<u32> {
        self.nvml
            .device_count()
            .map_err(nvml_err("nvmlDeviceGetCount"))
    }
    fn device(&self, index: u32) -> Result<Box<dyn NvmlDevice + '_>> {
        self.nvml
            .device_by_index(index)
            .map(|d| Box::new(WrapperDevice(d)) as Box<dyn NvmlDevice + '_>)
            .map_err(nvml_err("nvmlDeviceGetHandleByIndex"))
    }
    fn events(&self) -> Result<Box<dyn NvmlEvents + '_>> {
        // A GPU that cannot report XIDs is left out; registering it would spoil the set.
        let count = self.device_count()?;
        let mut skip = BTreeSet::new();
        'retry: loop {
            let mut set = self
                .nvml
                .create_event_set()
                .map_err(nvml_err("nvmlEventSetCreate"))?;
            for index in (0..count).filter(|i| !skip.contains(i)) {
                let device = self
                    .nvml
                    .device_by_index(index)
                    .map_err(nvml_err("nvmlDeviceGetHandleByIndex"))?;
                match device.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
                    Ok(s) => set = s,
                    Err(e) => {
                        warn!(gpu = index, error = %e.error, "GPU cannot report XID events; its health comes from queries only");
                        skip.insert(index);
                        continue 'retry;
                    }
                }
            }
            return Ok(Box::new(WrapperEvents { set }));
        }
    }
}

fn used(info: &ProcessInfo) -> u64 {
    match info.used_gpu_memory {
        UsedGpuMemory::Used(bytes) => bytes,
        // Only Windows' WDDM reports no value.
        UsedGpuMemory::Unavailable => 0,
    }
}

impl GpuProcesses for WrapperLibrary {
    fn list(&self, gpus: &BTreeSet<String>) -> Result<Vec<ProcessUse>> {
        let mut out = Vec::new();
        for uuid in gpus {
            let device = self
                .nvml
                .device_by_uuid(uuid.as_str())
                .map_err(nvml_err("nvmlDeviceGetHandleByUUID"))?;
            let mut infos = device
                .running_compute_processes()
                .map_err(nvml_err("nvmlDeviceGetComputeRunningProcesses"))?;
            // MPS clients; a GPU or driver without MPS says "not supported".
            match device.mps_running_compute_processes() {
                Ok(mps) => infos.extend(mps),
                Err(NvmlError::NotSupported | NvmlError::FunctionNotFound) => {}
                Err(e) => return Err(nvml_err("nvmlDeviceGetMPSComputeRunningProcesses")(e)),
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
