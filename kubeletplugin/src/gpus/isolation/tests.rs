use std::sync::{Condvar, RwLock};
use std::time::Duration;

use tessera_driver::node::gpu_mode::ModeChoice;
use tessera_driver::node::inventory::GpuMode;

use super::*;
use crate::gpus::discovery::{ChosenModes, FakeDiscovery};

const TWO_SHARED: &str = "nodes:\n- name: n\n  mode: shared\n  gpus:\n  - model: h200-141g\n  - model: h200-141g\n    isolation: unverified\n  - model: h200-141g\n    mode: exclusive\n";

struct Setup {
    _dir: tempfile::TempDir,
    file: std::path::PathBuf,
    probe: Arc<FakeProbe>,
}

fn setup(text: &str) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("inventory.yaml");
    std::fs::write(&file, text).unwrap();
    Setup {
        _dir: dir,
        file,
        probe: Arc::new(FakeProbe::new()),
    }
}

fn verified(s: &Setup, backend: &str, accept: bool) -> Verified {
    Verified::new(
        Arc::new(FakeDiscovery::new(&s.file, "n")),
        Arc::clone(&s.probe) as Arc<dyn IsolationProbe>,
        backend,
        accept,
    )
}

/// The inventory file's GPUs under `backend`, probed by `probe`.
fn probed_by(s: &Setup, probe: Arc<dyn IsolationProbe>, backend: &str) -> Verified {
    Verified::new(
        Arc::new(FakeDiscovery::new(&s.file, "n")),
        probe,
        backend,
        false,
    )
}

fn sorted(mut names: Vec<String>) -> Vec<String> {
    names.sort();
    names
}

fn states(node: &NodeInventory) -> Vec<(GpuMode, Isolation)> {
    node.gpus.iter().map(|g| (g.mode, g.isolation)).collect()
}

#[test]
fn shared_gpus_are_probed_once_and_only_a_held_probe_verifies() {
    let s = setup(TWO_SHARED);
    let d = verified(&s, "mps", false);
    let node = d.discover().unwrap();
    assert_eq!(
        sorted(s.probe.probed()),
        ["gpu-0", "gpu-1"],
        "the exclusive GPU is not probed"
    );
    assert_eq!(node.gpus[0].isolation, Isolation::Verified);
    assert_eq!(node.gpus[1].isolation, Isolation::Unverified);
    assert_eq!(
        node.gpus[1].isolation_reason,
        isolation::REASON_LIMIT_NOT_ENFORCED
    );
    // Nothing changed: no new probe at the next discovery.
    d.discover().unwrap();
    assert_eq!(s.probe.probed().len(), 2);
    assert_eq!(d.verdicts().len(), 2);
}

#[test]
fn a_new_driver_version_is_probed_again() {
    let s = setup(TWO_SHARED);
    let d = verified(&s, "hami-core", false);
    d.discover().unwrap();
    std::fs::write(
        &s.file,
        TWO_SHARED.replace(
            "  mode: shared\n",
            "  mode: shared\n  driverVersion: 580.159.04\n",
        ),
    )
    .unwrap();
    d.discover().unwrap();
    assert_eq!(
        sorted(s.probe.probed()),
        ["gpu-0", "gpu-0", "gpu-1", "gpu-1"]
    );
}

#[test]
fn the_admin_can_accept_unverified_isolation_and_none_is_never_verified() {
    let s = setup(TWO_SHARED);
    let node = verified(&s, "mps", true).discover().unwrap();
    assert_eq!(
        states(&node),
        [
            (GpuMode::Shared, Isolation::Verified),
            (GpuMode::Shared, Isolation::Accepted),
            (GpuMode::Exclusive, Isolation::Verified),
        ]
    );
    let untouched = verified(&s, "none", false).discover().unwrap();
    assert_eq!(untouched.gpus[0].isolation, Isolation::Unverified);
    assert_eq!(
        untouched.gpus[0].isolation_reason,
        isolation::REASON_NO_ENFORCEMENT
    );
    assert_eq!(s.probe.probed().len(), 2, "none has nothing to probe");
}

#[test]
fn a_gpu_switched_to_shared_is_probed_then() {
    let s = setup("nodes:\n- name: n\n  gpus:\n  - model: t4-16g\n");
    let choice = Arc::new(RwLock::new(ModeChoice::default()));
    let modes = ChosenModes::new(
        Arc::new(FakeDiscovery::new(&s.file, "n")),
        Arc::clone(&choice),
    );
    let d = Verified::new(
        Arc::new(modes),
        Arc::clone(&s.probe) as Arc<dyn IsolationProbe>,
        "mps",
        false,
    );
    d.discover().unwrap();
    assert!(s.probe.probed().is_empty());
    *choice.write().unwrap() = ModeChoice {
        node: Some(GpuMode::Shared),
        ..ModeChoice::default()
    };
    let node = d.discover().unwrap();
    assert_eq!(s.probe.probed(), ["gpu-0"]);
    assert_eq!(node.gpus[0].isolation, Isolation::Verified);
}

/// A probe that records how many probes are inside it at once. With `rendezvous`, each waits
/// (at most `patience`, so a test that fails still ends) until that many have come in; GPUs
/// named in `panics` panic. Odd GPUs fail, even ones hold.
struct Overlap {
    rendezvous: usize,
    patience: Duration,
    panics: Vec<String>,
    seen: Mutex<Seen>,
    arrived_cv: Condvar,
}

#[derive(Default)]
struct Seen {
    arrived: usize,
    inside: usize,
    most_inside: usize,
}

impl Overlap {
    fn new(rendezvous: usize, patience: Duration, panics: &[&str]) -> Self {
        Self {
            rendezvous,
            patience,
            panics: panics.iter().map(|p| (*p).to_owned()).collect(),
            seen: Mutex::new(Seen::default()),
            arrived_cv: Condvar::new(),
        }
    }

    fn most_inside(&self) -> usize {
        self.seen.lock().unwrap().most_inside
    }
}

impl IsolationProbe for Overlap {
    fn probe(&self, _node: &NodeInventory, gpu: &Gpu) -> ProbeOutcome {
        let mut seen = self.seen.lock().unwrap();
        seen.arrived += 1;
        seen.inside += 1;
        seen.most_inside = seen.most_inside.max(seen.inside);
        self.arrived_cv.notify_all();
        let (mut seen, _) = self
            .arrived_cv
            .wait_timeout_while(seen, self.patience, |s| s.arrived < self.rendezvous)
            .unwrap();
        seen.inside -= 1;
        drop(seen);
        assert!(
            !self.panics.contains(&gpu.device_name()),
            "this probe panics"
        );
        if gpu.index.is_multiple_of(2) {
            ProbeOutcome::Held
        } else {
            ProbeOutcome::failed(isolation::REASON_LIMIT_NOT_ENFORCED, "odd GPUs leak")
        }
    }
}

fn shared_gpus(n: usize) -> String {
    format!("nodes:\n- name: n\n  mode: shared\n  gpus:\n  - model: h200-141g\n    count: {n}\n")
}

fn reasons(node: &NodeInventory) -> Vec<(&str, Isolation)> {
    node.gpus
        .iter()
        .map(|g| (g.isolation_reason.as_str(), g.isolation))
        .collect()
}

#[test]
fn the_gpus_of_a_node_are_probed_side_by_side_and_judged_in_their_order() {
    let s = setup(&shared_gpus(4));
    // Each probe waits until all four are inside: one after another, none would get there.
    let probe = Arc::new(Overlap::new(4, Duration::from_secs(30), &[]));
    let d = probed_by(&s, Arc::clone(&probe) as Arc<dyn IsolationProbe>, "mps");
    let node = d.discover().unwrap();
    assert_eq!(probe.most_inside(), 4, "all four probes ran at once");
    let held = (isolation::REASON_PROBE_HELD, Isolation::Verified);
    let leaked = (isolation::REASON_LIMIT_NOT_ENFORCED, Isolation::Unverified);
    assert_eq!(reasons(&node), [held, leaked, held, leaked]);
}

#[test]
fn at_most_the_bound_probe_at_once_and_a_panicking_probe_leaves_its_gpu_unverified() {
    let gpus = PARALLEL_PROBES + 3;
    let s = setup(&shared_gpus(gpus));
    // Each probe waits (a second at most) for all of them: unbounded, all would be inside at
    // once; bounded, the first ones give up waiting and make room for the rest.
    let probe = Arc::new(Overlap::new(gpus, Duration::from_secs(1), &["gpu-2"]));
    let d = probed_by(
        &s,
        Arc::clone(&probe) as Arc<dyn IsolationProbe>,
        "hami-core",
    );
    let node = d.discover().unwrap();
    assert!(
        probe.most_inside() <= PARALLEL_PROBES,
        "{} probes at once",
        probe.most_inside()
    );
    assert_eq!(probe.seen.lock().unwrap().arrived, gpus, "every GPU probed");
    let got = reasons(&node);
    assert_eq!(
        got[2],
        (isolation::REASON_DID_NOT_RUN, Isolation::Unverified),
        "the panicking probe fails closed"
    );
    for (i, verdict) in got.iter().enumerate().filter(|(i, _)| *i != 2) {
        let want = if i.is_multiple_of(2) {
            isolation::REASON_PROBE_HELD
        } else {
            isolation::REASON_LIMIT_NOT_ENFORCED
        };
        assert_eq!(verdict.0, want, "gpu-{i}");
    }
}

/// Times out its first `failures` probes, then holds; counts its probes.
struct Flaky {
    failures: usize,
    probes: Mutex<usize>,
}

impl IsolationProbe for Flaky {
    fn probe(&self, _node: &NodeInventory, _gpu: &Gpu) -> ProbeOutcome {
        let mut probes = self.probes.lock().unwrap();
        *probes += 1;
        if *probes <= self.failures {
            ProbeOutcome::failed(isolation::REASON_TIMED_OUT, "the probe child timed out")
        } else {
            ProbeOutcome::Held
        }
    }
}

#[test]
fn a_probe_that_timed_out_is_tried_again_later_until_it_runs() {
    let s = setup("nodes:\n- name: n\n  mode: shared\n  gpus:\n  - model: h200-141g\n");
    let probe = Arc::new(Flaky {
        failures: 2,
        probes: Mutex::new(0),
    });
    let now = Arc::new(Mutex::new(Duration::ZERO));
    let clock = Arc::clone(&now);
    let d = probed_by(&s, Arc::clone(&probe) as Arc<dyn IsolationProbe>, "mps")
        .with_clock(Arc::new(move || *clock.lock().unwrap()));
    let at = |secs: u64| {
        *now.lock().unwrap() = Duration::from_secs(secs);
        let node = d.discover().unwrap();
        let (code, isolation) = reasons(&node)[0];
        (*probe.probes.lock().unwrap(), code.to_owned(), isolation)
    };
    let timed_out = |probes: usize| {
        (
            probes,
            isolation::REASON_TIMED_OUT.to_owned(),
            Isolation::Unverified,
        )
    };
    assert_eq!(at(0), timed_out(1));
    assert_eq!(at(59), timed_out(1), "a minute passes before the next try");
    assert_eq!(at(60), timed_out(2));
    assert_eq!(at(179), timed_out(2), "then two minutes");
    let held = (
        3,
        isolation::REASON_PROBE_HELD.to_owned(),
        Isolation::Verified,
    );
    assert_eq!(at(180), held);
    assert_eq!(at(100_000), held, "a probe that held is not repeated");
}
