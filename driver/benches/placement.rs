//! Single placement decisions on the Alibaba "openb" cluster (1,213 nodes, 6,212 GPUs), for
//! each policy, with the cluster about 70 % allocated by a replay of the default trace.
//!
//! Run: `cargo bench -p tessera-driver --bench placement`. It reads
//! `../shared/data/alibaba-gpu-v2023/csv/` (relative to the repository root; override with
//! `TESSERA_TRACE_DIR`) and skips, saying so, when the trace is not there.

use std::hint::black_box;
use std::path::PathBuf;

use criterion::{Criterion, criterion_group, criterion_main};
use k8s_openapi::api::resource::v1 as res;
use tessera_driver::placement::allocator::{Allocator, AllocatorOptions, Policy, Snapshot};
use tessera_driver::tools::simulate::{
    Cluster, TracePod, cluster::claim_for, order, parse_nodes, parse_pods,
};

fn trace_dir() -> PathBuf {
    std::env::var_os("TESSERA_TRACE_DIR").map_or_else(
        || {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../shared/data/alibaba-gpu-v2023/csv")
        },
        PathBuf::from,
    )
}

/// The cluster, the trace, and a snapshot filled to `fill` percent of GPU capacity.
fn filled(fill: u64) -> Option<(Cluster, Vec<TracePod>, Snapshot)> {
    let dir = trace_dir();
    let nodes = std::fs::read_to_string(dir.join("openb_node_list_gpu_node.csv")).ok()?;
    let pods = std::fs::read_to_string(dir.join("openb_pod_list_default.csv")).ok()?;
    let nodes = parse_nodes("nodes", &nodes).ok()?;
    let pods = parse_pods("pods", &pods).ok()?;
    let class: res::DeviceClass =
        serde_yaml::from_str(include_str!("../../deviceclasses/shared-gpu.yaml")).ok()?;
    let cluster = Cluster::new(nodes, vec![class], "gpu.tessera.dev").ok()?;
    let mut snap = cluster.snapshot().ok()?;
    let allocator = Allocator::new(AllocatorOptions {
        policy: Policy::DemandFgd,
        ..AllocatorOptions::default()
    });
    let demands: Vec<u64> = pods.iter().map(TracePod::gpu_demand).collect();
    let target = cluster.capacity_milli() * fill / 100;
    let mut arrived = 0;
    for (seq, &i) in order::arrival_order(&demands, 42, target)
        .iter()
        .enumerate()
    {
        let pod = &pods[i];
        arrived += pod.gpu_demand();
        if arrived > target {
            break;
        }
        snap.observe(pod.shape());
        let claim = claim_for(pod, seq, "gpu.tessera.dev");
        let claims: Vec<&res::ResourceClaim> = claim.iter().map(|(c, _)| c).collect();
        if let Ok(p) = allocator.allocate_pod(&snap, &claims, &cluster.candidates, &pod.host) {
            for (c, a) in claims.iter().zip(&p.allocations) {
                snap.commit(c, a);
            }
            snap.add_host_use(&p.node, &pod.host);
        }
    }
    Some((cluster, pods, snap))
}

fn bench(c: &mut Criterion) {
    let Some((cluster, pods, snap)) = filled(70) else {
        eprintln!(
            "placement bench skipped: no trace at {}",
            trace_dir().display()
        );
        return;
    };
    let share = pods
        .iter()
        .position(|p| p.num_gpu == 1 && p.gpu_milli < 1000);
    let whole = pods
        .iter()
        .position(|p| p.num_gpu == 1 && p.gpu_milli == 1000);
    for policy in Policy::ALL {
        let allocator = Allocator::new(AllocatorOptions {
            policy,
            ..AllocatorOptions::default()
        });
        for (kind, idx) in [("share", share), ("whole-gpu", whole)] {
            let Some(idx) = idx else { continue };
            let pod = &pods[idx];
            let Some((claim, _)) = claim_for(pod, 1_000_000 + idx, "gpu.tessera.dev") else {
                continue;
            };
            c.bench_function(
                &format!("place one {kind} pod on 1213 nodes, {policy}"),
                |b| {
                    b.iter(|| {
                        black_box(
                            allocator
                                .allocate_pod(&snap, &[&claim], &cluster.candidates, &pod.host)
                                .is_ok(),
                        )
                    });
                },
            );
        }
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = bench
}
criterion_main!(benches);
