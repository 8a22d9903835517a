//! The `AdmissionReview` v1 wire format (`admission.k8s.io/v1`), as far as Tessera reads and
//! writes it. k8s-openapi has no types for it, so these are written from the API's field names;
//! kube-core's `admission` types are not used because they would change the answers' JSON
//! (docs/admission.md, "Answers").

use k8s_openapi::ByteString;
use serde::{Deserialize, Serialize};

/// The API version of the reviews Tessera answers.
pub const ADMISSION_API_VERSION: &str = "admission.k8s.io/v1";
/// The kind of a review.
pub const ADMISSION_KIND: &str = "AdmissionReview";

/// A review as the API server sends it.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AdmissionReview {
    /// Must be [`ADMISSION_API_VERSION`].
    #[serde(default)]
    pub api_version: String,
    /// Must be [`ADMISSION_KIND`].
    #[serde(default)]
    pub kind: String,
    /// The request under review.
    pub request: Option<AdmissionRequest>,
}

/// Group, version and kind of the reviewed object.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct GroupVersionKind {
    /// API group (`""` for core).
    #[serde(default)]
    pub group: String,
    /// Version.
    #[serde(default)]
    pub version: String,
    /// Kind.
    #[serde(default)]
    pub kind: String,
}

/// Group, version and plural resource of the reviewed object.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct GroupVersionResource {
    /// API group (`""` for core).
    #[serde(default)]
    pub group: String,
    /// Version.
    #[serde(default)]
    pub version: String,
    /// Plural resource, e.g. `pods`.
    #[serde(default)]
    pub resource: String,
}

/// The request part of a review.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AdmissionRequest {
    /// Echoed in the response.
    pub uid: String,
    /// The object's kind, in the version the webhook registered for.
    #[serde(default)]
    pub kind: GroupVersionKind,
    /// The resource.
    #[serde(default)]
    pub resource: GroupVersionResource,
    /// The subresource, if any (`status`).
    #[serde(default)]
    pub sub_resource: Option<String>,
    /// The namespace of the object.
    #[serde(default)]
    pub namespace: Option<String>,
    /// The object's name (absent at CREATE with `generateName`).
    #[serde(default)]
    pub name: Option<String>,
    /// `CREATE`, `UPDATE`, `DELETE` or `CONNECT`.
    #[serde(default)]
    pub operation: String,
    /// The object as it would be stored.
    #[serde(default)]
    pub object: Option<serde_json::Value>,
    /// The stored object, for UPDATE and DELETE.
    #[serde(default)]
    pub old_object: Option<serde_json::Value>,
    /// Whether nothing will be persisted.
    #[serde(default)]
    pub dry_run: Option<bool>,
}

/// The status of a denied request, shown to the user.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ResponseStatus {
    /// HTTP-like code, e.g. 422.
    pub code: u16,
    /// Machine-readable reason, e.g. `Invalid`.
    pub reason: &'static str,
    /// The message: names the object, the field and the rule.
    pub message: String,
}

/// The response part of a review.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AdmissionResponse {
    /// The request's uid.
    pub uid: String,
    /// Whether the request is admitted.
    pub allowed: bool,
    /// Why not, when denied.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<ResponseStatus>,
    /// A JSON patch (base64 on the wire).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub patch: Option<ByteString>,
    /// `JSONPatch` when there is a patch.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub patch_type: Option<&'static str>,
    /// Warnings for the client (kubectl prints them).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

impl AdmissionResponse {
    /// Admits the request unchanged.
    pub fn allow(uid: &str) -> Self {
        Self {
            uid: uid.to_owned(),
            allowed: true,
            status: None,
            patch: None,
            patch_type: None,
            warnings: Vec::new(),
        }
    }

    /// Denies the request with `code` and `message`.
    pub fn deny(uid: &str, code: u16, reason: &'static str, message: String) -> Self {
        Self {
            allowed: false,
            status: Some(ResponseStatus {
                code,
                reason,
                message,
            }),
            ..Self::allow(uid)
        }
    }

    /// Adds a JSON patch (nothing when `ops` is empty).
    #[must_use]
    pub fn with_patch(mut self, ops: &[tessera_driver::admission::PatchOp]) -> Self {
        if ops.is_empty() {
            return self;
        }
        // A list of plain structs always encodes; an empty patch would be the only fallback.
        if let Ok(bytes) = serde_json::to_vec(ops) {
            self.patch = Some(ByteString(bytes));
            self.patch_type = Some("JSONPatch");
        }
        self
    }

    /// Adds warnings.
    #[must_use]
    pub fn with_warnings(mut self, warnings: Vec<String>) -> Self {
        self.warnings.extend(warnings);
        self
    }
}

/// A review as the webhook answers it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AdmissionReviewResponse {
    /// [`ADMISSION_API_VERSION`].
    pub api_version: &'static str,
    /// [`ADMISSION_KIND`].
    pub kind: &'static str,
    /// The answer.
    pub response: AdmissionResponse,
}

impl AdmissionReviewResponse {
    /// Wraps a response.
    pub fn new(response: AdmissionResponse) -> Self {
        Self {
            api_version: ADMISSION_API_VERSION,
            kind: ADMISSION_KIND,
            response,
        }
    }
}
