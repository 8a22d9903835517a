//! Pods written for the device-plugin world: extended-resource names turned into claims
//! (shared/DESIGN.md §7).
//!
//! ```text
//! let Some(request) = DevicePluginRequest::from_pod(&pod, "Pod ns/p")? else { return untouched };
//! let mapping = map_request(&request, &options, "Pod ns/p")?;   // claims, or a clear error
//! let patch = pod_patch(&pod, &request, &mapping)?;             // what the webhook returns
//! // the controller: templates(&mapping, ns), from the request recorded on the pod
//! // tessera allocate: rewrite_offline(&pod, &request, &mapping)
//! ```
//!
//! One function, [`map_request`], decides what every name means; the webhook, the controller
//! (which makes the ResourceClaimTemplates the rewritten pod refers to) and `tessera allocate`
//! all call it. The table:
//!
//! | names in one container | claim request |
//! |---|---|
//! | `nvidia.com/gpu: N` | `gpu`: N whole GPUs (class `gpu.tessera.dev`) |
//! | `nvidia.com/mig-<profile>: N` | `mig-<profile>`: N MIG devices with that `profile` |
//! | `nvidia.com/gpu.shared: N` | `shared`: N shares of 1/R of a card each (R: admin option) |
//! | `baidu.com/<model>_cgpu: M` | `baidu`: M whole GPUs of the model |
//! | ... + `_cgpu_memory: N` or `_cgpu_memory_percent: P`, optional `_cgpu_core: C` | `baidu`: `GpuShare{memory N Gi or memoryPercent P, compute C}` over M cards of the model |
//! | `nvidia.com/gpu: N` + `nvidia.com/gpumem` / `gpumem-percentage` / `gpucores` (HAMi) | `hami`: N shares, per-card sizes times N |
//!
//! and, once per pod, `aliyun.com/gpu-mem: N` (summed over the pod's containers) with the pod
//! label `aliyun.com/gpu-count: M` becomes the claim entry `tessera` shared by those containers:
//! `GpuShare{memory N Gi}` over M cards.
//!
//! The seed's share rules bind the Baidu and Aliyun forms exactly (whole GiB, compute in steps
//! of 5, totals over M cards divide evenly, compute needs memory, memory xor percent, a share
//! never exceeds a card). HAMi's per-card MiB and percent are rounded up to whole GiB and steps
//! of 5, each with a warning, never silently.
//!
//! Each vendor's dialect is one file ([`nvidia`] whole GPUs and time-slicing, [`mig`], [`hami`],
//! [`baidu`], [`aliyun`]); they read the request ([`request`]) and write into the claim builder
//! ([`claim`]). The rewritten pod's patch is [`patch`], the webhook's and `tessera allocate`'s
//! decision [`rewrite`], the templates [`template`].

mod aliyun;
mod baidu;
mod claim;
mod hami;
mod mig;
mod nvidia;
mod patch;
mod request;
mod rewrite;
mod template;

pub use aliyun::{ALIYUN_GPU_MEM, POD_ENTRY};
pub use baidu::{BAIDU_MODELS, BAIDU_PREFIX, baidu_model};
pub use claim::{MappedClaim, Mapping};
pub use hami::{HAMI_GPUCORES, HAMI_GPUMEM, HAMI_GPUMEM_PERCENTAGE};
pub use mig::NVIDIA_MIG_PREFIX;
pub use nvidia::{DEFAULT_SHARED_REPLICAS, NVIDIA_GPU, NVIDIA_GPU_SHARED};
pub use patch::{apply_pod_patch, pod_patch};
pub use request::{ALIYUN_GPU_COUNT_LABEL, ContainerAsk, DevicePluginRequest};
pub use rewrite::{PodRewrite, rewrite_offline, rewrite_pod};
pub use template::{
    recorded_request, referenced_templates, template, template_document, templates_for_pod,
};

use crate::error::Result;
use crate::names;

/// The admin's settings of the mapping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// Tessera's DRA driver name (the domain of attributes in selectors, the opaque driver).
    pub driver: String,
    /// Time-sliced replicas per GPU: one `nvidia.com/gpu.shared` is 1/R of a card (1..=100).
    pub shared_replicas: u32,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            driver: names::DEFAULT_DRIVER_NAME.to_owned(),
            shared_replicas: DEFAULT_SHARED_REPLICAS,
        }
    }
}

/// Whether `name` is one of the device-plugin resource names this module maps.
pub fn is_device_plugin_name(name: &str) -> bool {
    nvidia::is_name(name)
        || hami::is_name(name)
        || aliyun::is_name(name)
        || mig::is_name(name)
        || baidu::is_name(name)
}

/// Maps a pod's device-plugin request to claims, or says which container, resource and rule
/// is wrong. `object` names the pod in errors.
///
/// Per container, one claim of the requests its names ask for, in this order: HAMi's shares
/// (or else NVIDIA's whole GPUs), time-sliced replicas, MIG devices, Baidu's GPUs; then the
/// pod's one Aliyun claim.
pub fn map_request(
    request: &DevicePluginRequest,
    options: &Options,
    object: &str,
) -> Result<Mapping> {
    let driver = options.driver.as_str();
    let mut mapping = Mapping::default();
    for (i, ask) in request.containers.iter().enumerate() {
        let mut b = claim::Builder::default();
        if !hami::add(&mut b, ask, driver, object, &mut mapping.warnings)? {
            nvidia::whole_gpus(&mut b, ask);
        }
        nvidia::time_sliced(&mut b, ask, options, object)?;
        mig::add(&mut b, ask, driver, object)?;
        baidu::add(&mut b, ask, driver, object)?;
        if b.is_empty() {
            continue;
        }
        let claim = b.claim(object, (&ask.field(), &ask.name), ask.entry(), vec![i])?;
        mapping.claims.push(claim);
    }
    if let Some(claim) = aliyun::claim(request, options, object)? {
        mapping.claims.push(claim);
    }
    Ok(mapping)
}

#[cfg(test)]
mod tests;
