use tessera_driver::node::checkpoint::{ClaimEntry, HeldDevice, PrepareState};
use tessera_driver::node::mps::MpsDaemon;

use super::*;
use crate::claims::FakeClaimSource;

const GIB: u64 = 1 << 30;
const POD: &str = "0c6f33a4-5e2b-4a1b-9e0c-51d4b2a3f7e1";

struct FixedRecord(Checkpoint);

impl PreparedClaims for FixedRecord {
    fn record(&self) -> Result<Checkpoint> {
        Ok(self.0.clone())
    }
}

fn cgroup(pod: &str) -> String {
    format!(
        "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/cri-containerd-1.scope\n",
        pod.replace('-', "_")
    )
}

fn record(mps: Option<MpsDaemon>) -> Checkpoint {
    let mut record = Checkpoint::new("b");
    record.claims.insert(
        "c1".to_owned(),
        ClaimEntry {
            namespace: "team".to_owned(),
            name: "train".to_owned(),
            state: PrepareState::PrepareCompleted,
            devices: vec![HeldDevice {
                request: "gpu".to_owned(),
                pool: "node-a".to_owned(),
                device: "gpu-0".to_owned(),
                gpu_uuid: "GPU-1".to_owned(),
                mig: false,
                exclusive: false,
                cdi_ids: Vec::new(),
                share_memory_bytes: Some(10 * GIB),
                share_compute_percent: Some(50),
                share_id: Some("s1".to_owned()),
                share_tier: None,
            }],
            host_dirs: Vec::new(),
            mps_daemon: mps,
        },
    );
    record
}

fn claims() -> FakeClaimSource {
    let mut source = FakeClaimSource::new();
    source.insert(
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "train", "namespace": "team", "uid": "c1"},
            "spec": {},
            "status": {"reservedFor": [{"resource": "pods", "name": "trainer", "uid": POD}]}
        }))
        .unwrap(),
    );
    source
}

struct World {
    gpu: FakeGpu,
    host: FakeHostProcesses,
    events: FakeEvents,
    metrics: Arc<Metrics>,
    accountant: Accountant,
}

fn world(mps: Option<MpsDaemon>) -> World {
    let gpu = FakeGpu::new();
    let host = FakeHostProcesses::new(gpu.clone());
    let events = FakeEvents::new();
    let metrics = Arc::new(Metrics::new());
    let accountant = Accountant::new(
        Seams {
            prepared: Arc::new(FixedRecord(record(mps))),
            claims: Arc::new(claims()),
            gpus: Arc::new(gpu.clone()),
            host: Arc::new(host.clone()),
            mps: Arc::new(FakeMpsControl::new()),
            events: Some(Arc::new(events.clone())),
        },
        Some(Arc::clone(&metrics)),
    );
    World {
        gpu,
        host,
        events,
        metrics,
        accountant,
    }
}

/// Three workers of one container: 9.5 GiB each on a 10 GiB booking, started one after
/// another; and a process of no pod (an MPS server) beside them.
fn three_workers(w: &World) {
    for (i, pid) in [301u32, 302, 303].into_iter().enumerate() {
        w.gpu.run(pid, "GPU-1", 95 * GIB / 10);
        w.host.spawn(pid, &cgroup(POD), 1000 + i as u64);
    }
    w.gpu.run(50, "GPU-1", 30 * GIB);
    w.host.spawn(50, "0::/system.slice/mps.service\n", 1);
}

fn daemon(pipe: &std::path::Path) -> MpsDaemon {
    MpsDaemon {
        id: "mps-1".to_owned(),
        devices: vec!["GPU-1".to_owned()],
        pipe_dir: pipe.display().to_string(),
        shm_dir: pipe.join("shm").display().to_string(),
        log_dir: pipe.join("log").display().to_string(),
        user: None,
    }
}

#[tokio::test]
async fn a_claim_over_its_booking_loses_its_newest_processes_through_mps_and_its_pod_hears_why() {
    let dir = tempfile::tempdir().unwrap();
    let d = daemon(dir.path());
    let w = world(Some(d.clone()));
    let mps = FakeMpsDaemon::start(dir.path(), w.gpu.clone()).unwrap();
    three_workers(&w);
    for pid in [301, 302, 303] {
        mps.add_client(77, pid);
    }

    let report = w.accountant.pass(Instant::now()).await.unwrap();
    assert_eq!(report.terminated, [303, 302]);
    assert!(report.killed.is_empty());
    assert_eq!(mps.terminated(), [(77, 303), (77, 302)]);
    assert_eq!(
        w.gpu.pids(),
        BTreeSet::from([50, 301]),
        "the oldest worker and the process of no pod run on"
    );

    let events = w.events.events();
    assert_eq!(events.len(), 1);
    let e = &events[0];
    assert!(e.warning);
    assert_eq!(
        e.reason,
        tessera_driver::names::REASON_GPU_MEMORY_OVER_BOOKING
    );
    assert_eq!(e.regarding.kind.as_deref(), Some("Pod"));
    assert_eq!(e.regarding.name.as_deref(), Some("trainer"));
    assert_eq!(e.regarding.uid.as_deref(), Some(POD));
    // The Recorder creates the Event in the namespace of the object it is about.
    assert_eq!(e.regarding.namespace.as_deref(), Some("team"));
    let message = e.note.as_deref().unwrap();
    assert!(message.contains("ResourceClaim team/train"), "{message}");
    assert!(message.contains("booked 10240 MiB"), "{message}");
    assert!(message.contains("used 29184 MiB"), "{message}");

    let metrics = w.metrics.encode().unwrap();
    assert!(
        metrics.contains(
            "tessera_kubelet_plugin_accounting_stopped_processes_total{means=\"mps_terminate\"} 2"
        ),
        "{metrics}"
    );

    let again = w.accountant.pass(Instant::now()).await.unwrap();
    assert_eq!(
        again,
        PassReport {
            processes: 2,
            ..PassReport::default()
        }
    );
    assert_eq!(
        w.events.events().len(),
        1,
        "one Event per stop, not per pass"
    );
}

#[tokio::test]
async fn a_process_its_mps_server_does_not_list_is_killed() {
    let dir = tempfile::tempdir().unwrap();
    let w = world(Some(daemon(dir.path())));
    let mps = FakeMpsDaemon::start(dir.path(), w.gpu.clone()).unwrap();
    three_workers(&w);
    // 303 bypassed MPS (no pipe directory in its environment): the daemon does not know it.
    mps.add_client(77, 301);
    mps.add_client(77, 302);
    let report = w.accountant.pass(Instant::now()).await.unwrap();
    assert_eq!(report.killed, [303]);
    assert_eq!(report.terminated, [302]);
    assert_eq!(w.host.killed(), BTreeSet::from([303]));
}

#[tokio::test]
async fn a_process_nvml_still_lists_after_terminate_client_is_killed_in_the_same_pass() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = world(Some(daemon(dir.path())));
    w.accountant = w
        .accountant
        .with_terminate_confirm(Duration::from_millis(100));
    let mps = FakeMpsDaemon::start(dir.path(), FakeGpu::new()).unwrap();
    three_workers(&w);
    for pid in [301, 302, 303] {
        mps.add_client(77, pid);
    }
    // This daemon's terminate_client frees nothing on our GPU: the processes stay listed.
    let report = w.accountant.pass(Instant::now()).await.unwrap();
    assert_eq!(mps.terminated(), [(77, 303), (77, 302)]);
    assert_eq!(report.killed, [303, 302]);
    assert!(report.terminated.is_empty());
    assert_eq!(w.gpu.pids(), BTreeSet::from([50, 301]));
}

#[tokio::test]
async fn without_mps_the_processes_over_the_booking_are_killed() {
    let w = world(None);
    three_workers(&w);
    let report = w.accountant.pass(Instant::now()).await.unwrap();
    assert_eq!(report.killed, [303, 302]);
    assert_eq!(w.events.events().len(), 1);
}

#[tokio::test]
async fn a_node_without_booked_gpus_lists_nothing() {
    let gpu = FakeGpu::new();
    gpu.run(1, "GPU-1", 80 * GIB);
    let accountant = Accountant::new(
        Seams {
            prepared: Arc::new(FixedRecord(Checkpoint::new("b"))),
            claims: Arc::new(FakeClaimSource::new()),
            gpus: Arc::new(gpu.clone()),
            host: Arc::new(FakeHostProcesses::new(gpu.clone())),
            mps: Arc::new(FakeMpsControl::new()),
            events: None,
        },
        None,
    );
    assert_eq!(
        accountant.pass(Instant::now()).await.unwrap(),
        PassReport::default()
    );
    assert_eq!(gpu.pids(), BTreeSet::from([1]));
}

#[tokio::test]
async fn processes_of_a_pod_the_claim_is_not_reserved_for_are_left_alone() {
    let w = world(None);
    for pid in [1u32, 2] {
        w.gpu.run(pid, "GPU-1", 9 * GIB);
        w.host
            .spawn(pid, &cgroup("11111111-2222-3333-4444-555555555555"), 5);
    }
    let report = w.accountant.pass(Instant::now()).await.unwrap();
    assert!(report.killed.is_empty() && report.terminated.is_empty());
    assert_eq!(w.gpu.pids(), BTreeSet::from([1, 2]));
}

#[tokio::test]
async fn processes_that_cannot_be_read_or_told_apart_are_skipped_and_counted_while_the_pass_goes_on()
 {
    let w = world(None);
    three_workers(&w);
    // One renamed itself to bytes that are not UTF-8, one cannot be read, one sits in
    // cgroups that name two pods.
    w.gpu.run(401, "GPU-1", GIB / 2);
    let mut odd_cgroup = cgroup(POD).trim_end().as_bytes().to_vec();
    odd_cgroup.extend_from_slice(b"/\xff\xfe\n");
    w.host.spawn_raw(
        401,
        ProcFiles {
            stat: stat_line(401, b"\xff\xfe) S", 900),
            cgroup: odd_cgroup,
        },
    );
    w.gpu.run(402, "GPU-1", 20 * GIB);
    w.host.spawn_unreadable(402);
    w.gpu.run(403, "GPU-1", 20 * GIB);
    w.host.spawn_raw(
        403,
        ProcFiles {
            stat: stat_line(403, b"x", 901),
            cgroup: format!(
                "1:name=systemd:/kubepods/besteffort/pod{POD}/c\n\
                 0::/kubepods/besteffort/pod11111111-2222-3333-4444-555555555555/c\n"
            )
            .into_bytes(),
        },
    );

    let report = w.accountant.pass(Instant::now()).await.unwrap();
    assert_eq!(
        report.killed,
        [303, 302],
        "the claim's own workers over its booking are stopped as before"
    );
    assert_eq!(
        report.skipped,
        [(402, Skip::Unreadable), (403, Skip::PodsDisagree)]
    );
    assert!(
        w.gpu.pids().contains(&401) && w.gpu.pids().contains(&403),
        "the renamed process is judged (it started first), the unattributed one left alone"
    );
    let metrics = w.metrics.encode().unwrap();
    for reason in ["unreadable", "pods_disagree"] {
        assert!(
            metrics.contains(&format!(
                "tessera_kubelet_plugin_accounting_skipped_processes_total{{reason=\"{reason}\"}} 1"
            )),
            "{metrics}"
        );
    }
}
