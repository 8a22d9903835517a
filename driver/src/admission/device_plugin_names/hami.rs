//! HAMi's dialect: `nvidia.com/gpu: N` with `nvidia.com/gpumem` (MiB per card),
//! `nvidia.com/gpumem-percentage` or `nvidia.com/gpucores` (percent per card) beside it, as
//! the request `hami`: N shares, the per-card sizes times N. Tessera shares memory in whole
//! GiB and compute in steps of 5, so HAMi's sizes are rounded up, each time with a warning.

use super::claim::{Builder, gpu_share};
use super::nvidia::NVIDIA_GPU;
use super::request::ContainerAsk;
use crate::error::Result;
use crate::names;
use crate::rules::share::COMPUTE_STEP;

/// HAMi: GPU memory per card, in MiB.
pub const HAMI_GPUMEM: &str = "nvidia.com/gpumem";
/// HAMi: GPU memory per card, in percent of the card.
pub const HAMI_GPUMEM_PERCENTAGE: &str = "nvidia.com/gpumem-percentage";
/// HAMi: compute per card, in percent.
pub const HAMI_GPUCORES: &str = "nvidia.com/gpucores";

/// Whether `name` is one of this dialect's own names (it shares `nvidia.com/gpu`).
pub(super) fn is_name(name: &str) -> bool {
    matches!(name, HAMI_GPUMEM | HAMI_GPUMEM_PERCENTAGE | HAMI_GPUCORES)
}

/// The HAMi share of a container that names one of HAMi's sizes; `false` when it names none
/// (its `nvidia.com/gpu` is then whole GPUs).
pub(super) fn add(
    b: &mut Builder,
    ask: &ContainerAsk,
    driver: &str,
    object: &str,
    warnings: &mut Vec<String>,
) -> Result<bool> {
    let c = ask.name.as_str();
    let (mem_mib, mem_pct, cores) = (
        ask.get(HAMI_GPUMEM),
        ask.get(HAMI_GPUMEM_PERCENTAGE),
        ask.get(HAMI_GPUCORES),
    );
    if mem_mib.is_none() && mem_pct.is_none() && cores.is_none() {
        return Ok(false);
    }
    let n = if let Some(n) = ask.get(NVIDIA_GPU) {
        n
    } else {
        warnings.push(format!(
            "container {c}: HAMi sizes without {NVIDIA_GPU}: one GPU, HAMi's default"
        ));
        1
    };
    let count = ask.cards(object, NVIDIA_GPU, n)?;
    if mem_mib.is_some() && mem_pct.is_some() {
        return Err(ask.error(
            object,
            HAMI_GPUMEM_PERCENTAGE,
            &format!("{HAMI_GPUMEM} and {HAMI_GPUMEM_PERCENTAGE} are exclusive: set one"),
        ));
    }
    let (memory, percent) = match (mem_mib, mem_pct) {
        (Some(mib), _) => {
            let gib = mib.div_ceil(1024);
            if !mib.is_multiple_of(1024) {
                warnings.push(format!(
                    "container {c}: {HAMI_GPUMEM} {mib} (MiB) rounded up to {gib}Gi per card: \
                     Tessera shares memory in whole GiB"
                ));
            }
            (Some(gib * n), None)
        }
        (None, Some(p)) => {
            if p > 100 {
                return Err(ask.error(
                    object,
                    HAMI_GPUMEM_PERCENTAGE,
                    &format!("{HAMI_GPUMEM_PERCENTAGE} {p} is outside 1..100"),
                ));
            }
            (None, Some(p))
        }
        (None, None) => {
            warnings.push(format!(
                "container {c}: {HAMI_GPUCORES} without a memory size: each card's whole \
                 memory, HAMi's default"
            ));
            (None, Some(100))
        }
    };
    let compute = match cores {
        Some(p) if p > 100 => {
            return Err(ask.error(
                object,
                HAMI_GPUCORES,
                &format!("{HAMI_GPUCORES} {p} is more than a card's 100"),
            ));
        }
        Some(p) => {
            let step = COMPUTE_STEP.unsigned_abs();
            let rounded = p.div_ceil(step) * step;
            if rounded != p {
                warnings.push(format!(
                    "container {c}: {HAMI_GPUCORES} {p} rounded up to {rounded} per card: \
                     Tessera isolates compute in steps of {step}"
                ));
            }
            Some(rounded * n)
        }
        None => None,
    };
    b.request("hami", "hami", names::CLASS_SHARED_GPU, n, None);
    b.share("hami", driver, gpu_share(memory, percent, compute), count);
    Ok(true)
}
