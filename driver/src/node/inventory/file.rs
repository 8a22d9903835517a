//! The fake-inventory file: its YAML shape and its resolution into [`Inventory`].
//!
//! The shape is private so the resolved structs stay independent of YAML; docs/inventory.md
//! documents it for users.

use std::collections::{BTreeMap, BTreeSet};

use serde::Deserialize;

use super::mig::{self, PlaceError, Wanted};
use super::models::{self, GpuModel};
use super::{Gpu, GpuMode, Inventory, Isolation, MigIds, MigInstance, MigMinors, NodeInventory};
use crate::error::{Error, Result};
use crate::rules::limits;
use crate::rules::quantity::Quantity;

/// Driver version a file gets when it names none.
const DEFAULT_DRIVER_VERSION: &str = "550.54.15";
/// CUDA driver version a file gets when it names none.
const DEFAULT_CUDA_DRIVER_VERSION: &str = "12.4";
/// More GPUs than any real node has; a bound so a typo cannot ask for billions.
const MAX_GPUS_PER_NODE: u32 = 1024;
/// Longest node name Kubernetes accepts (a DNS subdomain).
const MAX_NODE_NAME: usize = limits::MAX_DNS_SUBDOMAIN;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct FileInventory {
    #[serde(default)]
    defaults: FileDefaults,
    #[serde(default)]
    nodes: Vec<FileNode>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct FileDefaults {
    mode: Option<GpuModeName>,
    driver_version: Option<String>,
    cuda_driver_version: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct FileNode {
    name: String,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    mode: Option<GpuModeName>,
    driver_version: Option<String>,
    cuda_driver_version: Option<String>,
    numa_nodes: Option<u32>,
    isolation: Option<IsolationName>,
    #[serde(default)]
    gpus: Vec<FileGpuGroup>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct FileGpuGroup {
    model: String,
    count: Option<u32>,
    mode: Option<GpuModeName>,
    product_name: Option<String>,
    memory: Option<String>,
    numa_node: Option<u32>,
    nvlink_domain: Option<String>,
    nvlink_island_size: Option<u32>,
    pci_bus_ids: Option<Vec<String>>,
    pcie_root: Option<String>,
    uuids: Option<Vec<String>>,
    healthy: Option<bool>,
    isolation: Option<IsolationName>,
    driver_version: Option<String>,
    cuda_driver_version: Option<String>,
    mig: Option<Vec<FileMig>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct FileMig {
    profile: String,
    count: Option<u32>,
    placements: Option<Vec<u32>>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
enum GpuModeName {
    Exclusive,
    Shared,
    Mig,
}

/// What the node's isolation probe finds on the GPU (the fake backend's probe answers it).
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
enum IsolationName {
    Verified,
    Unverified,
}

impl From<IsolationName> for Isolation {
    fn from(i: IsolationName) -> Self {
        match i {
            IsolationName::Verified => Self::Verified,
            IsolationName::Unverified => Self::Unverified,
        }
    }
}

impl From<GpuModeName> for GpuMode {
    fn from(m: GpuModeName) -> Self {
        match m {
            GpuModeName::Exclusive => Self::Exclusive,
            GpuModeName::Shared => Self::Shared,
            GpuModeName::Mig => Self::Mig,
        }
    }
}

fn err(field: impl Into<String>, message: impl Into<String>) -> Error {
    Error::Inventory {
        field: field.into(),
        message: message.into(),
    }
}

pub(super) fn parse(text: &str) -> Result<Inventory> {
    let de = serde_yaml::Deserializer::from_str(text);
    let file: FileInventory = serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let field = if path == "." {
            "(document)".to_owned()
        } else {
            path
        };
        err(field, e.into_inner().to_string())
    })?;
    resolve(&file)
}

fn resolve(file: &FileInventory) -> Result<Inventory> {
    let mut seen = BTreeSet::new();
    let mut nodes = Vec::with_capacity(file.nodes.len());
    for (n, node) in file.nodes.iter().enumerate() {
        let field = format!("nodes[{n}]");
        if !seen.insert(node.name.as_str()) {
            return Err(err(
                format!("{field}.name"),
                format!("node {:?} appears twice", node.name),
            ));
        }
        nodes.push(resolve_node(&file.defaults, node, &field)?);
    }
    Ok(Inventory { nodes })
}

fn resolve_node(defaults: &FileDefaults, node: &FileNode, field: &str) -> Result<NodeInventory> {
    if !limits::is_dns_subdomain(&node.name, MAX_NODE_NAME) {
        return Err(err(
            format!("{field}.name"),
            format!(
                "{:?} is not a valid node name (a DNS subdomain: lower-case letters, digits, \
                 '-' and '.', at most {MAX_NODE_NAME} characters)",
                node.name
            ),
        ));
    }
    let total: u32 = node
        .gpus
        .iter()
        .map(|g| g.count.unwrap_or(1))
        .fold(0_u32, u32::saturating_add);
    if total > MAX_GPUS_PER_NODE {
        return Err(err(
            format!("{field}.gpus"),
            format!("{total} GPUs on one node; at most {MAX_GPUS_PER_NODE} are allowed"),
        ));
    }
    let numa_nodes = node.numa_nodes.unwrap_or(1);
    if numa_nodes == 0 {
        return Err(err(format!("{field}.numaNodes"), "must be at least 1"));
    }
    let mut gpus = Vec::with_capacity(total as usize);
    let mut pci_seen = BTreeSet::new();
    for (g, group) in node.gpus.iter().enumerate() {
        let gfield = format!("{field}.gpus[{g}]");
        let ctx = NodeContext {
            defaults,
            node,
            total,
            numa_nodes,
        };
        for gpu in resolve_group(&ctx, group, &gfield, &gpus)? {
            if !pci_seen.insert(gpu.pci_bus_id.clone()) {
                return Err(err(
                    format!("{gfield}.pciBusIds"),
                    format!("PCI bus id {} is used by two GPUs", gpu.pci_bus_id),
                ));
            }
            gpus.push(gpu);
        }
    }
    // A simulated node's driver lists the capability minors in its usual layout.
    let mig_minors = Some(MigMinors::driver_layout(gpus.iter().map(|g| g.minor)));
    Ok(NodeInventory {
        name: node.name.clone(),
        labels: node.labels.clone(),
        gpus,
        mig_minors,
    })
}

struct NodeContext<'a> {
    defaults: &'a FileDefaults,
    node: &'a FileNode,
    total: u32,
    numa_nodes: u32,
}

fn resolve_group(
    ctx: &NodeContext<'_>,
    group: &FileGpuGroup,
    field: &str,
    before: &[Gpu],
) -> Result<Vec<Gpu>> {
    let model = models::lookup(&group.model).ok_or_else(|| {
        err(
            format!("{field}.model"),
            format!(
                "unknown GPU model {:?}; known models: {}",
                group.model,
                models::known_ids()
            ),
        )
    })?;
    let count = group.count.unwrap_or(1);
    if count == 0 {
        return Err(err(format!("{field}.count"), "must be at least 1"));
    }
    let mode = group_mode(ctx, group, model, field)?;
    let mig_wanted = match &group.mig {
        Some(list) => mig_wanted(model, list, &format!("{field}.mig"))?,
        None => Vec::new(),
    };
    let memory_bytes = match &group.memory {
        Some(text) => parse_memory(text, &format!("{field}.memory"))?,
        None => model.memory_bytes,
    };
    check_list_len(
        group.pci_bus_ids.as_ref(),
        count,
        &format!("{field}.pciBusIds"),
    )?;
    check_list_len(group.uuids.as_ref(), count, &format!("{field}.uuids"))?;
    let nvlink = nvlink_rule(group, field)?;
    let (driver_version, cuda_driver_version) = versions(ctx, group, field)?;
    let first = u32::try_from(before.len()).map_err(|_| err(field, "too many GPUs"))?;
    let mut out = Vec::with_capacity(count as usize);
    for k in 0..count {
        let index = first + k;
        let (pci_bus_id, pcie_root, uuid) = identity(group, field, k, index, &ctx.node.name)?;
        let numa_node = Some(
            group
                .numa_node
                .unwrap_or_else(|| numa_of(index, ctx.total, ctx.numa_nodes)),
        );
        let nvlink_domain = match &nvlink {
            Nvlink::None => None,
            Nvlink::Named(name) => Some(name.clone()),
            Nvlink::Islands(size) => Some(format!(
                "{}-nvlink-{}",
                ctx.node.name,
                (index - first) / size + island_offset(before, &ctx.node.name)
            )),
        };
        let mig_instances = if mode == GpuMode::Mig {
            mig_instances(model, &mig_wanted, &ctx.node.name, index, field)?
        } else {
            Vec::new()
        };
        out.push(Gpu {
            index,
            // A simulated GPU's device node is numbered as its index.
            minor: index,
            uuid,
            model: model.id.to_owned(),
            product_name: group
                .product_name
                .clone()
                .unwrap_or_else(|| model.product_name.to_owned()),
            brand: model.brand.to_owned(),
            architecture: model.architecture.to_owned(),
            compute_capability: model.compute_capability.to_owned(),
            memory_bytes,
            multiprocessors: model.multiprocessors,
            mig_capable: model.mig_capable(),
            pci_bus_id,
            pcie_root,
            numa_node,
            nvlink_domain,
            mode,
            mig_instances,
            driver_version: driver_version.clone(),
            cuda_driver_version: cuda_driver_version.clone(),
            healthy: group.healthy.unwrap_or(true),
            draining_to: None,
            isolation: group
                .isolation
                .or(ctx.node.isolation)
                .map_or(Isolation::Verified, Isolation::from),
            isolation_reason: String::new(),
        });
    }
    Ok(out)
}

/// Driver and CUDA driver versions: the group's, else the node's, else the file's defaults.
fn versions(ctx: &NodeContext<'_>, group: &FileGpuGroup, field: &str) -> Result<(String, String)> {
    let driver_version = pick_version(
        [
            &group.driver_version,
            &ctx.node.driver_version,
            &ctx.defaults.driver_version,
        ],
        DEFAULT_DRIVER_VERSION,
        &format!("{field}.driverVersion"),
    )?;
    let cuda_driver_version = pick_version(
        [
            &group.cuda_driver_version,
            &ctx.node.cuda_driver_version,
            &ctx.defaults.cuda_driver_version,
        ],
        DEFAULT_CUDA_DRIVER_VERSION,
        &format!("{field}.cudaDriverVersion"),
    )?;

    Ok((driver_version, cuda_driver_version))
}

/// The group's mode: its own, else implied by a `mig` list, else the node's or the file's.
fn group_mode(
    ctx: &NodeContext<'_>,
    group: &FileGpuGroup,
    model: &GpuModel,
    field: &str,
) -> Result<GpuMode> {
    let mode: GpuMode = match (group.mode, &group.mig) {
        (Some(m), _) => m.into(),
        (None, Some(_)) => GpuMode::Mig,
        (None, None) => ctx
            .node
            .mode
            .or(ctx.defaults.mode)
            .map_or(GpuMode::Exclusive, Into::into),
    };
    if mode == GpuMode::Mig && !model.mig_capable() {
        return Err(err(
            format!("{field}.mode"),
            format!("model {} is not MIG-capable", model.id),
        ));
    }
    if mode != GpuMode::Mig && group.mig.is_some() {
        return Err(err(
            format!("{field}.mig"),
            format!("MIG instances need mode mig, not {mode}"),
        ));
    }
    Ok(mode)
}

/// The PCI bus id, `PCIe` root and UUID of the `k`-th GPU of a group: as the file gives them,
/// else derived from the node name and index.
fn identity(
    group: &FileGpuGroup,
    field: &str,
    k: u32,
    index: u32,
    node: &str,
) -> Result<(String, String, String)> {
    let pci_bus_id = match &group.pci_bus_ids {
        Some(ids) => normalize_pci_bus_id(&ids[k as usize]).ok_or_else(|| {
            err(
                format!("{field}.pciBusIds[{k}]"),
                format!(
                    "{:?} is not a PCI bus id (dddd:bb:dd.f, hexadecimal)",
                    ids[k as usize]
                ),
            )
        })?,
        None => default_pci_bus_id(index),
    };
    let pcie_root = match &group.pcie_root {
        Some(root) => root.clone(),
        None => pcie_root_of(&pci_bus_id),
    };
    let uuid = match &group.uuids {
        Some(ids) => {
            let id = &ids[k as usize];
            if !id.starts_with("GPU-") || id.len() > 64 {
                return Err(err(
                    format!("{field}.uuids[{k}]"),
                    format!("{id:?} is not a GPU UUID (GPU-..., at most 64 characters)"),
                ));
            }
            id.clone()
        }
        None => format!("GPU-{}", stable_uuid(&format!("{node}/gpu/{index}"))),
    };
    Ok((pci_bus_id, pcie_root, uuid))
}

enum Nvlink {
    None,
    Named(String),
    Islands(u32),
}

fn nvlink_rule(group: &FileGpuGroup, field: &str) -> Result<Nvlink> {
    match (&group.nvlink_domain, group.nvlink_island_size) {
        (Some(_), Some(_)) => Err(err(
            format!("{field}.nvlinkIslandSize"),
            "set either nvlinkDomain or nvlinkIslandSize, not both",
        )),
        (Some(name), None) if name.is_empty() => {
            Err(err(format!("{field}.nvlinkDomain"), "must not be empty"))
        }
        (Some(name), None) => Ok(Nvlink::Named(name.clone())),
        (None, Some(0)) => Err(err(
            format!("{field}.nvlinkIslandSize"),
            "must be at least 1",
        )),
        (None, Some(size)) => Ok(Nvlink::Islands(size)),
        (None, None) => Ok(Nvlink::None),
    }
}

/// Islands numbered per node: a group's islands follow those of earlier groups.
fn island_offset(before: &[Gpu], node: &str) -> u32 {
    let prefix = format!("{node}-nvlink-");
    before
        .iter()
        .filter_map(|g| {
            g.nvlink_domain
                .as_deref()?
                .strip_prefix(&prefix)?
                .parse::<u32>()
                .ok()
        })
        .map(|k| k + 1)
        .max()
        .unwrap_or(0)
}

fn check_list_len(list: Option<&Vec<String>>, count: u32, field: &str) -> Result<()> {
    match list {
        Some(l) if l.len() != count as usize => Err(err(
            field,
            format!("has {} entries; the group has count {count}", l.len()),
        )),
        _ => Ok(()),
    }
}

fn pick_version(candidates: [&Option<String>; 3], default: &str, field: &str) -> Result<String> {
    let chosen = candidates
        .into_iter()
        .find_map(Option::as_deref)
        .unwrap_or(default);
    if chosen.trim().is_empty() {
        return Err(err(field, "must not be empty"));
    }
    Ok(chosen.to_owned())
}

fn parse_memory(text: &str, field: &str) -> Result<u64> {
    let q = Quantity::parse(text).map_err(|e| err(field, e.to_string()))?;
    let bytes = q.as_units().filter(|b| *b > 0).ok_or_else(|| {
        err(
            field,
            format!("{text:?} is not a positive whole number of bytes"),
        )
    })?;
    u64::try_from(bytes).map_err(|_| err(field, "out of range"))
}

fn mig_wanted(model: &'static GpuModel, list: &[FileMig], field: &str) -> Result<Vec<Wanted>> {
    let mut wanted = Vec::new();
    for (i, m) in list.iter().enumerate() {
        let profile = model.mig_profile(&m.profile).ok_or_else(|| {
            err(
                format!("{field}[{i}].profile"),
                format!(
                    "MIG profile {:?} is not valid for {}; valid profiles: {}",
                    m.profile,
                    model.id,
                    model
                        .mig_profiles
                        .iter()
                        .map(|p| p.name)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )
        })?;
        let count = m.count.unwrap_or(1);
        if count == 0 {
            return Err(err(format!("{field}[{i}].count"), "must be at least 1"));
        }
        if count > model.mig_compute_slices {
            return Err(err(
                format!("{field}[{i}].count"),
                format!(
                    "{count} instances of {} need more than the {} compute slices of {}",
                    profile.name, model.mig_compute_slices, model.id
                ),
            ));
        }
        if let Some(p) = &m.placements {
            if p.len() != count as usize {
                return Err(err(
                    format!("{field}[{i}].placements"),
                    format!("has {} entries; count is {count}", p.len()),
                ));
            }
            for (j, start) in p.iter().enumerate() {
                if !profile.placements.contains(start) {
                    return Err(err(
                        format!("{field}[{i}].placements[{j}]"),
                        format!(
                            "{start} is not a valid placement of {} on {}; valid: {:?}",
                            profile.name, model.id, profile.placements
                        ),
                    ));
                }
            }
        }
        for j in 0..count {
            wanted.push(Wanted {
                profile,
                placement: m.placements.as_ref().map(|p| p[j as usize]),
            });
        }
    }
    Ok(wanted)
}

fn mig_instances(
    model: &GpuModel,
    wanted: &[Wanted],
    node: &str,
    index: u32,
    field: &str,
) -> Result<Vec<MigInstance>> {
    let placed = mig::place(model, wanted).map_err(|e| match e {
        PlaceError::TooManySlices { needed, available } => err(
            format!("{field}.mig"),
            format!(
                "too many MIG slices for one GPU: the instances need {needed} compute slices, \
                 {} has {available}",
                model.id
            ),
        ),
        PlaceError::NoPlacement => err(
            format!("{field}.mig"),
            format!(
                "the MIG instances cannot all be placed on one {} without overlapping \
                 (too many memory slices, or conflicting placements)",
                model.id
            ),
        ),
    })?;
    // A simulated GPU numbers its GPU instances in placement order from 0, each with its one
    // compute instance 0; NVML numbers a real GPU's instances its own way (discovery asks it).
    Ok(placed
        .into_iter()
        .zip(0_u32..)
        .map(|((profile, placement), gpu_instance)| MigInstance {
            profile: profile.name.to_owned(),
            placement,
            ids: Some(MigIds {
                gpu_instance,
                compute_instance: 0,
            }),
            uuid: format!(
                "MIG-{}",
                stable_uuid(&format!(
                    "{node}/gpu/{index}/mig/{}/{placement}",
                    profile.name
                ))
            ),
            memory_bytes: profile.memory_bytes,
            multiprocessors: profile.multiprocessors,
            compute_slices: profile.compute_slices,
            compute_percent: MigInstance::compute_percent_of(
                profile.compute_slices,
                model.mig_compute_slices,
            ),
        })
        .collect())
}

/// A UUID v5 in Tessera's own namespace: the same name gives the same UUID on every run.
fn stable_uuid(name: &str) -> uuid::Uuid {
    let namespace = uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_DNS, b"gpu.tessera.dev");
    uuid::Uuid::new_v5(&namespace, name.as_bytes())
}

/// GPUs split evenly over the NUMA nodes by index, lower indices on lower NUMA nodes.
fn numa_of(index: u32, total: u32, numa_nodes: u32) -> u32 {
    if total == 0 {
        return 0;
    }
    let n = u64::from(index) * u64::from(numa_nodes) / u64::from(total);
    u32::try_from(n).unwrap_or(0)
}

/// Sixteen GPUs per PCI domain, buses 0x08, 0x18, ... 0xf8.
fn default_pci_bus_id(index: u32) -> String {
    let domain = index / 16;
    let bus = 0x08 + 0x10 * (index % 16);
    format!("{domain:04x}:{bus:02x}:00.0")
}

/// The root complex of a bus id: GPUs pair up under one root per 0x20 buses.
fn pcie_root_of(pci_bus_id: &str) -> String {
    let mut parts = pci_bus_id.split(':');
    let domain = parts.next().unwrap_or("0000");
    let bus = parts
        .next()
        .and_then(|b| u32::from_str_radix(b, 16).ok())
        .unwrap_or(0);
    format!("pci{domain}:{:02x}", bus & 0xe0)
}

/// `dddd:bb:dd.f` in lower case; an 8-digit NVML domain (`00000000:07:00.0`) is shortened.
pub(super) fn normalize_pci_bus_id(id: &str) -> Option<String> {
    let id = id.trim().to_ascii_lowercase();
    let (rest, function) = id.rsplit_once('.')?;
    let mut parts = rest.split(':');
    let (domain, bus, device) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let hex = |s: &str, max: usize| {
        !s.is_empty() && s.len() <= max && s.bytes().all(|b| b.is_ascii_hexdigit())
    };
    if !(hex(domain, 8) && hex(bus, 2) && hex(device, 2) && hex(function, 1)) {
        return None;
    }
    let domain = u32::from_str_radix(domain, 16).ok()?;
    let bus = u32::from_str_radix(bus, 16).ok()?;
    let device = u32::from_str_radix(device, 16).ok()?;
    let function = u32::from_str_radix(function, 16).ok()?;
    if domain > 0xffff || device > 0x1f || function > 7 {
        return None;
    }
    Some(format!("{domain:04x}:{bus:02x}:{device:02x}.{function}"))
}
