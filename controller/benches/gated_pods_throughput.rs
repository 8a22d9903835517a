//! End-to-end controller throughput: gated pods placed per second against the in-process fake
//! API server, on a 1,000-node x 8-GPU cluster (nodes 0-499 exclusive, 500-999 shared).
//!
//! Run: `cargo bench -p tessera-controller --bench gated_pods_throughput`. Each sample starts
//! a fresh server and a synced controller (binpack), then creates PODS gated pods at once
//! (alternately one whole GPU and one 10 GiB share) and times until the last gate is removed.
//! Every pod costs the controller three writes over HTTP (finalizer, allocation, gate), so
//! this measures the whole path: watch events in, decision, writes out. It also prints pods/s.
#![allow(missing_docs, clippy::unwrap_used, reason = "a benchmark binary")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use serde_json::json;
use tessera_controller::metrics::{Metrics, Outcome};
use tessera_controller::service::{self, ControllerConfig};
use tessera_driver::names;
use tessera_driver::node::inventory::Inventory;
use tessera_driver::placement::allocator::Policy;
use tessera_tests::fake_apiserver::FakeApiServer;
use tessera_tests::scale::seed_fake;
use tokio::sync::watch;

const NODES: usize = 1000;
const GPUS: usize = 8;
const PODS: usize = 1000;
/// [`PODS`] as a float, for rates.
const PODS_F64: f64 = 1000.0;

fn inventory() -> Inventory {
    use std::fmt::Write as _;
    let mut text = String::from("nodes:\n");
    for i in 0..NODES {
        let mode = if i < NODES / 2 { "exclusive" } else { "shared" };
        let _ = write!(
            text,
            "- name: node-{i:04}\n  mode: {mode}\n  gpus:\n  - model: h100-80g\n    count: {GPUS}\n    nvlinkIslandSize: 4\n"
        );
    }
    Inventory::from_yaml(&text).unwrap()
}

fn create_pods(server: &FakeApiServer, round: usize) {
    for i in 0..PODS {
        let name = format!("r{round}-p{i}");
        let request = if i % 2 == 0 {
            json!({"name": "gpu", "exactly": {"deviceClassName": names::CLASS_GPU}})
        } else {
            json!({"name": "gpu", "exactly": {"deviceClassName": names::CLASS_SHARED_GPU,
                   "capacity": {"requests": {"memory": "10Gi"}}}})
        };
        server
            .create(
                "resourceclaims",
                json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                       "metadata": {"name": name, "namespace": "default"},
                       "spec": {"devices": {"requests": [request]}}}),
            )
            .unwrap();
        server
            .create(
                "pods",
                json!({"apiVersion": "v1", "kind": "Pod",
                       "metadata": {"name": name, "namespace": "default"},
                       "spec": {"schedulingGates": [{"name": names::SCHEDULING_GATE}],
                                "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                                "containers": [{"name": "c", "image": "x",
                                    "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}]}}),
            )
            .unwrap();
    }
}

/// One sample: time to place PODS gated pods on a fresh, synced controller.
async fn sample(inventory: &Inventory) -> Duration {
    let server = FakeApiServer::start(&["v1"]).await.unwrap();
    seed_fake(
        &server,
        inventory,
        |_| json!({"allocatable": {"cpu": "128", "memory": "1Ti", "pods": "110"}}),
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubeconfig");
    std::fs::write(&path, server.kubeconfig()).unwrap();
    let client = tessera_kubeapi::client(Some(&path)).await.unwrap();
    let metrics = Arc::new(Metrics::new("binpack"));
    let (synced_tx, mut synced) = watch::channel(false);
    let config = ControllerConfig {
        driver_name: names::DEFAULT_DRIVER_NAME.to_owned(),
        policy: Policy::Binpack,
        unbound_after: Duration::from_hours(1),
        resync: Duration::from_mins(1),
        leader: None,
        metrics_addr: None,
        shared_replicas: tessera_driver::admission::device_plugin_names::DEFAULT_SHARED_REPLICAS,
        // The gate protocol's three writes, as this benchmark has always measured.
        fast_path: false,
        preemption: false,
        defrag_per_hour: 0,
    };
    let task = tokio::spawn(service::run_with(
        client,
        config,
        Arc::clone(&metrics),
        synced_tx,
        std::future::pending(),
    ));
    synced.wait_for(|s| *s).await.unwrap();
    let start = Instant::now();
    create_pods(&server, 0);
    while metrics.outcome_count(Outcome::Allocated) < PODS as u64 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let took = start.elapsed();
    task.abort();
    took
}

fn throughput(c: &mut Criterion) {
    let inventory = inventory();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut group = c.benchmark_group("controller");
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(30));
    group.throughput(Throughput::Elements(PODS as u64));
    let mut samples = Vec::new();
    group.bench_function("gated_pods_1000_nodes_x_8_gpus", |b| {
        b.iter_custom(|iterations| {
            let mut total = Duration::ZERO;
            for _ in 0..iterations {
                let took = runtime.block_on(sample(&inventory));
                samples.push(took);
                total += took;
            }
            total
        });
    });
    group.finish();
    if let Some(best) = samples.iter().min() {
        let mean = samples.iter().sum::<Duration>() / u32::try_from(samples.len()).unwrap();
        #[allow(clippy::print_stdout, reason = "the benchmark's report")]
        {
            println!(
                "controller throughput: {PODS} gated pods on {NODES} nodes x {GPUS} GPUs: mean {:.0} pods/s, best {:.0} pods/s over {} samples",
                PODS_F64 / mean.as_secs_f64(),
                PODS_F64 / best.as_secs_f64(),
                samples.len()
            );
        }
    }
}

criterion_group!(benches, throughput);
criterion_main!(benches);
