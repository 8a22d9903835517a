//! Allocation throughput on a 1,000-node x 8-GPU cluster (half the nodes in shared mode).
//!
//! Run: `cargo bench -p tessera-driver --bench allocate`. Besides Criterion's timing of one
//! decision, it prints decisions/s and the p99 latency of a stream of mixed claims: 1/2 shares
//! of 1-20Gi, 1/4 whole GPUs, 1/4 multi-card (2-4 GPU) requests, each allocated and committed.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1 as res;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity as K8sQuantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
use serde_json::json;
use tessera_driver::placement::allocator::{Allocator, AllocatorOptions, Policy, Snapshot};

const D: &str = "gpu.tessera.dev";
const NODES: usize = 1000;
const GPUS: usize = 8;

fn q(s: &str) -> K8sQuantity {
    K8sQuantity(s.into())
}

fn attr(v: &str) -> res::DeviceAttribute {
    res::DeviceAttribute {
        string: Some(v.into()),
        ..Default::default()
    }
}

#[allow(clippy::too_many_lines)] // Reason: one literal cluster, read top to bottom.
fn cluster() -> (Vec<res::ResourceSlice>, Vec<res::DeviceClass>, Vec<Node>) {
    let policy = |default: &str, min: &str, max: &str, step: &str| res::CapacityRequestPolicy {
        default: Some(q(default)),
        valid_range: Some(res::CapacityRequestPolicyRange {
            min: q(min),
            max: Some(q(max)),
            step: Some(q(step)),
        }),
        valid_values: None,
    };
    let mut slices = Vec::new();
    let mut nodes = Vec::new();
    for n in 0..NODES {
        let shared = n % 2 == 1;
        let devices = (0..GPUS)
            .map(|i| res::Device {
                name: format!("gpu-{i}"),
                attributes: Some(
                    [
                        (
                            "sharing".to_owned(),
                            attr(if shared { "shared" } else { "exclusive" }),
                        ),
                        (
                            "nvlinkDomain".to_owned(),
                            attr(&format!("node-{n}-island-{}", i / 4)),
                        ),
                        ("model".to_owned(), attr("a100-80g")),
                    ]
                    .into(),
                ),
                capacity: Some(
                    [
                        (
                            "memory".to_owned(),
                            res::DeviceCapacity {
                                value: q("80Gi"),
                                request_policy: shared.then(|| policy("1Gi", "1Gi", "80Gi", "1Gi")),
                            },
                        ),
                        (
                            "compute".to_owned(),
                            res::DeviceCapacity {
                                value: q("100"),
                                request_policy: shared.then(|| policy("0", "0", "100", "5")),
                            },
                        ),
                    ]
                    .into(),
                ),
                allow_multiple_allocations: shared.then_some(true),
                ..Default::default()
            })
            .collect();
        let name = format!("node-{n}");
        slices.push(res::ResourceSlice {
            metadata: ObjectMeta {
                name: Some(format!("{name}-gpu")),
                ..ObjectMeta::default()
            },
            spec: res::ResourceSliceSpec {
                driver: D.into(),
                node_name: Some(name.clone()),
                pool: res::ResourcePool {
                    name: name.clone(),
                    generation: 1,
                    resource_slice_count: 1,
                },
                devices: Some(devices),
                ..Default::default()
            },
        });
        nodes.push(Node {
            metadata: ObjectMeta {
                name: Some(name),
                ..ObjectMeta::default()
            },
            ..Node::default()
        });
    }
    let class = |name: &str, sharing: &str| res::DeviceClass {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..ObjectMeta::default()
        },
        spec: res::DeviceClassSpec {
            selectors: Some(vec![res::DeviceSelector {
                cel: Some(res::CELDeviceSelector {
                    expression: format!(
                        r#"device.driver == "{D}" && device.attributes["{D}"].sharing == "{sharing}""#
                    ),
                }),
            }]),
            ..Default::default()
        },
    };
    (
        slices,
        vec![
            class("gpu.tessera.dev", "exclusive"),
            class("shared.gpu.tessera.dev", "shared"),
        ],
        nodes,
    )
}

/// The i-th claim of the stream (deterministic).
fn claim(i: usize) -> res::ResourceClaim {
    let exact = |class: &str, count: i64| res::ExactDeviceRequest {
        device_class_name: class.into(),
        count: Some(count),
        ..Default::default()
    };
    let mut devices = res::DeviceClaim::default();
    match i % 4 {
        0 | 1 => {
            devices.requests = Some(vec![res::DeviceRequest {
                name: "share".into(),
                exactly: Some(exact("shared.gpu.tessera.dev", 1)),
                ..Default::default()
            }]);
            let memory = 1 + (i * 7919) % 20;
            devices.config = Some(vec![res::DeviceClaimConfiguration {
                requests: None,
                opaque: Some(res::OpaqueDeviceConfiguration {
                    driver: D.into(),
                    parameters: RawExtension(
                        json!({"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuShare", "memory": format!("{memory}Gi")}),
                    ),
                }),
            }]);
        }
        2 => {
            devices.requests = Some(vec![res::DeviceRequest {
                name: "gpu".into(),
                exactly: Some(exact("gpu.tessera.dev", 1)),
                ..Default::default()
            }]);
        }
        _ => {
            let count = 2 + i64::try_from(i % 3).unwrap_or(0);
            devices.requests = Some(vec![res::DeviceRequest {
                name: "gpus".into(),
                exactly: Some(exact("gpu.tessera.dev", count)),
                ..Default::default()
            }]);
        }
    }
    res::ResourceClaim {
        metadata: ObjectMeta {
            name: Some(format!("c{i}")),
            namespace: Some("bench".into()),
            uid: Some(format!("uid-{i}")),
            ..ObjectMeta::default()
        },
        spec: res::ResourceClaimSpec {
            devices: Some(devices),
        },
        status: None,
    }
}

fn stream(policy: Policy, claims: usize) {
    let (slices, classes, nodes) = cluster();
    let mut snap = Snapshot::new(&slices, &classes, &[]).expect("snapshot");
    let allocator = Allocator::new(AllocatorOptions {
        policy,
        ..AllocatorOptions::default()
    });
    let mut latencies = Vec::with_capacity(claims);
    let (mut placed, mut failed) = (0, 0);
    let start = Instant::now();
    for i in 0..claims {
        let c = claim(i);
        let t = Instant::now();
        match allocator.allocate(&snap, &[&c], &nodes) {
            Ok(p) => {
                snap.commit(&c, &p.allocations[0]);
                placed += 1;
            }
            Err(_) => failed += 1,
        }
        latencies.push(t.elapsed());
    }
    let total = start.elapsed();
    latencies.sort_unstable();
    let p99 = latencies[latencies.len() * 99 / 100];
    let p50 = latencies[latencies.len() / 2];
    eprintln!(
        "policy {policy}: {claims} decisions ({placed} placed, {failed} unsatisfiable) in {total:?}: {:.0} decisions/s, p50 {p50:?}, p99 {p99:?}",
        f64::from(u32::try_from(claims).unwrap_or(u32::MAX)) / total.as_secs_f64()
    );
}

fn bench(c: &mut Criterion) {
    for policy in [Policy::FirstFit, Policy::Binpack, Policy::Spread] {
        stream(policy, 12_000);
    }
    let (slices, classes, nodes) = cluster();
    let snap = Snapshot::new(&slices, &classes, &[]).expect("snapshot");
    let mut group = c.benchmark_group("allocate");
    group.measurement_time(Duration::from_secs(5));
    for policy in [Policy::FirstFit, Policy::Binpack] {
        let allocator = Allocator::new(AllocatorOptions {
            policy,
            ..AllocatorOptions::default()
        });
        let mut i = 0;
        group.bench_function(format!("one decision, empty cluster, {policy}"), |b| {
            b.iter(|| {
                i += 1;
                let c = claim(i);
                black_box(allocator.allocate(&snap, &[&c], &nodes).is_ok())
            });
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
