//! What the `tessera` command tests share: the repository root and a run of the real binary.

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
