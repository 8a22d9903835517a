//! `tessera-mps exec`: runs an MPS control binary (the daemon, or one control command) in a
//! mount namespace of its own, set up by this process before it replaces itself with the
//! binary (`tessera_driver::node::mps_exec::plan`). No shell, `unshare` or `mount` binary is needed:
//! the image has none. The steps run in this single-threaded process on itself, so no code
//! runs between `fork` and `exec` and nothing here needs `unsafe`.

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

fn failed(step: &Step, errno: nix::errno::Errno) -> Error {
    let hint = match (step, errno) {
        (Step::MakePrivate, nix::errno::Errno::EINVAL) => {
            "`/` is not a mount point (a container's root is; a plain chroot's is not)"
        }
        (_, nix::errno::Errno::ENOENT) => "a directory is missing",
        _ => {
            "the daemon's mount namespace needs CAP_SYS_ADMIN, and a driver root needs \
             CAP_SYS_CHROOT"
        }
    };
    Error::Mps(format!(
        "tessera-mps exec: {step:?} failed: {errno} ({hint})"
    ))
}

fn apply(step: &Step) -> Result<()> {
    match step {
        Step::NewMountNamespace => unshare(CloneFlags::CLONE_NEWNS).map_err(|e| failed(step, e)),
        Step::MakePrivate => mount(
            None::<&str>,
            "/",
            None::<&str>,
            MsFlags::MS_REC | MsFlags::MS_PRIVATE,
            None::<&str>,
        )
        .map_err(|e| failed(step, e)),
        Step::CreateDir(dir) => {
            std::fs::create_dir_all(dir).map_err(|e| Error::io("creating", dir, e))
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
            .map_err(|e| failed(step, e))
        }
        Step::ChangeRoot(root) => {
            nix::unistd::chroot(root.as_str()).map_err(|e| failed(step, e))?;
            nix::unistd::chdir("/").map_err(|e| failed(step, e))
        }
    }
}

/// Sets up the namespace and replaces this process with the program; returns only on failure.
pub fn exec(request: &ExecRequest) -> Error {
    let steps = match mps_exec::plan(&request.root, request.shm_dir.as_deref(), &request.binds) {
        Ok(steps) => steps,
        Err(e) => return Error::Config(e.to_string()),
    };
    for step in &steps {
        if let Err(e) = apply(step) {
            return e;
        }
    }
    let error = Command::new(&request.program)
        .args(&request.args)
        .env("PATH", mps_exec::search_path(&request.program))
        .exec();
    Error::io("running", &request.program, error)
}
