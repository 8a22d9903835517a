//! What a node prepares for an allocated claim: its devices on this node, with their shares.
//!
//! The node never recomputes a share: it takes the allocation's `AllocatedShares` record (or,
//! for allocations made by kube-scheduler with consumable capacity, the `consumedCapacity`) and
//! maps each allocated device of this driver and this node's pool to the GPU or MIG instance of
//! the node's inventory. The result feeds the CDI builder.

use k8s_openapi::api::resource::v1 as res;

use crate::cdi::{GpuNode, MigNode, PreparedClaim, PreparedDevice};
use crate::config::{self, TesseraConfig};
use crate::error::{Error, Result};
use crate::inventory::{Gpu, Inventory, NodeInventory};
use crate::names;
use crate::quantity::Quantity;
use crate::share::PerDeviceShare;

/// nvidia-caps minors: 1 and 2 are config and monitor; then each GPU has 15 GPU instances,
/// each with an access minor followed by the minors of its 8 compute instances.
const CAPS_FIRST: u32 = 3;
const CAPS_PER_GI: u32 = 9;
const CAPS_PER_GPU: u32 = 15 * CAPS_PER_GI;

fn claim_label(claim: &res::ResourceClaim) -> String {
    format!(
        "{}/{}",
        claim.metadata.namespace.as_deref().unwrap_or_default(),
        claim.metadata.name.as_deref().unwrap_or_default()
    )
}

/// The devices of `claim`'s allocation that `driver` prepares on `node`, ready for the CDI
/// builder. Errors name the claim and what does not match the node.
pub fn prepare_on_node(
    claim: &res::ResourceClaim,
    driver: &str,
    node: &NodeInventory,
) -> Result<PreparedClaim> {
    let label = claim_label(claim);
    let err = |message: String| Error::Cdi {
        claim: label.clone(),
        message,
    };
    let allocation = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .ok_or_else(|| err("the claim is not allocated".to_owned()))?;
    let uid = claim
        .metadata
        .uid
        .clone()
        .filter(|u| !u.is_empty())
        .ok_or_else(|| err("the claim has no UID".to_owned()))?;
    let shares = recorded_shares(allocation, driver);
    let mut devices = Vec::new();
    for result in allocation
        .devices
        .iter()
        .flat_map(|d| d.results.iter().flatten())
    {
        if result.driver != driver || result.pool != node.name {
            continue;
        }
        let (gpu, mig) = find_device(node, &result.device).ok_or_else(|| {
            err(format!(
                "device {}/{} is not on node {}",
                result.pool, result.device, node.name
            ))
        })?;
        let share = match shares
            .iter()
            .find(|(pool, device, _)| *pool == result.pool && *device == result.device)
        {
            Some((_, _, share)) => Some(*share),
            None => {
                consumed_share(result).map_err(|m| err(format!("device {}: {m}", result.device)))?
            }
        };
        devices.push(PreparedDevice {
            request: result.request.clone(),
            pool: result.pool.clone(),
            device: result.device.clone(),
            gpu: GpuNode {
                index: gpu.index,
                uuid: gpu.uuid.clone(),
                minor: gpu.index,
            },
            mig,
            share,
        });
    }
    if devices.is_empty() {
        return Err(err(format!(
            "the allocation has no device of driver {driver} on node {}",
            node.name
        )));
    }
    Ok(PreparedClaim {
        uid,
        namespace: claim.metadata.namespace.clone().unwrap_or_default(),
        name: claim.metadata.name.clone().unwrap_or_default(),
        devices,
    })
}

/// Like [`prepare_on_node`], on the node the allocation's devices are on.
pub fn prepared_claim(
    claim: &res::ResourceClaim,
    driver: &str,
    inventory: &Inventory,
) -> Result<PreparedClaim> {
    let pool = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_ref())
        .and_then(|r| r.iter().find(|r| r.driver == driver))
        .map(|r| r.pool.clone())
        .ok_or_else(|| Error::Cdi {
            claim: claim_label(claim),
            message: format!("no device of driver {driver}"),
        })?;
    let node = inventory.node(&pool).ok_or_else(|| Error::Cdi {
        claim: claim_label(claim),
        message: format!("no node {pool} in the inventory"),
    })?;
    prepare_on_node(claim, driver, node)
}

fn find_device<'a>(node: &'a NodeInventory, name: &str) -> Option<(&'a Gpu, Option<MigNode>)> {
    node.gpus.iter().find_map(|gpu| {
        if gpu.device_name() == name {
            return Some((gpu, None));
        }
        gpu.mig_instances
            .iter()
            .enumerate()
            .find(|(_, m)| m.device_name(gpu.index) == name)
            .map(|(gi, m)| {
                let gi = u32::try_from(gi).unwrap_or(u32::MAX);
                let gi_minor = CAPS_FIRST + gpu.index * CAPS_PER_GPU + gi * CAPS_PER_GI;
                (
                    gpu,
                    Some(MigNode {
                        uuid: m.uuid.clone(),
                        gpu_instance: gi,
                        compute_instance: 0,
                        gpu_instance_cap_minor: gi_minor,
                        compute_instance_cap_minor: gi_minor + 1,
                    }),
                )
            })
    })
}

/// The shares the allocator recorded for `driver`, as (pool, device, share).
fn recorded_shares(
    allocation: &res::AllocationResult,
    driver: &str,
) -> Vec<(String, String, PerDeviceShare)> {
    let mut shares = Vec::new();
    for cfg in allocation
        .devices
        .iter()
        .flat_map(|d| d.config.iter().flatten())
    {
        let Some(opaque) = cfg.opaque.as_ref().filter(|o| o.driver == driver) else {
            continue;
        };
        if let Ok(TesseraConfig::AllocatedShares(record)) =
            config::decode(&opaque.parameters.0, "config")
        {
            for d in record.devices {
                let memory_bytes = d
                    .memory
                    .as_units()
                    .and_then(|b| u64::try_from(b).ok())
                    .unwrap_or(0);
                shares.push((
                    d.pool,
                    d.device,
                    PerDeviceShare {
                        memory_bytes,
                        compute_percent: d.compute,
                    },
                ));
            }
        }
    }
    shares
}

/// A share from `consumedCapacity`, for allocations kube-scheduler made on its own.
fn consumed_share(
    result: &res::DeviceRequestAllocationResult,
) -> std::result::Result<Option<PerDeviceShare>, String> {
    let Some(consumed) = result.consumed_capacity.as_ref().filter(|c| !c.is_empty()) else {
        return Ok(None);
    };
    let get = |name: &str| -> std::result::Result<Option<i64>, String> {
        consumed
            .get(name)
            .map(|q| {
                Quantity::from_k8s(q)
                    .map_err(|e| e.to_string())?
                    .as_units()
                    .ok_or_else(|| format!("{name} {} is not whole", q.0))
            })
            .transpose()
    };
    let memory = get(names::CAP_MEMORY)?.ok_or("consumedCapacity has no memory")?;
    let memory_bytes = u64::try_from(memory).map_err(|_| format!("memory {memory} is negative"))?;
    let compute_percent = get(names::CAP_COMPUTE)?.unwrap_or(0);
    Ok(Some(PerDeviceShare {
        memory_bytes,
        compute_percent,
    }))
}
