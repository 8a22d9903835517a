//! A MIG device's GPU instance id and compute instance id, from NVML.
//!
//! `nvml-wrapper` 0.13 loads every NVML symbol but offers no safe method for
//! `nvmlDeviceGetGpuInstanceId` and `nvmlDeviceGetComputeInstanceId`. The kubelet plugin
//! needs both: they key the capability minors (`/proc/driver/nvidia-caps/mig-minors`) that
//! grant a container access to one MIG instance and no other. The rest of the workspace
//! forbids unsafe code; this crate holds the two calls in one reviewed function.
//!
//! A driver too old to export a symbol answers [`NvmlError::FailedToLoadSymbol`], never a
//! panic (the raw binding's own wrapper would panic there, so it is not used).

use std::os::raw::c_uint;

use nvml_wrapper::Device;
use nvml_wrapper::error::{NvmlError, nvml_sym, nvml_try};
use nvml_wrapper_sys::bindings::{NvmlLib, nvmlDevice_t, nvmlReturn_t};

/// The C signature both calls share: `nvmlReturn_t f(nvmlDevice_t device, unsigned int *id)`.
type IdCall = unsafe extern "C" fn(device: nvmlDevice_t, id: *mut c_uint) -> nvmlReturn_t;

/// The id of the GPU instance that MIG device `device` belongs to, on its parent GPU.
///
/// NVML answers `NotSupported` (or `InvalidArg`) for a handle that is not a MIG device.
pub fn gpu_instance_id(device: &Device<'_>) -> Result<u32, NvmlError> {
    instance_id(device, |lib| {
        nvml_sym(lib.nvmlDeviceGetGpuInstanceId.as_ref())
    })
}

/// The id of the compute instance that MIG device `device` is, within its GPU instance.
///
/// NVML answers `NotSupported` (or `InvalidArg`) for a handle that is not a MIG device.
pub fn compute_instance_id(device: &Device<'_>) -> Result<u32, NvmlError> {
    instance_id(device, |lib| {
        nvml_sym(lib.nvmlDeviceGetComputeInstanceId.as_ref())
    })
}

/// Calls the NVML function `symbol` picks (one with [`IdCall`]'s signature) on `device` and
/// returns the id it writes.
#[allow(unsafe_code)] // Reason: the raw NVML calls nvml-wrapper has no safe method for.
fn instance_id(
    device: &Device<'_>,
    symbol: impl FnOnce(&NvmlLib) -> Result<&IdCall, NvmlError>,
) -> Result<u32, NvmlError> {
    let call = symbol(device.nvml().lib())?;
    // SAFETY: the raw handle is only passed to NVML below, while `device` (and the `Nvml`
    // it borrows, which keeps the library loaded and initialised) is still borrowed here.
    let handle = unsafe { device.handle() };
    let mut id: c_uint = 0;
    // SAFETY: `call` was loaded from the library the handle came from, and has the signature
    // NVML documents for both calls ([`IdCall`]); `handle` is live (above); `id` is a valid,
    // aligned `unsigned int` that NVML writes and does not keep.
    let code = unsafe { call(handle, &raw mut id) };
    nvml_try(code)?;
    Ok(id)
}
