use k8s_openapi::api::resource::v1::ResourceClaimStatus;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::*;
use crate::node::inventory::Isolation;
use crate::rules::config::Tier;
use crate::testing::{demo_node, mps_daemon};

const GIB: u64 = 1 << 30;
const DRIVER: &str = "gpu.tessera.dev";

fn t4_node() -> NodeInventory {
    let mut node = demo_node("t4-node");
    node.gpus[0].isolation = Isolation::Verified;
    node
}

fn mps() -> Enforcement {
    Enforcement::Mps {
        pipe_dir_root: "/run/tessera/mps".to_owned(),
        log_dir_root: "/var/log/tessera/mps".to_owned(),
    }
}

fn share(node: &NodeInventory) -> HeldDevice {
    HeldDevice {
        request: "gpu".to_owned(),
        pool: "t4-node".to_owned(),
        device: "gpu-0".to_owned(),
        gpu_uuid: node.gpus[0].uuid.clone(),
        mig: false,
        exclusive: false,
        cdi_ids: Vec::new(),
        share_memory_bytes: Some(10 * GIB),
        share_compute_percent: Some(50),
        share_id: Some("3f9c".to_owned()),
        share_tier: Some(Tier::Batch),
    }
}

fn entry(devices: Vec<HeldDevice>, node: &NodeInventory) -> ClaimEntry {
    ClaimEntry {
        namespace: "team".to_owned(),
        name: "train".to_owned(),
        state: PrepareState::PrepareCompleted,
        devices,
        host_dirs: Vec::new(),
        mps_daemon: Some(mps_daemon(&[node.gpus[0].uuid.as_str()])),
    }
}

fn claim(devices: Option<Vec<AllocatedDeviceStatus>>) -> ResourceClaim {
    ResourceClaim {
        metadata: ObjectMeta {
            namespace: Some("team".to_owned()),
            name: Some("train".to_owned()),
            generation: Some(1),
            ..ObjectMeta::default()
        },
        status: Some(ResourceClaimStatus {
            devices,
            ..ResourceClaimStatus::default()
        }),
        ..ResourceClaim::default()
    }
}

fn at(seconds: i64) -> Time {
    Time(format!("2026-01-01T00:00:{seconds:02}Z").parse().unwrap())
}

fn measured(node: &NodeInventory, used_gib_tenths: u64) -> BTreeMap<String, GpuUse> {
    BTreeMap::from([(
        node.gpus[0].uuid.clone(),
        GpuUse {
            used_bytes: used_gib_tenths * GIB / 10,
            booked_bytes: 10 * GIB,
            counted_with: 0,
        },
    )])
}

fn condition_of<'a>(status: &'a AllocatedDeviceStatus, type_: &str) -> &'a Condition {
    status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == type_)
        .unwrap()
}

fn written(
    node: &NodeInventory,
    current: &ResourceClaim,
    measure: Option<&BTreeMap<String, GpuUse>>,
    now: &Time,
) -> Option<Vec<AllocatedDeviceStatus>> {
    let enforcement = mps();
    let facts = NodeFacts {
        driver: DRIVER,
        node,
        enforcement: &enforcement,
    };
    status_write(
        current,
        Some(&entry(vec![share(node)], node)),
        measure,
        &facts,
        now,
    )
}

#[test]
fn a_prepared_share_says_its_limit_backend_isolation_tier_and_daemon_and_is_ready() {
    let node = t4_node();
    let devices = written(&node, &claim(None), None, &at(1)).unwrap();
    assert_eq!(devices.len(), 1);
    let d = &devices[0];
    assert_eq!(
        (d.driver.as_str(), d.pool.as_str(), d.device.as_str()),
        (DRIVER, "t4-node", "gpu-0")
    );
    assert_eq!(d.share_id.as_deref(), Some("3f9c"));
    let data = &d.data.as_ref().unwrap().0;
    assert_eq!(data["apiVersion"], names::CONFIG_API_VERSION);
    assert_eq!(data["kind"], DATA_KIND);
    assert_eq!(data["backend"], "mps");
    assert_eq!(data["isolation"], "verified");
    assert_eq!(data["memoryLimitBytes"], 10 * GIB);
    assert_eq!(data["computePercent"], 50);
    assert_eq!(data["tier"], "batch");
    assert_eq!(
        data["mpsDaemon"],
        entry(vec![], &node).mps_daemon.unwrap().id.as_str()
    );
    assert!(data.get("memoryUsedBytes").is_none());
    assert_eq!(condition_of(d, CONDITION_READY).status, "True");
    let memory = condition_of(d, CONDITION_MEMORY_WITHIN_BOOKING);
    assert_eq!(
        (memory.status.as_str(), memory.reason.as_str()),
        ("Unknown", "NotMeasured")
    );
}

#[test]
fn a_claim_over_its_booking_reads_false_with_its_use_and_true_again_once_back() {
    let node = t4_node();
    let over = written(&node, &claim(None), Some(&measured(&node, 125)), &at(1)).unwrap();
    let memory = condition_of(&over[0], CONDITION_MEMORY_WITHIN_BOOKING);
    assert_eq!(memory.status, "False");
    assert_eq!(memory.reason, "OverBooking");
    assert!(
        memory.message.contains("use 12800 MiB"),
        "{}",
        memory.message
    );
    assert!(
        memory.message.contains("10240 MiB booked"),
        "{}",
        memory.message
    );
    assert_eq!(
        over[0].data.as_ref().unwrap().0["memoryUsedBytes"],
        125 * GIB / 10
    );

    let back = written(
        &node,
        &claim(Some(over)),
        Some(&measured(&node, 60)),
        &at(2),
    )
    .unwrap();
    let memory = condition_of(&back[0], CONDITION_MEMORY_WITHIN_BOOKING);
    assert_eq!(memory.status, "True");
    assert_eq!(memory.last_transition_time, at(2));
}

#[test]
fn nothing_is_written_when_the_claim_already_says_it() {
    let node = t4_node();
    let first = written(&node, &claim(None), Some(&measured(&node, 50)), &at(1)).unwrap();
    assert_eq!(
        written(
            &node,
            &claim(Some(first.clone())),
            Some(&measured(&node, 52)),
            &at(9)
        ),
        None,
        "a move under a twentieth of the booking keeps the written use"
    );
    let moved = written(
        &node,
        &claim(Some(first)),
        Some(&measured(&node, 80)),
        &at(9),
    )
    .unwrap();
    let memory = condition_of(&moved[0], CONDITION_MEMORY_WITHIN_BOOKING);
    assert_eq!(memory.last_transition_time, at(1), "the status stayed True");
}

#[test]
fn other_drivers_entries_are_kept_and_ours_go_when_the_claim_is_unprepared() {
    let node = t4_node();
    let theirs = AllocatedDeviceStatus {
        driver: "nic.example.com".to_owned(),
        pool: "t4-node".to_owned(),
        device: "eth1".to_owned(),
        ..AllocatedDeviceStatus::default()
    };
    let ours = written(&node, &claim(Some(vec![theirs.clone()])), None, &at(1)).unwrap();
    assert_eq!(ours.len(), 2);
    assert_eq!(ours[0], theirs);
    let enforcement = mps();
    let facts = NodeFacts {
        driver: DRIVER,
        node: &node,
        enforcement: &enforcement,
    };
    let unprepared = status_write(&claim(Some(ours)), None, None, &facts, &at(2)).unwrap();
    assert_eq!(unprepared, vec![theirs]);
}

#[test]
fn a_whole_gpu_is_ready_with_hardware_isolation_and_no_memory_condition() {
    let node = t4_node();
    let whole = HeldDevice {
        exclusive: true,
        share_memory_bytes: None,
        share_compute_percent: None,
        share_id: None,
        share_tier: None,
        ..share(&node)
    };
    let enforcement = mps();
    let facts = NodeFacts {
        driver: DRIVER,
        node: &node,
        enforcement: &enforcement,
    };
    let mut e = entry(vec![whole], &node);
    e.mps_daemon = None;
    let devices = status_write(&claim(None), Some(&e), None, &facts, &at(1)).unwrap();
    let data = &devices[0].data.as_ref().unwrap().0;
    assert_eq!(data["backend"], "whole");
    assert_eq!(data["isolation"], "hardware");
    assert!(data.get("tier").is_none() && data.get("memoryLimitBytes").is_none());
    assert_eq!(devices[0].conditions.as_ref().unwrap().len(), 1);
}

#[test]
fn a_claim_only_started_is_not_reported_ready() {
    let node = t4_node();
    let enforcement = mps();
    let facts = NodeFacts {
        driver: DRIVER,
        node: &node,
        enforcement: &enforcement,
    };
    let mut e = entry(vec![share(&node)], &node);
    e.state = PrepareState::PrepareStarted;
    assert_eq!(
        status_write(&claim(None), Some(&e), None, &facts, &at(1)),
        None
    );
}

#[test]
fn the_reported_use_moves_by_a_twentieth_of_the_booking_or_across_it() {
    let m = |used| GpuUse {
        used_bytes: used,
        booked_bytes: 100,
        counted_with: 0,
    };
    assert_eq!(reported_use(None, &m(3)), 3);
    assert_eq!(reported_use(Some(50), &m(54)), 50);
    assert_eq!(reported_use(Some(50), &m(55)), 55);
    assert_eq!(
        reported_use(Some(99), &m(101)),
        101,
        "crossing the booking is reported"
    );
    assert_eq!(reported_use(Some(101), &m(100)), 100);
}

#[test]
fn retries_back_off_from_200_ms_to_at_most_30_s() {
    assert_eq!(retry_delay(0), Duration::from_millis(200));
    assert_eq!(retry_delay(1), Duration::from_millis(400));
    assert_eq!(
        retry_delay(7),
        Duration::from_secs(25) + Duration::from_millis(600)
    );
    assert_eq!(retry_delay(8), Duration::from_secs(30));
    assert_eq!(retry_delay(u32::MAX), Duration::from_secs(30));
}

#[test]
fn messages_are_bounded_at_a_character_boundary() {
    let long = "é".repeat(MESSAGE_LIMIT);
    let cut = bounded(long);
    assert!(cut.len() <= MESSAGE_LIMIT);
    assert!(cut.chars().all(|c| c == 'é'));
}

#[test]
fn the_same_report_ignores_transition_times_but_not_a_turned_condition() {
    let node = t4_node();
    let one = written(&node, &claim(None), Some(&measured(&node, 50)), &at(1)).unwrap();
    let later = written(&node, &claim(None), Some(&measured(&node, 50)), &at(7)).unwrap();
    assert!(same_report(&one, &later));
    let over = written(&node, &claim(None), Some(&measured(&node, 150)), &at(7)).unwrap();
    assert!(!same_report(&one, &over));
}
