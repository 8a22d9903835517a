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

    /// What a binary's own error type keeps of this error: `Ok((action, code, message))` of
    /// a failed call, or `Err(message)` of a configuration error.
    pub fn into_parts(self) -> std::result::Result<(String, Option<u16>, String), String> {
        match self {
            Self::Api {
                action,
                code,
                message,
            } => Ok((action, code, message)),
            Self::Config(message) => Err(message),
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

/// Gives a binary's error type, which has the variants `Config(String)` and
/// `Api { action, code, message }` of its own, the API client's conversions and status checks:
/// `From<tessera_kubeapi::Error>` (see [`Error::into_parts`]), `api` (from a kube client error),
/// `api_code`, `is_conflict`, `is_not_found` and `is_invalid`. One definition for the
/// controller and the kubelet plugin.
#[macro_export]
macro_rules! api_error_conversions {
    ($error:ty) => {
        impl From<$crate::Error> for $error {
            fn from(error: $crate::Error) -> Self {
                match error.into_parts() {
                    Ok((action, code, message)) => Self::Api {
                        action,
                        code,
                        message,
                    },
                    Err(message) => Self::Config(message),
                }
            }
        }

        impl $error {
            /// Builds an `Api` error from a kube client error.
            pub fn api(action: impl Into<String>, source: &::kube::Error) -> Self {
                $crate::Error::api(action, source).into()
            }

            /// The HTTP status code of an `Api` error the server answered.
            pub fn api_code(&self) -> Option<u16> {
                match self {
                    Self::Api { code, .. } => *code,
                    _ => None,
                }
            }

            /// Whether the server answered 409 Conflict (a stale `resourceVersion`, or the
            /// object exists).
            pub fn is_conflict(&self) -> bool {
                self.api_code() == Some(409)
            }

            /// Whether the server answered 404 Not Found.
            pub fn is_not_found(&self) -> bool {
                self.api_code() == Some(404)
            }

            /// Whether the server refused the write as invalid (422): retrying the same write
            /// cannot help.
            pub fn is_invalid(&self) -> bool {
                self.api_code() == Some(422)
            }
        }
    };
}
