//! `tessera-mps exec`: runs an MPS control binary (the daemon, or one control command) in a
//! mount namespace of its own, set up by this process before it replaces itself with the
//! binary (`tessera_driver::node::mps_exec::plan`). No shell, `unshare` or `mount` binary is needed:
//! the image has none. The steps run in this single-threaded process on itself, so no code
//! runs between `fork` and `exec` and nothing here needs `unsafe`. The isolation probe's child
//! applies its claim's mounts with the same [`apply_steps`] (`crate::gpus::isolation`).

use std::os::unix::process::CommandExt as _;
use std::process::Command;

use nix::mount::{MsFlags, mount};
use nix::sched::{CloneFlags, unshare};
use tessera_driver::node::mps_exec::{self, Step};

use crate::error::{Error, Result};

/// What to run, and the namespace it gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecRequest {
    /// The driver root (`/`: no change of root).
    pub root: String,
    /// The daemon's shm directory, bound over `/dev/shm`.
    pub shm_dir: Option<String>,
    /// Directories that keep their paths inside the root.
    pub binds: Vec<String>,
    /// The program, as seen inside the root.
    pub program: String,
    /// Its arguments.
    pub args: Vec<String>,
}

fn failed(who: &str, step: &Step, errno: nix::errno::Errno) -> Error {
    let hint = match (step, errno) {
        (Step::MakePrivate, nix::errno::Errno::EINVAL) => {
            "`/` is not a mount point (a container's root is; a plain chroot's is not)"
        }
        (Step::NewMountNamespace, nix::errno::Errno::EINVAL) => {
            "the process has more than one thread (the namespace must be made before any starts)"
        }
        (_, nix::errno::Errno::ENOENT) => "a directory is missing",
        _ => "a mount namespace needs CAP_SYS_ADMIN, and a change of root CAP_SYS_CHROOT",
    };
    Error::Namespace(format!("{who}: {step:?} failed: {errno} ({hint})"))
}

fn apply(who: &str, step: &Step) -> Result<()> {
    let failed = |e| failed(who, step, e);
    match step {
        Step::NewMountNamespace => unshare(CloneFlags::CLONE_NEWNS).map_err(failed),
        Step::MakePrivate => mount(
            None::<&str>,
            "/",
            None::<&str>,
            MsFlags::MS_REC | MsFlags::MS_PRIVATE,
            None::<&str>,
        )
        .map_err(failed),
        Step::CreateDir(dir) => {
            std::fs::create_dir_all(dir).map_err(|e| Error::io("creating", dir, e))
        }
        Step::CreateFile(file) => {
            // Whatever is there already is the mount point (a read-only image may hold it).
            if std::fs::symlink_metadata(file).is_ok() {
                return Ok(());
            }
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(file)
            {
                Ok(_) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
                Err(e) => Err(Error::io("creating the mount point", file, e)),
            }
        }
        Step::Bind {
            source,
            target,
            recursive,
        } => {
            let mut flags = MsFlags::MS_BIND;
            if *recursive {
                flags |= MsFlags::MS_REC;
            }
            mount(
                Some(source.as_str()),
                target.as_str(),
                None::<&str>,
                flags,
                None::<&str>,
            )
            .map_err(failed)
        }
        Step::Remount {
            target,
            read_only,
            nosuid,
            nodev,
            noexec,
        } => {
            let mut flags = MsFlags::MS_REMOUNT | MsFlags::MS_BIND;
            for (set, flag) in [
                (*read_only, MsFlags::MS_RDONLY),
                (*nosuid, MsFlags::MS_NOSUID),
                (*nodev, MsFlags::MS_NODEV),
                (*noexec, MsFlags::MS_NOEXEC),
            ] {
                if set {
                    flags |= flag;
                }
            }
            mount(
                None::<&str>,
                target.as_str(),
                None::<&str>,
                flags,
                None::<&str>,
            )
            .map_err(failed)
        }
        Step::ChangeRoot(root) => {
            nix::unistd::chroot(root.as_str()).map_err(failed)?;
            nix::unistd::chdir("/").map_err(failed)
        }
    }
}

/// Applies `steps` in order to this process (`who` names it in an error); stops at the first
/// that fails. A new mount namespace needs a single-threaded process: call this before any
/// thread or runtime is started.
pub fn apply_steps(who: &str, steps: &[Step]) -> Result<()> {
    steps.iter().try_for_each(|step| apply(who, step))
}

/// Sets up the namespace and replaces this process with the program; returns only on failure.
pub fn exec(request: &ExecRequest) -> Error {
    let steps = match mps_exec::plan(&request.root, request.shm_dir.as_deref(), &request.binds) {
        Ok(steps) => steps,
        Err(e) => return Error::Config(format!("tessera-mps exec: {e}")),
    };
    if let Err(e) = apply_steps("tessera-mps exec", &steps) {
        return e;
    }
    let error = Command::new(&request.program)
        .args(&request.args)
        .env("PATH", mps_exec::search_path(&request.program))
        .exec();
    Error::io("running", &request.program, error)
}
