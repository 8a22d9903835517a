//! Per node and GPU: mode, memory and compute allocated and free, and who holds it.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::resource::v1 as res;
use serde::Serialize;

use crate::error::Result;
use crate::names;
use crate::placement::allocator::Snapshot;
use crate::rules::quantity::{Format, Quantity};

/// A claim holding (part of) a GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimHold {
    /// The claim's namespace.
    pub namespace: String,
    /// The claim's name.
    pub name: String,
    /// The pods using the claim: those it is reserved for, else those that name it.
    pub pods: Vec<String>,
    /// The memory it booked on the device (a share's consumed capacity, else the limit its node
    /// enforces); left out for a device held whole.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_booked: Option<Quantity>,
    /// The memory its processes use there, as its node last wrote it on the claim
    /// (`status.devices`, docs/claim-status.md); left out until the node measured it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_used: Option<Quantity>,
}

/// One GPU (or MIG instance) and its use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuRow {
    /// The device name, e.g. `gpu-0`.
    pub device: String,
    /// The model attribute, e.g. `a100-80g` (empty when not published).
    pub model: String,
    /// `exclusive`, `shared` or `mig`.
    pub mode: String,
    /// The mode it switches to once the claims holding it are gone, while it drains (its
    /// devices carry the draining taint and take no new claims).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub draining_to: Option<String>,
    /// A shared GPU's `isolation` (`verified`, `unverified`, `unverified-accepted`): whether
    /// its node proved its share limits hold there ([`crate::node::isolation`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub isolation: Option<String>,
    /// Why, as the node published it (`isolationReason`, e.g. `limit-not-enforced`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub isolation_reason: Option<String>,
    /// The memory it declares.
    pub memory_total: Quantity,
    /// Memory allocated: all of it when held whole, else what its shares are guaranteed.
    pub memory_allocated: Quantity,
    /// Memory free.
    pub memory_free: Quantity,
    /// Compute allocated (guaranteed), in percent.
    pub compute_allocated: i64,
    /// Compute free, in percent.
    pub compute_free: i64,
    /// Memory batch shares were booked beyond their guarantee ([`crate::rules::overcommit`]); usable
    /// only while the guaranteed shares leave it idle. Left out when none.
    #[serde(skip_serializing_if = "quantity_is_zero")]
    pub memory_overcommitted: Quantity,
    /// Compute batch shares were booked beyond their guarantee, in percent; left out when none.
    #[serde(skip_serializing_if = "is_zero")]
    pub compute_overcommitted: i64,
    /// Allocations holding it whole.
    pub exclusive: u32,
    /// Share allocations on it.
    pub shares: u32,
    /// The claims holding it, by namespace and name.
    pub claims: Vec<ClaimHold>,
}

#[allow(clippy::trivially_copy_pass_by_ref)] // Reason: serde's skip_serializing_if passes a reference.
fn is_zero(v: &i64) -> bool {
    *v == 0
}

fn quantity_is_zero(q: &Quantity) -> bool {
    q.is_zero()
}

/// The GPUs of one node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeGpus {
    /// The node (or, for a pool not bound to one node, `pool <name>`).
    pub node: String,
    /// Its GPUs, in published order.
    pub gpus: Vec<GpuRow>,
}

/// Every node with Tessera GPUs, by name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterView {
    /// The nodes.
    pub nodes: Vec<NodeGpus>,
}

fn attribute(device: &res::Device, driver: &str, name: &str) -> Option<String> {
    let attrs = device.attributes.as_ref()?;
    let a = attrs
        .get(name)
        .or_else(|| attrs.get(&format!("{driver}/{name}")))?;
    a.string
        .clone()
        .or_else(|| a.int.map(|i| i.to_string()))
        .or_else(|| a.bool.map(|b| b.to_string()))
        .or_else(|| a.version.clone())
}

fn mode(device: &res::Device, driver: &str) -> String {
    if attribute(device, driver, names::ATTR_TYPE).as_deref() == Some(names::TYPE_MIG) {
        return names::TYPE_MIG.to_owned();
    }
    match attribute(device, driver, names::ATTR_SHARING) {
        Some(s) if s == names::SHARING_SHARED => s,
        _ if device.allow_multiple_allocations == Some(true) => names::SHARING_SHARED.to_owned(),
        _ => names::SHARING_EXCLUSIVE.to_owned(),
    }
}

/// The mode a draining device switches to: the value of its draining taint (`?` without one).
fn draining_to(device: &res::Device) -> Option<String> {
    device
        .taints
        .iter()
        .flatten()
        .find(|t| t.key == names::TAINT_DRAINING)
        .map(|t| t.value.clone().unwrap_or_else(|| "?".to_owned()))
}

/// The pods using `claim`: its `reservedFor` pods, else the pods of its namespace naming it.
fn claim_pods(claim: &res::ResourceClaim, pods: &[core::Pod]) -> Vec<String> {
    let reserved: Vec<String> = claim
        .status
        .iter()
        .flat_map(|s| s.reserved_for.iter().flatten())
        .filter(|r| r.resource == names::POD.plural)
        .map(|r| r.name.clone())
        .collect();
    if !reserved.is_empty() {
        return reserved;
    }
    let name = claim.metadata.name.as_deref().unwrap_or_default();
    let namespace = claim.metadata.namespace.as_deref();
    pods.iter()
        .filter(|p| p.metadata.namespace.as_deref() == namespace)
        .filter(|p| {
            let by_spec = p
                .spec
                .iter()
                .flat_map(|s| s.resource_claims.iter().flatten())
                .any(|rc| rc.resource_claim_name.as_deref() == Some(name));
            let by_status = p
                .status
                .iter()
                .flat_map(|s| s.resource_claim_statuses.iter().flatten())
                .any(|rc| rc.resource_claim_name.as_deref() == Some(name));
            by_spec || by_status
        })
        .filter_map(|p| p.metadata.name.clone())
        .collect()
}

/// Computes the view of every Tessera GPU from the cluster's objects.
///
/// Use comes from the allocator's snapshot of the allocated claims (shares by their recorded
/// amounts, whole devices in full), so it is exactly what the allocator sees.
pub fn cluster_view(
    driver: &str,
    slices: &[res::ResourceSlice],
    classes: &[res::DeviceClass],
    claims: &[res::ResourceClaim],
    pods: &[core::Pod],
) -> Result<ClusterView> {
    let allocated: Vec<res::ResourceClaim> = claims
        .iter()
        .filter(|c| c.status.as_ref().is_some_and(|s| s.allocation.is_some()))
        .cloned()
        .collect();
    let snapshot = Snapshot::for_driver(driver, slices, classes, &allocated)?;
    let mut devices: BTreeMap<(&str, &str), &res::Device> = BTreeMap::new();
    let mut pool_node: BTreeMap<&str, String> = BTreeMap::new();
    for slice in slices.iter().filter(|s| s.spec.driver == driver) {
        let pool = slice.spec.pool.name.as_str();
        let node = slice
            .spec
            .node_name
            .clone()
            .unwrap_or_else(|| format!("pool {pool}"));
        pool_node.entry(pool).or_insert(node);
        for device in slice.spec.devices.iter().flatten() {
            devices.insert((pool, device.name.as_str()), device);
        }
    }
    let mut holders: BTreeMap<(String, String), Vec<ClaimHold>> = BTreeMap::new();
    for claim in &allocated {
        let results = claim
            .status
            .iter()
            .filter_map(|s| s.allocation.as_ref())
            .flat_map(|a| a.devices.iter().flat_map(|d| d.results.iter().flatten()))
            .filter(|r| r.driver == driver);
        let users = claim_pods(claim, pods);
        for r in results {
            let (memory_booked, memory_used) = super::claim::memory_booked_and_used(claim, r);
            let hold = ClaimHold {
                namespace: claim.metadata.namespace.clone().unwrap_or_default(),
                name: claim.metadata.name.clone().unwrap_or_default(),
                pods: users.clone(),
                memory_booked,
                memory_used,
            };
            let list = holders
                .entry((r.pool.clone(), r.device.clone()))
                .or_default();
            if !list.contains(&hold) {
                list.push(hold);
            }
        }
    }
    let mut nodes: BTreeMap<String, Vec<GpuRow>> = BTreeMap::new();
    for usage in snapshot.device_usage() {
        if usage.driver != driver {
            continue;
        }
        let Some(device) = devices.get(&(usage.pool.as_str(), usage.device.as_str())) else {
            continue;
        };
        let total = usage.memory_total;
        let free = Quantity::from_nanos(
            total
                .nanos()
                .saturating_sub(usage.memory_used.nanos())
                .max(0),
            Format::BinarySi,
        );
        let node = pool_node
            .get(usage.pool.as_str())
            .cloned()
            .unwrap_or_else(|| format!("pool {}", usage.pool));
        nodes.entry(node).or_default().push(GpuRow {
            model: attribute(device, driver, names::ATTR_MODEL).unwrap_or_default(),
            mode: mode(device, driver),
            draining_to: draining_to(device),
            isolation: attribute(device, driver, names::ATTR_ISOLATION),
            isolation_reason: attribute(device, driver, names::ATTR_ISOLATION_REASON),
            memory_total: total,
            memory_allocated: usage.memory_used,
            memory_free: free,
            compute_allocated: usage.compute_used,
            compute_free: (100 - usage.compute_used).max(0),
            memory_overcommitted: usage.memory_overcommitted,
            compute_overcommitted: usage.compute_overcommitted,
            exclusive: usage.exclusive,
            shares: usage.shares,
            claims: holders
                .remove(&(usage.pool.clone(), usage.device.clone()))
                .unwrap_or_default(),
            device: usage.device,
        });
    }
    Ok(ClusterView {
        nodes: nodes
            .into_iter()
            .map(|(node, gpus)| NodeGpus { node, gpus })
            .collect(),
    })
}

#[cfg(test)]
mod tests {

    use serde_json::json;

    use super::*;
    use crate::node::inventory::Inventory;
    use crate::node::slices::{RenderOptions, render};
    use crate::placement::allocator::Policy;
    use crate::tools::batch::{BatchInput, BatchOptions, allocate_batch};

    fn slices() -> Vec<res::ResourceSlice> {
        let inventory = Inventory::from_yaml(
            "nodes:\n- name: n\n  gpus:\n  - model: a100-80g\n    mode: shared\n  - model: a100-40g\n    mig:\n    - profile: 1g.5gb\n      count: 2\n",
        )
        .unwrap();
        render(
            inventory.node("n").unwrap(),
            &RenderOptions {
                consumable_capacity: true,
                ..RenderOptions::default()
            },
        )
        .unwrap()
    }

    fn share(name: &str, memory: &str, compute: i64) -> res::ResourceClaim {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns", "uid": name},
            "spec": {"devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": names::CLASS_SHARED_GPU}}],
                "config": [{"opaque": {"driver": names::DEFAULT_DRIVER_NAME, "parameters":
                    {"apiVersion": names::CONFIG_API_VERSION, "kind": "GpuShare", "memory": memory, "compute": compute}}}],
            }},
        }))
        .unwrap()
    }

    /// The claims placed by the allocator, with their allocations recorded.
    fn allocated(
        slices: &[res::ResourceSlice],
        claims: Vec<res::ResourceClaim>,
    ) -> Vec<res::ResourceClaim> {
        let classes: Vec<res::DeviceClass> = vec![serde_json::from_value(json!({
            "metadata": {"name": names::CLASS_SHARED_GPU},
            "spec": {"selectors": [{"cel": {"expression": "device.attributes[\"gpu.tessera.dev\"].sharing == \"shared\""}}]},
        }))
        .unwrap()];
        let outcomes = allocate_batch(
            &BatchInput {
                classes: &classes,
                slices,
                claims: &claims,
                nodes: &[],
                pods: &[],
            },
            &BatchOptions {
                driver_name: names::DEFAULT_DRIVER_NAME.to_owned(),
                policy: Policy::FirstFit,
                node: None,
            },
        )
        .unwrap();
        claims
            .into_iter()
            .zip(outcomes)
            .map(|(mut c, o)| {
                assert!(o.allocated, "{o:?}");
                c.status = Some(res::ResourceClaimStatus {
                    allocation: o.allocation,
                    ..Default::default()
                });
                c
            })
            .collect()
    }

    #[test]
    fn shares_add_up_and_mig_instances_show_as_mig() {
        let slices = slices();
        let claims = allocated(&slices, vec![share("a", "8Gi", 25), share("b", "16Gi", 50)]);
        let view = cluster_view(names::DEFAULT_DRIVER_NAME, &slices, &[], &claims, &[]).unwrap();
        assert_eq!(view.nodes.len(), 1);
        let gpus = &view.nodes[0].gpus;
        let shared = gpus.iter().find(|g| g.device == "gpu-0").unwrap();
        assert_eq!(shared.mode, "shared");
        assert_eq!(shared.shares, 2);
        assert_eq!(shared.memory_allocated.to_string(), "24Gi");
        assert_eq!(shared.memory_free.to_string(), "56Gi");
        assert_eq!((shared.compute_allocated, shared.compute_free), (75, 25));
        let names: Vec<&str> = shared.claims.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        let mig: Vec<&GpuRow> = gpus.iter().filter(|g| g.mode == "mig").collect();
        assert_eq!(mig.len(), 2);
        assert!(
            mig.iter()
                .all(|g| g.claims.is_empty() && g.compute_allocated == 0)
        );
    }

    #[test]
    fn a_shared_gpu_shows_its_isolation_and_why() {
        let mut inventory = Inventory::from_yaml(
            "nodes:\n- name: n\n  mode: shared\n  gpus:\n  - model: h200-141g\n    count: 2\n",
        )
        .unwrap();
        let gpu = &mut inventory.nodes[0].gpus[1];
        gpu.isolation = crate::node::inventory::Isolation::Unverified;
        gpu.isolation_reason = crate::node::isolation::REASON_LIMIT_NOT_ENFORCED.to_owned();
        let slices = render(&inventory.nodes[0], &RenderOptions::default()).unwrap();
        let view = cluster_view(names::DEFAULT_DRIVER_NAME, &slices, &[], &[], &[]).unwrap();
        let gpus = &view.nodes[0].gpus;
        assert_eq!(gpus[0].isolation.as_deref(), Some("verified"));
        assert_eq!(gpus[1].isolation.as_deref(), Some("unverified"));
        assert_eq!(
            gpus[1].isolation_reason.as_deref(),
            Some("limit-not-enforced")
        );
        let json = serde_json::to_value(gpus).unwrap();
        assert_eq!(json[1]["isolationReason"], "limit-not-enforced");
    }

    #[test]
    fn a_draining_gpu_shows_the_mode_it_switches_to() {
        let mut inventory = Inventory::from_yaml(
            "nodes:\n- name: n\n  gpus:\n  - model: a100-80g\n    mode: shared\n  - model: a100-80g\n",
        )
        .unwrap();
        inventory.nodes[0].gpus[0].draining_to = Some(crate::node::inventory::GpuMode::Exclusive);
        let slices = render(
            &inventory.nodes[0],
            &RenderOptions {
                consumable_capacity: true,
                ..RenderOptions::default()
            },
        )
        .unwrap();
        let view = cluster_view(names::DEFAULT_DRIVER_NAME, &slices, &[], &[], &[]).unwrap();
        let gpus = &view.nodes[0].gpus;
        assert_eq!(gpus[0].mode, "shared");
        assert_eq!(gpus[0].draining_to.as_deref(), Some("exclusive"));
        assert_eq!(gpus[1].draining_to, None);
        assert_eq!(
            gpus[1].isolation, None,
            "an exclusive GPU has no isolation to prove"
        );
        let json = serde_json::to_value(gpus).unwrap();
        assert_eq!(json[0]["drainingTo"], "exclusive");
        assert!(json[1].get("drainingTo").is_none());
    }

    #[test]
    fn guaranteed_and_over_committed_are_shown_apart() {
        let slices = slices();
        let classes: Vec<res::DeviceClass> = vec![
            serde_json::from_value(json!({
                "metadata": {"name": names::CLASS_SHARED_GPU},
                "spec": {"selectors": [{"cel": {"expression": "device.attributes[\"gpu.tessera.dev\"].sharing == \"shared\""}}]},
            }))
            .unwrap(),
            serde_json::from_value(json!({
                "metadata": {"name": "batch"},
                "spec": {"selectors": [{"cel": {"expression": "device.attributes[\"gpu.tessera.dev\"].sharing == \"shared\""}}],
                  "config": [{"opaque": {"driver": names::DEFAULT_DRIVER_NAME, "parameters": {
                    "apiVersion": names::CONFIG_API_VERSION, "kind": "TierPolicy", "tier": "batch",
                    "batchComputeOvercommit": 2}}}]},
            }))
            .unwrap(),
        ];
        // Batch over-commits only among batch shares: both shares are batch.
        let batch_of = |name: &str, compute: i64| {
            let mut c = share(name, "8Gi", compute);
            c.spec.devices.as_mut().unwrap().requests.as_mut().unwrap()[0]
                .exactly
                .as_mut()
                .unwrap()
                .device_class_name = "batch".to_owned();
            c
        };
        let batch = batch_of("b", 60);
        let mut snap = Snapshot::new(&slices, &classes, &[]).unwrap();
        let allocator = crate::placement::allocator::Allocator::new(
            crate::placement::allocator::AllocatorOptions::default(),
        );
        let mut claims = Vec::new();
        for mut c in [batch_of("a", 70), batch] {
            let p = allocator
                .allocate(&snap, &[&c], &[crate::tools::batch::bare_node("n")])
                .unwrap();
            snap.commit(&c, &p.allocations[0]);
            c.status = Some(res::ResourceClaimStatus {
                allocation: Some(p.allocations[0].clone()),
                ..Default::default()
            });
            claims.push(c);
        }
        let view =
            cluster_view(names::DEFAULT_DRIVER_NAME, &slices, &classes, &claims, &[]).unwrap();
        let gpu = &view.nodes[0].gpus[0];
        // 70 online + 30 of the batch share guaranteed; the batch share's other 30 over.
        assert_eq!((gpu.compute_allocated, gpu.compute_free), (100, 0));
        assert_eq!(gpu.compute_overcommitted, 30);
        assert!(gpu.memory_overcommitted.is_zero());
        let json = serde_json::to_value(gpu).unwrap();
        assert_eq!(json["computeOvercommitted"], 30);
        assert!(json.get("memoryOvercommitted").is_none());
    }

    #[test]
    fn other_drivers_devices_are_left_out() {
        let view = cluster_view("other.example.com", &slices(), &[], &[], &[]).unwrap();
        assert!(view.nodes.is_empty());
    }
}
