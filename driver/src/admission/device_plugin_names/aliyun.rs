//! Aliyun gpushare's dialect, once per pod: `aliyun.com/gpu-mem: N` (GiB, summed over the
//! pod's containers) with the pod label `aliyun.com/gpu-count: M` becomes the claim entry
//! `tessera` shared by those containers: `GpuShare{memory N Gi}` over M cards.

use super::Options;
use super::claim::{Builder, MappedClaim, gpu_share};
use super::request::{ALIYUN_GPU_COUNT_LABEL, DevicePluginRequest};
use crate::error::{Error, Result};
use crate::names;

/// Aliyun gpushare: GPU memory in GiB, total for the container.
pub const ALIYUN_GPU_MEM: &str = "aliyun.com/gpu-mem";
/// The pod claim entry of the Aliyun form (one per pod).
pub const POD_ENTRY: &str = "tessera";

/// Whether `name` is one of this dialect's names.
pub(super) fn is_name(name: &str) -> bool {
    name == ALIYUN_GPU_MEM
}

/// The pod's Aliyun claim, when any container asks for `aliyun.com/gpu-mem`.
pub(super) fn claim(
    request: &DevicePluginRequest,
    options: &Options,
    object: &str,
) -> Result<Option<MappedClaim>> {
    let askers: Vec<usize> = request
        .containers
        .iter()
        .enumerate()
        .filter(|(_, a)| a.get(ALIYUN_GPU_MEM).is_some())
        .map(|(i, _)| i)
        .collect();
    let Some(&first) = askers.first() else {
        return Ok(None);
    };
    let total: u64 = askers
        .iter()
        .filter_map(|&i| request.containers[i].get(ALIYUN_GPU_MEM))
        .sum();
    let label_field = format!("metadata.labels[{ALIYUN_GPU_COUNT_LABEL}]");
    let m = match request.gpu_count_label.as_deref() {
        None => 1,
        Some(text) => text
            .trim()
            .parse::<u32>()
            .ok()
            .filter(|m| *m >= 1)
            .ok_or_else(|| {
                Error::invalid(
                    object,
                    label_field.clone(),
                    format!("{text:?} is not a number of cards (a whole number, at least 1)"),
                )
            })?,
    };
    if !total.is_multiple_of(u64::from(m)) {
        let ask = &request.containers[first];
        return Err(Error::invalid(
            object,
            ask.limit_field(ALIYUN_GPU_MEM),
            format!(
                "{ALIYUN_GPU_MEM}: {total} GiB for the pod over {m} cards ({ALIYUN_GPU_COUNT_LABEL}) \
                 is not a whole number of GiB per card"
            ),
        ));
    }
    let mut b = Builder::default();
    b.request(
        "aliyun",
        "aliyun",
        names::CLASS_SHARED_GPU,
        u64::from(m),
        None,
    );
    b.share(
        "aliyun",
        &options.driver,
        gpu_share(Some(total), None, None),
        m,
    );
    b.claim(
        object,
        ("metadata", "of the pod"),
        POD_ENTRY.to_owned(),
        askers,
    )
    .map(Some)
}
