//! The isolation probe's child, the real `tessera-kubelet-plugin isolation-probe`, applies its
//! claim's bind mounts itself (a mount namespace of its own, the mounts in Rust) and then runs
//! the probe: no shell, `unshare` or `mount` binary is needed, as the plugin's image has none.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use tessera_driver::node::cdi::{ContainerEdits, Enforcement, Mount};
use tessera_driver::node::isolation::{self, ProbeOutcome};
use tessera_kubelet_plugin::gpus::isolation::ChildProbe;

const PLUGIN: &str = env!("CARGO_BIN_EXE_tessera-kubelet-plugin");

fn bind(source: &Path, target: &Path, options: &[&str]) -> Mount {
    Mount {
        host_path: source.display().to_string(),
        container_path: target.display().to_string(),
        options: options.iter().map(|o| (*o).to_owned()).collect(),
        mount_type: None,
    }
}

/// A probe child started by the plugin binary, which applies the mounts, then runs `program`
/// (as seen inside the mounts) in probe mode.
fn child(program: &Path) -> ChildProbe {
    ChildProbe {
        program: program.to_owned(),
        args: vec![tessera_kubelet_plugin::gpus::isolation::SUBCOMMAND.to_owned()],
        enforcement: Enforcement::None,
        mps: None,
        timeout: Duration::from_mins(2),
        launcher: Some(PathBuf::from(PLUGIN)),
    }
}

fn failure(outcome: ProbeOutcome) -> (&'static str, String) {
    match outcome {
        ProbeOutcome::Failed { code, message } => (code, message),
        ProbeOutcome::Held => panic!("no probe holds without a GPU limit"),
    }
}

/// Whether the child was refused its mount namespace (no `CAP_SYS_ADMIN` here).
fn refused_namespace(message: &str) -> bool {
    (message.contains("NewMountNamespace") || message.contains("MakePrivate"))
        && message.contains("EPERM")
}

#[test]
fn the_child_binds_a_directory_and_a_file_and_runs_the_probe_from_them_with_no_tools_on_path() {
    let dir = tempfile::tempdir().unwrap();
    // PATH names an empty directory: nothing can be looked up there.
    let no_tools = dir.path().join("no-tools");
    std::fs::create_dir(&no_tools).unwrap();
    let host_dir = dir.path().join("host-dir");
    std::fs::create_dir(&host_dir).unwrap();
    std::fs::write(host_dir.join("seen"), "from the host").unwrap();
    let inside = dir.path().join("inside");
    // The plugin's binary is bound as a file into the bound directory, and the probe runs
    // from there: the exec finds it only if both binds are visible in the child's namespace.
    let program = inside.join("bin/probe");
    let edits = ContainerEdits {
        env: vec![format!("PATH={}", no_tools.display())],
        mounts: vec![
            bind(&host_dir, &inside, &["rw", "nosuid", "nodev", "bind"]),
            bind(
                Path::new(PLUGIN),
                &program,
                &["ro", "nosuid", "nodev", "bind"],
            ),
        ],
        ..ContainerEdits::default()
    };

    let (code, message) = failure(child(&program).run(&edits));
    if refused_namespace(&message) {
        eprintln!("skipped: this process may not make a mount namespace ({message})");
        return;
    }
    // The probe itself ran (from the bound file) and stopped at its first check: the
    // environment holds no memory limit. Any failure to mount or exec reads otherwise.
    assert_eq!(code, isolation::REASON_DID_NOT_RUN);
    assert!(
        message.contains("exit status: 2")
            && message.contains("TESSERA_GPU_MEMORY_LIMIT_BYTES does not hold a limit"),
        "{message}"
    );
    // The file's mount point was made through the directory bind, so it is in the host's
    // directory (empty: only a mount point), ...
    assert_eq!(std::fs::read(host_dir.join("bin/probe")).unwrap(), b"");
    // ... while the directory bind itself stayed in the child's namespace.
    assert_eq!(std::fs::read_dir(&inside).unwrap().count(), 0);
}

#[test]
fn a_mount_that_cannot_be_applied_fails_the_probe_with_its_reason() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing");
    let edits = ContainerEdits {
        mounts: vec![bind(&missing, &dir.path().join("t"), &["bind"])],
        ..ContainerEdits::default()
    };
    let (code, message) = failure(child(Path::new(PLUGIN)).run(&edits));
    assert_eq!(code, isolation::REASON_DID_NOT_RUN);
    assert!(
        message.contains("exit status: 4")
            && message.contains(&format!("reading the mount source {}", missing.display())),
        "{message}"
    );

    let edits = ContainerEdits {
        mounts: vec![bind(dir.path(), &dir.path().join("t"), &["bind", "shared"])],
        ..ContainerEdits::default()
    };
    let (code, message) = failure(child(Path::new(PLUGIN)).run(&edits));
    assert_eq!(code, isolation::REASON_DID_NOT_RUN);
    assert!(
        message.contains("\"shared\" is not a mount option the probe applies"),
        "{message}"
    );
}

#[test]
fn the_specs_preload_reaches_only_the_probe_the_child_runs_after_its_mounts() {
    let dir = tempfile::tempdir().unwrap();
    // A library that is nowhere: glibc's loader says so once for each process that preloads it.
    let preload = dir.path().join("lib/not-mounted.so");
    let out = std::process::Command::new(PLUGIN)
        .args([
            tessera_kubelet_plugin::gpus::isolation::SUBCOMMAND,
            "--",
            PLUGIN,
            tessera_kubelet_plugin::gpus::isolation::SUBCOMMAND,
        ])
        .env_clear()
        .env(isolation::PRELOAD_HANDOFF_ENV, &preload)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if refused_namespace(&stderr) {
        eprintln!("skipped: this process may not make a mount namespace ({stderr})");
        return;
    }
    // The child itself started without it; the probe it ran after the mounts got it (and
    // stopped at its first check: no memory limit in the environment).
    let complaints = stderr
        .lines()
        .filter(|l| l.contains(&preload.display().to_string()))
        .count();
    assert_eq!(complaints, 1, "{stderr}");
    assert_eq!(out.status.code(), Some(2), "{stderr}");
}
