//! `--mixing`: best-effort tasks as batch shares, and what it measures.

use super::*;
use crate::placement::allocator::{Allocator, AllocatorOptions, Learn};
use crate::tools::simulate::cluster::claim_in;
use crate::tools::simulate::mixing::Tracker;

const BATCH: &str = "batch.gpu.tessera.dev";

fn batch_class(memory_factor: Option<f64>) -> res::DeviceClass {
    let mut c: res::DeviceClass =
        serde_yaml::from_str(include_str!("../../../../../deviceclasses/batch-gpu.yaml")).unwrap();
    if let Some(f) = memory_factor {
        let cfg = &mut c.spec.config.as_mut().unwrap()[0];
        cfg.opaque.as_mut().unwrap().parameters.0["batchMemoryOvercommit"] = serde_json::json!(f);
    }
    c
}

fn mixed_cluster(memory_factor: Option<f64>) -> Cluster {
    let nodes = parse_nodes("nodes.csv", NODES).unwrap();
    Cluster::with_enforcement(
        nodes,
        vec![shared_class(), batch_class(memory_factor)],
        crate::names::DEFAULT_DRIVER_NAME,
        memory_factor.map(|_| crate::names::ENFORCEMENT_HAMI_CORE),
    )
    .unwrap()
}

fn mixing() -> Mixing {
    Mixing {
        batch_class: BATCH.to_owned(),
    }
}

fn task(name: &str, milli: u32, best_effort: bool) -> TracePod {
    TracePod {
        name: name.to_owned(),
        host: crate::placement::fragmentation::HostResources {
            cpu_milli: 1000,
            memory_bytes: 1 << 30,
        },
        num_gpu: 1,
        gpu_milli: milli,
        gpu_spec: vec!["t4-16g".to_owned()],
        best_effort: Some(best_effort),
    }
}

#[test]
fn the_qos_column_marks_best_effort_tasks() {
    let pods = parse_pods("pods.csv", PODS).unwrap();
    assert_eq!(pods[2].best_effort, Some(true));
    assert_eq!(pods[0].best_effort, Some(false));
    let bare = parse_pods(
        "p.csv",
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\nx,1,1,1,100\n",
    )
    .unwrap();
    assert_eq!(bare[0].best_effort, None);
}

#[test]
fn mixing_needs_a_qos_column() {
    let pods = parse_pods(
        "p.csv",
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\nx,1,1,1,100\n",
    )
    .unwrap();
    let opts = ReplayOptions {
        policy: Policy::DemandFgd,
        seed: 42,
        history: None,
        mixing: Some(mixing()),
    };
    let err = replay(
        &mixed_cluster(None),
        &pods,
        &workload_of(&pods),
        &opts,
        &mut |_, _| {},
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("qos"), "{err}");
}

#[test]
fn without_over_commit_mixing_places_exactly_what_a_single_tier_does() {
    let pods = parse_pods("pods.csv", PODS).unwrap();
    for seed in [42, 43] {
        let plain = ReplayOptions {
            policy: Policy::DemandFgd,
            seed,
            history: None,
            mixing: None,
        };
        let mixed = ReplayOptions {
            mixing: Some(mixing()),
            ..plain.clone()
        };
        let cluster = mixed_cluster(None);
        let a = replay(&cluster, &pods, &workload_of(&pods), &plain, &mut |_, _| {}).unwrap();
        let b = replay(&cluster, &pods, &workload_of(&pods), &mixed, &mut |_, _| {}).unwrap();
        assert_eq!(a.allocation_curve, b.allocation_curve);
        assert_eq!(a.failed_pods, b.failed_pods);
        let m = b.mixing.unwrap();
        assert!(a.mixing.is_none());
        assert!(m.batch_overcommitted_pct_at_100.abs() < 1e-9);
        assert!(m.online_gpu_tasks > 0);
    }
}

#[test]
fn an_online_task_blocked_by_batch_counts_as_would_preempt_and_batch_memory_over_commits() {
    let cluster = mixed_cluster(Some(2.0));
    let mut snap = cluster.snapshot().unwrap();
    let allocator = Allocator::new(AllocatorOptions::default()).without_explanations();
    let pods = [
        task("batch-1", 600, true),
        task("online", 600, false),
        task("batch-2", 600, true),
    ];
    let mut tracker = Tracker::new(&mixing(), &cluster, &pods).unwrap();
    let mut outcomes = Vec::new();
    for (seq, pod) in pods.iter().enumerate() {
        let class = tracker
            .class_of(pod, crate::names::CLASS_SHARED_GPU)
            .to_owned();
        let (claim, _) = claim_in(pod, seq, &cluster.driver_name, &class).unwrap();
        let placed = allocator.place_pod(
            &mut snap,
            &[&claim],
            &cluster.candidates,
            &pod.host,
            Learn::Known,
        );
        let placement = placed.result.as_ref().ok();
        outcomes.push(placement.is_some());
        tracker.arrival(
            &allocator,
            pod,
            &[&claim],
            &cluster.candidates,
            placement,
            true,
        );
    }
    // The only T4 holds 600 batch: online 600 does not fit (online memory is never
    // over-committed) but would after evicting the batch task; a second batch 600 fits, 200
    // of it over-committed (1.2 GPU booked of 2.0 allowed).
    assert_eq!(outcomes, [true, false, true]);
    tracker.at_100(&snap, cluster.capacity_milli());
    let r = &tracker.result;
    assert_eq!(r.online_failed, 1);
    assert_eq!(r.online_would_preempt, 1);
    assert_eq!(r.online_would_preempt_before_100, 1);
    assert_eq!(r.batch_placed_milli_at_100, 1200);
    assert!((r.batch_placed_pct_at_100 - 100.0).abs() < 1e-9);
    assert!(r.online_placed_pct_at_100.abs() < 1e-9);
    // 200 milli of one T4 over-committed, of 5 GPUs: 4 %.
    assert!(
        (r.batch_overcommitted_pct_at_100 - 4.0).abs() < 0.01,
        "{r:?}"
    );
}
