//! Resolving what a GPU library reports about a node (NVML on real nodes) into the inventory
//! model: model short names, MIG instance names, NVLink islands, PCI and NUMA facts.
//!
//! The kubelet plugin asks the library and fills [`DiscoveredNode`]; [`resolve`] decides the
//! rest, so the decisions are tested without a GPU.

use std::collections::{BTreeMap, BTreeSet};

use super::file::normalize_pci_bus_id;
use super::mig::{self, Wanted};
use super::models::{self, GpuModel};
use super::{Gpu, GpuMode, MigIds, MigInstance, NodeInventory};
use crate::error::{Error, Result};

const MIB: u64 = 1024 * 1024;
const GIB: u64 = 1024 * MIB;

/// What the library reports about a node.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DiscoveredNode {
    /// The Kubernetes node name.
    pub name: String,
    /// The NVIDIA driver version, e.g. `550.54.15`.
    pub driver_version: String,
    /// The CUDA driver version as NVML encodes it (`1000 * major + 10 * minor`, e.g. 12040).
    pub cuda_driver_version: i32,
    /// The GPUs, in NVML index order.
    pub gpus: Vec<DiscoveredGpu>,
}

/// What the library reports about one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DiscoveredGpu {
    /// NVML index.
    pub index: u32,
    /// The minor number of the GPU's device node (`/dev/nvidia<minor>`).
    pub minor: u32,
    /// `GPU-<uuid>`.
    pub uuid: String,
    /// Product name, e.g. `NVIDIA A100-SXM4-80GB`.
    pub product_name: String,
    /// Brand, e.g. `Tesla`.
    pub brand: String,
    /// Architecture, e.g. `Ampere`.
    pub architecture: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Total memory in bytes.
    pub memory_bytes: u64,
    /// Streaming multiprocessors, when the library reports them.
    pub multiprocessors: Option<u32>,
    /// PCI bus id as the library writes it (`00000000:07:00.0`).
    pub pci_bus_id: String,
    /// The `PCIe` root complex (`pci0000:00`), when the host tells it.
    pub pcie_root: Option<String>,
    /// NUMA node, when the host tells it.
    pub numa_node: Option<u32>,
    /// Whether the GPU supports MIG.
    pub mig_capable: bool,
    /// Whether MIG mode is enabled now.
    pub mig_enabled: bool,
    /// The MIG devices, when MIG mode is enabled.
    pub mig_devices: Vec<DiscoveredMig>,
    /// PCI bus ids of the GPUs at the far end of this GPU's active `NVLinks`.
    pub nvlink_peers: Vec<String>,
}

/// What the library reports about one MIG device.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DiscoveredMig {
    /// `MIG-<uuid>`.
    pub uuid: String,
    /// The GPU instance and compute instance ids, when the library reports them.
    pub ids: Option<MigIds>,
    /// The device name NVML reports, e.g. `NVIDIA A100-SXM4-80GB MIG 1g.10gb`.
    pub name: String,
    /// Usable memory in bytes.
    pub memory_bytes: u64,
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// Compute slices of the GPU instance.
    pub compute_slices: u32,
    /// Start placement of the GPU instance, when the library reports it.
    pub placement: Option<u32>,
}

fn err(field: String, message: String) -> Error {
    Error::Inventory { field, message }
}

/// The model short name of a product: the table's id when the product is known and its memory
/// is the table's (within a tenth: one product name can come in two memory sizes, as the H20
/// does), else the product name without vendor words and form factors, lower case,
/// dash-separated, with the memory in whole GiB rounded up (`NVIDIA L40S` with 45 GiB becomes
/// `l40s-45g`).
pub fn model_id(product_name: &str, memory_bytes: u64) -> String {
    if let Some(model) = models::lookup(product_name)
        && model.memory_bytes.abs_diff(memory_bytes) <= model.memory_bytes / 10
    {
        return model.id.to_owned();
    }
    let lower = product_name.to_ascii_lowercase();
    let words: Vec<&str> = lower
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| !w.is_empty())
        .filter(|w| !matches!(*w, "nvidia" | "tesla" | "geforce" | "quadro"))
        .filter(|w| !(w.starts_with("sxm") || w.starts_with("pcie") || w.starts_with("hbm")))
        .filter(|w| !(w.ends_with("gb") && w[..w.len() - 2].bytes().all(|b| b.is_ascii_digit())))
        .collect();
    let gib = memory_bytes.div_ceil(GIB);
    if words.is_empty() {
        return format!("gpu-{gib}g");
    }
    format!("{}-{gib}g", words.join("-"))
}

/// The MIG profile of a MIG device from its NVML name (`... MIG 1g.10gb` gives `1g.10gb`).
pub fn mig_profile_name(device_name: &str) -> Option<&str> {
    let (_, profile) = device_name.rsplit_once(" MIG ")?;
    let profile = profile.trim();
    let valid = !profile.is_empty()
        && profile
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'+' || b == b'-');
    valid.then_some(profile)
}

/// `NVLink` islands: GPUs connected through active links (directly or through other GPUs)
/// share a domain id `<node>-nvlink-<k>`, islands numbered by their lowest GPU index; a GPU
/// without `NVLink` peers is on no island. Peers that are not GPUs of the node (`NVSwitch`
/// chips show up as peers with their own bus ids) connect the GPUs that reach the same peer.
pub fn nvlink_islands(node: &str, gpus: &[DiscoveredGpu]) -> BTreeMap<u32, String> {
    // Union-find over GPU indices and foreign peer ids.
    let mut parent: BTreeMap<String, String> = BTreeMap::new();
    let key_of_bus: BTreeMap<String, String> = gpus
        .iter()
        .map(|g| {
            (
                normalize_pci_bus_id(&g.pci_bus_id).unwrap_or_else(|| g.pci_bus_id.clone()),
                format!("gpu/{}", g.index),
            )
        })
        .collect();
    let mut linked = BTreeSet::new();
    for g in gpus {
        let me = format!("gpu/{}", g.index);
        parent.entry(me.clone()).or_insert_with(|| me.clone());
        for peer in &g.nvlink_peers {
            let bus = normalize_pci_bus_id(peer).unwrap_or_else(|| peer.clone());
            let other = key_of_bus
                .get(&bus)
                .cloned()
                .unwrap_or_else(|| format!("peer/{bus}"));
            if other == me {
                continue;
            }
            parent.entry(other.clone()).or_insert_with(|| other.clone());
            let (a, b) = (find(&mut parent, &me), find(&mut parent, &other));
            if a != b {
                parent.insert(a, b);
            }
            linked.insert(g.index);
            if let Some(i) = other.strip_prefix("gpu/").and_then(|i| i.parse().ok()) {
                linked.insert(i);
            }
        }
    }
    let mut island_of_root: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeMap::new();
    let mut ordered: Vec<u32> = gpus.iter().map(|g| g.index).collect();
    ordered.sort_unstable();
    for index in ordered {
        if !linked.contains(&index) {
            continue;
        }
        let root = find(&mut parent, &format!("gpu/{index}"));
        let next = island_of_root.len();
        let k = *island_of_root.entry(root).or_insert(next);
        out.insert(index, format!("{node}-nvlink-{k}"));
    }
    out
}

/// The representative of `x`'s set in a union-find forest, compressing the path to it.
fn find(parent: &mut BTreeMap<String, String>, x: &str) -> String {
    let mut root = x.to_owned();
    while let Some(p) = parent.get(&root).filter(|p| **p != root) {
        root.clone_from(p);
    }
    let mut cur = x.to_owned();
    while cur != root {
        let next = parent.get(&cur).cloned().unwrap_or_else(|| root.clone());
        parent.insert(cur, root.clone());
        cur = next;
    }
    root
}

/// `major.minor` of NVML's CUDA driver version (12040 is `12.4`).
pub fn cuda_version(encoded: i32) -> String {
    format!("{}.{}", encoded / 1000, (encoded % 1000) / 10)
}

/// The root complex of a bus id when the host does not tell it: the GPU's own domain and bus.
fn own_root(pci_bus_id: &str) -> String {
    let mut parts = pci_bus_id.split(':');
    let domain = parts.next().unwrap_or("0000");
    let bus = parts.next().unwrap_or("00");
    format!("pci{domain}:{bus}")
}

fn mig_instances(
    gpu: &DiscoveredGpu,
    model: Option<&'static GpuModel>,
    field: &str,
) -> Result<Vec<MigInstance>> {
    let total_slices = model.map_or(7, |m| m.mig_compute_slices.max(1));
    let mut named = Vec::with_capacity(gpu.mig_devices.len());
    let mut ids_seen = BTreeSet::new();
    for (i, m) in gpu.mig_devices.iter().enumerate() {
        // Two MIG devices with one pair of ids would share their capability minors.
        if let Some(ids) = m.ids
            && !ids_seen.insert(ids)
        {
            return Err(err(
                format!("{field}.migDevices[{i}]"),
                format!(
                    "GPU instance {} with compute instance {} is reported for two MIG devices",
                    ids.gpu_instance, ids.compute_instance
                ),
            ));
        }
        let profile = mig_profile_name(&m.name).ok_or_else(|| {
            err(
                format!("{field}.migDevices[{i}].name"),
                format!(
                    "{:?} names no MIG profile (expected `<product> MIG <profile>`)",
                    m.name
                ),
            )
        })?;
        named.push((m, profile));
    }
    // Placements the library did not report are the ones Tessera's own placement search
    // gives the same profiles: stable while the layout stays.
    let known: Option<Vec<Wanted>> = model.and_then(|model| {
        named
            .iter()
            .map(|(m, p)| {
                model.mig_profile(p).map(|profile| Wanted {
                    profile,
                    placement: m.placement,
                })
            })
            .collect()
    });
    let mut placed: Vec<Option<u32>> = named.iter().map(|(m, _)| m.placement).collect();
    if placed.iter().any(Option::is_none)
        && let (Some(model), Some(wanted)) = (model, known)
        && let Ok(found) = mig::place(model, &wanted)
    {
        let mut free: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
        for (profile, start) in found {
            free.entry(profile.name).or_default().push(start);
        }
        for (slot, (_, p)) in placed.iter_mut().zip(&named) {
            let taken = model.mig_profile(p).map(|profile| profile.name);
            match (slot.as_ref(), taken.and_then(|n| free.get_mut(n))) {
                (Some(start), Some(starts)) => starts.retain(|s| s != start),
                (None, Some(starts)) if !starts.is_empty() => *slot = Some(starts.remove(0)),
                _ => {}
            }
        }
    }
    let mut out = Vec::with_capacity(named.len());
    for (i, ((m, profile), placement)) in named.iter().zip(placed).enumerate() {
        // Without a placement (unknown model), the MIG device's index keeps names unique.
        let placement = placement.unwrap_or(u32::try_from(i).unwrap_or(u32::MAX));
        out.push(MigInstance {
            profile: (*profile).to_owned(),
            placement,
            uuid: m.uuid.clone(),
            ids: m.ids,
            memory_bytes: m.memory_bytes,
            multiprocessors: m.multiprocessors,
            compute_slices: m.compute_slices,
            compute_percent: MigInstance::compute_percent_of(m.compute_slices, total_slices),
        });
    }
    out.sort_by(|a, b| {
        a.placement
            .cmp(&b.placement)
            .then(a.profile.cmp(&b.profile))
    });
    Ok(out)
}

/// The inventory of a node from what the library reported. Every GPU is exclusive unless MIG
/// mode is enabled on it (then its MIG devices are its devices); the admin's choice of shared
/// GPUs is applied afterwards (`crate::node::gpu_mode`). Errors name the GPU and the fact.
pub fn resolve(node: &DiscoveredNode) -> Result<NodeInventory> {
    let islands = nvlink_islands(&node.name, &node.gpus);
    let mut gpus = Vec::with_capacity(node.gpus.len());
    let mut seen = BTreeSet::new();
    let mut minors = BTreeSet::new();
    for g in &node.gpus {
        let field = format!("gpus[{}]", g.index);
        if !seen.insert(g.index) {
            return Err(err(field, format!("index {} appears twice", g.index)));
        }
        if !minors.insert(g.minor) {
            return Err(err(
                format!("{field}.minor"),
                format!("minor {} is another GPU's too", g.minor),
            ));
        }
        let pci_bus_id = normalize_pci_bus_id(&g.pci_bus_id).ok_or_else(|| {
            err(
                format!("{field}.pciBusId"),
                format!("{:?} is not a PCI bus id (dddd:bb:dd.f)", g.pci_bus_id),
            )
        })?;
        let model = models::lookup(&g.product_name);
        let mode = if g.mig_enabled {
            GpuMode::Mig
        } else {
            GpuMode::Exclusive
        };
        let mig_instances = if g.mig_enabled {
            mig_instances(g, model, &field)?
        } else {
            Vec::new()
        };
        gpus.push(Gpu {
            index: g.index,
            minor: g.minor,
            uuid: g.uuid.clone(),
            model: model_id(&g.product_name, g.memory_bytes),
            product_name: g.product_name.clone(),
            brand: g.brand.clone(),
            architecture: g.architecture.clone(),
            compute_capability: format!("{}.{}", g.compute_capability.0, g.compute_capability.1),
            memory_bytes: g.memory_bytes,
            multiprocessors: g
                .multiprocessors
                .or(model.map(|m| m.multiprocessors))
                .unwrap_or(0),
            mig_capable: g.mig_capable,
            pcie_root: g.pcie_root.clone().unwrap_or_else(|| own_root(&pci_bus_id)),
            pci_bus_id,
            numa_node: g.numa_node,
            nvlink_domain: islands.get(&g.index).cloned(),
            mode,
            mig_instances,
            driver_version: node.driver_version.clone(),
            cuda_driver_version: cuda_version(node.cuda_driver_version),
            healthy: true,
            draining_to: None,
            isolation: super::Isolation::Unverified,
            isolation_reason: super::REASON_NOT_PROBED.to_owned(),
        });
    }
    gpus.sort_by_key(|g| g.index);
    Ok(NodeInventory {
        name: node.name.clone(),
        labels: BTreeMap::new(),
        gpus,
        // The host's table, which the library does not give: the kubelet plugin reads it.
        mig_minors: None,
    })
}

#[cfg(test)]
mod tests {

    use super::*;

    fn a100(index: u32, bus: &str) -> DiscoveredGpu {
        DiscoveredGpu {
            index,
            // The device nodes are numbered unlike NVML's indices, as they may be.
            minor: index + 4,
            uuid: format!("GPU-0000000{index}-0000-0000-0000-000000000000"),
            product_name: "NVIDIA A100-SXM4-80GB".to_owned(),
            brand: "Tesla".to_owned(),
            architecture: "Ampere".to_owned(),
            compute_capability: (8, 0),
            memory_bytes: 81920 * MIB,
            multiprocessors: None,
            pci_bus_id: bus.to_owned(),
            mig_capable: true,
            ..DiscoveredGpu::default()
        }
    }

    #[test]
    fn known_products_get_the_tables_id_and_others_a_derived_one() {
        assert_eq!(model_id("NVIDIA A100-SXM4-80GB", 80 * GIB), "a100-80g");
        assert_eq!(model_id("NVIDIA L40S", 46068 * MIB), "l40s-45g");
        assert_eq!(model_id("NVIDIA H200 NVL", 143_771 * MIB), "h200-nvl-141g");
        assert_eq!(model_id("NVIDIA A800-SXM4-80GB", 81920 * MIB), "a800-80g");
        assert_eq!(model_id("NVIDIA", GIB), "gpu-1g");
        assert_eq!(model_id("NVIDIA H20", 97871 * MIB), "h20-96g");
        assert_eq!(model_id("NVIDIA H20", 143_771 * MIB), "h20-141g");
    }

    #[test]
    fn mig_profiles_come_from_the_device_name() {
        assert_eq!(
            mig_profile_name("NVIDIA A100-SXM4-80GB MIG 1g.10gb"),
            Some("1g.10gb")
        );
        assert_eq!(
            mig_profile_name("NVIDIA H100 80GB HBM3 MIG 1g.10gb+me"),
            Some("1g.10gb+me")
        );
        assert_eq!(mig_profile_name("NVIDIA A100-SXM4-80GB"), None);
        assert_eq!(mig_profile_name("x MIG ../etc"), None);
    }

    #[test]
    fn nvlink_peers_group_into_islands_by_connected_components() {
        let mut gpus: Vec<DiscoveredGpu> = (0..5)
            .map(|i| a100(i, &format!("00000000:{:02X}:00.0", 0x10 + i)))
            .collect();
        // 0-1 and 1-2 are linked directly; 3 reaches 4 through an NVSwitch; nothing on 4's
        // own list needed.
        gpus[0].nvlink_peers = vec!["00000000:11:00.0".to_owned()];
        gpus[1].nvlink_peers = vec!["00000000:10:00.0".to_owned(), "0000:12:00.0".to_owned()];
        gpus[3].nvlink_peers = vec!["00000000:C0:00.0".to_owned()];
        gpus[4].nvlink_peers = vec!["00000000:c0:00.0".to_owned()];
        let islands = nvlink_islands("n", &gpus);
        assert_eq!(islands[&0], "n-nvlink-0");
        assert_eq!(islands[&1], "n-nvlink-0");
        assert_eq!(islands[&2], "n-nvlink-0");
        assert_eq!(islands[&3], "n-nvlink-1");
        assert_eq!(islands[&4], "n-nvlink-1");

        gpus[3].nvlink_peers.clear();
        gpus[4].nvlink_peers.clear();
        let islands = nvlink_islands("n", &gpus);
        assert!(
            !islands.contains_key(&3),
            "a GPU without links is on no island"
        );
    }

    #[test]
    fn a_node_resolves_with_versions_pci_numa_and_mig_names() {
        let mut mig = a100(1, "00000000:8A:00.0");
        mig.mig_enabled = true;
        mig.numa_node = Some(1);
        mig.pcie_root = Some("pci0000:80".to_owned());
        for (uuid, profile, slices, placement, gpu_instance) in [
            ("MIG-a", "3g.40gb", 3, None, 2),
            ("MIG-b", "1g.10gb", 1, None, 9),
            ("MIG-c", "1g.10gb", 1, None, 10),
        ] {
            mig.mig_devices.push(DiscoveredMig {
                uuid: uuid.to_owned(),
                ids: Some(MigIds {
                    gpu_instance,
                    compute_instance: 0,
                }),
                name: format!("NVIDIA A100-SXM4-80GB MIG {profile}"),
                memory_bytes: 40192 * MIB,
                multiprocessors: 42,
                compute_slices: slices,
                placement,
            });
        }
        let node = resolve(&DiscoveredNode {
            name: "n".to_owned(),
            driver_version: "550.54.15".to_owned(),
            cuda_driver_version: 12040,
            gpus: vec![a100(0, "00000000:07:00.0"), mig],
        })
        .unwrap();
        let g0 = &node.gpus[0];
        assert_eq!(g0.model, "a100-80g");
        assert_eq!(g0.pci_bus_id, "0000:07:00.0");
        assert_eq!(g0.pcie_root, "pci0000:07");
        assert_eq!(g0.cuda_driver_version, "12.4");
        assert_eq!(g0.compute_capability, "8.0");
        assert_eq!(g0.multiprocessors, 108, "from the model table");
        assert_eq!(g0.mode, GpuMode::Exclusive);
        let g1 = &node.gpus[1];
        assert_eq!(g1.mode, GpuMode::Mig);
        assert_eq!(g1.numa_node, Some(1));
        assert_eq!(g1.pcie_root, "pci0000:80");
        let names: Vec<String> = g1.mig_instances.iter().map(|m| m.device_name(1)).collect();
        // The 3g instance takes the first half; the 1g instances the next free slices.
        assert_eq!(
            names,
            [
                "gpu-1-mig-3g-40gb-0",
                "gpu-1-mig-1g-10gb-4",
                "gpu-1-mig-1g-10gb-5"
            ]
        );
        assert_eq!(g1.mig_instances[1].uuid, "MIG-b");
        assert_eq!(g1.mig_instances[0].compute_percent, 40);
        assert_eq!(g1.minor, 5, "the device node's minor, not the index");
        assert_eq!(
            g1.mig_instances[1].ids,
            Some(MigIds {
                gpu_instance: 9,
                compute_instance: 0
            }),
            "the ids NVML reports, not the list position"
        );
        assert_eq!(node.mig_minors, None, "the plugin reads the host's table");
    }

    #[test]
    fn two_gpus_with_one_minor_or_two_mig_devices_with_one_pair_of_ids_are_refused() {
        let mut twin = a100(1, "00000000:08:00.0");
        twin.minor = 4;
        let e = resolve(&DiscoveredNode {
            name: "n".to_owned(),
            gpus: vec![a100(0, "00000000:07:00.0"), twin],
            ..DiscoveredNode::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("gpus[1].minor"), "{e}");
        let mut g = a100(0, "00000000:07:00.0");
        g.mig_enabled = true;
        for uuid in ["MIG-a", "MIG-b"] {
            g.mig_devices.push(DiscoveredMig {
                uuid: uuid.to_owned(),
                ids: Some(MigIds {
                    gpu_instance: 7,
                    compute_instance: 0,
                }),
                name: "NVIDIA A100-SXM4-80GB MIG 1g.10gb".to_owned(),
                compute_slices: 1,
                ..DiscoveredMig::default()
            });
        }
        let e = resolve(&DiscoveredNode {
            name: "n".to_owned(),
            gpus: vec![g],
            ..DiscoveredNode::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("gpus[0].migDevices[1]"), "{e}");
        assert!(e.to_string().contains("two MIG devices"), "{e}");
    }

    #[test]
    fn a_bad_pci_bus_id_or_mig_name_is_an_error_naming_the_gpu() {
        let mut g = a100(3, "not-a-bus");
        let e = resolve(&DiscoveredNode {
            name: "n".to_owned(),
            gpus: vec![g.clone()],
            ..DiscoveredNode::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("gpus[3].pciBusId"), "{e}");
        g.pci_bus_id = "0000:07:00.0".to_owned();
        g.mig_enabled = true;
        g.mig_devices.push(DiscoveredMig {
            name: "odd".to_owned(),
            ..DiscoveredMig::default()
        });
        let e = resolve(&DiscoveredNode {
            name: "n".to_owned(),
            gpus: vec![g],
            ..DiscoveredNode::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("gpus[3].migDevices[0].name"), "{e}");
    }
}
