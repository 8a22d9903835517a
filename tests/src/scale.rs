//! What the scale benchmarks share (`controller_scale`, `view_scale`, `control_plane_scale`):
//! the cluster of issue 15's measurement, the same pods in every run, and reading a process's
//! CPU time and memory from `/proc`.

use std::time::Duration;

use serde_json::{Value, json};
use tessera_driver::apiversion::{self, ApiVersion};
use tessera_driver::names;
use tessera_driver::node::inventory::Inventory;
use tessera_driver::node::slices::{self, RenderOptions};

use crate::fake_apiserver::FakeApiServer;

/// GPUs per node.
pub const GPUS: usize = 8;

/// `nodes` nodes `node-0000`… with 8 shared A100-80G each, NVLink islands of 4, two NUMA nodes.
///
/// # Panics
///
/// Never for any `nodes`: the text is well-formed by construction.
#[must_use]
pub fn inventory(nodes: usize) -> Inventory {
    use std::fmt::Write as _;
    let mut text = String::from("nodes:\n");
    for i in 0..nodes {
        let _ = write!(
            text,
            "- name: node-{i:04}\n  mode: shared\n  numaNodes: 2\n  gpus:\n  - model: a100-80g\n    count: {GPUS}\n    nvlinkIslandSize: 4\n"
        );
    }
    // The text above is valid by construction.
    Inventory::from_yaml(&text).expect("the scale inventory parses")
}

/// Fills the fake API server with the DeviceClasses `gpu.tessera.dev` and
/// `shared.gpu.tessera.dev` from the repository's `deviceclasses/`, and for every node of
/// `inventory` a Node (hostname, os and arch labels) with `status(name)` and its ResourceSlices in
/// v1 (consumable capacity).
///
/// # Panics
///
/// When a class file is missing or the server refuses an object: a benchmark's set-up.
#[allow(clippy::unwrap_used, reason = "a benchmark's set-up, failing loudly")]
pub fn seed_fake(server: &FakeApiServer, inventory: &Inventory, status: impl Fn(&str) -> Value) {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap();
    for file in ["gpu.yaml", "shared-gpu.yaml"] {
        let text = std::fs::read_to_string(repo.join("deviceclasses").join(file)).unwrap();
        let value: Value = serde_yaml::from_str(&text).unwrap();
        server.create("deviceclasses", value).unwrap();
    }
    let options = RenderOptions {
        consumable_capacity: true,
        ..RenderOptions::default()
    };
    for node in &inventory.nodes {
        server
            .create(
                "nodes",
                json!({"apiVersion": "v1", "kind": "Node",
                       "metadata": {"name": node.name, "labels": {
                           names::LABEL_HOSTNAME: node.name,
                           "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}}}),
            )
            .unwrap();
        server
            .set_status("nodes", None, &node.name, &status(&node.name))
            .unwrap();
        for slice in slices::render(node, &options).unwrap() {
            server
                .create(
                    "resourceslices",
                    apiversion::encode_slice(&slice, ApiVersion::V1).unwrap(),
                )
                .unwrap();
        }
    }
}

/// A deterministic sequence (xorshift), so every run asks for the same pods.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    /// The next number below `n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// The next pod's claim spec: 70 % shares (memory 5–40Gi and compute 5–50, steps of 5), 25 %
/// whole GPUs (memory 80Gi, compute 100), 5 % two GPUs on one NVLink island.
pub fn claim_spec(rng: &mut Rng) -> Value {
    let roll = rng.below(100);
    let class = names::CLASS_SHARED_GPU;
    if roll < 70 {
        let memory = 5 * (1 + rng.below(8));
        let compute = 5 * (1 + rng.below(10));
        json!({"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": class,
            "capacity": {"requests": {"memory": format!("{memory}Gi"), "compute": compute.to_string()}}}}]}})
    } else if roll < 95 {
        json!({"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": class,
            "capacity": {"requests": {"memory": "80Gi", "compute": "100"}}}}]}})
    } else {
        json!({"devices": {
            "requests": [{"name": "gpus", "exactly": {"deviceClassName": class, "count": 2,
                "capacity": {"requests": {"memory": "80Gi", "compute": "100"}}}}],
            "constraints": [{"requests": ["gpus"],
                "matchAttribute": format!("{}/{}", names::DEFAULT_DRIVER_NAME, names::ATTR_NVLINK_DOMAIN)}]}})
    }
}

/// A number field of `/proc/<pid>/status` (`VmHWM:`, `VmRSS:`, in KiB), if the process lives.
pub fn proc_status(pid: u32, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// The process's user plus system CPU time so far (zero once it is gone).
pub fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command (which may hold spaces) start after the last ')'.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // utime and stime are fields 14 and 15 of stat, 12 and 13 after the command, in clock
    // ticks of 1/100 s on every common Linux configuration.
    Duration::from_millis((ticks(11) + ticks(12)) * 10)
}

/// The `p`th percentile of `sorted` (zero when empty).
pub fn percentile(sorted: &[Duration], p: usize) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[(sorted.len() * p / 100).min(sorted.len() - 1)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_pods_every_run_in_the_measured_mix() {
        let specs = |seed| {
            let mut rng = Rng(seed);
            (0..1_000).map(|_| claim_spec(&mut rng)).collect::<Vec<_>>()
        };
        let a = specs(0x5eed_1234_abcd_ef01);
        assert_eq!(a, specs(0x5eed_1234_abcd_ef01));
        let pairs = a
            .iter()
            .filter(|s| s["devices"]["requests"][0]["exactly"]["count"] == 2)
            .count();
        assert!((20..=80).contains(&pairs), "about 5 % pairs: {pairs}");
        assert_eq!(inventory(3).nodes.len(), 3);
        let ms = |n| Duration::from_millis(n);
        assert_eq!(percentile(&[ms(1), ms(2), ms(3), ms(4)], 50), ms(3));
        assert_eq!(percentile(&[], 99), Duration::ZERO);
        assert!(cpu_time(std::process::id()) >= Duration::ZERO);
        assert!(proc_status(std::process::id(), "VmHWM:").is_some_and(|k| k > 0));
    }
}
