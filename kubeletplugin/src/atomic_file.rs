//! Durable file replacement: readers see the old content or the new one, never a mix, and
//! after a crash the new content is there once the call returned.

use std::fs::{self, File, OpenOptions};
use std::io::Write as _;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::crash;
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
        crash::point(crash::ATOMIC_WRITE_TEMP_SYNCED);
        fs::rename(&tmp, &target).map_err(|e| Error::io("renaming into", &target, e))?;
        crash::point(crash::ATOMIC_WRITE_RENAMED);
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

/// Removes the temp files a crashed [`write`] left in `dir` for targets whose name starts with
/// `prefix`; returns how many. Only names this module makes are touched, so a directory shared
/// with other writers (the CDI directory) keeps their files.
pub fn remove_temp_files(dir: &Path, prefix: &str) -> Result<usize> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(Error::io("listing", dir, e)),
    };
    let mut removed = 0;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("listing", dir, e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if is_temp_name(name, prefix) {
            let path = entry.path();
            match fs::remove_file(&path) {
                Ok(()) => removed += 1,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io("removing", path, e)),
            }
        }
    }
    if removed > 0 {
        sync_dir(dir)?;
    }
    Ok(removed)
}

/// Whether `name` is a temp file of [`write`] for a target starting with `prefix`.
pub fn is_temp_name(name: &str, prefix: &str) -> bool {
    name.strip_prefix('.')
        .is_some_and(|rest| rest.starts_with(prefix) && rest.contains(".tmp-"))
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io("syncing directory", dir, e))
}

#[cfg(test)]
mod tests {

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
    fn leftover_temp_files_of_the_prefix_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "mine.json", b"x").unwrap();
        fs::write(dir.path().join(".mine.json.tmp-1-2"), b"torn").unwrap();
        fs::write(dir.path().join(".other.json.tmp-1-2"), b"theirs").unwrap();
        assert_eq!(remove_temp_files(dir.path(), "mine").unwrap(), 1);
        assert!(dir.path().join("mine.json").exists());
        assert!(dir.path().join(".other.json.tmp-1-2").exists());
        assert_eq!(
            remove_temp_files(&dir.path().join("absent"), "mine").unwrap(),
            0
        );
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
