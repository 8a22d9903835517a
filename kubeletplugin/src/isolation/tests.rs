#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::RwLock;

use tessera_driver::node::gpu_mode::ModeChoice;
use tessera_driver::node::inventory::GpuMode;

use super::*;
use crate::discovery::{ChosenModes, FakeDiscovery};

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

fn states(node: &NodeInventory) -> Vec<(GpuMode, Isolation)> {
    node.gpus.iter().map(|g| (g.mode, g.isolation)).collect()
}

#[test]
fn shared_gpus_are_probed_once_and_only_a_held_probe_verifies() {
    let s = setup(TWO_SHARED);
    let d = verified(&s, "mps", false);
    let node = d.discover().unwrap();
    assert_eq!(
        s.probe.probed(),
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
    assert_eq!(s.probe.probed(), ["gpu-0", "gpu-1", "gpu-0", "gpu-1"]);
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
