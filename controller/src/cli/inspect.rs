//! `tessera inspect`: the live cluster's GPUs, and why a gated pod is pending.
//!
//! Reads through `--kubeconfig` (or the pod's service account), in the resource.k8s.io version
//! the API server serves; every figure comes from `tessera_driver::tools::inspect`, the same
//! accounting the allocator uses.

use std::fmt::Write as _;
use std::path::Path;

use k8s_openapi::api::core::v1 as core;
use kube::api::{Api, DynamicObject, ListParams};
use tessera_driver::apiversion::{self, ApiVersion};
use tessera_driver::names;
use tessera_driver::placement::allocator::Policy;
use tessera_driver::tools::inspect::{self, ClusterObjects, ClusterView, PodExplanation};

use crate::cli::input::Objects;
use crate::error::{Error, Result};

/// Output formats of `tessera inspect`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum InspectFormat {
    /// A table for people.
    Table,
    /// JSON.
    Json,
}

/// What to inspect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// Every node's GPUs.
    Cluster,
    /// Why one pod is pending.
    Pod {
        /// The pod's namespace.
        namespace: String,
        /// The pod's name.
        name: String,
    },
    /// What one claim booked, got and uses.
    Claim {
        /// The claim's namespace.
        namespace: String,
        /// The claim's name.
        name: String,
    },
}

/// Runs `tessera inspect` to completion on its own runtime, appending the output to `out`.
pub fn run(
    kubeconfig: Option<&Path>,
    driver: &str,
    target: &Target,
    format: InspectFormat,
    out: &mut String,
) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::Config(format!("starting the async runtime: {e}")))?;
    runtime.block_on(inspect(kubeconfig, driver, target, format, out))
}

/// `tessera inspect`, for callers that have a runtime.
pub async fn inspect(
    kubeconfig: Option<&Path>,
    driver: &str,
    target: &Target,
    format: InspectFormat,
    out: &mut String,
) -> Result<()> {
    let client = tessera_kubeapi::client(kubeconfig).await?;
    let version = tessera_kubeapi::served_resource_version(&client).await?;
    match target {
        Target::Cluster => {
            let objects = fetch(&client, version, true).await?;
            let view = inspect::cluster_view(
                driver,
                &objects.slices,
                &objects.classes,
                &objects.claims,
                &objects.pods,
            )?;
            match format {
                InspectFormat::Json => write_json(&view, out),
                InspectFormat::Table => {
                    write_cluster_table(&view, out);
                    let schedules = fetch_schedules(&client).await?;
                    let rows = tessera_driver::tools::inspect::profiles::node_profiles(
                        driver,
                        &schedules,
                        &objects.nodes,
                        &objects.slices,
                        &objects.classes,
                        &objects.claims,
                        &objects.pods,
                        k8s_openapi::jiff::Timestamp::now(),
                    );
                    write_profiles(&rows, out);
                    Ok(())
                }
            }
        }
        Target::Claim { namespace, name } => {
            let view = inspect_claim(&client, version, driver, namespace, name).await?;
            match format {
                InspectFormat::Json => write_json(&view, out),
                InspectFormat::Table => {
                    write_claim(&view, out);
                    Ok(())
                }
            }
        }
        Target::Pod { namespace, name } => {
            let pod = Api::<core::Pod>::namespaced(client.clone(), namespace)
                .get_opt(name)
                .await
                .map_err(|e| Error::api(format!("getting pod {namespace}/{name}"), &e))?
                .ok_or_else(|| Error::Api {
                    action: format!("getting pod {namespace}/{name}"),
                    code: Some(404),
                    message: "not found".to_owned(),
                })?;
            let objects = fetch(&client, version, false).await?;
            let explanation = inspect::explain_pod(
                driver,
                Policy::FirstFit,
                &pod,
                &ClusterObjects {
                    classes: &objects.classes,
                    slices: &objects.slices,
                    claims: &objects.claims,
                    nodes: &objects.nodes,
                },
            )?;
            match format {
                InspectFormat::Json => write_json(&explanation, out),
                InspectFormat::Table => {
                    write_explanation(&explanation, out);
                    Ok(())
                }
            }
        }
    }
}

/// The cluster's `GpuProfileSchedules` (none when the CRD is not installed); one that breaks a
/// rule is left out with a warning on standard error.
async fn fetch_schedules(
    client: &kube::Client,
) -> Result<Vec<tessera_driver::node::schedule::Schedule>> {
    let ar = crate::tidal::schedule_resource();
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &ar);
    let listed = match api.list(&ListParams::default()).await {
        Ok(l) => l,
        Err(kube::Error::Api(s)) if s.code == 404 => return Ok(Vec::new()),
        Err(e) => return Err(Error::api("listing GpuProfileSchedules", &e)),
    };
    let mut out = Vec::new();
    for item in listed.items {
        let mut value = serde_json::to_value(&item).map_err(|e| Error::Output(e.to_string()))?;
        value["apiVersion"] = serde_json::json!(names::CONFIG_API_VERSION);
        value["kind"] = serde_json::json!(names::GPU_PROFILE_SCHEDULE.kind);
        match tessera_driver::node::schedule::parse(&value) {
            Ok(s) => out.push(s),
            Err(e) => {
                let line = format!(
                    "warning: {}\n",
                    crate::cli::output::printable(&e.to_string(), false)
                );
                let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
            }
        }
    }
    Ok(out)
}

/// The scheduled nodes: profile in force, next switch, and who holds each draining GPU.
fn write_profiles(
    rows: &[tessera_driver::tools::inspect::profiles::NodeProfile],
    out: &mut String,
) {
    if rows.is_empty() {
        return;
    }
    let mut table = vec![
        [
            "NODE",
            "SCHEDULE",
            "PROFILE (SINCE)",
            "NEXT SWITCH",
            "DRAINING GPUS (HELD BY)",
        ]
        .map(str::to_owned)
        .to_vec(),
    ];
    for r in rows {
        let profile = match (&r.profile, &r.since) {
            (Some(p), Some(s)) => format!("{p} ({s})"),
            _ => "-".to_owned(),
        };
        let next = r
            .next
            .as_ref()
            .map_or_else(|| "-".to_owned(), |(p, at)| format!("{p} at {at}"));
        let draining = if r.draining.is_empty() {
            "none".to_owned()
        } else {
            r.draining
                .iter()
                .map(|g| {
                    format!(
                        "gpu-{} {}->{} ({})",
                        g.index,
                        g.mode,
                        g.wanted,
                        g.held_by.join(", ")
                    )
                })
                .collect::<Vec<_>>()
                .join("; ")
        };
        table.push(
            [r.node.clone(), r.schedule.clone(), profile, next, draining]
                .map(|c| crate::cli::output::printable(&c, false))
                .to_vec(),
        );
    }
    out.push('\n');
    write_table(&table, out);
}

/// Reads one claim in the served version, and its namespace's events.k8s.io Events.
async fn inspect_claim(
    client: &kube::Client,
    version: ApiVersion,
    driver: &str,
    namespace: &str,
    name: &str,
) -> Result<inspect::ClaimView> {
    let action = format!("getting claim {namespace}/{name}");
    let api: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        namespace,
        &tessera_kubeapi::resource(version, names::RESOURCE_CLAIM),
    );
    let object = api
        .get_opt(name)
        .await
        .map_err(|e| Error::api(action.clone(), &e))?
        .ok_or_else(|| Error::Api {
            action: action.clone(),
            code: Some(404),
            message: "not found".to_owned(),
        })?;
    let value = tessera_kubeapi::typed_json(&object, version, names::RESOURCE_CLAIM, &action)?;
    let apiversion::Object::ResourceClaim(claim) = apiversion::decode_document(value, &action)?
    else {
        return Err(Error::Api {
            action,
            code: None,
            message: "the answer is not a ResourceClaim".to_owned(),
        });
    };
    let events = Api::<k8s_openapi::api::events::v1::Event>::namespaced(client.clone(), namespace)
        .list(&ListParams::default())
        .await
        .map_err(|e| Error::api(format!("listing Events in {namespace}"), &e))?
        .items;
    Ok(inspect::explain_claim(driver, &claim, &events))
}

/// Lists DeviceClasses, ResourceSlices, ResourceClaims and Nodes (and Pods when `pods`).
async fn fetch(client: &kube::Client, version: ApiVersion, pods: bool) -> Result<Objects> {
    let mut objects = Objects::default();
    for kind in [
        names::DEVICE_CLASS,
        names::RESOURCE_SLICE,
        names::RESOURCE_CLAIM,
    ] {
        let api: Api<DynamicObject> =
            Api::all_with(client.clone(), &tessera_kubeapi::resource(version, kind));
        let action = format!("listing {}", kind.plural);
        let listed = api
            .list(&ListParams::default())
            .await
            .map_err(|e| Error::api(action.clone(), &e))?;
        for item in listed.items {
            let value = tessera_kubeapi::typed_json(&item, version, kind, &action)?;
            objects.push(&action, apiversion::decode_document(value, &action)?)?;
        }
    }
    objects.nodes = Api::<core::Node>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(|e| Error::api("listing nodes", &e))?
        .items;
    if pods {
        objects.pods = Api::<core::Pod>::all(client.clone())
            .list(&ListParams::default())
            .await
            .map_err(|e| Error::api("listing pods", &e))?
            .items;
    }
    Ok(objects)
}

fn write_json(value: &impl serde::Serialize, out: &mut String) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| Error::Output(e.to_string()))?;
    out.push_str(&text);
    out.push('\n');
    Ok(())
}

/// Writes rows as columns padded to their widest cell (the last column unpadded).
fn write_table(rows: &[Vec<String>], out: &mut String) {
    let columns = rows.first().map_or(0, Vec::len);
    let widths: Vec<usize> = (0..columns)
        .map(|i| {
            rows.iter()
                .map(|r| r.get(i).map_or(0, |c| c.chars().count()))
                .max()
                .unwrap_or(0)
        })
        .collect();
    for row in rows {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i + 1 == row.len() {
                line.push_str(cell);
            } else {
                let _ = write!(line, "{cell:<width$}  ", width = widths[i]);
            }
        }
        let _ = writeln!(out, "{}", line.trim_end());
    }
}

fn write_cluster_table(view: &ClusterView, out: &mut String) {
    if view.nodes.is_empty() {
        let _ = writeln!(out, "no GPUs published by Tessera's driver");
        return;
    }
    let mut rows = vec![
        [
            "NODE",
            "GPU",
            "MODEL",
            "MODE",
            "MEMORY ALLOC/TOTAL",
            "MEMORY FREE",
            "COMPUTE ALLOC",
            "COMPUTE FREE",
            "CLAIMS (PODS)",
        ]
        .map(str::to_owned)
        .to_vec(),
    ];
    for node in &view.nodes {
        for gpu in &node.gpus {
            let claims = gpu
                .claims
                .iter()
                .map(|c| {
                    let who = if c.pods.is_empty() {
                        format!("{}/{}", c.namespace, c.name)
                    } else {
                        format!("{}/{} ({})", c.namespace, c.name, c.pods.join(", "))
                    };
                    match (c.memory_booked, c.memory_used) {
                        (Some(booked), Some(used)) => format!("{who} [{used} of {booked} used]"),
                        (Some(booked), None) => format!("{who} [{booked} booked]"),
                        _ => who,
                    }
                })
                .collect::<Vec<_>>()
                .join(", ");
            rows.push(vec![
                node.node.clone(),
                gpu.device.clone(),
                if gpu.model.is_empty() {
                    "-".to_owned()
                } else {
                    gpu.model.clone()
                },
                mode_cell(gpu),
                if gpu.memory_overcommitted.is_zero() {
                    format!("{}/{}", gpu.memory_allocated, gpu.memory_total)
                } else {
                    format!(
                        "{}/{} (+{} over)",
                        gpu.memory_allocated, gpu.memory_total, gpu.memory_overcommitted
                    )
                },
                gpu.memory_free.to_string(),
                if gpu.compute_overcommitted == 0 {
                    format!("{}%", gpu.compute_allocated)
                } else {
                    format!(
                        "{}% (+{}% over)",
                        gpu.compute_allocated, gpu.compute_overcommitted
                    )
                },
                format!("{}%", gpu.compute_free),
                if claims.is_empty() {
                    "-".to_owned()
                } else {
                    claims
                },
            ]);
        }
    }
    write_table(&rows, out);
}

fn write_explanation(e: &PodExplanation, out: &mut String) {
    let _ = writeln!(out, "Pod {}/{}: {}", e.namespace, e.name, e.message);
    if !e.claims.is_empty() {
        let _ = writeln!(out, "\nClaims:");
        let mut rows = vec![
            ["  POD CLAIM", "RESOURCECLAIM", "STATE", "DETAIL"]
                .map(str::to_owned)
                .to_vec(),
        ];
        for c in &e.claims {
            rows.push(vec![
                format!("  {}", c.pod_claim),
                c.claim.clone().unwrap_or_else(|| "-".to_owned()),
                c.state.to_owned(),
                c.detail.clone().unwrap_or_default(),
            ]);
        }
        write_table(&rows, out);
    }
    if !e.conditions.is_empty() {
        let _ = writeln!(out, "\nConditions not true:");
        for c in &e.conditions {
            let _ = writeln!(out, "  {c}");
        }
    }
}

/// The MODE cell: the mode, the mode a draining GPU switches to, and a shared GPU's isolation
/// when it is not verified (with the node's reason), e.g.
/// `shared (isolation unverified: limit-not-enforced)`.
fn mode_cell(gpu: &tessera_driver::tools::inspect::gpus::GpuRow) -> String {
    let mut notes = Vec::new();
    if let Some(next) = &gpu.draining_to {
        notes.push(format!("draining to {next}"));
    }
    if let Some(isolation) = gpu
        .isolation
        .as_deref()
        .filter(|i| *i != tessera_driver::names::ISOLATION_VERIFIED)
    {
        notes.push(match &gpu.isolation_reason {
            Some(reason) => format!("isolation {isolation}: {reason}"),
            None => format!("isolation {isolation}"),
        });
    }
    if notes.is_empty() {
        gpu.mode.clone()
    } else {
        format!("{} ({})", gpu.mode, notes.join(", "))
    }
}

fn write_claim(view: &inspect::ClaimView, out: &mut String) {
    let p = |t: &str| crate::cli::output::printable(t, false);
    let _ = writeln!(
        out,
        "claim {}/{}: {}{}",
        p(&view.namespace),
        p(&view.name),
        if view.allocated {
            "allocated"
        } else {
            "not allocated"
        },
        if view.pods.is_empty() {
            String::new()
        } else {
            format!(", reserved for pod {}", p(&view.pods.join(", ")))
        }
    );
    let mut rows = vec![
        [
            "DEVICE",
            "REQUEST",
            "MEMORY BOOKED",
            "MEMORY USED",
            "COMPUTE",
            "BACKEND",
            "ISOLATION",
            "READY",
            "WITHIN BOOKING",
        ]
        .map(str::to_owned)
        .to_vec(),
    ];
    let unknown = || "-".to_owned();
    for d in &view.devices {
        rows.push(vec![
            p(&d.device),
            p(&d.request),
            d.memory_booked.map_or_else(unknown, |q| q.to_string()),
            d.memory_used.map_or_else(unknown, |q| q.to_string()),
            d.compute_booked.map_or_else(unknown, |c| format!("{c}%")),
            d.backend.as_deref().map_or_else(unknown, p),
            d.isolation.as_deref().map_or_else(unknown, p),
            d.ready.as_deref().map_or_else(unknown, p),
            d.memory_within_booking
                .as_ref()
                .map_or_else(unknown, |(status, _)| p(status)),
        ]);
    }
    write_table(&rows, out);
    for d in &view.devices {
        if let Some((_, message)) = &d.memory_within_booking {
            let _ = writeln!(out, "{}: {}", p(&d.device), p(message));
        }
    }
    if view.events.is_empty() {
        let _ = writeln!(
            out,
            "no Events of the node's plugin about the claim or its pods"
        );
        return;
    }
    let mut rows = vec![
        ["TYPE", "REASON", "ABOUT", "COUNT", "NOTE"]
            .map(str::to_owned)
            .to_vec(),
    ];
    for e in &view.events {
        rows.push(vec![
            p(&e.kind),
            p(&e.reason),
            p(&e.regarding),
            e.count.to_string(),
            p(&e.note),
        ]);
    }
    write_table(&rows, out);
}
