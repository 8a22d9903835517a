//! What a node checks of a claim's shares against the GPUs it publishes, before anything is
//! written: a share only on a GPU published as shared, and one claim's shares of a GPU within
//! that GPU. The allocator never writes anything else; these checks hold whoever allocated.

use std::collections::BTreeMap;

use crate::node::inventory::{Gpu, GpuMode};
use crate::rules::quantity::Quantity;

use super::PreparedDevice;

/// Refuses a share, or booked capacity, on a device this node does not publish as a shared
/// GPU: an exclusive GPU or a MIG instance is one claim's alone, and two claims must never be
/// prepared on it as shares. `booked` says whether the result carries a `consumedCapacity`
/// or a record, `mig` whether the device is a MIG instance of `gpu`.
pub(super) fn check_shareable(gpu: &Gpu, mig: bool, booked: bool) -> Result<(), String> {
    if !booked {
        return Ok(());
    }
    let published = if mig {
        "a MIG instance"
    } else if gpu.mode == GpuMode::Shared {
        return Ok(());
    } else {
        match gpu.mode {
            GpuMode::Exclusive => "an exclusive GPU",
            _ => "a GPU in MIG mode",
        }
    };
    Err(format!(
        "the allocation books a share of it (consumedCapacity or an AllocatedShares record), but \
         this node publishes it as {published}, which is one claim's alone: a share there would \
         let several claims hold it, so the claim is refused; deallocate it (delete its pod) and \
         let it be allocated to a shared GPU"
    ))
}

/// Refuses a claim whose shares of one GPU add up past that GPU: memory past the card's, or
/// compute past 100. The sum is what the claim's containers get as their limit (a batch
/// share's limit is what it may use, never below its guarantee), so a limit within the card
/// keeps the guarantee within it too.
pub(super) fn check_within_cards(devices: &[PreparedDevice], gpus: &[Gpu]) -> Result<(), String> {
    let mut per_gpu: BTreeMap<&str, (u64, i64, Vec<&str>)> = BTreeMap::new();
    for d in devices {
        let Some(share) = &d.share else { continue };
        let entry = per_gpu.entry(d.gpu.uuid.as_str()).or_default();
        entry.0 = entry.0.saturating_add(share.memory_bytes);
        entry.1 = entry.1.saturating_add(share.compute_percent);
        entry.2.push(d.request.as_str());
    }
    for (uuid, (memory, compute, requests)) in per_gpu {
        let Some(gpu) = gpus.iter().find(|g| g.uuid == uuid) else {
            continue;
        };
        let whose = if requests.len() == 1 {
            format!("the share of request {}", requests[0])
        } else {
            format!("the shares of requests {} together", requests.join(", "))
        };
        if memory > gpu.memory_bytes {
            return Err(format!(
                "device {}: {whose}: memory {} ({memory} bytes) is more than the card's {} \
                 ({} bytes); a limit past the card cannot be held, so the claim is refused: \
                 deallocate it (delete its pod) and let Tessera allocate it again",
                gpu.device_name(),
                Quantity::from_bytes(memory),
                Quantity::from_bytes(gpu.memory_bytes),
                gpu.memory_bytes
            ));
        }
        if compute > 100 {
            return Err(format!(
                "device {}: {whose}: compute {compute} is more than 100; deallocate the claim \
                 (delete its pod) and let Tessera allocate it again",
                gpu.device_name()
            ));
        }
    }
    Ok(())
}
