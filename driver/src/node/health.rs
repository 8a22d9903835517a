//! Device health: which GPU events make a GPU unhealthy, and the health of every device the
//! node publishes, as kubelet's health stream reports it.
//!
//! A GPU is unhealthy after an event that means its state can no longer be trusted: the GPU
//! fell off the bus, or an XID error that NVIDIA documents as needing a GPU reset or a node
//! reboot (memory faults that the driver could not contain, uncorrectable ECC, NVLink or
//! fabric failures). XIDs that report a fault of one application (an illegal address, a
//! kernel that was stopped, a page fault in one process's context) leave the GPU healthy:
//! the application failed, not the device, and tainting the GPU would take it from every
//! other tenant for one bad kernel. An XID this table does not know is taken as fatal, so a
//! new failure mode errs on the side of not placing claims on a suspicious GPU.

use std::collections::BTreeMap;

use crate::node::inventory::{GpuMode, NodeInventory};

/// XIDs that report a fault of one application's work, not of the GPU (the GPU stays healthy).
///
/// 13: graphics engine exception (an illegal instruction or address in a kernel),
/// 31: GPU memory page fault in one context,
/// 43: GPU stopped processing (a kernel was killed, typically by the user),
/// 45: preemptive cleanup after an earlier error (a process was torn down),
/// 68: video processor exception in one stream.
pub const APPLICATION_XIDS: [u64; 5] = [13, 31, 43, 45, 68];

/// XIDs that are known to need a GPU reset or a node reboot (the GPU becomes unhealthy).
///
/// 48: double-bit ECC error, 63/64: ECC page retirement or row remapping event/failure,
/// 74: NVLink error, 79: GPU has fallen off the bus, 92: high single-bit ECC rate,
/// 94/95: contained/uncontained ECC error, 119/120: GSP RPC timeout / GSP error.
pub const FATAL_XIDS: [u64; 10] = [48, 63, 64, 74, 79, 92, 94, 95, 119, 120];

/// The health of a device, in the terms of the DRA health API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Health {
    /// The device works.
    Healthy,
    /// The device has failed; claims should not be placed on it.
    Unhealthy,
    /// The device's health cannot be told (for instance while its GPU does not answer).
    Unknown,
}

/// Something that happened to one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuEvent {
    /// The driver reported an XID error with this number.
    Xid(u64),
    /// The GPU stopped answering (NVML's "GPU is lost").
    Lost,
    /// The GPU answered a query again after it was lost.
    Answering,
}

/// Whether an XID makes the GPU unhealthy: everything except [`APPLICATION_XIDS`].
pub fn xid_is_fatal(xid: u64) -> bool {
    !APPLICATION_XIDS.contains(&xid)
}

/// What one GPU's health is after `event`, starting from `current`.
///
/// A fatal XID is final for the life of the process (only a GPU reset clears it, and a reset
/// restarts the plugin's view of the GPU with a new discovery); a lost GPU that answers again is
/// healthy again unless a fatal XID was seen, which `fatal_seen` says.
pub fn after_event(current: Health, event: GpuEvent, fatal_seen: bool) -> Health {
    match event {
        GpuEvent::Xid(xid) if xid_is_fatal(xid) => Health::Unhealthy,
        GpuEvent::Xid(_) => current,
        GpuEvent::Lost => Health::Unhealthy,
        GpuEvent::Answering if fatal_seen => Health::Unhealthy,
        GpuEvent::Answering => Health::Healthy,
    }
}

/// The health of each GPU of a node as events arrive, by GPU UUID; a GPU no event named is
/// healthy.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GpuHealthTracker {
    gpus: BTreeMap<String, (Health, bool)>,
}

impl GpuHealthTracker {
    /// A tracker where every GPU is healthy.
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes `event` of the GPU `uuid`; returns whether its health changed.
    pub fn observe(&mut self, uuid: &str, event: GpuEvent) -> bool {
        let (current, fatal_seen) = self
            .gpus
            .get(uuid)
            .copied()
            .unwrap_or((Health::Healthy, false));
        let fatal = fatal_seen || matches!(event, GpuEvent::Xid(x) if xid_is_fatal(x));
        let next = after_event(current, event, fatal);
        self.gpus.insert(uuid.to_owned(), (next, fatal));
        next != current
    }

    /// The GPU's health now.
    pub fn health(&self, uuid: &str) -> Health {
        self.gpus.get(uuid).map_or(Health::Healthy, |(h, _)| *h)
    }

    /// Marks every GPU of `node` with its tracked health (`healthy` is false unless
    /// [`Health::Healthy`]).
    pub fn apply(&self, node: &mut NodeInventory) {
        for gpu in &mut node.gpus {
            gpu.healthy = self.health(&gpu.uuid) == Health::Healthy;
        }
    }
}

/// The health of every device `node` publishes, by device name: a GPU's devices (the GPU, or
/// its MIG instances) all share the GPU's health.
pub fn device_health(node: &NodeInventory) -> BTreeMap<String, Health> {
    let mut out = BTreeMap::new();
    for gpu in &node.gpus {
        let health = if gpu.healthy {
            Health::Healthy
        } else {
            Health::Unhealthy
        };
        match gpu.mode {
            GpuMode::Mig => {
                for mig in &gpu.mig_instances {
                    out.insert(mig.device_name(gpu.index), health);
                }
            }
            GpuMode::Exclusive | GpuMode::Shared => {
                out.insert(gpu.device_name(), health);
            }
        }
    }
    out
}

/// One device's reported health and since when (Unix seconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthEntry {
    /// The health.
    pub health: Health,
    /// When the health was last checked, in Unix seconds.
    pub updated_unix: i64,
}

/// The health of every device of one pool, as the health stream reports it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HealthBoard {
    /// The pool (the node's name).
    pub pool: String,
    /// Each device's health, by device name.
    pub devices: BTreeMap<String, HealthEntry>,
}

/// What changed between two boards.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HealthChange {
    /// Devices whose health changed or that appeared, with their new entry.
    pub changed: Vec<(String, HealthEntry)>,
    /// Devices that are no longer published (reported once as [`Health::Unknown`]).
    pub removed: Vec<String>,
}

impl HealthChange {
    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.changed.is_empty() && self.removed.is_empty()
    }
}

impl HealthBoard {
    /// The board of `node` as checked at `now` (Unix seconds).
    pub fn of(node: &NodeInventory, now: i64) -> Self {
        Self {
            pool: node.name.clone(),
            devices: device_health(node)
                .into_iter()
                .map(|(d, health)| {
                    (
                        d,
                        HealthEntry {
                            health,
                            updated_unix: now,
                        },
                    )
                })
                .collect(),
        }
    }

    /// Takes `node`'s health as checked at `now`; a device whose health did not change keeps its
    /// time (the stream reports changes, not checks). Returns what changed.
    pub fn update(&mut self, node: &NodeInventory, now: i64) -> HealthChange {
        let next = device_health(node);
        let mut change = HealthChange::default();
        let removed: Vec<String> = self
            .devices
            .keys()
            .filter(|d| !next.contains_key(*d))
            .cloned()
            .collect();
        for d in removed {
            self.devices.remove(&d);
            change.removed.push(d);
        }
        for (device, health) in next {
            let entry = HealthEntry {
                health,
                updated_unix: now,
            };
            match self.devices.get(&device) {
                Some(old) if old.health == health => {}
                _ => {
                    self.devices.insert(device.clone(), entry);
                    change.changed.push((device, entry));
                }
            }
        }
        self.pool.clone_from(&node.name);
        change
    }

    /// What a reader who saw `self` must be told to know `newer`: devices whose entry differs
    /// or is new, and devices `newer` no longer has.
    pub fn changes_to(&self, newer: &HealthBoard) -> HealthChange {
        HealthChange {
            changed: newer
                .devices
                .iter()
                .filter(|(d, e)| self.devices.get(*d) != Some(*e))
                .map(|(d, e)| (d.clone(), *e))
                .collect(),
            removed: self
                .devices
                .keys()
                .filter(|d| !newer.devices.contains_key(*d))
                .cloned()
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {

    use super::*;

    const NODE: &str = "nodes:\n- name: n\n  gpus:\n  - model: a100-80g\n    count: 2\n  - model: a100-80g\n    mode: mig\n    mig:\n    - profile: 3g.40gb\n      count: 2\n";

    fn node() -> NodeInventory {
        crate::testing::node_inventory(NODE)
    }

    #[test]
    fn application_xids_leave_the_gpu_healthy_and_others_do_not() {
        for xid in APPLICATION_XIDS {
            assert!(!xid_is_fatal(xid), "{xid}");
            assert_eq!(
                after_event(Health::Healthy, GpuEvent::Xid(xid), false),
                Health::Healthy
            );
        }
        for xid in FATAL_XIDS {
            assert!(xid_is_fatal(xid), "{xid}");
        }
        assert!(xid_is_fatal(9999), "an unknown XID errs on the safe side");
        assert_eq!(
            after_event(Health::Healthy, GpuEvent::Xid(79), false),
            Health::Unhealthy
        );
    }

    #[test]
    fn a_lost_gpu_recovers_when_it_answers_unless_a_fatal_xid_was_seen() {
        let lost = after_event(Health::Healthy, GpuEvent::Lost, false);
        assert_eq!(lost, Health::Unhealthy);
        assert_eq!(
            after_event(lost, GpuEvent::Answering, false),
            Health::Healthy
        );
        assert_eq!(
            after_event(lost, GpuEvent::Answering, true),
            Health::Unhealthy
        );
    }

    #[test]
    fn the_tracker_keeps_a_gpu_unhealthy_after_a_fatal_xid() {
        let mut t = GpuHealthTracker::new();
        assert!(!t.observe("GPU-1", GpuEvent::Xid(13)));
        assert!(t.observe("GPU-1", GpuEvent::Lost));
        assert!(t.observe("GPU-1", GpuEvent::Answering));
        assert_eq!(t.health("GPU-1"), Health::Healthy);
        assert!(t.observe("GPU-1", GpuEvent::Xid(79)));
        assert!(!t.observe("GPU-1", GpuEvent::Answering));
        let mut n = node();
        n.gpus[1].uuid = "GPU-1".to_owned();
        t.apply(&mut n);
        assert!(n.gpus[0].healthy);
        assert!(!n.gpus[1].healthy);
    }

    #[test]
    fn every_published_device_has_its_gpus_health() {
        let mut n = node();
        n.gpus[2].healthy = false;
        let health = device_health(&n);
        assert_eq!(
            health.keys().cloned().collect::<Vec<_>>(),
            [
                "gpu-0",
                "gpu-1",
                "gpu-2-mig-3g-40gb-0",
                "gpu-2-mig-3g-40gb-4"
            ]
        );
        assert_eq!(health["gpu-0"], Health::Healthy);
        assert_eq!(health["gpu-2-mig-3g-40gb-4"], Health::Unhealthy);
    }

    #[test]
    fn the_board_reports_changes_only_and_keeps_times_of_unchanged_devices() {
        let mut n = node();
        let mut board = HealthBoard::of(&n, 100);
        assert!(board.update(&n, 200).is_empty());
        assert_eq!(board.devices["gpu-0"].updated_unix, 100);

        n.gpus[1].healthy = false;
        let change = board.update(&n, 300);
        assert_eq!(
            change.changed,
            vec![(
                "gpu-1".to_owned(),
                HealthEntry {
                    health: Health::Unhealthy,
                    updated_unix: 300
                }
            )]
        );
        assert_eq!(board.devices["gpu-0"].updated_unix, 100);

        let before = board.clone();
        n.gpus.remove(0);
        let change = board.update(&n, 400);
        assert_eq!(before.changes_to(&board), change);
        assert_eq!(change.removed, vec!["gpu-0".to_owned()]);
        assert!(change.changed.is_empty());
    }
}
