use super::*;
use crate::node::checkpoint::{ClaimEntry, HeldDevice, PrepareState};
use crate::testing::mps_daemon as daemon;

const GIB: u64 = 1 << 30;

fn share(gpu: &str, gib: u64) -> HeldDevice {
    HeldDevice {
        request: "gpu".to_owned(),
        pool: "node-a".to_owned(),
        device: format!("{gpu}-dev"),
        gpu_uuid: gpu.to_owned(),
        mig: false,
        exclusive: false,
        cdi_ids: Vec::new(),
        share_memory_bytes: Some(gib * GIB),
        share_compute_percent: Some(0),
        share_id: Some("s".to_owned()),
        share_tier: None,
    }
}

fn whole(gpu: &str) -> HeldDevice {
    HeldDevice {
        exclusive: true,
        share_memory_bytes: None,
        share_compute_percent: None,
        share_id: None,
        ..share(gpu, 0)
    }
}

fn claim(record: &mut Checkpoint, uid: &str, devices: Vec<HeldDevice>, mps: Option<MpsDaemon>) {
    record.claims.insert(
        uid.to_owned(),
        ClaimEntry {
            namespace: "team".to_owned(),
            name: format!("claim-{uid}"),
            state: PrepareState::PrepareCompleted,
            devices,
            host_dirs: Vec::new(),
            mps_daemon: mps,
        },
    );
}

fn consumers(pairs: &[(&str, &str)]) -> Consumers {
    let mut out = Consumers::new();
    for (claim, pod) in pairs {
        out.entry((*claim).to_owned()).or_default().push(Consumer {
            uid: (*pod).to_owned(),
            name: format!("pod-{pod}"),
        });
    }
    out
}

fn process(pid: u32, gpu: &str, gib_tenths: u64, start: u64, pod: Option<&str>) -> GpuProcess {
    GpuProcess {
        pid,
        gpu_uuid: gpu.to_owned(),
        used_bytes: gib_tenths * GIB / 10,
        start_ticks: start,
        pod_uid: pod.map(str::to_owned),
    }
}

fn pids(verdict: &Verdict) -> Vec<u32> {
    verdict.stops.iter().map(|s| s.pid).collect()
}

/// The H200 measurement: three processes of one 10 GiB share, 9.5 GiB each.
fn three_workers() -> (Checkpoint, Consumers, Vec<GpuProcess>) {
    let mut record = Checkpoint::new("b");
    claim(
        &mut record,
        "c1",
        vec![share("GPU-1", 10)],
        Some(daemon(&["GPU-1"])),
    );
    let who = consumers(&[("c1", "p1")]);
    let procs = vec![
        process(101, "GPU-1", 95, 1000, Some("p1")),
        process(102, "GPU-1", 95, 1001, Some("p1")),
        process(103, "GPU-1", 95, 1002, Some("p1")),
    ];
    (record, who, procs)
}

#[test]
fn three_processes_each_under_the_limit_but_together_over_the_booking_lose_the_newest_two() {
    let (record, who, procs) = three_workers();
    let verdict = judge(&record, &who, &procs, &BTreeSet::new());
    assert_eq!(
        pids(&verdict),
        [103, 102],
        "newest first, until the rest fits"
    );
    assert!(
        verdict
            .stops
            .iter()
            .all(|s| s.means == Means::MpsTerminate(vec![daemon(&["GPU-1"])]))
    );
    assert_eq!(verdict.over.len(), 1);
    let over = &verdict.over[0];
    assert_eq!(over.pod_name, "pod-p1");
    assert_eq!(over.namespace, "team");
    assert_eq!(over.booked_bytes, 10 * GIB);
    assert_eq!(over.used_bytes, 285 * GIB / 10);
    assert_eq!(over.stopped.len(), 2);
    let message = over.message();
    assert!(message.contains("ResourceClaim team/claim-c1"), "{message}");
    assert!(
        message.contains("booked 10240 MiB of GPU GPU-1"),
        "{message}"
    );
    assert!(message.contains("used 29184 MiB"), "{message}");
    assert!(message.contains("103 (9728 MiB)"), "{message}");
}

#[test]
fn a_claim_within_its_booking_is_left_alone_and_its_use_is_the_sum_of_its_processes() {
    let (record, who, mut procs) = three_workers();
    for p in &mut procs {
        p.used_bytes = 3 * GIB;
    }
    let verdict = judge(&record, &who, &procs, &BTreeSet::new());
    assert!(verdict.stops.is_empty());
    assert!(verdict.over.is_empty());
    // One more byte than the booking's last free GiB puts the claim over: the three processes
    // counted 9 GiB together, exactly.
    procs.push(GpuProcess {
        used_bytes: GIB + 1,
        ..process(104, "GPU-1", 0, 1003, Some("p1"))
    });
    let verdict = judge(&record, &who, &procs, &BTreeSet::new());
    assert_eq!(pids(&verdict), [104]);
    assert_eq!(verdict.over[0].used_bytes, 10 * GIB + 1);
}

#[test]
fn use_exactly_at_the_booking_is_within_it() {
    let (record, who, mut procs) = three_workers();
    procs.truncate(2);
    procs[0].used_bytes = 5 * GIB;
    procs[1].used_bytes = 5 * GIB;
    assert!(
        judge(&record, &who, &procs, &BTreeSet::new())
            .stops
            .is_empty()
    );
}

#[test]
fn an_older_process_that_grows_past_the_booking_is_stopped_when_the_newer_ones_are_not_enough() {
    let (record, who, mut procs) = three_workers();
    procs[0].used_bytes = 12 * GIB;
    procs[1].used_bytes = GIB;
    procs[2].used_bytes = GIB;
    assert_eq!(
        pids(&judge(&record, &who, &procs, &BTreeSet::new())),
        [103, 102, 101]
    );
}

#[test]
fn processes_started_in_the_same_tick_lose_the_larger_first() {
    let (record, who, mut procs) = three_workers();
    for p in &mut procs {
        p.start_ticks = 7;
    }
    procs[1].used_bytes = 96 * GIB / 10;
    assert_eq!(
        pids(&judge(&record, &who, &procs, &BTreeSet::new())),
        [102, 103]
    );
}

#[test]
fn a_process_mps_did_not_stop_is_killed_on_the_next_pass() {
    let (record, who, procs) = three_workers();
    let asked = BTreeSet::from([(103, 1002)]);
    let verdict = judge(&record, &who, &procs, &asked);
    assert_eq!(verdict.stops[0].pid, 103);
    assert_eq!(verdict.stops[0].means, Means::Kill);
    assert!(matches!(verdict.stops[1].means, Means::MpsTerminate(_)));
}

#[test]
fn a_reused_pid_is_not_taken_for_the_process_mps_was_asked_to_stop() {
    let (record, who, procs) = three_workers();
    let asked = BTreeSet::from([(103, 5)]);
    let verdict = judge(&record, &who, &procs, &asked);
    assert!(matches!(verdict.stops[0].means, Means::MpsTerminate(_)));
}

#[test]
fn without_an_mps_daemon_the_process_is_killed() {
    let (mut record, who, procs) = three_workers();
    record.claims.get_mut("c1").unwrap().mps_daemon = None;
    let verdict = judge(&record, &who, &procs, &BTreeSet::new());
    assert!(verdict.stops.iter().all(|s| s.means == Means::Kill));
}

#[test]
fn processes_outside_pods_or_of_other_pods_are_unattributed_and_left_alone() {
    let (record, who, mut procs) = three_workers();
    procs.push(process(7, "GPU-1", 400, 1, None));
    procs.push(process(8, "GPU-1", 400, 1, Some("stranger")));
    let verdict = judge(&record, &who, &procs, &BTreeSet::new());
    assert_eq!(verdict.unattributed, [7, 8]);
    assert!(!pids(&verdict).contains(&7) && !pids(&verdict).contains(&8));
}

#[test]
fn gpus_without_bookings_and_whole_gpu_claims_are_not_accounted() {
    let mut record = Checkpoint::new("b");
    claim(&mut record, "w", vec![whole("GPU-9")], None);
    let who = consumers(&[("w", "p")]);
    let procs = vec![
        process(1, "GPU-9", 800, 1, Some("p")),
        process(2, "GPU-5", 800, 1, Some("p")),
    ];
    let verdict = judge(&record, &who, &procs, &BTreeSet::new());
    assert_eq!(verdict, Verdict::default());
}

#[test]
fn each_gpu_of_a_claim_is_held_to_that_gpus_booking() {
    let mut record = Checkpoint::new("b");
    let d = daemon(&["GPU-1", "GPU-2"]);
    claim(
        &mut record,
        "c",
        vec![share("GPU-1", 4), share("GPU-2", 4)],
        Some(d),
    );
    let who = consumers(&[("c", "p")]);
    let procs = vec![
        process(1, "GPU-1", 30, 1, Some("p")),
        process(2, "GPU-2", 30, 1, Some("p")),
        process(3, "GPU-2", 30, 2, Some("p")),
    ];
    let verdict = judge(&record, &who, &procs, &BTreeSet::new());
    assert_eq!(pids(&verdict), [3]);
    assert_eq!(verdict.stops[0].gpu_uuid, "GPU-2");
}

#[test]
fn two_shares_of_one_claim_on_one_gpu_book_their_sum() {
    let mut record = Checkpoint::new("b");
    claim(
        &mut record,
        "c",
        vec![share("GPU-1", 4), share("GPU-1", 4)],
        None,
    );
    let who = consumers(&[("c", "p")]);
    let procs = vec![
        process(1, "GPU-1", 40, 1, Some("p")),
        process(2, "GPU-1", 40, 2, Some("p")),
    ];
    assert!(
        judge(&record, &who, &procs, &BTreeSet::new())
            .stops
            .is_empty()
    );
}

#[test]
fn a_claim_shared_by_two_pods_counts_the_processes_of_both() {
    let mut record = Checkpoint::new("b");
    claim(&mut record, "c", vec![share("GPU-1", 10)], None);
    let who = consumers(&[("c", "p1"), ("c", "p2")]);
    let procs = vec![
        process(1, "GPU-1", 60, 1, Some("p1")),
        process(2, "GPU-1", 60, 2, Some("p2")),
    ];
    let verdict = judge(&record, &who, &procs, &BTreeSet::new());
    assert_eq!(pids(&verdict), [2]);
    assert_eq!(
        verdict.over.len(),
        1,
        "only the pod that loses a process hears of it"
    );
    assert_eq!(verdict.over[0].pod_name, "pod-p2");
}

#[test]
fn a_pods_two_claims_on_one_gpu_are_held_to_their_sum_together() {
    let mut record = Checkpoint::new("b");
    claim(&mut record, "a", vec![share("GPU-1", 4)], None);
    claim(&mut record, "b", vec![share("GPU-1", 6)], None);
    let who = consumers(&[("a", "p"), ("b", "p")]);
    let within = vec![
        process(1, "GPU-1", 70, 1, Some("p")),
        process(2, "GPU-1", 30, 2, Some("p")),
    ];
    assert!(
        judge(&record, &who, &within, &BTreeSet::new())
            .stops
            .is_empty()
    );
    let over = vec![
        process(1, "GPU-1", 70, 1, Some("p")),
        process(2, "GPU-1", 40, 2, Some("p")),
    ];
    let verdict = judge(&record, &who, &over, &BTreeSet::new());
    assert_eq!(pids(&verdict), [2]);
    assert_eq!(verdict.over[0].claims.len(), 2);
    assert!(verdict.over[0].message().contains(" + "));
}

#[test]
fn a_process_of_claims_served_by_two_daemons_is_asked_of_each_daemon_once() {
    // A pod's two claims on one GPU: each daemon that serves one of them may be the one the
    // process is a client of, so each is asked; a daemon both claims share is asked once.
    let one = daemon(&["GPU-1"]);
    let two = daemon(&["GPU-1", "GPU-2"]);
    let over = vec![
        process(1, "GPU-1", 70, 1, Some("p")),
        process(2, "GPU-1", 40, 2, Some("p")),
    ];
    let who = consumers(&[("a", "p"), ("b", "p")]);

    let mut record = Checkpoint::new("b");
    claim(&mut record, "a", vec![share("GPU-1", 4)], Some(one.clone()));
    claim(&mut record, "b", vec![share("GPU-1", 6)], Some(two.clone()));
    let verdict = judge(&record, &who, &over, &BTreeSet::new());
    assert_eq!(pids(&verdict), [2]);
    let mut both = vec![one.clone(), two];
    both.sort_by(|a, b| a.id.cmp(&b.id));
    assert_eq!(verdict.stops[0].means, Means::MpsTerminate(both));

    let mut record = Checkpoint::new("b");
    claim(&mut record, "a", vec![share("GPU-1", 4)], Some(one.clone()));
    claim(&mut record, "b", vec![share("GPU-1", 6)], Some(one.clone()));
    let verdict = judge(&record, &who, &over, &BTreeSet::new());
    assert_eq!(verdict.stops[0].means, Means::MpsTerminate(vec![one]));
}

#[test]
fn other_claims_on_the_same_gpu_are_untouched() {
    let (mut record, mut who, mut procs) = three_workers();
    claim(
        &mut record,
        "c2",
        vec![share("GPU-1", 20)],
        Some(daemon(&["GPU-1"])),
    );
    who.extend(consumers(&[("c2", "p2")]));
    procs.push(process(200, "GPU-1", 190, 5000, Some("p2")));
    let verdict = judge(&record, &who, &procs, &BTreeSet::new());
    assert_eq!(pids(&verdict), [103, 102]);
}

#[test]
fn a_process_listed_by_both_nvml_lists_counts_once() {
    let (record, who, mut procs) = three_workers();
    procs.truncate(1);
    procs.push(procs[0].clone());
    let verdict = judge(&record, &who, &procs, &BTreeSet::new());
    assert!(verdict.stops.is_empty());
    // Over the booking, the use it reports counts the twice-listed process once.
    procs.push(process(104, "GPU-1", 10, 1003, Some("p1")));
    let verdict = judge(&record, &who, &procs, &BTreeSet::new());
    assert_eq!(pids(&verdict), [104]);
    assert_eq!(verdict.over[0].used_bytes, 105 * GIB / 10);
}

#[test]
fn a_claims_consumers_are_the_pods_it_is_reserved_for() {
    let claim: k8s_openapi::api::resource::v1::ResourceClaim =
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "c", "namespace": "team", "uid": "c1"},
            "spec": {},
            "status": {"reservedFor": [
                {"resource": "pods", "name": "b", "uid": "u-b"},
                {"resource": "pods", "name": "a", "uid": "u-a"},
                {"apiGroup": "example.com", "resource": "pods", "name": "x", "uid": "u-x"},
                {"apiGroup": "apps", "resource": "statefulsets", "name": "s", "uid": "u-s"}
            ]}
        }))
        .unwrap();
    let names: Vec<String> = pod_consumers(&claim).into_iter().map(|c| c.name).collect();
    assert_eq!(names, ["a", "b"]);
}

#[test]
fn only_shares_on_whole_gpus_are_booked_never_a_mig_device_or_a_whole_device() {
    let mut record = Checkpoint::new("b");
    let mig = HeldDevice {
        mig: true,
        ..share("GPU-1", 10)
    };
    claim(
        &mut record,
        "c1",
        vec![mig, share("GPU-2", 5), whole("GPU-3")],
        None,
    );
    assert_eq!(
        booked(&record.claims["c1"]).collect::<Vec<_>>(),
        [("GPU-2", 5 * GIB)]
    );
    assert_eq!(booked_gpus(&record), BTreeSet::from(["GPU-2".to_owned()]));
}

#[test]
fn a_process_listed_twice_with_different_readings_counts_at_the_larger() {
    // Booked 10 GiB; one process read at 4 GiB by one NVML list and 11 GiB by the other.
    let (record, who, _) = three_workers();
    let small = process(101, "GPU-1", 40, 1000, Some("p1"));
    let large = process(101, "GPU-1", 110, 1000, Some("p1"));
    for procs in [
        vec![small.clone(), large.clone()],
        vec![large.clone(), small.clone()],
    ] {
        let verdict = judge(&record, &who, &procs, &BTreeSet::new());
        assert_eq!(pids(&verdict), [101]);
        assert_eq!(verdict.over[0].used_bytes, 11 * GIB);
        assert_eq!(verdict.stops[0].used_bytes, 11 * GIB);
    }
}

#[test]
fn a_claims_use_is_the_sum_of_its_pods_processes_against_its_booking() {
    let (record, who, procs) = three_workers();
    let measured = usage(&record, &who, &procs);
    let gpu = measured["c1"]["GPU-1"];
    assert_eq!(gpu.used_bytes, 3 * 95 * GIB / 10);
    assert_eq!(gpu.booked_bytes, 10 * GIB);
    assert!(!gpu.within_booking());
}

#[test]
fn a_booked_gpu_without_processes_reads_zero_and_within_booking() {
    let (record, who, _) = three_workers();
    let gpu = usage(&record, &who, &[])["c1"]["GPU-1"];
    assert_eq!((gpu.used_bytes, gpu.booked_bytes), (0, 10 * GIB));
    assert!(gpu.within_booking());
}

#[test]
fn processes_of_other_pods_and_outside_pods_do_not_count_for_a_claim() {
    let (record, who, _) = three_workers();
    let procs = vec![
        process(101, "GPU-1", 40, 1000, Some("p1")),
        process(201, "GPU-1", 90, 1001, Some("stranger")),
        process(301, "GPU-1", 90, 1002, None),
    ];
    assert_eq!(
        usage(&record, &who, &procs)["c1"]["GPU-1"].used_bytes,
        4 * GIB
    );
}

#[test]
fn a_process_listed_twice_counts_once_at_its_larger_reading() {
    let (record, who, _) = three_workers();
    let procs = vec![
        process(101, "GPU-1", 30, 1000, Some("p1")),
        process(101, "GPU-1", 50, 1000, Some("p1")),
    ];
    assert_eq!(
        usage(&record, &who, &procs)["c1"]["GPU-1"].used_bytes,
        5 * GIB
    );
}

#[test]
fn two_claims_one_pod_uses_on_a_gpu_are_measured_together() {
    let mut record = Checkpoint::new("b");
    claim(&mut record, "c1", vec![share("GPU-1", 4)], None);
    claim(&mut record, "c2", vec![share("GPU-1", 6)], None);
    let who = consumers(&[("c1", "p1"), ("c2", "p1")]);
    let procs = vec![process(101, "GPU-1", 70, 1000, Some("p1"))];
    let measured = usage(&record, &who, &procs);
    for uid in ["c1", "c2"] {
        let gpu = measured[uid]["GPU-1"];
        assert_eq!((gpu.used_bytes, gpu.booked_bytes), (7 * GIB, 10 * GIB));
        assert_eq!(gpu.counted_with, 1);
    }
}

#[test]
fn whole_devices_are_not_measured() {
    let mut record = Checkpoint::new("b");
    claim(&mut record, "c1", vec![whole("GPU-1")], None);
    let who = consumers(&[("c1", "p1")]);
    let procs = vec![process(101, "GPU-1", 70, 1000, Some("p1"))];
    assert!(usage(&record, &who, &procs).is_empty());
}
