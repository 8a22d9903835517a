//! A trace's cluster as Kubernetes objects: nodes become fake inventories and their
//! `ResourceSlices`, tasks become `ResourceClaims` for Tessera's share class.
//!
//! Every GPU is published in `shared` mode (any GPU may take shares). A task's milli-GPU maps
//! onto a `GpuShare` with `memoryPercent` = milli / 10 on each of its `num_gpu` cards: a whole
//! GPU is `memoryPercent: 100`, which fits only a GPU nobody holds any of. Percent conversion
//! rounds down to whole MiB, so shares whose percents sum to at most 100 always fit together
//! and shares that sum to more never do (the rounding is below 1 MiB per share, far less
//! than 1 % of any card): feasibility is exactly the trace's. A milli value that is not a
//! multiple of 10 cannot be written as a percent; it is rounded **up** to the next percent
//! and counted (`rounded_pods`) — none of the published traces has one. `gpu_spec` becomes a
//! CEL selector on the `model` attribute.

use std::fmt::Write as _;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1 as res;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
use serde_json::json;

use super::trace::{TraceNode, TracePod};
use crate::error::{Error, Result};
use crate::names;
use crate::node::inventory::Inventory;
use crate::node::slices::{self, RenderOptions};
use crate::placement::allocator::Snapshot;
use crate::placement::fragmentation::{HostResources, WHOLE_GPU};
use crate::tools::batch::bare_node;

/// The simulated cluster: its slices, classes and candidate nodes, built once per trace.
#[derive(Debug, Clone)]
pub struct Cluster {
    /// The trace's nodes, in file order (also the candidate order).
    pub nodes: Vec<TraceNode>,
    slices: Vec<res::ResourceSlice>,
    classes: Vec<res::DeviceClass>,
    /// Node objects, in file order.
    pub candidates: Vec<Node>,
    /// The driver name the slices are published under.
    pub driver_name: String,
}

impl Cluster {
    /// Builds the cluster's objects; `classes` must include Tessera's share class.
    pub fn new(
        nodes: Vec<TraceNode>,
        classes: Vec<res::DeviceClass>,
        driver_name: &str,
    ) -> Result<Self> {
        Self::with_enforcement(nodes, classes, driver_name, None)
    }

    /// As [`Cluster::new`], with every GPU publishing `enforcement` (e.g. `hami-core`, so
    /// batch memory over-commit applies).
    pub fn with_enforcement(
        nodes: Vec<TraceNode>,
        classes: Vec<res::DeviceClass>,
        driver_name: &str,
        enforcement: Option<&str>,
    ) -> Result<Self> {
        if !classes
            .iter()
            .any(|c| c.metadata.name.as_deref() == Some(names::CLASS_SHARED_GPU))
        {
            return Err(Error::invalid(
                "simulation",
                "classes",
                format!("the DeviceClass {} is missing", names::CLASS_SHARED_GPU),
            ));
        }
        let mut yaml = String::from("defaults: {mode: shared}\nnodes:\n");
        for n in &nodes {
            if n.gpus == 0 {
                return Err(Error::invalid(
                    format!("node {}", n.name),
                    "gpu",
                    "a node without GPUs cannot be simulated; use a GPU node list",
                ));
            }
            let _ = writeln!(
                yaml,
                "- name: {}\n  gpus:\n  - {{model: {}, count: {}}}",
                n.name, n.model, n.gpus
            );
        }
        let inventory = Inventory::from_yaml(&yaml)?;
        let opts = RenderOptions {
            driver_name: driver_name.to_owned(),
            enforcement: enforcement.map(str::to_owned),
            ..RenderOptions::default()
        };
        let mut all = Vec::new();
        for node in &inventory.nodes {
            all.extend(slices::render(node, &opts)?);
        }
        let candidates = nodes.iter().map(|n| bare_node(&n.name)).collect();
        Ok(Self {
            nodes,
            slices: all,
            classes,
            candidates,
            driver_name: driver_name.to_owned(),
        })
    }

    /// The `ResourceSlices` the cluster's nodes publish.
    pub fn slices(&self) -> &[res::ResourceSlice] {
        &self.slices
    }

    /// GPU capacity in milli-GPU.
    pub fn capacity_milli(&self) -> u64 {
        self.nodes
            .iter()
            .map(|n| u64::from(n.gpus) * u64::from(WHOLE_GPU))
            .sum()
    }

    /// A fresh snapshot: nothing allocated, every node's CPU and memory tracked.
    pub fn snapshot(&self) -> Result<Snapshot> {
        let mut snap = Snapshot::for_driver(&self.driver_name, &self.slices, &self.classes, &[])?;
        for n in &self.nodes {
            snap.set_host(&n.name, n.host, HostResources::default());
        }
        Ok(snap)
    }
}

/// The claim of task `pod` arriving as the `seq`-th, and whether its milli was rounded up.
/// CPU-only tasks have no claim.
pub fn claim_for(pod: &TracePod, seq: usize, driver: &str) -> Option<(res::ResourceClaim, bool)> {
    claim_in(pod, seq, driver, names::CLASS_SHARED_GPU)
}

/// As [`claim_for`], for DeviceClass `class` (mixing puts batch tasks in a batch class).
pub fn claim_in(
    pod: &TracePod,
    seq: usize,
    driver: &str,
    class: &str,
) -> Option<(res::ResourceClaim, bool)> {
    if pod.num_gpu == 0 {
        return None;
    }
    let percent = pod.gpu_milli.div_ceil(10);
    let rounded = !pod.gpu_milli.is_multiple_of(10);
    let selectors = (!pod.gpu_spec.is_empty()).then(|| {
        let list = pod
            .gpu_spec
            .iter()
            .map(|m| format!("{m:?}"))
            .collect::<Vec<_>>()
            .join(", ");
        vec![res::DeviceSelector {
            cel: Some(res::CELDeviceSelector {
                expression: format!(
                    "device.attributes[{driver:?}].{} in [{list}]",
                    names::ATTR_MODEL
                ),
            }),
        }]
    });
    let name = format!("{}-{seq}", pod.name);
    let claim = res::ResourceClaim {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: Some("simulate".to_owned()),
            uid: Some(format!("simulate-{seq}")),
            ..ObjectMeta::default()
        },
        spec: res::ResourceClaimSpec {
            devices: Some(res::DeviceClaim {
                requests: Some(vec![res::DeviceRequest {
                    name: "gpu".to_owned(),
                    exactly: Some(res::ExactDeviceRequest {
                        device_class_name: class.to_owned(),
                        count: Some(i64::from(pod.num_gpu)),
                        selectors,
                        ..res::ExactDeviceRequest::default()
                    }),
                    ..res::DeviceRequest::default()
                }]),
                config: Some(vec![res::DeviceClaimConfiguration {
                    requests: None,
                    opaque: Some(res::OpaqueDeviceConfiguration {
                        driver: driver.to_owned(),
                        parameters: RawExtension(json!({
                            "apiVersion": names::CONFIG_API_VERSION,
                            "kind": names::GPU_SHARE_KIND,
                            "memoryPercent": percent,
                        })),
                    }),
                }]),
                ..res::DeviceClaim::default()
            }),
        },
        status: None,
    };
    Some((claim, rounded))
}
