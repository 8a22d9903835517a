//! What the `tessera` command tests share: the repository root, a run of the real binary, the
//! files it reads and what it printed.
// Each test binary uses its own subset of these helpers.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The repository root (the tests read its examples and device classes).
pub(crate) fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the controller crate lives in the repository")
        .to_path_buf()
}

/// Runs the real `tessera` binary with `args` from the repository root.
pub(crate) fn tessera(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(args)
        .current_dir(repo())
        .output()
        .expect("the tessera binary runs")
}

/// Writes `text` to the file `name` in this test process's own folder under the system's
/// temporary directory; returns its path.
pub(crate) fn write_temp(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tessera-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// What a run printed: its stdout, then its stderr.
pub(crate) fn printed(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Asserts that a run succeeded, showing what it printed when it did not.
pub(crate) fn assert_success(out: &Output) {
    assert!(out.status.success(), "{}", printed(out));
}

/// Asserts that a run succeeded and parses its stdout as JSON.
pub(crate) fn success_json(out: &Output) -> serde_json::Value {
    assert_success(out);
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Runs `tessera allocate` with `-f` before each of `files`, printing as `output`.
pub(crate) fn allocate(files: &[&Path], output: &str) -> Output {
    let mut args = vec!["allocate"];
    for file in files {
        args.extend(["-f", file.to_str().unwrap()]);
    }
    args.extend(["-o", output]);
    tessera(&args)
}

/// Runs `tessera simulate --nodes NODES --pods PODS` with `extra` after.
pub(crate) fn simulate(nodes: &Path, pods: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "simulate",
        "--nodes",
        nodes.to_str().unwrap(),
        "--pods",
        pods.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    tessera(&args)
}
