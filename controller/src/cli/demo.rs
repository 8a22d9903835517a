//! `tessera demo`: the whole flow on a built-in example cluster.
//!
//! Fake nodes publish their GPUs as ResourceSlices, the example claims of `examples/claims/`
//! and the pods written for device plugins of `examples/pods/` (rewritten as the webhook would)
//! are allocated against the DeviceClasses of `deviceclasses/`, and the report shows each
//! claim's devices or the reason it was not placed, what every GPU has in use, and the CDI spec
//! a node would write for one share. Everything is compiled in, so the demo runs anywhere.

use std::fmt::Write as _;

use k8s_openapi::api::resource::v1 as res;
use tessera_driver::admission::device_plugin_names;
use tessera_driver::node::cdi::{self, Enforcement};
use tessera_driver::node::inventory::Inventory;
use tessera_driver::node::prepare;
use tessera_driver::node::slices::{self, RenderOptions};
use tessera_driver::placement::allocator::{Policy, Snapshot};
use tessera_driver::tools::batch::{BatchOptions, ClaimOutcome, allocate_batch};

use crate::cli::device_plugin;
use crate::cli::input::Objects;
use crate::cli::output::device_lines;
use crate::error::{Error, Result};

/// The built-in cluster (a copy of `examples/inventory/demo-cluster.yaml`).
const INVENTORY: &str = include_str!("../../../examples/inventory/demo-cluster.yaml");

/// The DeviceClasses admins install, as shipped in `deviceclasses/`.
const CLASSES: &[(&str, &str)] = &[
    (
        "deviceclasses/gpu.yaml",
        include_str!("../../../deviceclasses/gpu.yaml"),
    ),
    (
        "deviceclasses/shared-gpu.yaml",
        include_str!("../../../deviceclasses/shared-gpu.yaml"),
    ),
    (
        "deviceclasses/mig.yaml",
        include_str!("../../../deviceclasses/mig.yaml"),
    ),
    (
        "deviceclasses/batch-gpu.yaml",
        include_str!("../../../deviceclasses/batch-gpu.yaml"),
    ),
    (
        "deviceclasses/batch-overcommit-gpu.yaml",
        include_str!("../../../deviceclasses/batch-overcommit-gpu.yaml"),
    ),
    (
        "deviceclasses/model-a100-80g.yaml",
        include_str!("../../../deviceclasses/model-a100-80g.yaml"),
    ),
    (
        "deviceclasses/model-h100-80g.yaml",
        include_str!("../../../deviceclasses/model-h100-80g.yaml"),
    ),
];

/// The example claims, in the order they are allocated.
const CLAIMS: &[(&str, &str)] = &[
    (
        "examples/claims/00-too-big-for-one-island.yaml",
        include_str!("../../../examples/claims/00-too-big-for-one-island.yaml"),
    ),
    (
        "examples/claims/01-whole-gpu.yaml",
        include_str!("../../../examples/claims/01-whole-gpu.yaml"),
    ),
    (
        "examples/claims/02-four-gpus-one-nvlink-island.yaml",
        include_str!("../../../examples/claims/02-four-gpus-one-nvlink-island.yaml"),
    ),
    (
        "examples/claims/03-share-capacity-requests.yaml",
        include_str!("../../../examples/claims/03-share-capacity-requests.yaml"),
    ),
    (
        "examples/claims/04-share-opaque-config.yaml",
        include_str!("../../../examples/claims/04-share-opaque-config.yaml"),
    ),
    (
        "examples/claims/05-share-memory-only.yaml",
        include_str!("../../../examples/claims/05-share-memory-only.yaml"),
    ),
    (
        "examples/claims/06-share-memory-percent.yaml",
        include_str!("../../../examples/claims/06-share-memory-percent.yaml"),
    ),
    (
        "examples/claims/07-share-over-two-cards.yaml",
        include_str!("../../../examples/claims/07-share-over-two-cards.yaml"),
    ),
    (
        "examples/claims/08-mig-instance.yaml",
        include_str!("../../../examples/claims/08-mig-instance.yaml"),
    ),
    (
        "examples/claims/09-specific-model.yaml",
        include_str!("../../../examples/claims/09-specific-model.yaml"),
    ),
    (
        "examples/claims/10-any-a100-or-h100.yaml",
        include_str!("../../../examples/claims/10-any-a100-or-h100.yaml"),
    ),
    (
        "examples/claims/11-share-batch.yaml",
        include_str!("../../../examples/claims/11-share-batch.yaml"),
    ),
    (
        "examples/claims/12-share-delay-tolerant.yaml",
        include_str!("../../../examples/claims/12-share-delay-tolerant.yaml"),
    ),
    (
        "examples/claims/13-share-batch-overcommit.yaml",
        include_str!("../../../examples/claims/13-share-batch-overcommit.yaml"),
    ),
];

/// Pods written for device plugins (Baidu's cGPU, Aliyun's gpushare), placed unchanged.
const PODS: &[(&str, &str)] = &[
    (
        "examples/pods/baidu-share.yaml",
        include_str!("../../../examples/pods/baidu-share.yaml"),
    ),
    (
        "examples/pods/aliyun-share.yaml",
        include_str!("../../../examples/pods/aliyun-share.yaml"),
    ),
];

/// What an example asks for: the first comment line of its file.
fn description(text: &str) -> String {
    text.lines()
        .take_while(|l| l.starts_with('#'))
        .map(|l| l.trim_start_matches('#').trim())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs the demo with `policy` and writes the report into `out`.
pub fn run(driver: &str, policy: Policy, out: &mut String) -> Result<()> {
    let inventory = Inventory::from_yaml(INVENTORY)?;
    let mut objects = Objects::default();
    let render = RenderOptions {
        driver_name: driver.to_owned(),
        consumable_capacity: true,
        ..RenderOptions::default()
    };
    for node in &inventory.nodes {
        objects.slices.extend(slices::render(node, &render)?);
    }
    for (name, text) in CLASSES.iter().chain(CLAIMS).chain(PODS) {
        objects.load_text(name, text)?;
    }
    let mapping = device_plugin_names::Options {
        driver: driver.to_owned(),
        ..device_plugin_names::Options::default()
    };
    let example_claims = objects.claims.len();
    device_plugin::rewrite(&mut objects, &mapping)?;
    let pod_claims: Vec<String> = objects.claims[example_claims..]
        .iter()
        .filter_map(|c| c.metadata.name.clone())
        .collect();
    let input = objects.batch_input();
    let options = BatchOptions {
        driver_name: driver.to_owned(),
        policy,
        node: None,
    };
    let outcomes = allocate_batch(&input, &options)?;

    let _ = writeln!(
        out,
        "Tessera demo: {} nodes, placement policy {policy}\n",
        inventory.nodes.len()
    );
    cluster_section(&inventory, &objects.slices, out);
    let (pod_outcomes, claim_outcomes): (Vec<ClaimOutcome>, Vec<ClaimOutcome>) = outcomes
        .into_iter()
        .partition(|o| pod_claims.contains(&o.name));
    claims_section(&claim_outcomes, out);
    pods_section(&pod_outcomes, out);
    let outcomes: Vec<ClaimOutcome> = claim_outcomes.into_iter().chain(pod_outcomes).collect();
    let allocated: Vec<res::ResourceClaim> = allocated_claims(&objects.claims, &outcomes);
    usage_section(driver, &objects, &allocated, out)?;
    cdi_section(driver, &inventory, &allocated, out)?;
    Ok(())
}

fn cluster_section(inventory: &Inventory, slices: &[res::ResourceSlice], out: &mut String) {
    let _ = writeln!(out, "Cluster");
    for node in &inventory.nodes {
        let mut groups: Vec<(String, String, usize)> = Vec::new();
        for gpu in &node.gpus {
            let mode = gpu.mode.as_str().to_owned();
            match groups.last_mut() {
                Some((model, m, n)) if *model == gpu.model && *m == mode => *n += 1,
                _ => groups.push((gpu.model.clone(), mode, 1)),
            }
        }
        let gpus: Vec<String> = groups
            .iter()
            .map(|(model, mode, n)| format!("{n} x {model} ({mode})"))
            .collect();
        let devices: usize = slices
            .iter()
            .filter(|s| s.spec.node_name.as_deref() == Some(node.name.as_str()))
            .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
            .sum();
        let _ = writeln!(
            out,
            "  {:<10} {}  ->  {devices} devices published",
            node.name,
            gpus.join(", ")
        );
    }
    let _ = writeln!(
        out,
        "  ({} ResourceSlices in resource.k8s.io/v1, with consumable capacity)\n",
        slices.len()
    );
}

fn claims_section(outcomes: &[ClaimOutcome], out: &mut String) {
    let _ = writeln!(out, "Claims (examples/claims/, allocated in this order)");
    for outcome in outcomes {
        let text = CLAIMS
            .iter()
            .find(|(_, t)| t.contains(&format!("name: {}\n", outcome.name)))
            .map(|(_, t)| description(t))
            .unwrap_or_default();
        let _ = writeln!(out, "  {}: {text}", outcome.name);
        outcome_lines(outcome, out);
    }
    let _ = writeln!(out);
}

fn pods_section(outcomes: &[ClaimOutcome], out: &mut String) {
    let _ = writeln!(
        out,
        "Pods written for device plugins (examples/pods/, unchanged; see docs/migration.md)"
    );
    for (file, text) in PODS {
        let _ = writeln!(out, "  {file}: {}", description(text));
        let pod = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("name: "))
            .unwrap_or_default();
        for outcome in outcomes
            .iter()
            .filter(|o| o.name.starts_with(&format!("{pod}-")))
        {
            let _ = writeln!(out, "    claim {}", outcome.name);
            outcome_lines(outcome, out);
        }
    }
    let _ = writeln!(out);
}

fn outcome_lines(outcome: &ClaimOutcome, out: &mut String) {
    match &outcome.allocation {
        Some(allocation) => {
            for line in device_lines(allocation) {
                let _ = writeln!(out, "      allocated  {line}");
            }
        }
        None => {
            let _ = writeln!(
                out,
                "      NOT ALLOCATED  {}",
                outcome.reason.as_deref().unwrap_or("no reason given")
            );
        }
    }
}

fn allocated_claims(
    claims: &[res::ResourceClaim],
    outcomes: &[ClaimOutcome],
) -> Vec<res::ResourceClaim> {
    claims
        .iter()
        .filter_map(|claim| {
            let outcome = outcomes
                .iter()
                .find(|o| Some(&o.name) == claim.metadata.name.as_ref())?;
            let mut claim = claim.clone();
            claim.metadata.uid = Some(format!("demo-{}", outcome.name));
            claim.status = Some(res::ResourceClaimStatus {
                allocation: outcome.allocation.clone(),
                ..Default::default()
            });
            outcome.allocation.is_some().then_some(claim)
        })
        .collect()
}

fn usage_section(
    driver: &str,
    objects: &Objects,
    allocated: &[res::ResourceClaim],
    out: &mut String,
) -> Result<()> {
    let snapshot = Snapshot::for_driver(driver, &objects.slices, &objects.classes, allocated)?;
    let mut holders: std::collections::BTreeMap<(String, String), Vec<String>> =
        std::collections::BTreeMap::new();
    for claim in allocated {
        let name = claim.metadata.name.clone().unwrap_or_default();
        let results = claim
            .status
            .iter()
            .filter_map(|s| s.allocation.as_ref())
            .flat_map(|a| a.devices.iter().flat_map(|d| d.results.iter().flatten()));
        for r in results {
            holders
                .entry((r.pool.clone(), r.device.clone()))
                .or_default()
                .push(name.clone());
        }
    }
    let _ = writeln!(out, "GPUs in use");
    let _ = writeln!(
        out,
        "  {:<32} {:>17}  {:>7}  CLAIMS",
        "DEVICE", "MEMORY USED/TOTAL", "COMPUTE"
    );
    for usage in snapshot.device_usage() {
        let Some(claims) = holders.get(&(usage.pool.clone(), usage.device.clone())) else {
            continue;
        };
        let how = if usage.exclusive > 0 {
            "whole"
        } else {
            "shared"
        };
        let _ = writeln!(
            out,
            "  {:<32} {:>17}  {:>6}%  {} ({how})",
            format!("{}/{}", usage.pool, usage.device),
            format!("{}/{}", usage.memory_used, usage.memory_total),
            usage.compute_used,
            claims.join(", ")
        );
    }
    let _ = writeln!(out);
    Ok(())
}

fn cdi_section(
    driver: &str,
    inventory: &Inventory,
    allocated: &[res::ResourceClaim],
    out: &mut String,
) -> Result<()> {
    let share = allocated.iter().find(|c| {
        c.status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .is_some_and(|a| device_lines(a).iter().any(|l| l.contains('(')))
    });
    let Some(claim) = share else { return Ok(()) };
    let enforcement = Enforcement::Mps {
        pipe_dir_root: "/run/tessera/mps".to_owned(),
        log_dir_root: "/var/log/tessera/mps".to_owned(),
    };
    let prepared = prepare::prepared_claim(claim, driver, inventory)?;
    let spec = cdi::build_spec(&prepared, &enforcement)?;
    let json = spec.to_json().map_err(Error::Driver)?;
    let _ = writeln!(
        out,
        "CDI spec the node writes for claim {}/{} (enforcement: mps), file /var/run/cdi/{}",
        prepared.namespace,
        prepared.name,
        cdi::spec_file_name(&prepared.uid)
    );
    for line in json.lines() {
        let _ = writeln!(out, "  {line}");
    }
    Ok(())
}
