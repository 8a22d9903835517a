//! Durable file replacement: readers see the old content or the new one, never a mix, and
//! after a crash the new content is there once the call returned.

use std::fs::{self, File, OpenOptions};
use std::io::Write as _;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// Replaces `dir/name` with `bytes`: temp file in the same directory, fsync, rename, fsync of
/// the directory (the rename itself must survive a crash).
pub fn write(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    let tmp = dir.join(format!(
        ".{name}.tmp-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let target = dir.join(name);
    let result = (|| {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|e| Error::io("creating", &tmp, e))?;
        file.write_all(bytes)
            .map_err(|e| Error::io("writing", &tmp, e))?;
        file.sync_all().map_err(|e| Error::io("syncing", &tmp, e))?;
        fs::rename(&tmp, &target).map_err(|e| Error::io("renaming into", &target, e))?;
        sync_dir(dir)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Removes `dir/name` durably; a file that is already gone is fine.
pub fn remove(dir: &Path, name: &str) -> Result<()> {
    let target = dir.join(name);
    match fs::remove_file(&target) {
        Ok(()) => sync_dir(dir),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io("removing", &target, e)),
    }
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io("syncing directory", dir, e))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn write_replaces_and_leaves_no_temp_file() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "f.json", b"one").unwrap();
        write(dir.path(), "f.json", b"two").unwrap();
        assert_eq!(fs::read(dir.path().join("f.json")).unwrap(), b"two");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn remove_is_idempotent() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "f", b"x").unwrap();
        remove(dir.path(), "f").unwrap();
        remove(dir.path(), "f").unwrap();
        assert!(!dir.path().join("f").exists());
    }

    #[test]
    fn write_into_missing_dir_names_the_path() {
        let err = write(Path::new("/nonexistent/tessera"), "f", b"x").unwrap_err();
        assert!(err.to_string().contains("/nonexistent/tessera"), "{err}");
    }
}
