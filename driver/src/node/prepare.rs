//! What a node prepares for an allocated claim: its devices on this node, with their shares.
//!
//! The node never recomputes a share, and it trusts only what an allocator wrote into the
//! claim's status (shared/DESIGN.md §5): the `consumedCapacity` of each result (kube-scheduler
//! or Tessera's controller) and the controller's `AllocatedShares` record. Where both exist
//! the record must stay within what was booked. It refuses, with a message that says what to
//! do:
//! * a record that the claim's own `spec.devices.config` carries (kube-scheduler copies a
//!   claim's configs into its allocation, so a user could otherwise pick their own limits), or
//!   a record that came from a class;
//! * a record or config of this driver in the allocation that does not decode;
//! * a record larger than the `consumedCapacity` booked for the same device;
//! * a request that asks for a `GpuShare` whose device has no record: kube-scheduler placed it
//!   with the request policy's defaults because Tessera's admission did not gate the pod;
//! * a record that says `online` for a request whose class's `TierPolicy` (copied into the
//!   allocation as `FromClass`) says `allowOnline: false`;
//! * a share, or a `consumedCapacity`, on a device this node publishes as an exclusive GPU or a
//!   MIG instance, and shares of one GPU that add up past the card (memory past its bytes,
//!   compute past 100) (`card`).
//!
//! A share's tier comes from the record alone; where kube-scheduler booked a share without a
//! record, the class's `TierPolicy` (from the allocation's `FromClass` configs) decides, and
//! online only where no such policy says batch. A record's tier that does not decode makes
//! the record undecodable, and the claim is refused.
//!
//! Each allocated device of this driver and this node's pool is then mapped to the GPU or MIG
//! instance of the node's inventory. The result feeds the CDI builder.

use k8s_openapi::api::resource::v1 as res;

use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::names;
use crate::node::cdi;
use crate::node::inventory::{Gpu, Inventory, Isolation, MigInstance, NodeInventory};
use crate::node::prepared::{GpuNode, MigNode, PreparedClaim, PreparedDevice};
use crate::rules::config::{self, TesseraConfig, Tier};
use crate::rules::quantity::Quantity;
use crate::rules::share::PerDeviceShare;

mod card;

/// The `source` of an allocation config the allocator wrote for the claim.
const SOURCE_CLAIM: &str = "FromClaim";
/// The `source` of an allocation config copied from the request's DeviceClass.
const SOURCE_CLASS: &str = "FromClass";

fn claim_label(claim: &res::ResourceClaim) -> String {
    format!(
        "{}/{}",
        claim.metadata.namespace.as_deref().unwrap_or_default(),
        claim.metadata.name.as_deref().unwrap_or_default()
    )
}

/// Why `gpu` takes no share that over-commits memory: its isolation was not proven.
fn no_memory_overcommit(gpu: &Gpu) -> String {
    format!(
        "the share over-commits memory, which needs isolation proven on GPU {} (it is {})",
        gpu.device_name(),
        gpu.isolation
    )
}

/// Why `gpu` offers no shares: its isolation was neither proven nor accepted.
fn no_shares(gpu: &Gpu) -> String {
    format!(
        "GPU {} offers no shares: its isolation is {} (the node's probe has not proven its \
         limits there; see the plugin's log, its metrics or `tessera inspect`); delete the pod \
         to allocate it elsewhere, or accept unverified isolation with \
         --accept-unverified-isolation",
        gpu.device_name(),
        gpu.isolation
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
    let err = |message: String| Error::Prepare {
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
    let trusted = TrustedShares::read(claim, allocation, driver).map_err(&err)?;
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
        let record = trusted.record(result);
        let device_err = |m: String| {
            err(format!(
                "device {} (request {}): {m}",
                result.device, result.request
            ))
        };
        let mig = mig
            .map(|m| mig_node(node, gpu, m))
            .transpose()
            .map_err(device_err)?;
        let booked = record.is_some()
            || result
                .consumed_capacity
                .as_ref()
                .is_some_and(|c| !c.is_empty());
        card::check_shareable(gpu, mig.is_some(), booked).map_err(device_err)?;
        let share = resolve_share(result, record, trusted.asks_gpu_share(&result.request))
            .map_err(device_err)?;
        let tier = match share {
            None => Tier::Online,
            Some(_) => trusted
                .tier(&result.request, record.map(|r| r.tier))
                .map_err(device_err)?,
        };
        let memory_overcommitted =
            record.is_some_and(|r| r.guaranteed.memory_bytes < r.share.memory_bytes);
        // Fail closed: a share only where the node proved (or the admin accepted) isolation,
        // and over-committed memory only where the probe held (`crate::node::isolation`).
        if share.is_some() && !gpu.isolation.offers_shares() {
            return Err(device_err(no_shares(gpu)));
        }
        if memory_overcommitted && gpu.isolation != Isolation::Verified {
            return Err(device_err(no_memory_overcommit(gpu)));
        }
        devices.push(PreparedDevice {
            request: result.request.clone(),
            pool: result.pool.clone(),
            device: result.device.clone(),
            gpu: GpuNode {
                index: gpu.index,
                uuid: gpu.uuid.clone(),
                minor: gpu.minor,
            },
            mig,
            share,
            tier,
            memory_overcommitted,
            share_id: result.share_id.clone(),
        });
    }
    if devices.is_empty() {
        return Err(err(not_here(allocation, driver, &node.name)));
    }
    card::check_within_cards(&devices, &node.gpus).map_err(&err)?;
    if let Some(stray) = trusted.stray(allocation, driver) {
        return Err(err(format!(
            "the AllocatedShares record names {stray}, which is not a result of the allocation; \
             a record that does not match its allocation cannot be trusted"
        )));
    }
    Ok(PreparedClaim {
        uid,
        namespace: claim.metadata.namespace.clone().unwrap_or_default(),
        name: claim.metadata.name.clone().unwrap_or_default(),
        devices,
    })
}

/// Why an allocation with none of `driver`'s devices on `node` is refused there: naming the
/// node it is allocated to (the pool of a Tessera device is its node), where there is one.
fn not_here(allocation: &res::AllocationResult, driver: &str, node: &str) -> String {
    let elsewhere: std::collections::BTreeSet<&str> = allocation
        .devices
        .iter()
        .flat_map(|d| d.results.iter().flatten())
        .filter(|r| r.driver == driver)
        .map(|r| r.pool.as_str())
        .collect();
    if elsewhere.is_empty() {
        return format!("the allocation has no device of driver {driver} on node {node}");
    }
    let nodes: Vec<&str> = elsewhere.into_iter().collect();
    format!(
        "the claim is allocated to node {}, not to this node {node}: its devices of driver \
         {driver} are there, and only that node's plugin prepares them",
        nodes.join(", ")
    )
}

/// Everything the node makes for `claim` on `node`, decided at once: its devices with their
/// shares ([`prepare_on_node`]) and their rendering for `enforcement` ([`cdi::render`]),
/// including the environment images written for a device plugin read
/// ([`cdi::device_plugin_env`]). The kubelet plugin writes what this returns.
pub fn prepare_and_render(
    claim: &res::ResourceClaim,
    driver: &str,
    node: &NodeInventory,
    enforcement: &cdi::Enforcement,
) -> Result<(PreparedClaim, cdi::Rendered)> {
    prepare_and_render_for_user(claim, driver, node, enforcement, None)
}

/// [`prepare_and_render`] for a claim whose containers run as the Unix user `mps_user`
/// (`crate::node::mps_user::claim_user`): under MPS its daemon is the one of its GPU set and
/// that user ([`cdi::render_for_user`]).
pub fn prepare_and_render_for_user(
    claim: &res::ResourceClaim,
    driver: &str,
    node: &NodeInventory,
    enforcement: &cdi::Enforcement,
    mps_user: Option<u32>,
) -> Result<(PreparedClaim, cdi::Rendered)> {
    let prepared = prepare_on_node(claim, driver, node)?;
    let mut rendered = cdi::render_for_user(&prepared, enforcement, mps_user)?;
    cdi::device_plugin_env::add_device_plugin_env(&mut rendered.spec, claim, &prepared, node);
    Ok((prepared, rendered))
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

/// The GPU `name` is on, and the MIG instance when `name` is one.
fn find_device<'a>(
    node: &'a NodeInventory,
    name: &str,
) -> Option<(&'a Gpu, Option<&'a MigInstance>)> {
    node.gpus.iter().find_map(|gpu| {
        if gpu.device_name() == name {
            return Some((gpu, None));
        }
        gpu.mig_instances
            .iter()
            .find(|m| m.device_name(gpu.index) == name)
            .map(|m| (gpu, Some(m)))
    })
}

/// MIG instance `mig` of `gpu` with the capability minors that grant access to it
/// ([`NodeInventory::mig_access`], the one rule for it).
fn mig_node(
    node: &NodeInventory,
    gpu: &Gpu,
    mig: &MigInstance,
) -> std::result::Result<MigNode, String> {
    let access = node.mig_access(gpu, mig)?;
    Ok(MigNode {
        uuid: mig.uuid.clone(),
        gpu_instance: access.ids.gpu_instance,
        compute_instance: access.ids.compute_instance,
        gpu_instance_cap_minor: access.gpu_instance_minor,
        compute_instance_cap_minor: access.compute_instance_minor,
    })
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

/// One device's entry of the allocator's record: what the share may use, what it is
/// guaranteed (equal unless a batch share over-commits), and its tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Recorded {
    share: PerDeviceShare,
    guaranteed: PerDeviceShare,
    tier: Tier,
}

/// A device's share, from what the allocation booked (`consumed`) and what the allocator
/// recorded (`record`); `asks_gpu_share` says whether the request asks for a `GpuShare`.
/// What was booked is the record's guarantee: an over-committed batch share may use more.
fn resolve_share(
    result: &res::DeviceRequestAllocationResult,
    record: Option<Recorded>,
    asks_gpu_share: bool,
) -> std::result::Result<Option<PerDeviceShare>, String> {
    let consumed = consumed_share(result)?;
    match (record, consumed) {
        (
            Some(Recorded {
                share, guaranteed, ..
            }),
            Some(booked),
        ) => {
            let compute_within = booked.compute_percent == 0
                || (share.compute_percent > 0
                    && guaranteed.compute_percent <= booked.compute_percent);
            if guaranteed.memory_bytes > booked.memory_bytes || !compute_within {
                return Err(format!(
                    "the AllocatedShares record (guaranteed memory {} bytes, compute {}) \
                     disagrees with consumedCapacity (memory {} bytes, compute {}): the record \
                     must stay within what was booked; the allocation was changed by something \
                     other than Tessera's allocator, so deallocate the claim (delete its pod) \
                     and let Tessera allocate it again",
                    guaranteed.memory_bytes,
                    guaranteed.compute_percent,
                    booked.memory_bytes,
                    booked.compute_percent
                ));
            }
            Ok(Some(share))
        }
        (Some(record), None) => Ok(Some(record.share)),
        (None, booked) if asks_gpu_share => Err(format!(
            "the request asks for a GpuShare, but the allocation has no AllocatedShares record \
             for the device{}: it was allocated by kube-scheduler, which does not read GpuShare, \
             so the pod was not gated by Tessera's admission webhook. Check that the webhook \
             is installed and answering (kubectl get mutatingwebhookconfigurations), then \
             delete the pod so that it is admitted and allocated again",
            booked.map_or_else(String::new, |b| format!(
                " (it booked only the request policy's defaults: memory {} bytes, compute {})",
                b.memory_bytes, b.compute_percent
            ))
        )),
        (None, booked) => Ok(booked),
    }
}

/// What a record's device is guaranteed: all of its share unless it names less. Only a batch
/// share is ever over-committed, and never to more than it may use.
fn guaranteed_share(
    d: &config::DeviceShare,
    share: PerDeviceShare,
) -> std::result::Result<PerDeviceShare, String> {
    let memory_bytes = d
        .guaranteed_memory()
        .as_units()
        .and_then(|b| u64::try_from(b).ok())
        .filter(|&b| b <= share.memory_bytes)
        .ok_or_else(|| {
            format!(
                "guaranteedMemory {} is not a whole number of bytes within 0..=memory",
                d.guaranteed_memory()
            )
        })?;
    let compute_percent = d.guaranteed_compute();
    if !(0..=share.compute_percent).contains(&compute_percent) {
        return Err(format!(
            "guaranteedCompute {compute_percent} is not within 0..=compute ({})",
            share.compute_percent
        ));
    }
    let guaranteed = PerDeviceShare {
        memory_bytes,
        compute_percent,
    };
    if guaranteed != share && d.tier == Tier::Online {
        return Err(
            "an online share is guaranteed less than it may use; online shares are never \
             over-committed, so the record cannot be trusted"
                .to_owned(),
        );
    }
    Ok(guaranteed)
}

/// The allocator's share records of one allocation, and which requests ask for a `GpuShare`;
/// only what the claim's author could not have written.
struct TrustedShares {
    /// (request, pool, device) -> the recorded share.
    records: BTreeMap<(String, String, String), Recorded>,
    /// The requests each `GpuShare` config names (empty: every request).
    gpu_share_requests: Vec<Vec<String>>,
    /// The classes' `TierPolicy` configs (source `FromClass`) and the requests they name
    /// (empty: every request).
    class_policies: Vec<(Vec<String>, config::TierPolicy)>,
}

impl TrustedShares {
    fn read(
        claim: &res::ResourceClaim,
        allocation: &res::AllocationResult,
        driver: &str,
    ) -> std::result::Result<Self, String> {
        let spec_configs = claim.spec.devices.as_ref().and_then(|d| d.config.as_ref());
        for (i, cfg) in spec_configs.into_iter().flatten().enumerate() {
            let Some(opaque) = cfg.opaque.as_ref().filter(|o| o.driver == driver) else {
                continue;
            };
            if opaque
                .parameters
                .0
                .get("kind")
                .and_then(serde_json::Value::as_str)
                == Some(names::ALLOCATED_SHARES_KIND)
            {
                return Err(format!(
                    "spec.devices.config[{i}] is an {kind}: only Tessera's allocator writes \
                     {kind} (into status.allocation), and a claim that carries one could set \
                     its own limits; recreate the claim without it",
                    kind = names::ALLOCATED_SHARES_KIND
                ));
            }
        }
        let mut records = BTreeMap::new();
        let mut gpu_share_requests = Vec::new();
        let mut class_policies = Vec::new();
        let configs = allocation.devices.as_ref().and_then(|d| d.config.as_ref());
        for (i, cfg) in configs.into_iter().flatten().enumerate() {
            let Some(opaque) = cfg.opaque.as_ref().filter(|o| o.driver == driver) else {
                continue;
            };
            let field = format!("status.allocation.devices.config[{i}]");
            let decoded = config::decode(&opaque.parameters.0, &field).map_err(|e| {
                format!(
                    "{field} does not decode ({e}); the node prepares no share it cannot read: \
                     deallocate the claim (delete its pod) and let Tessera allocate it again"
                )
            })?;
            match decoded {
                TesseraConfig::GpuShare(_) => {
                    gpu_share_requests.push(cfg.requests.clone().unwrap_or_default());
                }
                // A claim's own TierPolicy (admission refuses it) never changes a tier.
                TesseraConfig::TierPolicy(policy) => {
                    if cfg.source == SOURCE_CLASS {
                        class_policies.push((cfg.requests.clone().unwrap_or_default(), policy));
                    }
                }
                TesseraConfig::AllocatedShares(record) => {
                    if cfg.source != SOURCE_CLAIM {
                        return Err(format!(
                            "{field} is an {} from source {}: only Tessera's allocator writes \
                             one, as {SOURCE_CLAIM}; remove it from the DeviceClass",
                            names::ALLOCATED_SHARES_KIND,
                            cfg.source
                        ));
                    }
                    for (j, d) in record.devices.into_iter().enumerate() {
                        let memory_bytes = d
                            .memory
                            .as_units()
                            .and_then(|b| u64::try_from(b).ok())
                            .ok_or_else(|| {
                                format!(
                                    "{field}.devices[{j}].memory {} is not a whole, \
                                     non-negative number of bytes",
                                    d.memory
                                )
                            })?;
                        if !(0..=100).contains(&d.compute) {
                            return Err(format!(
                                "{field}.devices[{j}].compute {} is not within 0..=100",
                                d.compute
                            ));
                        }
                        let share = PerDeviceShare {
                            memory_bytes,
                            compute_percent: d.compute,
                        };
                        let guaranteed = guaranteed_share(&d, share)
                            .map_err(|m| format!("{field}.devices[{j}]: {m}"))?;
                        let key = (d.request, d.pool, d.device);
                        let recorded = Recorded {
                            share,
                            guaranteed,
                            tier: d.tier,
                        };
                        if records.insert(key.clone(), recorded).is_some() {
                            return Err(format!(
                                "{field} records device {}/{} for request {} twice",
                                key.1, key.2, key.0
                            ));
                        }
                    }
                }
            }
        }
        Ok(Self {
            records,
            gpu_share_requests,
            class_policies,
        })
    }

    /// The tier of a share of `request`: the record's (`recorded`) where there is one, else
    /// batch where a class policy says so, else online. A recorded online tier that a class
    /// policy forbids is refused.
    fn tier(&self, request: &str, recorded: Option<Tier>) -> std::result::Result<Tier, String> {
        let policies = || {
            self.class_policies
                .iter()
                .filter(|(names, _)| config::applies(names, request))
                .map(|(_, p)| p)
        };
        let Some(tier) = recorded else {
            let batch = policies().any(|p| p.tier == Some(Tier::Batch));
            return Ok(if batch { Tier::Batch } else { Tier::Online });
        };
        if tier == Tier::Online && policies().any(|p| p.allow_online == Some(false)) {
            return Err(format!(
                "the AllocatedShares record gives the share the online tier, but its class's \
                 {} says allowOnline: false; the allocation was not made by Tessera's \
                 allocator as the class requires, so deallocate the claim (delete its pod) and \
                 let Tessera allocate it again",
                names::TIER_POLICY_KIND
            ));
        }
        Ok(tier)
    }

    fn record(&self, result: &res::DeviceRequestAllocationResult) -> Option<Recorded> {
        self.records
            .get(&(
                result.request.clone(),
                result.pool.clone(),
                result.device.clone(),
            ))
            .copied()
    }

    /// Whether a `GpuShare` applies to `request` (`request` or `request/subrequest`; a config
    /// naming the parent applies to its subrequests).
    fn asks_gpu_share(&self, request: &str) -> bool {
        self.gpu_share_requests
            .iter()
            .any(|names| config::applies(names, request))
    }

    /// A recorded (request, pool, device) that no result of `driver` matches.
    fn stray(&self, allocation: &res::AllocationResult, driver: &str) -> Option<String> {
        let results: Vec<_> = allocation
            .devices
            .iter()
            .flat_map(|d| d.results.iter().flatten())
            .filter(|r| r.driver == driver)
            .map(|r| (r.request.as_str(), r.pool.as_str(), r.device.as_str()))
            .collect();
        self.records
            .keys()
            .find(|(r, p, d)| !results.contains(&(r.as_str(), p.as_str(), d.as_str())))
            .map(|(r, p, d)| format!("device {p}/{d} for request {r}"))
    }
}

#[cfg(test)]
mod tests;
