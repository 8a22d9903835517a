//! The admission webhook's decisions, as pure functions of the objects under review.
//!
//! * [`gate`]: which pods get Tessera's scheduling gate at creation (the mutating hook).
//! * [`device_plugin_names`]: pods that ask with device-plugin resource names
//!   (`nvidia.com/gpu`, Baidu's and Aliyun's shares, HAMi's) rewritten into claims.
//! * [`device_plugin_templates`]: which claim templates those rewritten pods need made, and
//!   which of the ones made no pod uses any more (the controller makes the calls).
//! * [`claim`]: what a ResourceClaim or ResourceClaimTemplate must obey (the validating hook),
//!   and the JSON patch that rewrites its opaque parameters canonically (the mutating hook).
//! * [`claim_mark`]: the controller's finalizer and annotation, added to a claim made from a
//!   template for a gated pod as it is created (the mutating hook).
//!
//! The webhook in the controller fetches what these functions read and turns their answers into
//! `AdmissionReview` responses; nothing here knows about HTTP or the API server.

pub mod claim;
pub mod claim_mark;
pub mod device_plugin_names;
pub mod device_plugin_templates;
pub mod gate;

use serde::Serialize;

pub use claim::{canonical_parameters_patch, review_claim, review_claim_spec, v1beta1_field};
pub use claim_mark::claim_mark_patch;
pub use gate::{ClaimSource, GateDecision, PodClaim, class_is_gated, decide_gate, spec_classes};

/// One operation of an RFC 6902 JSON patch, as the API server applies it to a mutated object.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PatchOp {
    /// `add`, `replace` or `remove`.
    pub op: &'static str,
    /// The JSON pointer of the target, e.g. `/spec/schedulingGates/-`.
    pub path: String,
    /// The value to put there (none for `remove`).
    #[serde(skip_serializing_if = "serde_json::Value::is_null")]
    pub value: serde_json::Value,
}
