use super::*;
use crate::placement::fragmentation::tests::shape;
use crate::placement::fragmentation::{HostResources, TaskShape};
use crate::placement::packing::{GapCounts, ModelFree};

fn host(cpu: u64) -> HostResources {
    HostResources {
        cpu_milli: cpu,
        memory_bytes: 64 << 30,
    }
}

fn view<'a>(name: &'a str, free: &'a [u32], cpu_free: u64) -> NodeView<'a> {
    let used: u64 = free.iter().map(|&f| u64::from(WHOLE_GPU - f)).sum();
    NodeView {
        name,
        position: 0,
        devices: u32::try_from(free.len()).unwrap(),
        used_permille: used,
        gpu_free: free,
        model: Some("a100-40g"),
        host_free: Some(host(cpu_free)),
        host_total: Some(host(32_000)),
    }
}

fn ask(cards: u32, milli: u32) -> PodAsk {
    PodAsk {
        cards,
        gpu_milli: milli,
        host: HostResources {
            cpu_milli: 1000,
            memory_bytes: 1 << 30,
        },
    }
}

fn workload(shapes: &[(u32, u32, usize)]) -> Workload {
    Workload::from_shapes(
        shapes
            .iter()
            .flat_map(|&(gpus, milli, n)| std::iter::repeat_n(shape(gpus, milli), n)),
    )
}

/// Two nodes of two GPUs with all their CPU free: `empty`, and `half`, with half a GPU used.
fn empty_and_half() -> [NodeView<'static>; 2] {
    [
        view("empty", &[1000, 1000], 32_000),
        view("half", &[500, 1000], 32_000),
    ]
}

/// The name of the node a policy ranks and scores lowest (ties: the first), with the
/// cluster-wide gaps being those of `nodes` alone.
fn pick<'a>(policy: Policy, nodes: &[NodeView<'a>], ask: &PodAsk, w: &Workload) -> &'a str {
    let mut gaps = GapCounts::new();
    for n in nodes {
        n.gpu_free.iter().for_each(|&f| gaps.add(f));
    }
    pick_with(policy, nodes, ask, w, &gaps)
}

fn pick_with<'a>(
    policy: Policy,
    nodes: &[NodeView<'a>],
    ask: &PodAsk,
    w: &Workload,
    gaps: &GapCounts,
) -> &'a str {
    let input = ScoreInput {
        ask,
        workload: w,
        model_shares: &[],
        gaps,
        held_back: &[],
    };
    nodes
        .iter()
        .min_by_key(|n| (policy.node_rank(n, &input), policy.node_score(n, &input)))
        .unwrap()
        .name
}

#[test]
fn demand_fgd_packs_a_share_into_a_gap_the_cluster_has_many_of() {
    let w = workload(&[(1, 470, 10), (1, 320, 10), (1, 160, 10)]);
    let nodes = [
        view("a", &[350, 1000], 32_000),
        view("b", &[530, 1000], 32_000),
    ];
    // Five GPUs in the cluster have 530 free: a 320 share uses one of them (leaving 210, which
    // a 160 share can still fill) rather than the only 350 gap.
    let mut common = GapCounts::new();
    common.add(350);
    (0..5).for_each(|_| common.add(530));
    assert_eq!(
        pick_with(Policy::DemandFgd, &nodes, &ask(1, 320), &w, &common),
        "b"
    );
    // With one 530 gap, closing the 350 gap (the 30 left is too small for any share and
    // counts as full) keeps the supply of gaps more even.
    let mut even = GapCounts::new();
    even.add(350);
    even.add(530);
    assert_eq!(
        pick_with(Policy::DemandFgd, &nodes, &ask(1, 320), &w, &even),
        "a"
    );
}

#[test]
fn policies_round_trip_through_their_names() {
    for p in Policy::ALL {
        assert_eq!(p.to_string().parse::<Policy>().unwrap(), p);
    }
    let err = "worst-fit".parse::<Policy>().unwrap_err().to_string();
    assert!(
        err.contains("unknown policy") && err.contains("demand-fgd"),
        "{err}"
    );
}

#[test]
fn the_default_policy_is_demand_fgd() {
    assert_eq!(Policy::default(), Policy::DemandFgd);
}

#[test]
fn binpack_prefers_the_fuller_node_and_spread_the_emptier() {
    let w = Workload::new();
    let nodes = empty_and_half();
    assert_eq!(pick(Policy::Binpack, &nodes, &ask(1, 200), &w), "half");
    assert_eq!(pick(Policy::Spread, &nodes, &ask(1, 200), &w), "empty");
    assert_eq!(pick(Policy::FirstFit, &nodes, &ask(1, 200), &w), "empty");
}

#[test]
fn best_fit_counts_cpu_as_well_as_gpu() {
    let w = Workload::new();
    // Same GPU use; the second node has less CPU left.
    let nodes = [
        view("roomy", &[500, 1000], 30_000),
        view("tight", &[500, 1000], 4000),
    ];
    assert_eq!(pick(Policy::BestFit, &nodes, &ask(1, 200), &w), "tight");
}

#[test]
fn fgd_puts_a_share_where_it_leaves_no_unusable_remainder() {
    // Typical tasks: whole and half GPUs. A 500 share on the node with 500 free fills it
    // exactly and removes a remainder whole GPUs cannot use; on the empty node it would break
    // a whole GPU.
    let w = workload(&[(1, 1000, 10), (1, 500, 10)]);
    let nodes = [view("empty", &[1000], 32_000), view("half", &[500], 32_000)];
    assert_eq!(pick(Policy::Fgd, &nodes, &ask(1, 500), &w), "half");
}

#[test]
fn fgd_keeps_whole_gpus_whole_when_whole_gpu_tasks_are_typical() {
    // A 300 share: on "partial" (600 free) it leaves 300, on "whole" it breaks a whole GPU that
    // whole-GPU tasks need.
    let w = workload(&[(1, 1000, 10), (1, 300, 10)]);
    let nodes = [
        view("whole", &[1000], 32_000),
        view("partial", &[600], 32_000),
    ];
    assert_eq!(pick(Policy::Fgd, &nodes, &ask(1, 300), &w), "partial");
}

#[test]
fn fgd_avoids_starving_a_node_of_cpu() {
    // Taking the last CPU of "starved" strands its idle GPU for every typical task.
    let w = workload(&[(1, 1000, 10)]);
    let nodes = [
        view("starved", &[1000, 1000], 1000),
        view("roomy", &[1000, 1000], 32_000),
    ];
    assert_eq!(pick(Policy::Fgd, &nodes, &ask(1, 1000), &w), "roomy");
}

#[test]
fn demand_fgd_weighs_big_tasks_by_what_they_would_leave_unallocated() {
    // Many small shares, few 8-GPU tasks. By task count FGD barely cares about 8 free GPUs on
    // one node; by demand, breaking the only fully free 8-GPU node is expensive.
    let w = workload(&[(1, 100, 60), (8, 1000, 2)]);
    let eight = [1000; 8];
    let mut seven = [1000; 8];
    seven[0] = 900;
    let nodes = [view("free8", &eight, 32_000), view("used", &seven, 32_000)];
    assert_eq!(pick(Policy::DemandFgd, &nodes, &ask(1, 100), &w), "used");
}

#[test]
fn demand_fgd_breaks_ties_towards_the_fuller_node() {
    let w = Workload::new();
    let nodes = empty_and_half();
    assert_eq!(pick(Policy::DemandFgd, &nodes, &ask(1, 1000), &w), "half");
}

#[test]
fn fgd_scores_the_gpu_within_the_node_by_the_same_measure() {
    let w = workload(&[(1, 1000, 10), (1, 300, 10)]);
    let free = [1000, 300];
    let node = view("n", &free, 32_000);
    let a = ask(1, 300);
    let input = ScoreInput {
        ask: &a,
        workload: &w,
        model_shares: &[],
        gaps: &GapCounts::new(),
        held_back: &[],
    };
    let device = |gpu| DeviceView {
        position: gpu,
        used_permille: u64::from(WHOLE_GPU - free[gpu]),
        gpu: Some(gpu),
    };
    assert!(
        Policy::Fgd.device_score(&device(1), &node, &input)
            < Policy::Fgd.device_score(&device(0), &node, &input),
        "the 300 share belongs on the GPU with exactly 300 free"
    );
}

#[test]
fn a_node_without_room_in_the_view_is_tried_last() {
    let w = workload(&[(1, 1000, 10)]);
    let a = ask(2, 1000);
    let input = ScoreInput {
        ask: &a,
        workload: &w,
        model_shares: &[],
        gaps: &GapCounts::new(),
        held_back: &[],
    };
    assert_eq!(
        Policy::Fgd.node_score(&view("n", &[1000, 10], 32_000), &input),
        UNFIT
    );
}

#[test]
fn demand_fgd_keeps_a_model_that_restricted_tasks_need_for_them() {
    // Half the workload's demand accepts only T4s, which are a quarter of the GPUs: a task
    // that runs anywhere goes to the other model.
    let restricted = TaskShape {
        models: Some(vec!["t4-16g".to_owned()].into()),
        ..shape(1, 1000)
    };
    let mut shapes = vec![restricted; 10];
    shapes.extend(
        workload(&[(1, 1000, 10)])
            .typical()
            .iter()
            .map(|t| t.shape.clone()),
    );
    let w = Workload::from_shapes(shapes);
    let model_shares = [("t4-16g".to_owned(), 0.25), ("a100-40g".to_owned(), 0.75)];
    let a = ask(1, 1000);
    let input = ScoreInput {
        ask: &a,
        workload: &w,
        model_shares: &model_shares,
        gaps: &GapCounts::new(),
        held_back: &[],
    };
    let free = [1000, 1000];
    let mut t4 = view("t4", &free, 32_000);
    t4.model = Some("t4-16g");
    let a100 = view("a100", &free, 32_000);
    assert!(input.reserved(Some("t4-16g")) > 0.9);
    assert!(
        Policy::DemandFgd.node_score(&a100, &input) < Policy::DemandFgd.node_score(&t4, &input)
    );
}

#[test]
fn demand_fgd_ranks_a_node_last_when_it_would_eat_what_restricted_tasks_will_need() {
    // A fifth of the demand accepts only T4s.
    let restricted = TaskShape {
        host: host(1000),
        gpus: 1,
        gpu_milli: 1000,
        models: Some(vec!["t4-16g".to_owned()].into()),
    };
    let mut shapes = vec![restricted; 2];
    shapes.extend(std::iter::repeat_n(
        TaskShape {
            host: host(1000),
            gpus: 1,
            gpu_milli: 1000,
            models: None,
        },
        8,
    ));
    let w = Workload::from_shapes(shapes);
    let free = [1000, 1000];
    let mut t4 = view("t4", &free, 32_000);
    t4.model = Some("t4-16g");
    let a100 = view("a100", &free, 32_000);
    let rank = |t4_free: u64, a100_free: u64, node: &NodeView<'_>, a: &PodAsk| {
        let mut model_free = ModelFree::new();
        model_free.add(Some("t4-16g"), t4_free);
        model_free.add(Some("a100-40g"), a100_free);
        let held_back = model_free.held_back(u64::from(a.cards) * u64::from(a.gpu_milli), |m| {
            w.model_pressure(Some(m))
        });
        let input = ScoreInput {
            ask: a,
            workload: &w,
            model_shares: &[],
            gaps: &GapCounts::new(),
            held_back: &held_back,
        };
        Policy::DemandFgd.node_rank(node, &input)
    };
    let whole = ask(1, 1000);
    // 2,000 of T4 free out of 10,000: one more GPU leaves 1,000, less than a fifth of 9,000.
    assert!(rank(2000, 8000, &t4, &whole) > rank(2000, 8000, &a100, &whole));
    // 4,000 of T4 free: 3,000 left is enough; the T4 node is not held back.
    assert_eq!(
        rank(4000, 6000, &t4, &whole),
        rank(4000, 6000, &a100, &whole)
    );
    // A CPU-only pod takes no GPU and is never held back.
    let cpu_only = ask(0, 0);
    assert_eq!(rank(2000, 8000, &t4, &cpu_only), 0);
}
