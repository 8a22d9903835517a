//! Creating the host directories of claims and MPS daemons through handles that never follow a
//! link.
//!
//! A claim's directories sit next to directories its containers write, and a directory a tenant
//! once wrote may be met again (a record lost, a claim prepared anew). `create_dir_all` and
//! `set_permissions` resolve the whole path at each call and follow any link on the way: with a
//! link a tenant left, the plugin made a `0700` directory elsewhere `1777`. Here the admin's
//! root is opened as configured (it may itself be a link the admin made, such as `/var/run`),
//! and every segment below it is created with `mkdirat` and opened with `openat2`
//! (`RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH`, relative to the directory above, one segment at a
//! time); the mode is set with `fchmod` on the opened descriptor, so it lands on the directory
//! that was checked whatever is renamed meanwhile. An entry already there that is not a plain
//! directory owned by the plugin's user, or a directory only the node should write that others
//! may write, is an error for that claim, never opened up.
//!
//! On a kernel without `openat2` (before 5.6) each segment is opened with `openat` and
//! `O_NOFOLLOW`: a single name with no `/` and no `..`, so nothing is followed there either.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags, ResolveFlags};
use rustix::io::Errno;
use tessera_driver::node::host_dir::HostDir;

use crate::error::{Error, Result};

const DIR_FLAGS: OFlags = OFlags::RDONLY
    .union(OFlags::DIRECTORY)
    .union(OFlags::NOFOLLOW)
    .union(OFlags::CLOEXEC);

fn io(action: &'static str, path: &Path, e: Errno) -> Error {
    Error::io(action, path, e.into())
}

fn refused(path: &Path, message: impl Into<String>) -> Error {
    Error::HostDir {
        path: path.to_owned(),
        message: message.into(),
    }
}

/// The admin's root, opened as configured (created first, `0755`, when missing).
fn open_root(root: &Path) -> Result<OwnedFd> {
    let open = || {
        rustix::fs::open(
            root,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
    };
    match open() {
        Ok(fd) => Ok(fd),
        Err(Errno::NOENT) => {
            std::fs::create_dir_all(root).map_err(|e| Error::io("creating", root, e))?;
            open().map_err(|e| io("opening", root, e))
        }
        Err(e) => Err(io("opening", root, e)),
    }
}

/// Opens the directory `name` of `dir` without following a link.
fn open_below(dir: &OwnedFd, name: &str) -> std::result::Result<OwnedFd, Errno> {
    match rustix::fs::openat2(
        dir,
        name,
        DIR_FLAGS,
        Mode::empty(),
        ResolveFlags::NO_SYMLINKS | ResolveFlags::BENEATH,
    ) {
        Err(Errno::NOSYS) => rustix::fs::openat(dir, name, DIR_FLAGS, Mode::empty()),
        other => other,
    }
}

/// Checks that `fd` (opened at `path`) is a directory owned by the plugin's user, or by
/// `owner`, the user the node gives it to; with `node_only`, also that no other user may write
/// it.
fn check_owned(fd: &OwnedFd, path: &Path, owner: Option<u32>, node_only: bool) -> Result<()> {
    let stat = rustix::fs::fstat(fd).map_err(|e| io("checking", path, e))?;
    let me = rustix::process::geteuid().as_raw();
    if stat.st_uid != me && Some(stat.st_uid) != owner {
        return Err(refused(
            path,
            format!(
                "is owned by uid {}, not by the plugin's uid {me}: a directory the node makes is \
                 never taken over from someone else",
                stat.st_uid
            ),
        ));
    }
    if node_only && stat.st_mode & 0o022 != 0 {
        return Err(refused(
            path,
            format!(
                "has mode {:o}: a directory only the node writes must not be writable by others \
                 (one a container wrote is never reused)",
                stat.st_mode & 0o7777
            ),
        ));
    }
    Ok(())
}

/// Creates `dir` (and any missing directory between its root and it) and gives it its mode,
/// through handles that never follow a link (see the module's rules), and gives it to its owner
/// (`fchown` on the opened descriptor) when it has one. A directory that exists already is
/// taken only when it is a plain directory owned by the plugin's user or its owner; directories
/// created on the way get `0755` and stay the plugin's.
pub fn create(dir: &HostDir) -> Result<()> {
    let segments = dir.segments();
    if segments.is_empty() || segments.iter().any(|s| *s == "." || *s == "..") {
        return Err(refused(
            Path::new(&dir.path),
            format!("must lie below its root {} in plain segments", dir.root),
        ));
    }
    let mut path = PathBuf::from(&dir.root);
    let mut here = open_root(&path)?;
    let last = segments.len() - 1;
    for (i, name) in segments.iter().enumerate() {
        path.push(name);
        let created = match rustix::fs::mkdirat(&here, *name, Mode::from_raw_mode(0o700)) {
            Ok(()) => true,
            Err(Errno::EXIST) => false,
            Err(e) => return Err(io("creating", &path, e)),
        };
        let next = match open_below(&here, name) {
            Ok(fd) => fd,
            Err(Errno::LOOP | Errno::NOTDIR | Errno::XDEV) => {
                return Err(refused(
                    &path,
                    "is not a plain directory (a link or another file is there): it is never \
                     followed",
                ));
            }
            Err(e) => return Err(io("opening", &path, e)),
        };
        let mode = if i == last { dir.mode } else { 0o755 };
        let owner = if i == last { dir.owner } else { None };
        check_owned(&next, &path, owner, mode & 0o022 == 0 && !created)?;
        if created || i == last {
            rustix::fs::fchmod(&next, Mode::from_raw_mode(mode))
                .map_err(|e| io("setting the mode of", &path, e))?;
        }
        if let Some(uid) = owner {
            if uid == u32::MAX {
                return Err(refused(
                    &path,
                    "cannot belong to uid 4294967295 (it means no user)",
                ));
            }
            rustix::fs::fchown(&next, Some(rustix::fs::Uid::from_raw(uid)), None)
                .map_err(|e| io("changing the owner of", &path, e))?;
        }
        here = next;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _, symlink};

    use tessera_driver::node::host_dir::{CONTAINER_DIR_MODE, NODE_DIR_MODE};

    use super::*;

    fn mode(path: &Path) -> u32 {
        std::fs::symlink_metadata(path)
            .unwrap()
            .permissions()
            .mode()
            & 0o7777
    }

    fn root(t: &tempfile::TempDir) -> String {
        t.path().to_str().unwrap().to_owned()
    }

    #[test]
    fn a_claims_directories_are_made_with_their_modes_whatever_the_umask() {
        let t = tempfile::tempdir().unwrap();
        let r = root(&t);
        for d in [
            HostDir::node(&r, "uid"),
            HostDir::container(&r, "uid/cache"),
        ] {
            create(&d).unwrap();
        }
        assert_eq!(mode(&t.path().join("uid")), NODE_DIR_MODE);
        assert_eq!(mode(&t.path().join("uid/cache")), CONTAINER_DIR_MODE);
        // Again: the same directories are taken as they are.
        create(&HostDir::container(&r, "uid/cache")).unwrap();
    }

    #[test]
    fn a_link_in_the_path_is_refused_and_its_target_keeps_its_mode() {
        let t = tempfile::tempdir().unwrap();
        let secret = t.path().join("secret");
        std::fs::create_dir(&secret).unwrap();
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o700)).unwrap();
        let r = root(&t);
        create(&HostDir::node(&r, "uid")).unwrap();
        symlink(&secret, t.path().join("uid/cache")).unwrap();
        let err = create(&HostDir::container(&r, "uid/cache")).unwrap_err();
        assert!(matches!(err, Error::HostDir { .. }), "{err}");
        assert!(err.to_string().contains("not a plain directory"), "{err}");
        assert_eq!(mode(&secret), 0o700);
        // A link higher up is refused too: nothing below it is made.
        std::fs::remove_file(t.path().join("uid/cache")).unwrap();
        std::fs::remove_dir(t.path().join("uid")).unwrap();
        symlink(&secret, t.path().join("uid")).unwrap();
        assert!(create(&HostDir::container(&r, "uid/cache")).is_err());
        assert!(!secret.join("cache").exists());
        assert_eq!(mode(&secret), 0o700);
    }

    #[test]
    fn a_file_where_a_directory_goes_is_refused() {
        let t = tempfile::tempdir().unwrap();
        std::fs::write(t.path().join("uid"), b"x").unwrap();
        let err = create(&HostDir::node(&root(&t), "uid")).unwrap_err();
        assert!(err.to_string().contains("not a plain directory"), "{err}");
    }

    #[test]
    fn a_node_directory_others_could_write_is_never_reused() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("uid");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let err = create(&HostDir::node(&root(&t), "uid")).unwrap_err();
        assert!(err.to_string().contains("mode 1777"), "{err}");
        assert_eq!(mode(&dir), 0o1777);
    }

    #[test]
    fn a_directory_of_another_user_is_refused() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("uid");
        std::fs::create_dir(&dir).unwrap();
        let me = rustix::process::geteuid().as_raw();
        if me != 0 {
            eprintln!("skipped: changing a directory's owner needs root");
            return;
        }
        std::os::unix::fs::chown(&dir, Some(65_534), None).unwrap();
        let err = create(&HostDir::container(&root(&t), "uid")).unwrap_err();
        assert!(err.to_string().contains("owned by uid 65534"), "{err}");
        assert_eq!(std::fs::metadata(&dir).unwrap().uid(), 65_534);
    }

    #[test]
    fn a_directory_given_to_a_user_is_theirs_and_is_taken_again_as_theirs() {
        if rustix::process::geteuid().as_raw() != 0 {
            eprintln!("skipped: giving a directory to another user needs root");
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let r = root(&t);
        let log = HostDir::node(&r, "daemon").owned_by(Some(1000));
        create(&log).unwrap();
        let made = std::fs::metadata(t.path().join("daemon")).unwrap();
        assert_eq!((made.uid(), made.mode() & 0o7777), (1000, 0o755));
        // A restarted plugin takes its user's directory again; another user's it refuses.
        create(&log).unwrap();
        let err = create(&HostDir::node(&r, "daemon").owned_by(Some(2000))).unwrap_err();
        assert!(err.to_string().contains("owned by uid 1000"), "{err}");
        // A link where it goes is never followed to give the user what it points at.
        let secret = t.path().join("secret");
        std::fs::create_dir(&secret).unwrap();
        symlink(&secret, t.path().join("other")).unwrap();
        assert!(create(&HostDir::node(&r, "other").owned_by(Some(1000))).is_err());
        assert_eq!(std::fs::metadata(&secret).unwrap().uid(), 0);
    }

    #[test]
    fn a_missing_root_is_made_as_configured() {
        let t = tempfile::tempdir().unwrap();
        let r = format!("{}/a/b", root(&t));
        create(&HostDir::node(&r, "uid")).unwrap();
        assert!(t.path().join("a/b/uid").is_dir());
    }
}
