//! Time of one accounting pass over 1,000 GPU processes, read from the real `/proc`: 800 plain
//! processes, 100 renamed to bytes that are not UTF-8 (`\xff\xfe)`), 50 that exited between
//! NVML's list and the read, and 50 whose `/proc` files cannot be read (the seam answers
//! "permission denied" for them, as `hidepid` would). NVML is the fake GPU listing the real
//! pids; the claim booking the GPU is reserved for a pod none of them is in, so the pass reads,
//! parses and judges every process and stops none, and every iteration is the same pass.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use tessera_driver::node::checkpoint::{Checkpoint, ClaimEntry, HeldDevice, PrepareState};
use tessera_kubelet_plugin::accounting::{
    Accountant, FakeGpu, FakeMpsControl, HostProcesses, PassReport, PreparedClaims, ProcFiles,
    ProcFs, Seams,
};
use tessera_kubelet_plugin::claims::FakeClaimSource;
use tessera_kubelet_plugin::{Error, Result};

const GPU: &str = "GPU-1";

struct Record(Checkpoint);

impl PreparedClaims for Record {
    fn record(&self) -> Result<Checkpoint> {
        Ok(self.0.clone())
    }
}

/// The real `/proc`, except that reading the processes of `hidden` fails.
struct Hiding {
    procfs: ProcFs,
    hidden: BTreeSet<u32>,
}

impl HostProcesses for Hiding {
    fn read(&self, pid: u32) -> Result<Option<ProcFiles>> {
        if self.hidden.contains(&pid) {
            return Err(Error::io(
                "opening",
                format!("/proc/{pid}"),
                std::io::Error::from_raw_os_error(13),
            ));
        }
        self.procfs.read(pid)
    }

    fn kill(&self, pid: u32, start_ticks: u64) -> Result<bool> {
        self.procfs.kill(pid, start_ticks)
    }
}

fn record() -> Checkpoint {
    let mut record = Checkpoint::new("bench");
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
                gpu_uuid: GPU.to_owned(),
                mig: false,
                exclusive: false,
                cdi_ids: Vec::new(),
                share_memory_bytes: Some(10 << 30),
                share_compute_percent: Some(50),
                share_id: Some("s1".to_owned()),
                share_tier: None,
            }],
            host_dirs: Vec::new(),
            mps_daemon: None,
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
            "status": {"reservedFor": [{"resource": "pods", "name": "p",
                                        "uid": "0c6f33a4-5e2b-4a1b-9e0c-51d4b2a3f7e1"}]}
        }))
        .unwrap(),
    );
    source
}

fn spawn(script: &str) -> Child {
    Command::new("sh")
        .args(["-c", script])
        .stdin(Stdio::piped())
        .spawn()
        .expect("sh runs")
}

fn bench(c: &mut Criterion) {
    let mut children: Vec<Child> = Vec::new();
    for _ in 0..850 {
        children.push(spawn("exec sleep 100000"));
    }
    for _ in 0..100 {
        children.push(spawn("printf '\\377\\376)' > /proc/$$/comm && read line"));
    }
    let mut gone = Vec::new();
    for _ in 0..50 {
        let mut child = Command::new("true").spawn().unwrap();
        gone.push(child.id());
        child.wait().unwrap();
    }
    let gpu = FakeGpu::new();
    for pid in children.iter().map(Child::id).chain(gone.iter().copied()) {
        gpu.run(pid, GPU, 1 << 20);
    }
    let hidden: BTreeSet<u32> = children.iter().take(50).map(Child::id).collect();
    let accountant = Accountant::new(
        Seams {
            prepared: Arc::new(Record(record())),
            claims: Arc::new(claims()),
            gpus: Arc::new(gpu.clone()),
            host: Arc::new(Hiding {
                procfs: ProcFs::default(),
                hidden,
            }),
            mps: Arc::new(FakeMpsControl::new()),
            events: None,
        },
        None,
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // Let the renamed processes rename themselves, then check what one pass sees.
    std::thread::sleep(Duration::from_secs(2));
    let report: PassReport = runtime.block_on(accountant.pass(Instant::now())).unwrap();
    eprintln!(
        "one pass: {} listed processes read, {} skipped, {} stopped",
        report.processes,
        report.skipped.len(),
        report.killed.len() + report.terminated.len()
    );

    let mut group = c.benchmark_group("accounting");
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(20));
    group.bench_function(
        "one pass over 1,000 GPU processes (100 renamed to non-UTF-8, 50 gone, 50 unreadable)",
        |b| b.iter(|| runtime.block_on(accountant.pass(Instant::now())).unwrap()),
    );
    group.finish();
    for mut child in children {
        let _ = child.kill();
        let _ = child.wait();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
