//! The NVIDIA device plugin's dialect: `nvidia.com/gpu: N` for N whole GPUs, and, with
//! time-slicing and `renameByDefault`, `nvidia.com/gpu.shared: N` for N replicas of 1/R of a
//! card each (R: [`super::Options::shared_replicas`]).

use super::Options;
use super::claim::{Builder, gpu_share};
use super::request::ContainerAsk;
use crate::error::Result;
use crate::names;

/// NVIDIA device plugin: whole GPUs.
pub const NVIDIA_GPU: &str = "nvidia.com/gpu";
/// NVIDIA device plugin with time-slicing and `renameByDefault`: time-sliced replicas.
pub const NVIDIA_GPU_SHARED: &str = "nvidia.com/gpu.shared";
/// Time-sliced replicas per GPU when the admin sets none.
pub const DEFAULT_SHARED_REPLICAS: u32 = 4;

/// Whether `name` is one of this dialect's names.
pub(super) fn is_name(name: &str) -> bool {
    matches!(name, NVIDIA_GPU | NVIDIA_GPU_SHARED)
}

/// `nvidia.com/gpu: N` as the request `gpu`: N whole GPUs.
pub(super) fn whole_gpus(b: &mut Builder, ask: &ContainerAsk) {
    if let Some(n) = ask.get(NVIDIA_GPU) {
        b.request("nvidia", "gpu", names::CLASS_GPU, n, None);
    }
}

/// `nvidia.com/gpu.shared: N` as the request `shared`: N shares of 1/R of a card each.
pub(super) fn time_sliced(
    b: &mut Builder,
    ask: &ContainerAsk,
    options: &Options,
    object: &str,
) -> Result<()> {
    if let Some(n) = ask.get(NVIDIA_GPU_SHARED) {
        let count = ask.cards(object, NVIDIA_GPU_SHARED, n)?;
        let replicas = options.shared_replicas.clamp(1, 100);
        let percent = 100 / u64::from(replicas);
        b.request("time-slicing", "shared", names::CLASS_SHARED_GPU, n, None);
        b.share(
            "shared",
            &options.driver,
            gpu_share(None, Some(percent), None),
            count,
        );
    }
    Ok(())
}
