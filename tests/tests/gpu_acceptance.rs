//! The GPU acceptance suite (`tests/gpu/`) where there is no GPU: it skips cleanly with its
//! message, its scripts parse (and pass shellcheck where it is installed), and — as root, with
//! the workspace's binaries built — its plumbing (fake API server, plugin, `tessera allocate`,
//! kubelet gRPC, a CDI spec applied in a private mount namespace) runs on a fake inventory.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::{Path, PathBuf};
use std::process::Command;

fn suite_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("gpu")
}

fn available(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn the_suite_skips_cleanly_where_there_is_no_gpu() {
    let out = Command::new("bash")
        .arg(suite_dir().join("run.sh"))
        .env("NVIDIA_SMI", "/nonexistent/nvidia-smi")
        .output()
        .expect("bash runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{:?}: {stdout} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.starts_with("SKIP: no NVIDIA GPU here"),
        "the skip says why: {stdout}"
    );
}

#[test]
fn the_suite_scripts_parse() {
    let run = suite_dir().join("run.sh");
    let syntax = Command::new("bash").arg("-n").arg(&run).output().unwrap();
    assert!(
        syntax.status.success(),
        "{}",
        String::from_utf8_lossy(&syntax.stderr)
    );
    if available("shellcheck") {
        let check = Command::new("shellcheck").arg(&run).output().unwrap();
        assert!(
            check.status.success(),
            "{}",
            String::from_utf8_lossy(&check.stdout)
        );
    } else {
        eprintln!("shellcheck is not installed: run.sh checked with bash -n only");
    }
    if !available("python3") {
        eprintln!("python3 is not installed: the suite's Python is not syntax-checked here");
        return;
    }
    for file in ["suite.py", "workloads/workloads.py"] {
        // ast.parse checks the syntax without writing __pycache__ into the repository.
        let parse = Command::new("python3")
            .args([
                "-c",
                "import ast, sys; ast.parse(open(sys.argv[1]).read(), sys.argv[1])",
            ])
            .arg(suite_dir().join(file))
            .output()
            .unwrap();
        assert!(
            parse.status.success(),
            "{file}: {}",
            String::from_utf8_lossy(&parse.stderr)
        );
    }
}

#[test]
fn the_suites_plumbing_runs_on_a_fake_inventory() {
    let bins = Path::new(env!("CARGO_BIN_EXE_tessera-fake-apiserver"))
        .parent()
        .unwrap()
        .to_owned();
    let missing: Vec<&str> = ["tessera", "tessera-kubelet-plugin", "tessera-fake-kubelet"]
        .into_iter()
        .filter(|b| !bins.join(b).exists())
        .collect();
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.trim_ascii() == b"0");
    if !missing.is_empty() || !root || !available("python3") || !available("unshare") {
        eprintln!(
            "skipped: needs root, python3, unshare and the workspace's binaries \
             (missing: {missing:?}, root: {root}); `cargo test --workspace` as root runs it"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new("python3")
        .arg(suite_dir().join("suite.py"))
        .arg("--bin-dir")
        .arg(&bins)
        .arg("--out")
        .arg(dir.path().join("out"))
        .arg("--work")
        .arg(dir.path().join("work"))
        .arg("--mps-root")
        .arg(dir.path().join("mps"))
        .args(["--budget", "120", "--plumbing"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("3 passed, 0 failed"), "{stdout}");
}
