//! Directory trees a tenant could build in a directory mounted into its containers, for the
//! tests of removing them.

use std::path::Path;

use rustix::fs::{CWD, Mode, OFlags};

/// `root` (created with its parents) with a chain of `depth` nested directories `d` under it,
/// built relative to an open descriptor as a container would (the whole path is far longer
/// than `PATH_MAX`), with a file `f` and a symlink `escape` out of the tree at the bottom.
///
/// # Errors
/// The first error of creating or opening a directory or creating the file or the symlink.
pub fn deep_tree(root: &Path, depth: usize) -> std::io::Result<()> {
    std::fs::create_dir_all(root)?;
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let mut dir = rustix::fs::openat(CWD, root, flags, Mode::empty())?;
    for _ in 0..depth {
        rustix::fs::mkdirat(&dir, c"d", Mode::RWXU)?;
        dir = rustix::fs::openat(&dir, c"d", flags, Mode::empty())?;
    }
    let file = rustix::fs::openat(
        &dir,
        c"f",
        OFlags::WRONLY | OFlags::CREATE | OFlags::CLOEXEC,
        Mode::RUSR | Mode::WUSR,
    )?;
    drop(file);
    rustix::fs::symlinkat(c"/", &dir, c"escape")?;
    Ok(())
}
