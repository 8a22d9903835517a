//! Durable file replacement: readers see the old content or the new one, never a mix, and
//! after a crash the new content is there once the call returned.

use std::fs::{self, File, OpenOptions};
use std::io::Write as _;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::claims::crash;
use crate::error::{Error, Result};

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// Replaces `dir/name` with `bytes`: temp file in the same directory, fsync, rename, fsync of
/// the directory (the rename itself must survive a crash).
pub fn write(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    write_all(dir, &[(name, bytes)])
        .pop()
        .unwrap_or_else(|| Err(Error::Task("no result for a write".to_owned())))
}

fn temp_name(name: &str) -> String {
    format!(
        ".{name}.tmp-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// Replaces each `dir/name` with its bytes, as [`write`] does one, with two syncs for all of
/// them instead of two per file: every temp file is written, their data synced (one file:
/// `fsync`; several: one `syncfs` of the file system), each renamed into place, and the
/// directory synced once. One result per file, in order; a file that failed leaves no temp
/// file behind.
pub fn write_all(dir: &Path, files: &[(&str, &[u8])]) -> Vec<Result<()>> {
    let mut results: Vec<Result<()>> = Vec::with_capacity(files.len());
    let mut temps: Vec<Option<std::path::PathBuf>> = Vec::with_capacity(files.len());
    let alone = files.len() == 1;
    for (name, bytes) in files {
        let tmp = dir.join(temp_name(name));
        let written = (|| {
            let mut file = OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&tmp)
                .map_err(|e| Error::io("creating", &tmp, e))?;
            file.write_all(bytes)
                .map_err(|e| Error::io("writing", &tmp, e))?;
            if alone {
                file.sync_all().map_err(|e| Error::io("syncing", &tmp, e))?;
            }
            Ok(())
        })();
        if written.is_err() {
            let _ = fs::remove_file(&tmp);
            temps.push(None);
        } else {
            temps.push(Some(tmp));
        }
        results.push(written);
    }
    if !alone && temps.iter().any(Option::is_some) {
        let synced = File::open(dir)
            .map_err(|e| Error::io("opening", dir, e))
            .and_then(|d| {
                rustix::fs::syncfs(&d)
                    .map_err(|e| Error::io("syncing the file system of", dir, e.into()))
            });
        if let Err(e) = synced {
            for (tmp, result) in temps.iter_mut().zip(results.iter_mut()) {
                if let Some(path) = tmp.take() {
                    let _ = fs::remove_file(&path);
                    *result = Err(same(&e, dir));
                }
            }
        }
    }
    let mut renamed = false;
    for ((tmp, (name, _)), result) in temps.iter().zip(files).zip(results.iter_mut()) {
        let Some(tmp) = tmp else { continue };
        crash::point(crash::ATOMIC_WRITE_TEMP_SYNCED);
        let target = dir.join(name);
        match fs::rename(tmp, &target) {
            Ok(()) => renamed = true,
            Err(e) => {
                let _ = fs::remove_file(tmp);
                *result = Err(Error::io("renaming into", &target, e));
                continue;
            }
        }
        crash::point(crash::ATOMIC_WRITE_RENAMED);
    }
    if renamed && let Err(e) = sync_dir(dir) {
        for result in results.iter_mut().filter(|r| r.is_ok()) {
            *result = Err(same(&e, dir));
        }
    }
    results
}

/// One failure shared by several files, as each file's error.
fn same(error: &Error, dir: &Path) -> Error {
    Error::io(
        "making durable in",
        dir,
        std::io::Error::other(error.to_string()),
    )
}

/// Removes `dir/name` durably; a file that is already gone is fine.
pub fn remove(dir: &Path, name: &str) -> Result<()> {
    remove_all(dir, &[name])
        .pop()
        .unwrap_or_else(|| Err(Error::Task("no result for a removal".to_owned())))
}

/// Removes each `dir/name`, with one directory sync for all; a file already gone is fine.
/// One result per file, in order.
pub fn remove_all(dir: &Path, names: &[&str]) -> Vec<Result<()>> {
    let mut removed = false;
    let mut results: Vec<Result<()>> = names
        .iter()
        .map(|name| {
            let target = dir.join(name);
            match fs::remove_file(&target) {
                Ok(()) => {
                    removed = true;
                    Ok(())
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(Error::io("removing", target, e)),
            }
        })
        .collect();
    if removed && let Err(e) = sync_dir(dir) {
        for result in results.iter_mut().filter(|r| r.is_ok()) {
            *result = Err(same(&e, dir));
        }
    }
    results
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
    fn many_files_are_written_and_removed_with_one_sync_each() {
        let dir = tempfile::tempdir().unwrap();
        let names: Vec<String> = (0..100).map(|i| format!("f{i}.json")).collect();
        let files: Vec<(&str, &[u8])> = names.iter().map(|n| (n.as_str(), &b"x"[..])).collect();
        assert!(write_all(dir.path(), &files).iter().all(Result::is_ok));
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 100);
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        assert!(remove_all(dir.path(), &refs).iter().all(Result::is_ok));
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn one_failing_file_of_many_fails_alone() {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join("taken")).unwrap();
        let results = write_all(dir.path(), &[("a", b"1"), ("taken", b"2"), ("b", b"3")]);
        assert!(results[0].is_ok() && results[2].is_ok());
        assert!(
            results[1]
                .as_ref()
                .unwrap_err()
                .to_string()
                .contains("taken")
        );
        let temps = fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .contains(".tmp-")
            })
            .count();
        assert_eq!(temps, 0);
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
