//! The driver crate's one error type.
//!
//! Every variant names what failed precisely enough for a user to fix their input: the object,
//! the field, the value and the rule. "A claim does not fit" is not an error: the allocator
//! returns it as a normal result.

/// Everything that can go wrong in Tessera's pure core.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A field of an object breaks a rule.
    #[error("{object}: {field}: {message}")]
    Invalid {
        /// The object, e.g. `ResourceClaim default/train`.
        object: String,
        /// The field path, e.g. `spec.devices.requests[0].count`.
        field: String,
        /// What is wrong and which rule it breaks.
        message: String,
    },

    /// A Kubernetes quantity could not be parsed or is out of range.
    #[error("quantity {value:?}: {reason}")]
    Quantity {
        /// The text as given.
        value: String,
        /// Why it was rejected.
        reason: String,
    },

    /// A document could not be decoded (YAML or JSON).
    #[error("{context}: {message}")]
    Decode {
        /// What was being decoded, e.g. a file name or object.
        context: String,
        /// The decoder's message.
        message: String,
    },

    // --- inventory and ResourceSlices
    /// A fake-inventory file is malformed.
    #[error("inventory: {field}: {message}")]
    Inventory {
        /// The field path inside the inventory, e.g. `nodes[1].gpus[0].model`.
        field: String,
        /// What is wrong.
        message: String,
    },

    // --- shares and opaque configuration
    /// A share request breaks one of the share rules.
    #[error("{field}: {message}")]
    Share {
        /// The field, e.g. `memory` or `capacity.requests.compute`.
        field: String,
        /// The value and the rule it breaks.
        message: String,
    },

    // --- CEL
    /// A CEL expression does not compile, is too large or too expensive.
    #[error("CEL expression {expression:?}: {message}")]
    CelCompile {
        /// The expression (truncated for very long ones).
        expression: String,
        /// Why it was rejected.
        message: String,
    },

    /// A CEL expression failed while evaluating against a device.
    #[error("CEL expression {expression:?} on device {device}: {message}")]
    CelRuntime {
        /// The expression (truncated for very long ones).
        expression: String,
        /// The device it was evaluated against.
        device: String,
        /// The runtime error, e.g. "no such key: model".
        message: String,
    },

    // --- allocator
    /// The allocator was handed an inconsistent snapshot (e.g. two slices claiming one device).
    #[error("snapshot: {0}")]
    Snapshot(String),

    // --- prepare
    /// The node refuses to prepare a claim: its allocation does not say what the node must
    /// enforce, or says something only a user could have written.
    #[error("claim {claim} cannot be prepared: {message}")]
    Prepare {
        /// The claim's namespace/name.
        claim: String,
        /// What is wrong and what to do about it.
        message: String,
    },

    // --- CDI
    /// A CDI spec could not be built from a prepared claim.
    #[error("CDI spec for claim {claim}: {message}")]
    Cdi {
        /// The claim's namespace/name or UID.
        claim: String,
        /// What is wrong.
        message: String,
    },

    // --- node checkpoint
    /// A claim cannot be prepared: another prepared claim holds one of its devices in a way
    /// that excludes sharing it.
    #[error("claim {claim}: device {device} is held by claim {holder}")]
    DeviceHeld {
        /// The claim being prepared, by UID.
        claim: String,
        /// The device, as `pool/device`.
        device: String,
        /// The claim that holds it, by UID.
        holder: String,
    },
}

impl Error {
    /// Whether retrying the same call could succeed. The core is pure, so none of its errors
    /// heal by themselves: a retry needs different input.
    pub fn is_retryable(&self) -> bool {
        false
    }

    /// Shorthand for [`Error::Invalid`].
    pub fn invalid(
        object: impl Into<String>,
        field: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Self::Invalid {
            object: object.into(),
            field: field.into(),
            message: message.into(),
        }
    }
}

/// The driver crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
