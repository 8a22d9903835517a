//! The kubeapi crate's one error type.

/// What can go wrong reaching the API server.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The client's configuration is unusable (kubeconfig, in-cluster environment).
    #[error("configuration: {0}")]
    Config(String),
    /// A call to the Kubernetes API server failed (or its answer made no sense).
    #[error("API server: {action}: {message}")]
    Api {
        /// What was being done, e.g. "discovering API groups".
        action: String,
        /// The HTTP status code, when the server answered.
        code: Option<u16>,
        /// The server's message or the transport error.
        message: String,
    },
}

impl Error {
    /// Builds an [`Error::Api`] from a kube client error.
    pub fn api(action: impl Into<String>, source: &kube::Error) -> Self {
        let (code, message) = match source {
            kube::Error::Api(status) => (Some(status.code), status.message.clone()),
            other => (None, other.to_string()),
        };
        Self::Api {
            action: action.into(),
            code,
            message,
        }
    }

    /// The HTTP status code of an [`Error::Api`] the server answered.
    pub fn api_code(&self) -> Option<u16> {
        match self {
            Self::Api { code, .. } => *code,
            Self::Config(_) => None,
        }
    }
}

/// The kubeapi crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
