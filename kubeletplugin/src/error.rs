//! The kubelet plugin's one error type.

use std::path::PathBuf;

/// Everything that can fail in the kubelet plugin. Each variant names the object or path.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A decision of the domain core failed (bad allocation, bad CDI input, device held...).
    #[error(transparent)]
    Driver(#[from] tessera_driver::Error),

    /// A file system operation failed.
    #[error("{action} {}: {source}", path.display())]
    Io {
        /// What the plugin was doing, e.g. "writing".
        action: &'static str,
        /// The path it was doing it to.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },

    /// An input file is not one the plugin reads (not a regular file, too large, not text).
    #[error("{}: {message}", path.display())]
    Input {
        /// The file.
        path: PathBuf,
        /// Which rule it breaks.
        message: String,
    },

    /// A host directory the node makes for a claim or an MPS daemon is already there as
    /// something the node did not make (a link, a file, another user's or a world-writable
    /// directory): the claim fails rather than the node taking it over.
    #[error("host directory {}: {message}", path.display())]
    HostDir {
        /// The directory.
        path: PathBuf,
        /// What is there instead, and the rule.
        message: String,
    },

    /// The claim kubelet names does not exist.
    #[error("claim {namespace}/{name} not found")]
    ClaimNotFound {
        /// The claim's namespace.
        namespace: String,
        /// The claim's name.
        name: String,
    },

    /// The claim exists under another UID (it was deleted and re-created).
    #[error("claim {namespace}/{name} has UID {actual}, kubelet asked for {expected}")]
    ClaimUidMismatch {
        /// The claim's namespace.
        namespace: String,
        /// The claim's name.
        name: String,
        /// The UID kubelet asked for.
        expected: String,
        /// The UID the claim has.
        actual: String,
    },

    /// A request field is missing or malformed.
    #[error("bad request: {0}")]
    BadRequest(String),

    /// A configuration value is missing or not supported.
    #[error("configuration: {0}")]
    Config(String),

    /// A client's HTTP/2 bytes break framing or HPACK (the connection is closed).
    #[error("HTTP/2 from the client: {0}")]
    Http2(String),

    /// Serving gRPC failed.
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),

    /// A step every claim of a call shared failed (the checkpoint write they wait on).
    #[error("{0}")]
    Shared(String),

    /// Kubelet gave up on the call before this claim was done (nothing of it is kept).
    #[error("the call was cancelled before this claim was done")]
    Cancelled,

    /// A worker task panicked or was cancelled.
    #[error("worker task: {0}")]
    Task(String),

    /// A call to the Kubernetes API server failed (or its answer made no sense).
    #[error("API server: {action}: {message}")]
    Api {
        /// What the plugin was doing, e.g. "listing ResourceSlices".
        action: String,
        /// The HTTP status code, when the server answered.
        code: Option<u16>,
        /// The server's message or the transport error.
        message: String,
    },
    /// An NVML call failed.
    #[error("NVML {call}: {message}")]
    Nvml {
        /// The NVML call (or step) that failed.
        call: &'static str,
        /// What kind of failure it was.
        kind: NvmlErrorKind,
        /// NVML's message.
        message: String,
    },

    /// A mount namespace could not be set up (a step of `tessera-mps exec` or of the
    /// isolation probe's child failed).
    #[error("mount namespace: {0}")]
    Namespace(String),

    /// An MPS control daemon could not be started or stopped.
    #[error("MPS: {0}")]
    Mps(String),

    /// The process listening on an MPS control socket is not the daemon that was started
    /// there (`SO_PEERCRED` against the daemon's record): nothing is sent to it.
    #[error(
        "MPS control daemon {daemon}: {}: {mismatch}; nothing was sent to it",
        socket.display()
    )]
    MpsPeer {
        /// The daemon's id.
        daemon: String,
        /// Its control socket.
        socket: PathBuf,
        /// Why the listener is not the daemon.
        mismatch: tessera_driver::node::mps_peer::PeerMismatch,
    },

    /// The Unix user a share claim's containers run as cannot be told, so the node cannot pick
    /// its MPS daemon (one per GPU set and user).
    #[error("{0}")]
    MpsUser(tessera_driver::node::mps_user::UserRefusal),

    /// Encoding the metrics failed.
    #[error("metrics: {0}")]
    Metrics(String),
}

/// The kinds of NVML failure the plugin tells apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NvmlErrorKind {
    /// NVML cannot be used at all (no library, no driver, no permission).
    Unavailable,
    /// The GPU does not support the call.
    NotSupported,
    /// The thing asked for does not exist (an empty MIG slot, an NVLink past the last).
    NotFound,
    /// The GPU fell off the bus or does not answer.
    GpuLost,
    /// No event arrived in time.
    Timeout,
    /// Anything else.
    Other,
}

impl Error {
    /// Builds an [`Error::Io`].
    pub fn io(action: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            action,
            path: path.into(),
            source,
        }
    }

    /// Whether the same call could succeed later without other input: kubelet retries prepare
    /// and unprepare anyway, so this only steers logging and metrics.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Self::Io { .. }
                | Self::ClaimNotFound { .. }
                | Self::Transport(_)
                | Self::Task(_)
                | Self::Cancelled
                | Self::Shared(_)
                | Self::Api { .. }
                | Self::Mps(_)
                | Self::MpsUser(tessera_driver::node::mps_user::UserRefusal {
                    reason: tessera_driver::node::mps_user::UserReason::NoPod,
                    ..
                })
                | Self::Nvml { .. }
                | Self::Driver(tessera_driver::Error::DeviceHeld { .. })
        )
    }
}

/// The plugin's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

// The shared API client's errors keep their meaning here (a configuration error stays one, an
// API error keeps its action and status code), and
// `api`, `api_code`, `is_conflict`, `is_not_found` and `is_invalid` are the client's.
tessera_kubeapi::api_error_conversions!(Error);
