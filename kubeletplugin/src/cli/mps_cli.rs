//! The `tessera-mps` binary: `host` runs the node's MPS daemons outside the plugin's
//! container ([`crate::mps::host`]); `exec` is the wrapper each daemon and control command
//! runs through ([`crate::mps::exec`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use tessera_driver::node::mps::{Launch, Wrapper};
use tracing::warn;

use crate::claims::input_file;
use crate::claims::preparer::CHECKPOINT_FILE;
use crate::error::{Error, Result};
use crate::gpus::driver_files;
use crate::mps::exec::{ExecRequest, exec};
use crate::mps::host::{self, HostConfig};
use crate::mps::{MpsConfig, MpsSupervisor, OsProcessHost};
use crate::ops::{LogFormat, init_logs};

/// The MPS daemons' host and wrapper.
#[derive(Debug, Parser)]
#[command(name = "tessera-mps", version)]
pub struct Cli {
    /// What to run.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the MPS control daemons the plugin's checkpoint records (the node's daemon host).
    Host(HostArgs),
    /// Run an MPS control binary in a mount namespace of its own.
    Exec(ExecArgs),
}

/// `tessera-mps host`.
#[derive(Debug, clap::Args)]
pub struct HostArgs {
    /// The plugin's state directory (its checkpoint is read, never written).
    #[arg(long, env = "TESSERA_STATE_DIR", default_value = "/var/lib/tessera")]
    pub state_dir: PathBuf,
    /// File holding the current boot's id.
    #[arg(
        long,
        env = "TESSERA_BOOT_ID_FILE",
        default_value = "/proc/sys/kernel/random/boot_id"
    )]
    pub boot_id_file: PathBuf,
    /// The driver root and how daemons are launched.
    #[command(flatten)]
    pub launch: LaunchArgs,
    /// Milliseconds between two passes over the checkpoint.
    #[arg(long, env = "TESSERA_MPS_HOST_INTERVAL_MS", default_value_t = 1000)]
    pub interval_ms: u64,
    /// Log line format on stderr.
    #[arg(long, env = "TESSERA_LOG_FORMAT", value_enum, default_value = "plain")]
    pub log_format: LogFormat,
}

/// How daemons are launched (shared by `tessera-mps host` and the plugin's local daemons).
#[derive(Debug, Clone, clap::Args)]
pub struct LaunchArgs {
    /// Where the host's NVIDIA driver root is mounted (`/`: the driver's files are already in
    /// this container). Other roots are changed into to run the daemons.
    #[arg(long, env = "TESSERA_DRIVER_ROOT", default_value = "/")]
    pub driver_root: PathBuf,
    /// The `nvidia-cuda-mps-control` binary as seen inside the driver root [default: found
    /// under the driver root, or on `PATH` with root `/`].
    #[arg(long, env = "TESSERA_MPS_CONTROL_BINARY")]
    pub mps_control_binary: Option<PathBuf>,
    /// Run each daemon in a mount namespace of its own with its shm directory as `/dev/shm`,
    /// the directory its clients get (needs `CAP_SYS_ADMIN`; always on with a driver root).
    /// Off only for a fake control binary: a real daemon would keep this container's own
    /// `/dev/shm`, which the claims' containers do not get, so its clients could not reach it
    /// (the isolation probe then leaves every shared GPU unverified).
    #[arg(
        long,
        env = "TESSERA_MPS_SHM_NAMESPACE",
        default_value_t = true,
        action = clap::ArgAction::Set
    )]
    pub mps_shm_namespace: bool,
    /// The `tessera-mps` binary [default: the one beside this program].
    #[arg(long, env = "TESSERA_MPS_EXEC_BINARY")]
    pub mps_exec_binary: Option<PathBuf>,
}

impl LaunchArgs {
    /// The launch these arguments describe; the control binary is looked up under the driver
    /// root now, so a node without the driver fails at start with the paths it tried.
    pub fn launch(&self) -> Result<Launch> {
        let root = self.driver_root.display().to_string();
        let changes_root = Path::new(&root) != Path::new("/");
        let control_binary = match &self.mps_control_binary {
            Some(path) => path.display().to_string(),
            None if changes_root => driver_files::mps_control(&self.driver_root)?.inside,
            None => tessera_driver::node::driver_root::MPS_CONTROL_BINARY.to_owned(),
        };
        let wrapper = if changes_root || self.mps_shm_namespace {
            let program = match &self.mps_exec_binary {
                Some(p) => p.clone(),
                None => std::env::current_exe()
                    .map_err(|e| Error::io("finding", "the running program", e))?
                    .with_file_name("tessera-mps"),
            };
            Some(Wrapper {
                program: program.display().to_string(),
                driver_root: root,
            })
        } else {
            warn!(
                "--mps-shm-namespace=false: each MPS daemon keeps this container's /dev/shm, \
                 while the claims' containers get the daemon's shm directory there; real MPS \
                 clients cannot reach such a daemon (meant for a fake control binary in tests)"
            );
            None
        };
        Ok(Launch {
            control_binary,
            wrapper,
        })
    }
}

/// `tessera-mps exec`.
#[derive(Debug, clap::Args)]
pub struct ExecArgs {
    /// The driver root to change into (`/`: none).
    #[arg(long, default_value = "/")]
    pub root: String,
    /// The daemon's shm directory, bound over `/dev/shm`.
    #[arg(long)]
    pub shm_dir: Option<String>,
    /// A directory that keeps its path inside the root (repeatable).
    #[arg(long = "bind")]
    pub binds: Vec<String>,
    /// The program (as seen inside the root) and its arguments.
    #[arg(last = true, required = true, num_args = 1..)]
    pub command: Vec<String>,
}

impl Cli {
    /// Parses the command line and runs the subcommand.
    pub fn parse_and_run() -> anyhow::Result<()> {
        match Self::parse().command {
            Command::Exec(args) => {
                let mut command = args.command.into_iter();
                let program = command.next().context("a program to run")?;
                let error = exec(&ExecRequest {
                    root: args.root,
                    shm_dir: args.shm_dir,
                    binds: args.binds,
                    program,
                    args: command.collect(),
                });
                Err(error.into())
            }
            Command::Host(args) => {
                init_logs(args.log_format);
                // As the plugin reads it: a regular file of at most 64 MiB (`/dev/zero` here is
                // an error, not a process growing until it runs out of memory).
                let boot_id = input_file::read_text(&args.boot_id_file, "the boot id file")?
                    .trim()
                    .to_owned();
                let mut config = MpsConfig::new("");
                config.launch = args.launch.launch()?;
                tracing::info!(launch = ?config.launch, state_dir = %args.state_dir.display(), "MPS host starting");
                let supervisor = MpsSupervisor::new(config, Arc::new(OsProcessHost::new()));
                host::run(
                    &supervisor,
                    &HostConfig {
                        checkpoint: args.state_dir.join(CHECKPOINT_FILE),
                        read: read_checkpoint,
                        boot_id,
                        interval: Duration::from_millis(args.interval_ms.max(10)),
                    },
                )
            }
        }
    }
}

/// The checkpoint at `path`, read as the plugin reads it (a regular file of at most 64 MiB);
/// `None` when it does not exist.
fn read_checkpoint(path: &Path) -> Result<Option<Vec<u8>>> {
    match input_file::read(path, "the checkpoint") {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if input_file::is_missing(&e) => Ok(None),
        Err(e) => Err(e),
    }
}
