use super::*;
use crate::tools::simulate::trace::{Qos, parse_nodes, parse_timed_pods};
use proptest::prelude::*;
use std::fmt::Write as _;

const HOUR: u64 = 3600;
const HEADER: &str = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time";
/// The example schedule: day (shared) from 08:00, night (exclusive) from 20:00 UTC, 30 minutes
/// to drain.
const DAY_NIGHT: &str = include_str!("../../../../../examples/schedules/day-night.yaml");

fn shared_class() -> res::DeviceClass {
    serde_yaml::from_str(include_str!("../../../../../deviceclasses/shared-gpu.yaml")).unwrap()
}

fn batch_class() -> res::DeviceClass {
    serde_yaml::from_str(include_str!("../../../../../deviceclasses/batch-gpu.yaml")).unwrap()
}

fn classes() -> Vec<res::DeviceClass> {
    vec![shared_class(), batch_class()]
}

/// Nodes of one GPU each (a T4), in the pools named.
fn cluster(pools: &[&str]) -> (Cluster, Vec<BTreeMap<String, String>>) {
    let mut csv = String::from("sn,cpu_milli,memory_mib,gpu,model\n");
    for i in 0..pools.len() {
        let _ = writeln!(csv, "n{i},32000,131072,1,T4");
    }
    let nodes = parse_nodes("nodes.csv", &csv).unwrap();
    let cluster = Cluster::new(nodes, classes(), names::DEFAULT_DRIVER_NAME).unwrap();
    let labels = pools
        .iter()
        .map(|p| BTreeMap::from([(POOL_LABEL.to_owned(), (*p).to_owned())]))
        .collect();
    (cluster, labels)
}

/// `(qos, num_gpu, gpu_milli, created, deleted)` rows as a pod list.
fn pods(rows: &[(&str, u32, u32, u64, u64)]) -> Vec<TimedPod> {
    let mut csv = format!("{HEADER}\n");
    for (i, (qos, gpus, milli, created, deleted)) in rows.iter().enumerate() {
        let _ = writeln!(
            csv,
            "p{i},1000,1024,{gpus},{milli},,{qos},Running,{created},{deleted},{created}"
        );
    }
    parse_timed_pods("pods.csv", &csv).unwrap()
}

fn day_night() -> Schedule {
    let value: serde_json::Value = serde_yaml::from_str(DAY_NIGHT).unwrap();
    schedule::parse(&value).unwrap()
}

/// Options with the trace's second 0 at `start` (RFC 3339).
fn options(
    labels: Vec<BTreeMap<String, String>>,
    schedule: Option<Schedule>,
    defrag: u32,
    start: &str,
) -> TimeOptions {
    TimeOptions {
        policy: Policy::default(),
        batch_class: "batch.gpu.tessera.dev".to_owned(),
        labels,
        schedule,
        defrag_evictions_per_hour: defrag,
        origin: parse_trace_start(start).unwrap(),
    }
}

fn run(
    pools: &[&str],
    rows: &[(&str, u32, u32, u64, u64)],
    schedule: Option<Schedule>,
    defrag: u32,
    start: &str,
) -> TimeResult {
    let (cluster, labels) = cluster(pools);
    replay_time(
        &cluster,
        &classes(),
        &pods(rows),
        &options(labels, schedule, defrag, start),
    )
    .unwrap()
}

#[test]
fn an_online_pod_holding_a_gpu_at_nightfall_is_never_evicted_the_switch_waits_for_it() {
    // From noon: an online pod holds the tidal node's GPU until 22:00; the night profile starts
    // at 20:00 and its drain deadline passes at 20:30. A batch whole-GPU task arrives at 20:30.
    let r = run(
        &[POOL_TIDAL],
        &[
            ("LS", 1, 1000, 0, 10 * HOUR),
            ("BE", 1, 1000, 8 * HOUR + 1800, 12 * HOUR),
            ("LS", 1, 1000, 12 * HOUR, 12 * HOUR + 60),
        ],
        Some(day_night()),
        0,
        "2023-01-02T12:00:00Z",
    );
    assert_eq!(r.online_evicted, 0);
    assert_eq!(r.schedule_evictions, 0);
    // The batch task starts when the online pod leaves at 22:00, 1.5 hours after it came.
    assert_eq!(r.whole_gpu_wait.max_secs, 3 * HOUR / 2);
}

#[test]
fn a_batch_pod_holding_a_gpu_past_the_morning_deadline_is_evicted_and_runs_on_later() {
    // From 20:00: the night lets a batch task take the tidal GPU for 20 hours; the day
    // starts at 08:00 and its deadline passes at 08:30: the batch task is evicted and waits
    // for the next night with its 7.5 hours left.
    let r = run(
        &[POOL_TIDAL],
        &[("BE", 1, 1000, 0, 20 * HOUR), ("LS", 0, 0, 0, 30 * HOUR)],
        Some(day_night()),
        0,
        "2023-01-02T20:00:00Z",
    );
    assert_eq!(r.schedule_evictions, 1);
    assert_eq!(r.online_evicted, 0);
    // 12.5 hours before the eviction, 6 hours from the next nightfall (20:00 + 24h) to the
    // end at 30 hours.
    assert!(
        (r.batch_gpu_hours - 18.5).abs() < 1e-9,
        "{}",
        r.batch_gpu_hours
    );
}

#[test]
fn a_night_window_gives_batch_more_gpu_hours_than_the_static_split() {
    let pools = [POOL_BATCH, POOL_TIDAL, POOL_ONLINE];
    // A day of demand: four batch whole-GPU tasks of 10 hours from the start (20:00), one
    // online task by day on the online node.
    let rows = [
        ("BE", 1, 1000, 0, 10 * HOUR),
        ("BE", 1, 1000, 0, 10 * HOUR),
        ("BE", 1, 1000, 0, 10 * HOUR),
        ("BE", 1, 1000, 0, 10 * HOUR),
        ("LS", 1, 500, 12 * HOUR, 24 * HOUR),
    ];
    let start = "2023-01-02T20:00:00Z";
    let fixed = run(&pools, &rows, None, 0, start);
    let tidal = run(&pools, &rows, Some(day_night()), 0, start);
    assert!(
        tidal.batch_gpu_hours > fixed.batch_gpu_hours,
        "tidal {} static {}",
        tidal.batch_gpu_hours,
        fixed.batch_gpu_hours
    );
    assert!((tidal.online_gpu_hours - fixed.online_gpu_hours).abs() < 1e-9);
    assert_eq!(tidal.online_evicted, 0);
}

/// Two batch nodes; shares of 40 % each: two on n0 and one on n1, the second of n0 leaving
/// at 1h, then a whole-GPU batch task comes at 2h: each GPU holds 40 %, the task fits nowhere
/// until a share moves.
fn fragmented() -> Vec<(&'static str, u32, u32, u64, u64)> {
    vec![
        ("BE", 1, 400, 0, 20 * HOUR),
        ("BE", 1, 400, 1, HOUR),
        ("BE", 1, 400, 2, 20 * HOUR),
        ("BE", 1, 1000, 2 * HOUR, 4 * HOUR),
    ]
}

#[test]
fn defragmentation_shortens_a_fragmented_whole_gpu_task_s_wait_within_its_budget() {
    let pools = [POOL_BATCH, POOL_BATCH];
    let start = "2023-01-02T12:00:00Z";
    let without = run(&pools, &fragmented(), None, 0, start);
    let with = run(&pools, &fragmented(), None, 1, start);
    assert!(
        with.whole_gpu_wait.max_secs < without.whole_gpu_wait.max_secs,
        "with {:?} without {:?}",
        with.whole_gpu_wait,
        without.whole_gpu_wait
    );
    assert_eq!(without.defrag_evictions, 0);
    assert_eq!(with.defrag_evictions, 1, "{with:?}");
    assert_eq!(with.defrag_plans, 1);
}

#[test]
fn defragmentation_never_evicts_more_than_its_hourly_budget() {
    // Six batch GPUs filled by twelve half shares (packed two a GPU); at 1h one of each pair
    // leaves, so every GPU holds a half; at 2h three whole-GPU tasks come. Each needs one
    // move, and the budget allows one an hour: they get in about an hour apart.
    let pools = [POOL_BATCH; 6];
    let mut rows = Vec::new();
    for i in 0..12 {
        let end = if i % 2 == 0 { HOUR } else { 20 * HOUR };
        rows.push(("BE", 1, 500, i, end));
    }
    for _ in 0..3 {
        rows.push(("BE", 1, 1000, 2 * HOUR, 30 * HOUR));
    }
    let r = run(&pools, &rows, None, 1, "2023-01-02T12:00:00Z");
    assert_eq!(r.defrag_plans, 3, "{r:?}");
    assert_eq!(r.defrag_evictions, 3, "{r:?}");
    // One eviction an hour: the third task waits two hours longer than the first.
    assert!(r.whole_gpu_wait.p50_secs >= HOUR, "{:?}", r.whole_gpu_wait);
    assert!(
        r.whole_gpu_wait.max_secs >= 2 * HOUR,
        "{:?}",
        r.whole_gpu_wait
    );
    assert!(
        r.whole_gpu_wait.max_secs < 18 * HOUR,
        "{:?}",
        r.whole_gpu_wait
    );
}

#[test]
fn a_task_deleted_before_it_was_created_is_an_error_naming_the_line_and_column() {
    let csv = format!("{HEADER}\np0,1000,1024,1,1000,,LS,Running,50,40,50\n");
    let e = parse_timed_pods("pods.csv", &csv).unwrap_err().to_string();
    assert!(
        e.contains("pods.csv line 2") && e.contains("deletion_time") && e.contains("before"),
        "{e}"
    );
}

#[test]
fn a_pod_list_without_time_columns_is_an_error_naming_the_file_and_column() {
    let csv = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1000,1024,1,1000\n";
    let e = parse_timed_pods("multigpu20.csv", csv)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("multigpu20.csv") && e.contains("qos") && e.contains("no qos column"),
        "{e}"
    );
}

#[test]
fn an_unknown_qos_is_an_error_and_guaranteed_is_online_burstable_batch() {
    let csv = format!("{HEADER}\np0,1000,1024,1,1000,,Gold,Running,0,1,0\n");
    let e = parse_timed_pods("pods.csv", &csv).unwrap_err().to_string();
    assert!(
        e.contains("pods.csv line 2") && e.contains("qos") && e.contains("Gold"),
        "{e}"
    );
    assert!(!Qos::Guaranteed.is_batch() && !Qos::LatencySensitive.is_batch());
    assert!(Qos::Burstable.is_batch() && Qos::BestEffort.is_batch());
}

#[test]
fn pools_add_up_to_at_most_all_nodes_and_spread_evenly() {
    assert!(pool_labels(10, 60, 50).is_err());
    let labels = pool_labels(100, 20, 30).unwrap();
    let count = |pool: &str| labels.iter().filter(|l| l[POOL_LABEL] == pool).count();
    assert_eq!(
        (count(POOL_BATCH), count(POOL_TIDAL), count(POOL_ONLINE)),
        (20, 30, 50)
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// On any small trace, with the schedule and defragmentation: no online task is evicted,
    /// GPU-hours stay within capacity times duration, and each tier's GPU-hours within what
    /// its tasks would hold running once each (a task placed twice at a time would exceed it).
    #[test]
    fn online_is_never_evicted_and_gpu_time_stays_within_capacity(
        rows in prop::collection::vec(
            (prop::sample::select(vec!["LS", "BE", "Guaranteed", "Burstable"]),
             prop::sample::select(vec![(0u32, 0u32), (1, 300), (1, 500), (1, 1000), (2, 1000)]),
             0u64..3 * 86400,
             60u64..12 * 3600),
            1..24),
        defrag in prop::sample::select(vec![0u32, 2]),
    ) {
        let rows: Vec<(&str, u32, u32, u64, u64)> = rows
            .iter()
            .map(|(q, (g, m), c, l)| (*q, *g, *m, *c, c + l))
            .collect();
        let pools = [POOL_BATCH, POOL_TIDAL, POOL_TIDAL, POOL_ONLINE];
        let r = run(&pools, &rows, Some(day_night()), defrag, "2023-01-02T15:00:00Z");
        prop_assert_eq!(r.online_evicted, 0);
        #[allow(clippy::cast_precision_loss)]
        let capacity = r.gpus as f64 * r.duration_secs as f64 / 3600.0;
        prop_assert!(r.online_gpu_hours + r.batch_gpu_hours <= capacity + 1e-9);
        let most = |batch: bool| -> f64 {
            rows.iter()
                .filter(|(q, ..)| matches!(*q, "BE" | "Burstable") == batch)
                .map(|(_, g, m, c, d)| {
                    f64::from(g * m) / 1000.0 * f64::from(u32::try_from(d - c).unwrap()) / 3600.0
                })
                .sum()
        };
        prop_assert!(r.online_gpu_hours <= most(false) + 1e-9);
        prop_assert!(r.batch_gpu_hours <= most(true) + 1e-9);
    }
}
