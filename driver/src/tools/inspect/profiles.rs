//! The scheduled GPU profiles of a cluster, for `tessera inspect`: each node a
//! `GpuProfileSchedule` selects, its profile in force and since when, the next switch, and what
//! still holds each GPU that drains towards the profile.

use std::collections::{BTreeMap, BTreeSet};

use jiff::Timestamp;
use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::resource::v1 as res;
use serde::Serialize;

use crate::node::schedule::switch::{self, GpuStep};
use crate::node::schedule::{self, Assignment, Schedule};

/// One draining GPU and its holders.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DrainingGpu {
    /// The GPU's index.
    pub index: u32,
    /// Its mode now.
    pub mode: String,
    /// The mode the profile wants.
    pub wanted: String,
    /// `namespace/name (tier)` of each pod holding it.
    pub held_by: Vec<String>,
}

/// One scheduled node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeProfile {
    /// The node.
    pub node: String,
    /// The schedule it follows (or, for a conflict, the schedules that select it).
    pub schedule: String,
    /// The profile in force, when one is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    /// Since when (RFC 3339).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
    /// The next switch: the profile and when (RFC 3339).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next: Option<(String, String)>,
    /// GPUs still draining towards the profile.
    pub draining: Vec<DrainingGpu>,
}

/// The scheduled nodes among `nodes` at `now`.
#[allow(
    clippy::too_many_arguments,
    reason = "the cluster's objects, each a list the CLI fetched"
)]
pub fn node_profiles(
    driver: &str,
    schedules: &[Schedule],
    nodes: &[core::Node],
    slices: &[res::ResourceSlice],
    classes: &[res::DeviceClass],
    claims: &[res::ResourceClaim],
    pods: &[core::Pod],
    now: Timestamp,
) -> Vec<NodeProfile> {
    let preemptible: BTreeSet<String> = switch::preemptible_classes(classes, driver);
    let pods: BTreeMap<String, &core::Pod> = pods
        .iter()
        .map(|p| {
            (
                format!(
                    "{}/{}",
                    p.metadata.namespace.as_deref().unwrap_or("default"),
                    p.metadata.name.as_deref().unwrap_or_default()
                ),
                p,
            )
        })
        .collect();
    let mut out = Vec::new();
    for node in nodes {
        let name = node.metadata.name.clone().unwrap_or_default();
        let labels = node.metadata.labels.clone().unwrap_or_default();
        let s = match schedule::assign(schedules, &labels) {
            Assignment::None => continue,
            Assignment::Conflict(names) => {
                out.push(NodeProfile {
                    node: name,
                    schedule: format!("conflict: {}", names.join(", ")),
                    profile: None,
                    since: None,
                    next: None,
                    draining: Vec::new(),
                });
                continue;
            }
            Assignment::One(s) => s,
        };
        let active = s.active_at(now);
        let next = s
            .next_switch(now)
            .and_then(|n| Some((s.profile(n.profile)?.name.clone(), n.since.to_string())));
        let mut row = NodeProfile {
            node: name.clone(),
            schedule: s.name.clone(),
            profile: active
                .and_then(|a| s.profile(a.profile))
                .map(|p| p.name.clone()),
            since: active.map(|a| a.since.to_string()),
            next,
            draining: Vec::new(),
        };
        if let Some(active) = active {
            let own: Vec<&res::ResourceSlice> = slices
                .iter()
                .filter(|sl| sl.spec.node_name.as_deref() == Some(name.as_str()))
                .collect();
            let gpus = switch::node_gpus(&own, claims, &pods, driver, &preemptible);
            let record = node
                .metadata
                .annotations
                .as_ref()
                .and_then(switch::SwitchRecord::from_annotations);
            if let Some(d) = switch::decide(s, active, &labels, &gpus, record.as_ref(), now) {
                for g in d.gpus {
                    if let GpuStep::Draining(holders) = g.step {
                        row.draining.push(DrainingGpu {
                            index: g.index,
                            mode: g.mode.as_str().to_owned(),
                            wanted: g.wanted.map_or_else(String::new, |m| m.as_str().to_owned()),
                            held_by: holders
                                .iter()
                                .map(|h| format!("{} ({})", h.pod, h.disruption.as_str()))
                                .collect(),
                        });
                    }
                }
            }
        }
        out.push(row);
    }
    out
}
