//! What the `tessera-mps exec` wrapper does before it runs an MPS control binary: the mount
//! steps that give the daemon (or a control command) the directories its clients share, in a
//! mount namespace of its own, with no shell and no external tool.
//!
//! With driver root `/` (the driver's files are already where the wrapper runs), the daemon
//! only gets its shm directory over `/dev/shm`. With another root (the host's `/` mounted at
//! `/driver-root`, or the GPU operator's `/run/nvidia/driver`), the wrapper changes root into
//! it, as NVIDIA's DRA driver runs its daemons (`chroot /driver-root`), so the control daemon,
//! the MPS server it starts and the libraries they load are all the host driver's own. The
//! container's `/dev` (a privileged container's holds the GPU device nodes) is bound over the
//! root's, and the pipe and log directories are bound at their own paths inside it, so the
//! `CUDA_MPS_*` variables name the same directories inside as outside.
//!
//! Every step happens in the wrapper's private mount namespace: nothing it mounts is seen by
//! the host or by the container it runs in.
//!
//! The isolation probe sets up its claim's mounts with the same [`Step`]s
//! (`crate::node::isolation::namespace::plan`), applied by the same code in the plugin.

use std::fmt;

/// One step of the wrapper, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// A mount namespace of its own (`unshare(CLONE_NEWNS)`).
    NewMountNamespace,
    /// Every mount in it private (`MS_REC | MS_PRIVATE` on `/`), so no mount below propagates
    /// back to the container or the host.
    MakePrivate,
    /// Creates a directory (a mount point) when it is missing.
    CreateDir(String),
    /// Creates an empty file (the mount point of a file) when nothing is there; its directory
    /// must exist.
    CreateFile(String),
    /// Binds `source` onto `target` (with its submounts when `recursive`).
    Bind {
        /// What is bound.
        source: String,
        /// Where.
        target: String,
        /// Whether submounts come along (`MS_REC`).
        recursive: bool,
    },
    /// Sets the per-mount flags of the bind mount at `target` (`MS_REMOUNT | MS_BIND`), as a
    /// container runtime applies a mount's `ro`, `nosuid`, `nodev` and `noexec` options.
    Remount {
        /// The bind mount.
        target: String,
        /// `MS_RDONLY`.
        read_only: bool,
        /// `MS_NOSUID`.
        nosuid: bool,
        /// `MS_NODEV`.
        nodev: bool,
        /// `MS_NOEXEC`.
        noexec: bool,
    },
    /// Changes root into the directory, and the working directory to its `/`.
    ChangeRoot(String),
}

/// An argument that cannot be planned (of `tessera-mps exec`, or of the isolation probe).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanError {
    /// The argument.
    pub argument: &'static str,
    /// Its value.
    pub value: String,
    /// The rule it breaks.
    pub rule: &'static str,
}

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {:?} {}", self.argument, self.value, self.rule)
    }
}

impl std::error::Error for PlanError {}

/// `value` as an absolute path without `..` and without a trailing `/`, or the error that names
/// `argument`.
pub(crate) fn checked(argument: &'static str, value: &str) -> Result<String, PlanError> {
    let error = |rule| PlanError {
        argument,
        value: value.to_owned(),
        rule,
    };
    if !value.starts_with('/') {
        return Err(error("must be an absolute path"));
    }
    if value.split('/').any(|c| c == "..") {
        return Err(error("must not contain `..`"));
    }
    let trimmed = value.trim_end_matches('/');
    Ok(if trimmed.is_empty() {
        "/".to_owned()
    } else {
        trimmed.to_owned()
    })
}

/// `path` (absolute) as seen from outside a change of root into `root`.
fn under(root: &str, path: &str) -> String {
    if root == "/" {
        path.to_owned()
    } else {
        format!("{root}{path}")
    }
}

/// The steps for driver root `root`, the daemon's `shm_dir` (none for a control command) and
/// the directories `binds` that must keep their paths inside the root.
pub fn plan(root: &str, shm_dir: Option<&str>, binds: &[String]) -> Result<Vec<Step>, PlanError> {
    let root = checked("--root", root)?;
    let mut steps = vec![Step::NewMountNamespace, Step::MakePrivate];
    let changes_root = root != "/";
    if changes_root {
        steps.push(Step::CreateDir(under(&root, "/dev")));
        steps.push(Step::Bind {
            source: "/dev".to_owned(),
            target: under(&root, "/dev"),
            recursive: true,
        });
    }
    if let Some(shm) = shm_dir {
        let shm = checked("--shm-dir", shm)?;
        let target = under(&root, "/dev/shm");
        steps.push(Step::CreateDir(target.clone()));
        steps.push(Step::Bind {
            source: shm,
            target,
            recursive: false,
        });
    }
    if changes_root {
        for dir in binds {
            let dir = checked("--bind", dir)?;
            let target = under(&root, &dir);
            steps.push(Step::CreateDir(target.clone()));
            steps.push(Step::Bind {
                source: dir,
                target,
                recursive: false,
            });
        }
        steps.push(Step::ChangeRoot(root));
    } else {
        for dir in binds {
            checked("--bind", dir)?;
        }
    }
    Ok(steps)
}

/// The `PATH` the control binary runs with: its own directory first (the control daemon
/// finds `nvidia-cuda-mps-server` on `PATH`), then the usual ones.
pub fn search_path(program: &str) -> String {
    let usual = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
    match program.rsplit_once('/') {
        Some((dir, _)) if !dir.is_empty() => format!("{dir}:{usual}"),
        _ => usual.to_owned(),
    }
}

#[cfg(test)]
mod tests {

    use super::*;

    fn bind(source: &str, target: &str, recursive: bool) -> Step {
        Step::Bind {
            source: source.to_owned(),
            target: target.to_owned(),
            recursive,
        }
    }

    #[test]
    fn in_its_own_root_the_daemon_only_gets_its_shm_directory_as_dev_shm() {
        let steps = plan(
            "/",
            Some("/run/tessera/mps/m/shm"),
            &["/run/tessera/mps/m/pipe".to_owned()],
        )
        .unwrap();
        assert_eq!(
            steps,
            [
                Step::NewMountNamespace,
                Step::MakePrivate,
                Step::CreateDir("/dev/shm".to_owned()),
                bind("/run/tessera/mps/m/shm", "/dev/shm", false),
            ]
        );
    }

    #[test]
    fn in_a_driver_root_the_daemon_gets_devices_shm_and_its_directories_then_changes_root() {
        let steps = plan(
            "/driver-root/",
            Some("/run/tessera/mps/m/shm"),
            &[
                "/run/tessera/mps/m/pipe".to_owned(),
                "/var/log/tessera/mps/m".to_owned(),
            ],
        )
        .unwrap();
        assert_eq!(
            steps,
            [
                Step::NewMountNamespace,
                Step::MakePrivate,
                Step::CreateDir("/driver-root/dev".to_owned()),
                bind("/dev", "/driver-root/dev", true),
                Step::CreateDir("/driver-root/dev/shm".to_owned()),
                bind("/run/tessera/mps/m/shm", "/driver-root/dev/shm", false),
                Step::CreateDir("/driver-root/run/tessera/mps/m/pipe".to_owned()),
                bind(
                    "/run/tessera/mps/m/pipe",
                    "/driver-root/run/tessera/mps/m/pipe",
                    false
                ),
                Step::CreateDir("/driver-root/var/log/tessera/mps/m".to_owned()),
                bind(
                    "/var/log/tessera/mps/m",
                    "/driver-root/var/log/tessera/mps/m",
                    false
                ),
                Step::ChangeRoot("/driver-root".to_owned()),
            ]
        );
    }

    #[test]
    fn relative_or_climbing_paths_are_refused_by_name() {
        let err = plan("driver-root", None, &[]).unwrap_err();
        assert_eq!(err.argument, "--root");
        assert!(err.to_string().contains("absolute"), "{err}");
        let err = plan("/", Some("/run/../etc"), &[]).unwrap_err();
        assert_eq!(err.argument, "--shm-dir");
        let err = plan("/r", None, &["pipe".to_owned()]).unwrap_err();
        assert_eq!(err.argument, "--bind");
    }

    #[test]
    fn the_control_binarys_directory_leads_the_search_path() {
        assert!(search_path("/usr/bin/nvidia-cuda-mps-control").starts_with("/usr/bin:"));
        assert!(search_path("nvidia-cuda-mps-control").starts_with("/usr/local/sbin:"));
    }
}
