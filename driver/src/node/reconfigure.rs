//! Taking a re-discovered inventory without pulling hardware from under running claims.
//!
//! When the node's inventory changes (a GPU added, marked unhealthy, its mode switched), the
//! plugin prepares later claims against the new one. A GPU whose configuration (mode, or MIG
//! layout) changed while prepared claims hold it keeps its old configuration: its devices are
//! in use by running pods, so the change is refused and reported, and is taken once the
//! claims are gone (the next discovery after that sees the same change again). Meanwhile the
//! GPU is marked as draining (`Gpu::draining_to`), so it is published with the draining taint
//! and no new claim lands on it.

use crate::node::checkpoint::Checkpoint;
use crate::node::inventory::{Gpu, GpuMode, NodeInventory};

/// A configuration change refused because claims hold the GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The GPU's device name (`gpu-<index>`).
    pub gpu: String,
    /// The GPU's UUID.
    pub uuid: String,
    /// The mode the GPU keeps.
    pub current: GpuMode,
    /// The mode the new inventory asked for (the same mode when only the MIG layout changed).
    pub requested: GpuMode,
    /// UIDs of the claims holding the GPU.
    pub holders: Vec<String>,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GPU {} ({}): switching from {} to {} is refused while claims {} hold it",
            self.gpu,
            self.uuid,
            self.current.as_str(),
            self.requested.as_str(),
            self.holders.join(", ")
        )
    }
}

/// The outcome of [`reconfigure`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reconfigured {
    /// The inventory to prepare claims against from now on.
    pub inventory: NodeInventory,
    /// The GPUs whose change was refused.
    pub refusals: Vec<Refusal>,
}

/// Whether `new` configures the GPU differently from `old` in a way that changes its devices.
fn configuration_changed(old: &Gpu, new: &Gpu) -> bool {
    old.mode != new.mode || (old.mode == GpuMode::Mig && old.mig_instances != new.mig_instances)
}

/// The inventory to use after discovery found `new` where `old` was, given the claims
/// `prepared` records (any state: a claim being prepared or unprepared holds its devices too).
/// Everything of `new` is taken, except the configuration of GPUs that are held and whose
/// configuration changed: those keep `old`'s mode and MIG instances (their health and other
/// facts still come from `new`) and are marked as draining to `new`'s mode.
pub fn reconfigure(
    old: &NodeInventory,
    new: &NodeInventory,
    prepared: &Checkpoint,
) -> Reconfigured {
    let mut inventory = new.clone();
    let mut refusals = Vec::new();
    for gpu in &mut inventory.gpus {
        let Some(before) = old.gpus.iter().find(|g| g.uuid == gpu.uuid) else {
            continue;
        };
        if !configuration_changed(before, gpu) {
            continue;
        }
        let holders: Vec<String> = prepared
            .claims
            .iter()
            .filter(|(_, e)| e.devices.iter().any(|d| d.gpu_uuid == gpu.uuid))
            .map(|(uid, _)| uid.clone())
            .collect();
        if holders.is_empty() {
            continue;
        }
        refusals.push(Refusal {
            gpu: gpu.device_name(),
            uuid: gpu.uuid.clone(),
            current: before.mode,
            requested: gpu.mode,
            holders,
        });
        gpu.draining_to = Some(gpu.mode);
        gpu.mode = before.mode;
        gpu.mig_instances.clone_from(&before.mig_instances);
    }
    Reconfigured {
        inventory,
        refusals,
    }
}

/// The draining GPUs of `node` that no claim `prepared` records holds any more (by device
/// name): the next discovery switches them.
pub fn released(node: &NodeInventory, prepared: &Checkpoint) -> Vec<String> {
    node.gpus
        .iter()
        .filter(|g| g.draining_to.is_some())
        .filter(|g| {
            !prepared
                .claims
                .values()
                .any(|e| e.devices.iter().any(|d| d.gpu_uuid == g.uuid))
        })
        .map(Gpu::device_name)
        .collect()
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::node::checkpoint::{ClaimEntry, HeldDevice, PrepareState};

    fn node() -> NodeInventory {
        crate::testing::demo_node("a100-node")
    }

    fn holding(uid: &str, gpu: &Gpu) -> Checkpoint {
        let mut record = Checkpoint::new("b");
        record.claims.insert(
            uid.to_owned(),
            ClaimEntry {
                namespace: "ns".to_owned(),
                name: "c".to_owned(),
                state: PrepareState::PrepareCompleted,
                devices: vec![HeldDevice {
                    request: "gpu".to_owned(),
                    pool: "a100-node".to_owned(),
                    device: gpu.device_name(),
                    gpu_uuid: gpu.uuid.clone(),
                    mig: false,
                    exclusive: true,
                    cdi_ids: Vec::new(),
                    share_memory_bytes: None,
                    share_compute_percent: None,
                    share_id: None,
                    share_tier: None,
                }],
                host_dirs: Vec::new(),
                mps_daemon: None,
            },
        );
        record
    }

    /// Asserts that `out` takes `wanted` as it is, refusing nothing.
    fn assert_taken(out: &Reconfigured, wanted: &NodeInventory) {
        assert_eq!(&out.inventory, wanted);
        assert!(out.refusals.is_empty());
    }

    fn switched(node: &NodeInventory, index: usize) -> NodeInventory {
        let mut next = node.clone();
        next.gpus[index].mode = if next.gpus[index].mode == GpuMode::Shared {
            GpuMode::Exclusive
        } else {
            GpuMode::Shared
        };
        next
    }

    #[test]
    fn change_of_a_free_gpu_is_taken() {
        let old = node();
        let new = switched(&old, 1);
        let out = reconfigure(&old, &new, &holding("u1", &old.gpus[0]));
        assert_taken(&out, &new);
    }

    #[test]
    fn change_of_a_held_gpu_is_refused_and_the_rest_taken() {
        let old = node();
        let mut new = switched(&old, 0);
        new.gpus[0].healthy = !old.gpus[0].healthy;
        new.gpus[1] = switched(&old, 1).gpus[1].clone();
        let out = reconfigure(&old, &new, &holding("u1", &old.gpus[0]));
        assert_eq!(out.refusals.len(), 1);
        let refusal = &out.refusals[0];
        assert_eq!(refusal.uuid, old.gpus[0].uuid);
        assert_eq!(refusal.current, old.gpus[0].mode);
        assert_eq!(refusal.requested, new.gpus[0].mode);
        assert_eq!(refusal.holders, vec!["u1".to_owned()]);
        assert!(refusal.to_string().contains("refused"), "{refusal}");
        assert_eq!(out.inventory.gpus[0].mode, old.gpus[0].mode);
        assert_eq!(out.inventory.gpus[0].draining_to, Some(new.gpus[0].mode));
        assert_eq!(out.inventory.gpus[1].draining_to, None);
        // Health is a fact, not a configuration: it is always taken.
        assert_eq!(out.inventory.gpus[0].healthy, new.gpus[0].healthy);
        assert_eq!(out.inventory.gpus[1], new.gpus[1]);
    }

    #[test]
    fn a_draining_gpu_switches_once_its_claims_are_gone() {
        let old = node();
        let new = switched(&old, 0);
        let draining = reconfigure(&old, &new, &holding("u1", &old.gpus[0])).inventory;
        assert_eq!(draining.gpus[0].draining_to, Some(new.gpus[0].mode));
        // Still held: still draining, nothing else changes.
        let again = reconfigure(&draining, &new, &holding("u1", &old.gpus[0]));
        assert_eq!(again.inventory, draining);
        // Released: the change is taken and the mark goes.
        let released = reconfigure(&draining, &new, &Checkpoint::new("b"));
        assert_taken(&released, &new);
        // The admin changed their mind while it drained: the mark goes too.
        let reverted = reconfigure(&draining, &old, &holding("u1", &old.gpus[0]));
        assert_eq!(reverted.inventory, old);
    }

    #[test]
    fn a_draining_gpu_is_released_when_no_claim_holds_it() {
        let old = node();
        let mut draining = reconfigure(
            &old,
            &switched(&switched(&old, 0), 1),
            &holding("u1", &old.gpus[0]),
        )
        .inventory;
        assert!(released(&draining, &holding("u1", &old.gpus[0])).is_empty());
        assert_eq!(
            released(&draining, &Checkpoint::new("b")),
            vec![old.gpus[0].device_name()]
        );
        // A GPU that is not draining is never reported.
        draining.gpus[0].draining_to = None;
        assert!(released(&draining, &Checkpoint::new("b")).is_empty());
    }

    #[test]
    fn unchanged_inventory_is_taken_as_is() {
        let old = node();
        let out = reconfigure(&old, &old, &holding("u1", &old.gpus[0]));
        assert_taken(&out, &old);
    }

    #[test]
    fn added_and_removed_gpus_are_taken() {
        let old = node();
        let mut new = old.clone();
        let gone = new.gpus.remove(0);
        let out = reconfigure(&old, &new, &holding("u1", &gone));
        assert_eq!(out.inventory, new);
        let out = reconfigure(&new, &old, &holding("u1", &gone));
        assert_eq!(out.inventory, old);
    }
}
