//! The controller crate's one error type.

use std::path::PathBuf;

/// What can go wrong in the controller and the `tessera` CLI.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An input file could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// An input document is malformed: the message names the file, the object and the field.
    #[error("{0}")]
    Malformed(String),
    /// The input is well-formed but breaks a rule (e.g. `tessera validate` found problems).
    #[error("{count} problem(s) found")]
    Findings {
        /// How many problems were reported.
        count: usize,
    },
    /// An error from Tessera's core.
    #[error(transparent)]
    Driver(#[from] tessera_driver::Error),
    /// Output could not be written or encoded.
    #[error("writing output: {0}")]
    Output(String),
    /// The controller's configuration is unusable (kubeconfig, flags, certificates).
    #[error("configuration: {0}")]
    Config(String),
    /// A call to the Kubernetes API server failed.
    #[error("API server: {action}: {message}")]
    Api {
        /// What the controller was doing, e.g. "listing ResourceSlices".
        action: String,
        /// The HTTP status code, when the server answered.
        code: Option<u16>,
        /// The server's message or the transport error.
        message: String,
    },
}

impl Error {
    /// The process exit code for this error: 2 for malformed input, 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Read { .. } | Self::Malformed(_) => 2,
            Self::Findings { .. }
            | Self::Driver(_)
            | Self::Output(_)
            | Self::Config(_)
            | Self::Api { .. } => 1,
        }
    }

    /// Whether retrying could succeed without changing the input.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Read { .. } | Self::Output(_) | Self::Api { .. })
    }
}

// The shared API client's errors keep their meaning here (a configuration error stays one, an
// API error keeps its action and status code), and
// `api`, `api_code`, `is_conflict`, `is_not_found` and `is_invalid` are the client's.
tessera_kubeapi::api_error_conversions!(Error);

/// The controller crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
