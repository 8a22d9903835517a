//! The kubelet plugin's command line: its flags and what they mean, and nothing else (the
//! process they start is [`super::wiring`]).

use std::path::{Path, PathBuf};

use clap::{Parser, ValueEnum};
use tessera_driver::names;
use tessera_driver::node::cdi::Enforcement;
use tessera_driver::node::gpu_mode::ModeChoice;
use tessera_driver::node::inventory::GpuMode;

use crate::cli::mps_cli::LaunchArgs;
use crate::ops::LogFormat;

/// Where GPUs are discovered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum GpuBackend {
    /// NVML on the node (`libnvidia-ml.so.1`, loaded at start).
    Nvml,
    /// An inventory file (`--fake-inventory`).
    Fake,
}

/// The mode of a GPU the admin chooses (MIG comes from the hardware).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ModeArg {
    /// Whole GPUs, one claim each.
    Exclusive,
    /// Shares of memory and compute.
    Shared,
}

impl From<ModeArg> for GpuMode {
    fn from(m: ModeArg) -> Self {
        match m {
            ModeArg::Exclusive => Self::Exclusive,
            ModeArg::Shared => Self::Shared,
        }
    }
}

/// Who runs the MPS control daemons.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum MpsDaemons {
    /// The plugin, as its own children.
    Local,
    /// The node's `tessera-mps host`, in a pod of its own.
    Host,
}

/// Which users an MPS control daemon serves (one MPS daemon runs a server for one Unix user at
/// a time).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum MpsUsers {
    /// One daemon per GPU set and user, the user read from the pods a claim is reserved for
    /// (`securityContext.runAsUser`); a share claim whose user cannot be told is refused.
    Separate,
    /// One daemon per GPU set for every user: the admin makes sure every share pod of the node
    /// runs as one user (a pod of another user waits at CUDA initialisation); no pod is read.
    Single,
}

/// How shares are enforced inside containers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EnforcementKind {
    /// One MPS control daemon per shared GPU set.
    Mps,
    /// HAMi-core's libvgpu.so, preloaded.
    HamiCore,
    /// Time-slicing; bookkeeping only.
    None,
}

impl EnforcementKind {
    /// The name published as the shared GPUs' `enforcement` attribute (the flag's spelling).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Mps => "mps",
            Self::HamiCore => tessera_driver::names::ENFORCEMENT_HAMI_CORE,
            Self::None => "none",
        }
    }
}

/// The Tessera kubelet plugin.
#[derive(Debug, Clone, Parser)]
#[command(name = "tessera-kubelet-plugin", version, about)]
pub struct Args {
    /// This node's name (also the name of its resource pool).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    /// The DRA driver name.
    #[arg(long, env = "TESSERA_DRIVER_NAME", default_value = names::DEFAULT_DRIVER_NAME)]
    pub driver_name: String,
    /// Where GPUs are discovered.
    #[arg(long, env = "TESSERA_GPU_BACKEND", value_enum, default_value = "nvml")]
    pub gpu_backend: GpuBackend,
    /// NVML library for `--gpu-backend nvml` (a file name searched the usual way, or a path;
    /// with a `--driver-root` other than `/`, the file name is looked for under it).
    #[arg(
        long,
        env = "TESSERA_NVML_LIBRARY",
        default_value = "libnvidia-ml.so.1"
    )]
    pub nvml_library: PathBuf,
    /// Where the host's sysfs is mounted (the `PCIe` root complexes of NVML GPUs).
    #[arg(long, env = "TESSERA_SYSFS_ROOT", default_value = "/sys")]
    pub sysfs_root: PathBuf,
    /// The NVIDIA driver's table of MIG capability minors; without it the node prepares no MIG
    /// device (docs/cdi.md).
    #[arg(
        long,
        env = "TESSERA_MIG_MINORS_FILE",
        default_value = tessera_driver::node::inventory::mig_minors::MIG_MINORS_PATH
    )]
    pub mig_minors_file: PathBuf,
    /// Mode of every non-MIG GPU of the node [default: exclusive, or the inventory file's];
    /// the node label `gpu.tessera.dev/mode` wins over it.
    #[arg(long, env = "TESSERA_GPU_MODE", value_enum)]
    pub gpu_mode: Option<ModeArg>,
    /// Mode of single GPUs, `<index>=<mode>` (repeat, or comma-separate in the environment);
    /// wins over `--gpu-mode`; the label `gpu.tessera.dev/mode.gpu-<index>` wins over it.
    #[arg(long, env = "TESSERA_GPU_MODE_OVERRIDES", value_delimiter = ',')]
    pub gpu_mode_override: Vec<String>,
    /// Inventory file for `--gpu-backend fake`.
    #[arg(long, env = "TESSERA_FAKE_INVENTORY")]
    pub fake_inventory: Option<PathBuf>,
    /// ResourceClaims (YAML) to serve instead of the API server, for running without a cluster
    /// (no ResourceSlices are published then).
    #[arg(long, env = "TESSERA_FAKE_CLAIMS")]
    pub fake_claims: Option<PathBuf>,
    /// Kubeconfig for the API server [default: the pod's service account (in-cluster)].
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Kubelet's plugin registry directory.
    #[arg(long, env = "TESSERA_REGISTRATION_DIR", default_value = names::DEFAULT_REGISTRATION_DIR)]
    pub registration_dir: PathBuf,
    /// The plugin's directory, for the DRA socket [default: /var/lib/kubelet/plugins/<driver>].
    #[arg(long, env = "TESSERA_PLUGIN_DIR")]
    pub plugin_dir: Option<PathBuf>,
    /// Where CDI specs are written.
    #[arg(long, env = "TESSERA_CDI_DIR", default_value = names::DEFAULT_CDI_DIR)]
    pub cdi_dir: PathBuf,
    /// Where the checkpoint is kept [default: the plugin directory].
    #[arg(long, env = "TESSERA_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// How shares are enforced inside containers.
    #[arg(long, env = "TESSERA_ENFORCEMENT", value_enum, default_value = "mps")]
    pub enforcement: EnforcementKind,
    /// MPS: host directory holding each daemon's pipe and shm directories.
    #[arg(
        long,
        env = "TESSERA_MPS_PIPE_DIR_ROOT",
        default_value = "/run/tessera/mps"
    )]
    pub mps_pipe_dir_root: String,
    /// MPS: host directory holding each daemon's logs.
    #[arg(
        long,
        env = "TESSERA_MPS_LOG_DIR_ROOT",
        default_value = "/var/log/tessera/mps"
    )]
    pub mps_log_dir_root: String,
    /// MPS: who runs the control daemons. `host`: the node's `tessera-mps host` (the chart's
    /// `tessera-mps` `DaemonSet`), outside this container, so restarts and rollouts of the
    /// plugin leave them and their clients alone; the plugin waits for each claim's daemon to
    /// answer. `local`: the plugin runs them as its own children (they outlive a plugin
    /// process, not its container).
    #[arg(long, env = "TESSERA_MPS_DAEMONS", value_enum, default_value = "local")]
    pub mps_daemons: MpsDaemons,
    /// MPS: which users a control daemon serves. `separate`: one daemon per GPU set and Unix
    /// user, the user taken from the `runAsUser` of the claim's pods (needs `get` on pods); a
    /// share claim whose containers set no user, or several, is refused with the reason.
    /// `single`: one daemon per GPU set for all (every share pod must run as one user).
    #[arg(
        long,
        env = "TESSERA_MPS_USERS",
        value_enum,
        default_value = "separate"
    )]
    pub mps_users: MpsUsers,
    /// MPS: seconds a claim's daemon may take to answer before the prepare fails.
    #[arg(long, env = "TESSERA_MPS_READY_SECONDS", default_value_t = 30)]
    pub mps_ready_seconds: u64,
    /// The driver root and how local daemons are launched.
    #[command(flatten)]
    pub launch: LaunchArgs,
    /// HAMi-core: host path of the installed libvgpu.so.
    #[arg(
        long,
        env = "TESSERA_HAMI_LIBRARY",
        default_value = "/usr/local/vgpu/libvgpu.so"
    )]
    pub hami_library_path: String,
    /// HAMi-core: host directory holding each claim's accounting directory.
    #[arg(
        long,
        env = "TESSERA_HAMI_CACHE_DIR",
        default_value = "/run/tessera/hami"
    )]
    pub hami_cache_dir: String,
    /// File holding the current boot's id (a checkpoint of another boot is dropped).
    #[arg(
        long,
        env = "TESSERA_BOOT_ID_FILE",
        default_value = "/proc/sys/kernel/random/boot_id"
    )]
    pub boot_id_file: PathBuf,
    /// Address of the `/metrics`, `/healthz` and `/readyz` endpoint, e.g. `0.0.0.0:9400`
    /// [default: not served].
    #[arg(long, env = "TESSERA_METRICS_ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Log line format on stderr.
    #[arg(long, env = "TESSERA_LOG_FORMAT", value_enum, default_value = "plain")]
    pub log_format: LogFormat,
    /// Seconds between GPU memory accounting passes (0: off): each claim's processes together
    /// are held to the claim's memory booking on each GPU; processes past it are stopped (MPS
    /// `terminate_client`, else `SIGKILL`) and the pod gets an Event. Needs the host's PID
    /// namespace (`hostPID`). Off with `--gpu-backend fake`.
    #[arg(long, env = "TESSERA_ACCOUNTING_INTERVAL_SECONDS", default_value_t = 5)]
    pub accounting_interval_seconds: u64,
    /// Seconds between checks of `--fake-inventory` for changes (0: never).
    #[arg(long, env = "TESSERA_INVENTORY_POLL_SECONDS", default_value_t = 10)]
    pub inventory_poll_seconds: u64,
    /// Offer shares of GPUs whose isolation the node could not prove (published as
    /// `isolation: unverified-accepted`, which the shipped share classes select). Off by
    /// default: such GPUs are published `unverified` and offer no shares.
    #[arg(
        long,
        env = "TESSERA_ACCEPT_UNVERIFIED_ISOLATION",
        default_value_t = false,
        action = clap::ArgAction::Set
    )]
    pub accept_unverified_isolation: bool,
    /// Seconds one isolation probe may take before it is killed (the GPU stays unverified).
    #[arg(
        long,
        env = "TESSERA_ISOLATION_PROBE_TIMEOUT_SECONDS",
        default_value_t = 60
    )]
    pub isolation_probe_timeout_seconds: u64,
}
impl Args {
    /// The plugin directory, defaulted from the driver name.
    pub fn plugin_dir(&self) -> PathBuf {
        self.plugin_dir
            .clone()
            .unwrap_or_else(|| Path::new(names::DEFAULT_PLUGINS_DIR).join(&self.driver_name))
    }

    /// The enforcement backend the flags describe.
    pub fn enforcement(&self) -> Enforcement {
        match self.enforcement {
            EnforcementKind::Mps => Enforcement::Mps {
                pipe_dir_root: self.mps_pipe_dir_root.clone(),
                log_dir_root: self.mps_log_dir_root.clone(),
            },
            EnforcementKind::HamiCore => Enforcement::HamiCore {
                library_path: self.hami_library_path.clone(),
                cache_dir: self.hami_cache_dir.clone(),
            },
            EnforcementKind::None => Enforcement::None,
        }
    }

    /// The mode choice of the flags.
    pub fn mode_flags(&self) -> anyhow::Result<ModeChoice> {
        Ok(ModeChoice::from_flags(
            self.gpu_mode.map(GpuMode::from),
            &self.gpu_mode_override,
        )?)
    }
}

#[cfg(test)]
mod enforcement_name_tests {
    use clap::ValueEnum as _;

    use super::EnforcementKind;

    #[test]
    fn the_published_enforcement_name_is_the_flag_value() {
        for kind in EnforcementKind::value_variants() {
            let value = kind.to_possible_value().expect("a value");
            assert_eq!(value.get_name(), kind.as_str());
        }
    }
}
