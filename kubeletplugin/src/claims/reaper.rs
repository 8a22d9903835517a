//! Removing directory trees a tenant could build: a claim's HAMi-core directories are mounted
//! read-write into its containers, so at unprepare they may hold anything (a tree 20,000
//! levels deep, millions of files, symlinks anywhere).
//!
//! A tree is first moved aside, one `rename` into `<parent>/.tessera-reap/` whatever it holds,
//! so the claim is unprepared at once; a background thread then removes it with
//! [`remove_tree`], which never recurses and holds at most four descriptors: it takes the
//! entries of the tree's top directory in batches, unlinks what is not a directory, and moves
//! each subdirectory's own subdirectories up to the top (`renameat`, no replacing) before it
//! removes the emptied subdirectory, so depth never turns into stack or descriptors. Nothing
//! is followed: a symlink is removed as a link, and every directory is opened with
//! `O_NOFOLLOW`. A tree that cannot be removed stays in the reap directory with a warning, and
//! the next start tries again ([`Reaper::resume`]).

use std::ffi::{CStr, CString};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, mpsc};
use std::time::Duration;

use rustix::fs::{AtFlags, CWD, Dir, FileType, Mode, OFlags, RenameFlags};
use rustix::io::Errno;
use tracing::{info, warn};

use crate::error::{Error, Result};

/// The directory, beside the trees it takes, that holds trees set aside for removal.
pub const REAP_DIR: &str = ".tessera-reap";

/// Entries taken from a directory at a time (bounds memory, whatever a directory holds).
const BATCH: usize = 1024;

static COUNTER: AtomicU64 = AtomicU64::new(0);

fn open_dir<Fd: AsFd>(dir: Fd, name: &CStr) -> rustix::io::Result<OwnedFd> {
    rustix::fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

/// Up to [`BATCH`] entries of `dir` (without `.` and `..`), with their types.
fn batch(dir: BorrowedFd<'_>) -> rustix::io::Result<Vec<(CString, FileType)>> {
    let mut out = Vec::new();
    for entry in Dir::read_from(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        if name == c"." || name == c".." {
            continue;
        }
        let mut kind = entry.file_type();
        if kind == FileType::Unknown {
            // Some file systems leave the type out of their entries.
            match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
                Ok(stat) => kind = FileType::from_raw_mode(stat.st_mode),
                Err(Errno::NOENT) => continue,
                Err(e) => return Err(e),
            }
        }
        out.push((name.to_owned(), kind));
        if out.len() >= BATCH {
            break;
        }
    }
    Ok(out)
}

/// Removes the file or directory tree at `path` (not following symlinks) without recursion:
/// its depth costs neither stack nor descriptors. Returns how many entries it removed; a path
/// that does not exist is 0.
pub fn remove_tree(path: &Path) -> std::io::Result<u64> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    if !meta.is_dir() {
        std::fs::remove_file(path)?;
        return Ok(1);
    }
    let top = rustix::fs::openat(
        CWD,
        path,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let mut removed = 0;
    loop {
        let entries = batch(top.as_fd())?;
        if entries.is_empty() {
            break;
        }
        for (name, kind) in entries {
            removed += remove_entry(top.as_fd(), &name, kind)?;
        }
    }
    drop(top);
    match std::fs::remove_dir(path) {
        Ok(()) => Ok(removed + 1),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(removed),
        Err(e) => Err(e),
    }
}

/// Removes `name` from the top directory `top`: a non-directory at once; a directory once its
/// files are unlinked and its subdirectories moved up into `top` (a later batch takes them).
fn remove_entry(top: BorrowedFd<'_>, name: &CStr, kind: FileType) -> std::io::Result<u64> {
    if kind != FileType::Directory {
        return match rustix::fs::unlinkat(top, name, AtFlags::empty()) {
            Ok(()) => Ok(1),
            Err(Errno::NOENT) => Ok(0),
            Err(e) => Err(e.into()),
        };
    }
    let mut removed = 0;
    loop {
        match rustix::fs::unlinkat(top, name, AtFlags::REMOVEDIR) {
            Ok(()) => return Ok(removed + 1),
            Err(Errno::NOENT) => return Ok(removed),
            Err(Errno::NOTEMPTY | Errno::EXIST) => {}
            Err(e) => return Err(e.into()),
        }
        let dir = open_dir(top, name)?;
        for (child, kind) in batch(dir.as_fd())? {
            if kind == FileType::Directory {
                move_up(dir.as_fd(), &child, top)?;
            } else {
                match rustix::fs::unlinkat(&dir, &child, AtFlags::empty()) {
                    Ok(()) => removed += 1,
                    Err(Errno::NOENT) => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
    }
}

/// Moves the directory `name` of `dir` into `top` under a fresh name (never replacing one).
fn move_up(dir: BorrowedFd<'_>, name: &CStr, top: BorrowedFd<'_>) -> std::io::Result<()> {
    loop {
        let fresh = CString::new(format!(".reap-{}", COUNTER.fetch_add(1, Ordering::Relaxed)))
            .map_err(std::io::Error::other)?;
        match rustix::fs::renameat_with(dir, name, top, &fresh, RenameFlags::NOREPLACE) {
            Ok(()) | Err(Errno::NOENT) => return Ok(()),
            Err(Errno::EXIST) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

/// Trees waiting for the background thread, and a signal when none is left.
#[derive(Debug, Default)]
struct Pending {
    count: Mutex<usize>,
    idle: Condvar,
}

/// Moves trees aside at once and removes them on a background thread.
#[derive(Debug)]
pub struct Reaper {
    queue: mpsc::Sender<PathBuf>,
    pending: Arc<Pending>,
}

impl Reaper {
    /// A reaper with its thread; the thread ends when the reaper is dropped, after the trees
    /// already queued.
    pub fn start() -> Result<Self> {
        let (queue, trees) = mpsc::channel::<PathBuf>();
        let pending = Arc::new(Pending::default());
        let done = Arc::clone(&pending);
        std::thread::Builder::new()
            .name("tessera-reaper".to_owned())
            .spawn(move || {
                for tree in trees {
                    match remove_tree(&tree) {
                        Ok(entries) => {
                            info!(path = %tree.display(), entries, "removed a claim's directory tree");
                        }
                        Err(e) => warn!(
                            path = %tree.display(),
                            error = %e,
                            "could not remove a claim's directory tree; it stays set aside and \
                             the next start tries again"
                        ),
                    }
                    if let Ok(mut count) = done.count.lock() {
                        *count = count.saturating_sub(1);
                        done.idle.notify_all();
                    }
                }
            })
            .map_err(|e| Error::Task(format!("starting the reaper thread: {e}")))?;
        Ok(Self { queue, pending })
    }

    fn enqueue(&self, tree: PathBuf) {
        if let Ok(mut count) = self.pending.count.lock() {
            *count += 1;
        }
        if let Err(mpsc::SendError(tree)) = self.queue.send(tree) {
            warn!(path = %tree.display(), "the reaper thread is gone; the tree stays set aside");
        }
    }

    /// The reap directory beside `dir`, created owner-only when missing; refused when it is
    /// anything but a directory (a symlink is never followed).
    fn reap_dir(dir: &Path) -> Result<PathBuf> {
        let parent = dir
            .parent()
            .ok_or_else(|| Error::Config(format!("{} has no parent directory", dir.display())))?;
        let reap = parent.join(REAP_DIR);
        match std::fs::create_dir(&reap) {
            Ok(()) => std::fs::set_permissions(&reap, std::fs::Permissions::from_mode(0o700))
                .map_err(|e| Error::io("restricting permissions of", &reap, e))?,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(Error::io("creating", &reap, e)),
        }
        let meta = std::fs::symlink_metadata(&reap).map_err(|e| Error::io("checking", &reap, e))?;
        if !meta.is_dir() {
            return Err(Error::Input {
                path: reap,
                message: "the reap directory must be a directory".to_owned(),
            });
        }
        Ok(reap)
    }

    /// Moves `dir` into the reap directory beside it (one rename, whatever the tree holds) and
    /// queues it for removal; `false` when there is no such directory.
    pub fn discard(&self, dir: &Path) -> Result<bool> {
        match std::fs::symlink_metadata(dir) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(Error::io("checking", dir, e)),
        }
        let reap = Self::reap_dir(dir)?;
        let name = dir
            .file_name()
            .map_or_else(|| "tree".into(), |n| n.to_string_lossy().into_owned());
        let aside = reap.join(format!(
            "{name}.{}.{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        match std::fs::rename(dir, &aside) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(Error::io("moving aside for removal", dir, e)),
        }
        self.enqueue(aside);
        Ok(true)
    }

    /// Queues what an earlier run left in the reap directory of `parent`.
    pub fn resume(&self, parent: &Path) {
        let reap = parent.join(REAP_DIR);
        let entries = match std::fs::read_dir(&reap) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(e) => {
                warn!(path = %reap.display(), error = %e, "cannot list the reap directory");
                return;
            }
        };
        for entry in entries.flatten() {
            self.enqueue(entry.path());
        }
    }

    /// Waits until every queued tree is handled, at most `timeout`; whether it was.
    pub fn wait_idle(&self, timeout: Duration) -> bool {
        let Ok(count) = self.pending.count.lock() else {
            return false;
        };
        self.pending
            .idle
            .wait_timeout_while(count, timeout, |count| *count > 0)
            .is_ok_and(|(_, waited)| !waited.timed_out())
    }
}

#[cfg(test)]
mod tests {
    use tessera_tests::trees::deep_tree;

    use super::*;

    /// A scratch directory on a tmpfs where there is one, as the HAMi cache directory is in
    /// production (`/run`): on a disk mounted with `discard` each `rmdir` waits for a TRIM.
    fn scratch() -> tempfile::TempDir {
        tempfile::tempdir_in("/dev/shm")
            .or_else(|_| tempfile::tempdir())
            .unwrap()
    }

    #[test]
    fn a_tree_20000_levels_deep_is_removed_without_recursion() {
        let dir = scratch();
        let tree = dir.path().join("uid-1");
        deep_tree(&tree, 20_000).unwrap();
        // On a small thread: the removal must not use stack per level.
        let path = tree.clone();
        let removed = std::thread::Builder::new()
            .stack_size(64 * 1024)
            .spawn(move || remove_tree(&path).unwrap())
            .unwrap()
            .join()
            .unwrap();
        assert_eq!(removed, 20_000 + 3);
        assert!(!tree.exists());
        assert!(Path::new("/").exists(), "the symlink was not followed");
    }

    #[test]
    fn wide_trees_files_and_a_missing_path_are_handled() {
        let dir = scratch();
        let tree = dir.path().join("t");
        for i in 0..50 {
            let sub = tree.join(format!("a{i}")).join("b").join("c");
            std::fs::create_dir_all(&sub).unwrap();
            for j in 0..30 {
                std::fs::write(sub.join(format!("f{j}")), b"x").unwrap();
            }
        }
        // A name the mover would pick is already taken: it picks another.
        std::fs::create_dir_all(tree.join(".reap-0").join("x")).unwrap();
        assert_eq!(remove_tree(&tree).unwrap(), 50 * 33 + 2 + 1);
        assert!(!tree.exists());
        assert_eq!(remove_tree(&tree).unwrap(), 0);
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        assert_eq!(remove_tree(&file).unwrap(), 1);
    }

    #[test]
    fn a_discarded_tree_is_gone_at_once_and_removed_in_the_background() {
        let dir = scratch();
        let tree = dir.path().join("uid-1");
        deep_tree(&tree, 2_000).unwrap();
        let reaper = Reaper::start().unwrap();
        assert!(reaper.discard(&tree).unwrap());
        assert!(!tree.exists());
        assert!(!reaper.discard(&tree).unwrap(), "already gone");
        assert!(reaper.wait_idle(Duration::from_mins(1)));
        let reap = dir.path().join(REAP_DIR);
        assert_eq!(std::fs::read_dir(&reap).unwrap().count(), 0);
        let mode = std::fs::metadata(&reap).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
    }

    #[test]
    fn what_an_earlier_run_left_aside_is_removed_on_resume() {
        let dir = scratch();
        let left = dir.path().join(REAP_DIR).join("uid-1.1.0");
        deep_tree(&left, 100).unwrap();
        let reaper = Reaper::start().unwrap();
        reaper.resume(dir.path());
        assert!(reaper.wait_idle(Duration::from_mins(1)));
        assert!(!left.exists());
    }

    #[test]
    fn a_reap_path_that_is_a_symlink_is_refused() {
        let dir = scratch();
        let elsewhere = scratch();
        std::os::unix::fs::symlink(elsewhere.path(), dir.path().join(REAP_DIR)).unwrap();
        let tree = dir.path().join("uid-1");
        std::fs::create_dir(&tree).unwrap();
        let reaper = Reaper::start().unwrap();
        let err = reaper.discard(&tree).unwrap_err().to_string();
        assert!(err.contains("must be a directory"), "{err}");
        assert!(tree.exists());
    }
}
