//! The NVIDIA driver's table of MIG capability minors (`/proc/driver/nvidia-caps/mig-minors`),
//! read bounded: the host piece behind [`MigMinorsFile`], with [`FakeMigMinors`] for tests.
//! `tessera_driver::node::inventory::MigMinors::parse` decides what the text means.

use std::path::PathBuf;

use crate::claims::input_file;
use crate::error::Result;

/// Where the driver's MIG capability table is read from.
pub trait MigMinorsFile: Send + Sync + std::fmt::Debug {
    /// The table's text; `None` when the host has no such file.
    fn read(&self) -> Result<Option<String>>;
}

/// The table in a file of the host's `/proc`: a regular file, at most the plugin's input
/// bound, UTF-8.
#[derive(Debug, Clone)]
pub struct ProcMigMinors {
    path: PathBuf,
}

impl ProcMigMinors {
    /// The table at `path` (normally
    /// `tessera_driver::node::inventory::mig_minors::MIG_MINORS_PATH`).
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }
}

impl MigMinorsFile for ProcMigMinors {
    fn read(&self) -> Result<Option<String>> {
        match input_file::read_text(&self.path, "the MIG capability table") {
            Ok(text) => Ok(Some(text)),
            Err(e) if input_file::is_missing(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// A fixed table, or none, as a host without the file has.
#[cfg(any(test, feature = "testing"))]
#[derive(Debug, Clone, Default)]
pub struct FakeMigMinors(pub Option<String>);

#[cfg(any(test, feature = "testing"))]
impl MigMinorsFile for FakeMigMinors {
    fn read(&self) -> Result<Option<String>> {
        Ok(self.0.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_read_from_its_file_and_a_missing_file_is_no_table() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mig-minors");
        assert_eq!(ProcMigMinors::new(&path).read().unwrap(), None);
        std::fs::write(&path, "config 1\nmonitor 2\n").unwrap();
        assert_eq!(
            ProcMigMinors::new(&path).read().unwrap().as_deref(),
            Some("config 1\nmonitor 2\n")
        );
    }

    #[test]
    fn a_table_that_is_not_a_regular_file_is_an_error_not_an_absent_table() {
        let dir = tempfile::tempdir().unwrap();
        let link = dir.path().join("mig-minors");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        let e = ProcMigMinors::new(&link).read().unwrap_err().to_string();
        assert!(e.contains("must be a regular file"), "{e}");
    }
}
