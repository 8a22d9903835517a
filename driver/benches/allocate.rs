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
use serde_json::json;
use tessera_driver::placement::allocator::{Allocator, AllocatorOptions, Policy, Snapshot};
use tessera_driver::testing::{self, exact_request, gpu_device, k8s_node, sharing_class};

const NODES: usize = 1000;
const GPUS: usize = 8;

fn cluster() -> (Vec<res::ResourceSlice>, Vec<res::DeviceClass>, Vec<Node>) {
    let mut slices = Vec::new();
    let mut nodes = Vec::new();
    for n in 0..NODES {
        let shared = n % 2 == 1;
        let devices = (0..GPUS)
            .map(|i| {
                gpu_device(
                    &format!("gpu-{i}"),
                    &[
                        ("sharing", if shared { "shared" } else { "exclusive" }),
                        ("nvlinkDomain", &format!("node-{n}-island-{}", i / 4)),
                        ("model", "a100-80g"),
                    ],
                    "80Gi",
                    shared,
                )
            })
            .collect();
        let name = format!("node-{n}");
        slices.push(testing::slice(&format!("{name}-gpu"), &name, devices));
        nodes.push(k8s_node(&name));
    }
    (
        slices,
        vec![
            sharing_class("gpu.tessera.dev", "exclusive"),
            sharing_class("shared.gpu.tessera.dev", "shared"),
        ],
        nodes,
    )
}

/// The i-th claim of the stream (deterministic).
fn claim(i: usize) -> res::ResourceClaim {
    let mut devices = res::DeviceClaim::default();
    match i % 4 {
        0 | 1 => {
            devices.requests = Some(vec![exact_request("share", "shared.gpu.tessera.dev", 1)]);
            let memory = 1 + (i * 7919) % 20;
            devices.config = Some(vec![testing::opaque_config(
                json!({"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuShare", "memory": format!("{memory}Gi")}),
            )]);
        }
        2 => {
            devices.requests = Some(vec![exact_request("gpu", "gpu.tessera.dev", 1)]);
        }
        _ => {
            let count = 2 + i64::try_from(i % 3).unwrap_or(0);
            devices.requests = Some(vec![exact_request("gpus", "gpu.tessera.dev", count)]);
        }
    }
    testing::claim("bench", &format!("c{i}"), &format!("uid-{i}"), devices)
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
