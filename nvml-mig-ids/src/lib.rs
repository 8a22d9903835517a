//! A MIG device's GPU instance id and compute instance id, from NVML.
//!
//! `nvml-wrapper` 0.13 loads every NVML symbol but offers no safe method for
//! `nvmlDeviceGetGpuInstanceId` and `nvmlDeviceGetComputeInstanceId`. The kubelet plugin
//! needs both: they key the capability minors (`/proc/driver/nvidia-caps/mig-minors`) that
//! grant a container access to one MIG instance and no other. The rest of the workspace
//! forbids unsafe code; this crate holds the two calls, each in two reviewed blocks.
//!
//! A driver too old to export a symbol answers [`NvmlError::FailedToLoadSymbol`], never a
//! panic (the raw binding's own wrapper would panic there, so it is not used).

use std::os::raw::c_uint;

use nvml_wrapper::Device;
use nvml_wrapper::error::{NvmlError, nvml_sym, nvml_try};

/// The id of the GPU instance that MIG device `device` belongs to, on its parent GPU.
///
/// NVML answers `NotSupported` (or `InvalidArg`) for a handle that is not a MIG device.
#[allow(unsafe_code)] // Reason: the raw NVML call nvml-wrapper has no safe method for.
pub fn gpu_instance_id(device: &Device<'_>) -> Result<u32, NvmlError> {
    let call = nvml_sym(device.nvml().lib().nvmlDeviceGetGpuInstanceId.as_ref())?;
    // SAFETY: the raw handle is only passed to NVML below, while `device` (and the `Nvml`
    // it borrows, which keeps the library loaded and initialised) is still borrowed here.
    let handle = unsafe { device.handle() };
    let mut id: c_uint = 0;
    // SAFETY: `call` is `nvmlDeviceGetGpuInstanceId`, loaded from the library the handle
    // came from, with the signature NVML documents; `handle` is live (above); `id` is a
    // valid, aligned `unsigned int` that NVML writes and does not keep.
    let code = unsafe { call(handle, &raw mut id) };
    nvml_try(code)?;
    Ok(id)
}

/// The id of the compute instance that MIG device `device` is, within its GPU instance.
///
/// NVML answers `NotSupported` (or `InvalidArg`) for a handle that is not a MIG device.
#[allow(unsafe_code)] // Reason: the raw NVML call nvml-wrapper has no safe method for.
pub fn compute_instance_id(device: &Device<'_>) -> Result<u32, NvmlError> {
    let call = nvml_sym(device.nvml().lib().nvmlDeviceGetComputeInstanceId.as_ref())?;
    // SAFETY: as in `gpu_instance_id`: used only while `device` is borrowed.
    let handle = unsafe { device.handle() };
    let mut id: c_uint = 0;
    // SAFETY: `call` is `nvmlDeviceGetComputeInstanceId` from the library the live handle
    // came from; `id` is a valid out-pointer NVML writes and does not keep.
    let code = unsafe { call(handle, &raw mut id) };
    nvml_try(code)?;
    Ok(id)
}
