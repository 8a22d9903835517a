//! Latency of preparing one claim on a real file system, fsyncs included: two checkpoint
//! writes and one CDI spec, each a temp file, fsync, rename and directory fsync.
#![allow(missing_docs, clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use tessera_driver::node::cdi::Enforcement;
use tessera_driver::node::inventory::Inventory;
use tessera_kubelet_plugin::claims::preparer::{CdiPreparer, CdiPreparerConfig};
use tessera_kubelet_plugin::claims::{ClaimRef, FakeClaimSource};

#[path = "../tests/support/mod.rs"]
mod support;

const INVENTORY: &str = include_str!("../../examples/inventory/demo-cluster.yaml");

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss,
        reason = "index into a short sample"
    )]
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn bench(c: &mut Criterion) {
    let dir = std::env::var_os("TESSERA_BENCH_DIR").map_or_else(
        || tempfile::tempdir().unwrap(),
        |d| tempfile::tempdir_in(d).unwrap(),
    );
    let node = Inventory::from_yaml(INVENTORY)
        .unwrap()
        .node("a100-node")
        .cloned()
        .unwrap();
    let mut source = FakeClaimSource::new();
    source.insert(support::claim(0));
    let object = support::claim(0);
    let preparer = CdiPreparer::new(
        CdiPreparerConfig {
            driver_name: support::DRIVER.to_owned(),
            cdi_dir: dir.path().join("cdi"),
            state_dir: dir.path().join("state"),
            enforcement: Enforcement::None,
            boot_id: "bench-boot".to_owned(),
        },
        node,
        Arc::new(source),
    )
    .unwrap();
    let claim = ClaimRef::new("default", "claim-0", "uid-0");

    c.bench_function("prepare one whole GPU, fsync included", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let start = Instant::now();
                preparer.prepare_fetched(&claim, &object).unwrap();
                total += start.elapsed();
                preparer.unprepare_blocking(&claim).unwrap();
            }
            total
        });
    });

    let mut samples: Vec<Duration> = (0..1000)
        .map(|_| {
            let start = Instant::now();
            preparer.prepare_fetched(&claim, &object).unwrap();
            let took = start.elapsed();
            preparer.unprepare_blocking(&claim).unwrap();
            took
        })
        .collect();
    samples.sort();
    eprintln!(
        "prepare latency over {} calls: p50 {:?}, p99 {:?}, max {:?}",
        samples.len(),
        percentile(&samples, 0.50),
        percentile(&samples, 0.99),
        samples[samples.len() - 1]
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
