//! The NVIDIA driver's files under the mounted driver root
//! (`tessera_driver::node::driver_root`): the first candidate that exists.

use std::path::{Path, PathBuf};

use tessera_driver::node::driver_root;

use crate::error::{Error, Result};

/// A driver file found under a root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// Its path inside the root (what a process that changed root into it sees).
    pub inside: String,
    /// Its path from here.
    pub outside: PathBuf,
}

/// Finds `file` in `dirs` under `root`; the error names the root and every path tried.
pub fn find(root: &Path, dirs: &[&str], file: &str) -> Result<Found> {
    let root_text = root.display().to_string();
    let tried = driver_root::candidates(dirs, file);
    for inside in &tried {
        let outside = PathBuf::from(driver_root::join(&root_text, inside));
        if outside.is_file() {
            return Ok(Found {
                inside: inside.clone(),
                outside,
            });
        }
    }
    Err(Error::Config(format!(
        "no {file} under the driver root {root_text} (tried {}); is the NVIDIA driver \
         installed there? Set the chart's nvidiaDriverRoot to where it is (`/` or \
         `/run/nvidia/driver`)",
        tried.join(", ")
    )))
}

/// The NVML library under `root`.
pub fn nvml(root: &Path) -> Result<Found> {
    find(root, &driver_root::LIBRARY_DIRS, driver_root::NVML_LIBRARY)
}

/// The MPS control binary under `root`.
pub fn mps_control(root: &Path) -> Result<Found> {
    find(
        root,
        &driver_root::BINARY_DIRS,
        driver_root::MPS_CONTROL_BINARY,
    )
}

#[cfg(test)]
mod tests {

    use super::*;

    #[test]
    fn the_first_existing_candidate_wins_and_a_missing_file_names_what_was_tried() {
        let root = tempfile::tempdir().unwrap();
        let err = nvml(root.path()).unwrap_err().to_string();
        assert!(
            err.contains("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"),
            "{err}"
        );
        assert!(err.contains("nvidiaDriverRoot"), "{err}");
        std::fs::create_dir_all(root.path().join("usr/lib64")).unwrap();
        std::fs::write(root.path().join("usr/lib64/libnvidia-ml.so.1"), "").unwrap();
        let found = nvml(root.path()).unwrap();
        assert_eq!(found.inside, "/usr/lib64/libnvidia-ml.so.1");
        assert_eq!(
            found.outside,
            root.path().join("usr/lib64/libnvidia-ml.so.1")
        );
    }
}
