//! The claims wing: a claim's life on the node, and the claim source its allocation comes from.
//!
//! * This module: where the plugin gets a claim's allocation, the `ClaimSource` seam.
//!   Kubelet only sends a claim's namespace, name and UID; the allocation lives in the
//!   ResourceClaim's status on the API server. The source fetches it and checks it is the claim
//!   kubelet means (same UID). `FakeClaimSource` serves a fixed set (`--fake-claims`, so the
//!   release binary keeps it); [`apiserver::ApiClaimSource`] fetches from the API server.
//! * [`preparer`]: `ClaimPreparer`, the seam kubelet's calls reach, and `CdiPreparer`, which
//!   prepares and unprepares claims under the crash-safe checkpoint (its rules live in
//!   `tessera_driver::node::checkpoint`).
//! * [`status`]: writing each prepared claim's `status.devices` entries (what it got, whether
//!   its processes stay within its booking) after kubelet's call, with retries.
//! * [`reaper`]: removing the directory trees a tenant could build; [`atomic_file`]: durable
//!   file replacement; [`input_file`]: bounded reads of the plugin's input files; [`cancel`]: a
//!   call's cancellation; [`crash`]: the crash points of the crash-safety tests.
//!
//! May import: `mps` (the daemons a prepared share claim needs) and `error`. Nothing here imports
//! `kubelet`, `gpus`, `ops`, `accounting`, `publisher` or `cli`.

pub mod apiserver;
pub mod atomic_file;
pub mod cancel;
pub mod crash;
pub mod input_file;
pub mod preparer;
pub mod reaper;
pub mod status;

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;

use crate::error::{Error, Result};

/// A claim as kubelet names it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ClaimRef {
    /// `metadata.namespace`.
    pub namespace: String,
    /// `metadata.name`.
    pub name: String,
    /// `metadata.uid`.
    pub uid: String,
}

impl ClaimRef {
    /// The span of one unit of `work` on this claim (`prepare`, `unprepare`), with its
    /// namespace, name and UID as fields: every line logged inside it names the claim, so one
    /// grep for the UID follows the claim through the log. (The plain log format escapes the
    /// fields, which come from kubelet.)
    pub fn span(&self, work: &'static str) -> tracing::Span {
        tracing::info_span!(
            "claim",
            work,
            namespace = %self.namespace,
            name = %self.name,
            uid = %self.uid
        )
    }

    /// A claim reference.
    pub fn new(
        namespace: impl Into<String>,
        name: impl Into<String>,
        uid: impl Into<String>,
    ) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
            uid: uid.into(),
        }
    }

    /// Refuses a reference with an empty field: kubelet always sends all three.
    pub fn validate(&self) -> Result<()> {
        for (field, value) in [
            ("namespace", &self.namespace),
            ("name", &self.name),
            ("uid", &self.uid),
        ] {
            if value.is_empty() {
                return Err(Error::BadRequest(format!("claim {field} is empty")));
            }
        }
        Ok(())
    }

    /// Refuses `found` when it has another UID than this reference: the claim was deleted and
    /// re-created under the same name.
    pub fn check_uid(&self, found: &ResourceClaim) -> Result<()> {
        let actual = found.metadata.uid.clone().unwrap_or_default();
        if actual != self.uid {
            return Err(Error::ClaimUidMismatch {
                namespace: self.namespace.clone(),
                name: self.name.clone(),
                expected: self.uid.clone(),
                actual,
            });
        }
        Ok(())
    }
}

impl std::fmt::Display for ClaimRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Escaped: kubelet's fields reach log lines and errors, and a newline must not forge
        // a line.
        write!(
            f,
            "{}/{} ({})",
            self.namespace.escape_debug(),
            self.name.escape_debug(),
            self.uid.escape_debug()
        )
    }
}

/// Fetches the ResourceClaim kubelet names, on the async runtime (the preparer then writes on
/// a blocking worker).
#[tonic::async_trait]
pub trait ClaimSource: Send + Sync {
    /// The claim with its allocation; an error when it does not exist or has another UID.
    async fn claim(&self, claim: &ClaimRef) -> Result<ResourceClaim>;
}

/// Fetches the pods a claim is reserved for, so that the node knows which Unix user their
/// containers run as (one MPS daemon per GPU set and user: `tessera_driver::node::mps_user`).
#[tonic::async_trait]
pub trait PodSource: Send + Sync {
    /// Pod `namespace/name`; `None` when it does not exist.
    async fn pod(&self, namespace: &str, name: &str) -> Result<Option<Pod>>;
}

/// A fixed set of claims (and pods), for tests and for running the plugin without an API
/// server.
#[derive(Debug, Clone, Default)]
pub struct FakeClaimSource {
    claims: BTreeMap<(String, String), ResourceClaim>,
    pods: BTreeMap<(String, String), Pod>,
}

impl FakeClaimSource {
    /// An empty source: every claim is "not found".
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds or replaces a claim, keyed by its namespace and name.
    pub fn insert(&mut self, claim: ResourceClaim) {
        let key = (
            claim.metadata.namespace.clone().unwrap_or_default(),
            claim.metadata.name.clone().unwrap_or_default(),
        );
        self.claims.insert(key, claim);
    }

    /// Adds or replaces a pod, keyed by its namespace and name.
    pub fn insert_pod(&mut self, pod: Pod) {
        let key = (
            pod.metadata.namespace.clone().unwrap_or_default(),
            pod.metadata.name.clone().unwrap_or_default(),
        );
        self.pods.insert(key, pod);
    }

    /// Reads every ResourceClaim (any served resource.k8s.io version) and Pod of a YAML
    /// stream; other objects are skipped.
    pub fn from_yaml(text: &str, context: &str) -> Result<Self> {
        use serde::Deserialize as _;
        let mut source = Self::new();
        for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
            let value = serde_json::Value::deserialize(doc).map_err(|e| {
                Error::Driver(tessera_driver::Error::Decode {
                    context: format!("{context} document {i}"),
                    message: e.to_string(),
                })
            })?;
            if value.is_null() {
                continue;
            }
            match tessera_driver::apiversion::decode_document(
                value,
                &format!("{context} document {i}"),
            )? {
                tessera_driver::apiversion::Object::ResourceClaim(claim) => source.insert(claim),
                tessera_driver::apiversion::Object::Pod(pod) => source.insert_pod(pod),
                _ => {}
            }
        }
        Ok(source)
    }
}

impl FakeClaimSource {
    /// The claim kubelet names, as [`ClaimSource::claim`] answers it.
    pub fn get(&self, claim: &ClaimRef) -> Result<ResourceClaim> {
        let found = self
            .claims
            .get(&(claim.namespace.clone(), claim.name.clone()))
            .ok_or_else(|| Error::ClaimNotFound {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
            })?;
        claim.check_uid(found)?;
        Ok(found.clone())
    }
}

#[tonic::async_trait]
impl ClaimSource for FakeClaimSource {
    async fn claim(&self, claim: &ClaimRef) -> Result<ResourceClaim> {
        self.get(claim)
    }
}

#[tonic::async_trait]
impl PodSource for FakeClaimSource {
    async fn pod(&self, namespace: &str, name: &str) -> Result<Option<Pod>> {
        Ok(self
            .pods
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned())
    }
}

#[cfg(test)]
mod tests {

    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;

    fn source() -> FakeClaimSource {
        let mut s = FakeClaimSource::new();
        s.insert(ResourceClaim {
            metadata: ObjectMeta {
                namespace: Some("ns".to_owned()),
                name: Some("c".to_owned()),
                uid: Some("u1".to_owned()),
                ..ObjectMeta::default()
            },
            ..ResourceClaim::default()
        });
        s
    }

    #[test]
    fn claim_with_matching_uid_is_found() {
        assert!(source().get(&ClaimRef::new("ns", "c", "u1")).is_ok());
    }

    #[test]
    fn claim_with_other_uid_is_refused() {
        let err = source().get(&ClaimRef::new("ns", "c", "u2")).unwrap_err();
        assert!(matches!(err, Error::ClaimUidMismatch { .. }), "{err}");
    }

    #[test]
    fn unknown_claim_is_not_found() {
        let err = source().get(&ClaimRef::new("ns", "d", "u1")).unwrap_err();
        assert!(matches!(err, Error::ClaimNotFound { .. }), "{err}");
    }

    #[test]
    fn empty_field_is_a_bad_request() {
        assert!(ClaimRef::new("ns", "", "u").validate().is_err());
    }
}
