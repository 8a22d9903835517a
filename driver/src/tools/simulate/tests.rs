use super::*;
use crate::placement::allocator::Policy;
use crate::placement::fragmentation::WHOLE_GPU;
use crate::tools::simulate::replay::{at_or_below, fragmentation_of};
use k8s_openapi::api::resource::v1 as res;

const NODES: &str = "\
sn,cpu_milli,memory_mib,gpu,model
node-a,32000,131072,2,G2
node-b,32000,131072,2,G2
node-c,8000,32768,1,T4
";

const PODS: &str = "\
name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time
p0,4000,8192,1,500,,LS,Running,0,10,0
p1,4000,8192,1,1000,,LS,Running,0,10,0
p2,2000,4096,0,0,,BE,Running,0,10,0
p3,4000,8192,2,1000,,LS,Running,0,10,0
p4,4000,8192,1,470,T4,LS,Running,0,10,0
p5,4000,8192,1,810,,LS,Running,0,10,0
";

fn shared_class() -> res::DeviceClass {
    serde_yaml::from_str(include_str!("../../../../deviceclasses/shared-gpu.yaml")).unwrap()
}

fn cluster() -> Cluster {
    let nodes = parse_nodes("nodes.csv", NODES).unwrap();
    Cluster::new(
        nodes,
        vec![shared_class()],
        crate::names::DEFAULT_DRIVER_NAME,
    )
    .unwrap()
}

fn run(policy: Policy, seed: u64) -> SeedResult {
    let pods = parse_pods("pods.csv", PODS).unwrap();
    let opts = ReplayOptions {
        policy,
        seed,
        history: None,
        mixing: None,
    };
    replay(
        &cluster(),
        &pods,
        &workload_of(&pods),
        &opts,
        &mut |_, _| {},
    )
    .unwrap()
}

#[test]
fn trace_files_read_by_column_name_with_models_mapped() {
    let nodes = parse_nodes("nodes.csv", NODES).unwrap();
    assert_eq!(nodes[0].model, "a100-40g");
    assert_eq!(nodes[2].model, "t4-16g");
    assert_eq!(nodes[0].host.memory_bytes, 131_072 << 20);
    let pods = parse_pods("pods.csv", PODS).unwrap();
    assert_eq!(pods[4].gpu_spec, vec!["t4-16g".to_owned()]);
    let five = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1000,1024,8,1000\n";
    assert_eq!(parse_pods("m.csv", five).unwrap()[0].num_gpu, 8);
}

#[test]
fn bad_trace_values_name_the_file_line_and_column() {
    let err = parse_pods(
        "p.csv",
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,1,1200\n",
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("p.csv line 2") && err.contains("gpu_milli"),
        "{err}"
    );
    let err = parse_nodes("n.csv", "sn,cpu_milli,memory_mib,gpu,model\nn,x,1,1,G2\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("cpu_milli") && err.contains("\"x\""), "{err}");
    let err = parse_nodes("n.csv", "sn,cpu_milli,memory_mib,gpu,model\nn,1,1,1,B9\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown GPU model"), "{err}");
    let err = parse_pods("p.csv", "name,cpu_milli\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("memory_mib"), "{err}");
}

#[test]
fn a_pod_becomes_a_share_claim_of_memory_percent_on_each_card() {
    let pods = parse_pods("pods.csv", PODS).unwrap();
    let (claim, rounded) = cluster::claim_for(&pods[5], 7, "gpu.tessera.dev").unwrap();
    assert!(!rounded);
    let devices = claim.spec.devices.unwrap();
    let config = &devices.config.unwrap()[0];
    assert_eq!(
        config.opaque.as_ref().unwrap().parameters.0["memoryPercent"],
        81
    );
    let odd = TracePod {
        gpu_milli: 815,
        ..pods[5].clone()
    };
    assert!(cluster::claim_for(&odd, 8, "gpu.tessera.dev").unwrap().1);
    assert!(cluster::claim_for(&pods[2], 9, "gpu.tessera.dev").is_none());
}

#[test]
fn every_policy_replays_the_small_trace_and_places_what_fits() {
    for policy in Policy::ALL {
        let r = run(policy, 42);
        assert!(r.pods >= 6, "{policy}");
        // 5 GPUs: the trace's 6.25 GPUs of demand are inflated to at most 6.5.
        assert!(r.failed_gpu_milli > 0, "{policy}: more demand than GPUs");
        assert_eq!(r.allocation_curve.len(), 131);
        assert!(r.unallocated_pct_at_100 >= 0.0 && r.unallocated_pct_at_100 <= 100.0);
    }
}

#[test]
fn a_replay_is_deterministic_per_seed() {
    assert_eq!(run(Policy::Fgd, 3), run(Policy::Fgd, 3));
}

#[test]
fn model_restricted_tasks_land_only_on_their_model() {
    let c = cluster();
    let pods = parse_pods("pods.csv", PODS).unwrap();
    let mut snap = c.snapshot().unwrap();
    let allocator = crate::placement::allocator::Allocator::new(
        crate::placement::allocator::AllocatorOptions {
            policy: Policy::DemandFgd,
            ..Default::default()
        },
    );
    let (claim, _) = cluster::claim_for(&pods[4], 0, "gpu.tessera.dev").unwrap();
    let placement = allocator
        .allocate_pod(&snap, &[&claim], &c.candidates, &pods[4].host)
        .unwrap();
    assert_eq!(placement.node, "node-c");
    snap.commit(&claim, &placement.allocations[0]);
    assert_eq!(snap.node_gpu_free("node-c").unwrap().1, &[530]);
}

#[test]
fn a_claims_shape_carries_the_models_its_selectors_accept() {
    // What the controller learns from a claim must match the trace's own shape, gpu_spec
    // included, so the model reserve works outside the simulator too.
    let c = cluster();
    let pods = parse_pods("pods.csv", PODS).unwrap();
    let snap = c.snapshot().unwrap();
    let allocator = crate::placement::allocator::Allocator::new(
        crate::placement::allocator::AllocatorOptions::default(),
    );
    for (seq, pod) in pods.iter().enumerate() {
        let claim = cluster::claim_for(pod, seq, "gpu.tessera.dev");
        let claims: Vec<&_> = claim.iter().map(|(cl, _)| cl).collect();
        let shape = allocator.task_shape(&snap, &claims, &pod.host).unwrap();
        assert_eq!(shape, pod.shape(), "{}", pod.name);
    }
}

#[test]
fn cpu_and_memory_are_enforced_per_node() {
    let c = cluster();
    let mut snap = c.snapshot().unwrap();
    let allocator = crate::placement::allocator::Allocator::new(
        crate::placement::allocator::AllocatorOptions {
            policy: Policy::FirstFit,
            ..Default::default()
        },
    );
    let big = crate::placement::fragmentation::HostResources {
        cpu_milli: 30_000,
        memory_bytes: 1 << 30,
    };
    for expected in ["node-a", "node-b"] {
        let p = allocator
            .allocate_pod(&snap, &[], &c.candidates, &big)
            .unwrap();
        assert_eq!(p.node, expected);
        snap.add_host_use(&p.node, &big);
    }
    let err = allocator
        .allocate_pod(&snap, &[], &c.candidates, &big)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("CPU and memory") && err.contains("3 nodes"),
        "{err}"
    );
}

/// Replays step by step and recounts allocated milli-GPU, fragmentation and the gap counts
/// from scratch after every arrival.
#[test]
fn bookkeeping_matches_a_brute_force_recount() {
    let c = cluster();
    let pods = parse_pods("pods.csv", PODS).unwrap();
    let measure = workload_of(&pods);
    let mut snap = c.snapshot().unwrap();
    let allocator = crate::placement::allocator::Allocator::new(
        crate::placement::allocator::AllocatorOptions {
            policy: Policy::DemandFgd,
            ..Default::default()
        },
    );
    let demands: Vec<u64> = pods.iter().map(TracePod::gpu_demand).collect();
    let order = order::arrival_order(&demands, 5, c.capacity_milli() * 13 / 10);
    let mut allocated = 0u64;
    let mut frag: Vec<f64> = c
        .nodes
        .iter()
        .map(|n| fragmentation_of(&snap, &n.name, measure.typical()))
        .collect();
    let mut cpu_used = std::collections::HashMap::new();
    for (seq, &i) in order.iter().enumerate() {
        let pod = &pods[i];
        snap.observe(pod.shape());
        let claim = cluster::claim_for(pod, seq, "gpu.tessera.dev");
        let claims: Vec<&_> = claim.iter().map(|(cl, _)| cl).collect();
        if let Ok(p) = allocator.allocate_pod(&snap, &claims, &c.candidates, &pod.host) {
            for (cl, a) in claims.iter().zip(&p.allocations) {
                snap.commit(cl, a);
            }
            snap.add_host_use(&p.node, &pod.host);
            *cpu_used.entry(p.node.clone()).or_insert(0u64) += pod.host.cpu_milli;
            allocated += pod.gpu_demand();
            let idx = c.nodes.iter().position(|n| n.name == p.node).unwrap();
            frag[idx] = fragmentation_of(&snap, &p.node, measure.typical());
        }
        // Recount: GPU use from the snapshot's devices, fragmentation from every node.
        let used: u64 = snap
            .gpu_free_by_node()
            .iter()
            .flat_map(|(_, _, free)| free.iter())
            .map(|&f| u64::from(WHOLE_GPU - f))
            .sum();
        assert_eq!(used, allocated, "after arrival {seq}");
        // The cluster-wide gap counts that Sum-of-Squares packing reads, kept incrementally.
        let mut gaps = crate::placement::packing::GapCounts::new();
        for (_, _, free) in snap.gpu_free_by_node() {
            for &f in free {
                gaps.add(f);
            }
        }
        assert_eq!(&gaps, snap.gaps(), "gap counts after arrival {seq}");
        let mut model_free = crate::placement::packing::ModelFree::new();
        for (_, model, free) in snap.gpu_free_by_node() {
            model_free.add(model, free.iter().map(|&f| u64::from(f)).sum());
        }
        assert_eq!(model_free.total(), snap.model_free().total());
        for n in &c.nodes {
            assert_eq!(
                model_free.of(&n.model),
                snap.model_free().of(&n.model),
                "free {} GPU after arrival {seq}",
                n.model
            );
        }
        let idle = super::IdleByKind::count(&snap, pod.host);
        assert_eq!(
            idle.partly_used + idle.untouched + idle.stranded + allocated,
            c.capacity_milli(),
            "idle GPU after arrival {seq}"
        );
        for (k, n) in c.nodes.iter().enumerate() {
            let fresh = fragmentation_of(&snap, &n.name, measure.typical());
            assert!(
                (fresh - frag[k]).abs() < 1e-9,
                "node {} after arrival {seq}",
                n.name
            );
            let free = snap.host_free(&n.name).unwrap();
            let used = cpu_used.get(&n.name).copied().unwrap_or(0);
            assert_eq!(free.cpu_milli, n.host.cpu_milli - used);
        }
    }
}

#[test]
fn the_headline_falls_back_to_the_nearest_percent_below() {
    let mut curve = vec![None; 131];
    curve[98] = Some(90.0);
    assert!((at_or_below(&curve, 100) - 90.0).abs() < 1e-9);
    curve[100] = Some(95.0);
    assert!((at_or_below(&curve, 100) - 95.0).abs() < 1e-9);
}

#[test]
fn the_summary_is_the_mean_over_seeds() {
    let a = run(Policy::BestFit, 1);
    let b = run(Policy::BestFit, 2);
    let expected = f64::midpoint(a.unallocated_pct_at_100, b.unallocated_pct_at_100);
    let s = Summary::new("best-fit", vec![a, b]);
    assert!((s.unallocated_pct_at_100 - expected).abs() < 1e-9);
}

mod mixing;
