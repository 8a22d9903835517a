//! The three admission hooks: from an `AdmissionReview` to its answer.
//!
//! * `/mutate-pods` rewrites pods that ask with device-plugin resource names into claims
//!   (`tessera_driver::admission::device_plugin_names`; a bad ask is denied with the container,
//!   resource and rule), and adds the scheduling gate to pods whose claims use classes marked
//!   for Tessera allocation. The gate itself is never a denial: anything it cannot decide is
//!   "no gate" plus a warning.
//! * `/mutate-claims` rewrites the opaque parameters of ResourceClaims and
//!   ResourceClaimTemplates canonically, and marks a claim made from a template for a gated
//!   pod with the controller's finalizer and annotation
//!   (`tessera_driver::admission::claim_mark`), so the controller need not write them.
//! * `/validate-claims` checks every Tessera opaque config and share rule of ResourceClaims and
//!   ResourceClaimTemplates and denies with a message naming the field and the rule.
//! * `/validate-schedules` checks `GpuProfileSchedules`
//!   (`tessera_driver::node::schedule::parse`: selector, time zone, profiles, cron windows,
//!   drain deadlines) and denies with a message naming the object, the field and the rule.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::resource::v1 as res;
use tessera_driver::admission::device_plugin_names::{self, PodRewrite};
use tessera_driver::admission::{self, ClaimSource, PodClaim};
use tessera_driver::apiversion::{self, Object};
use tessera_driver::names;
use tessera_driver::placement::gate;
use tessera_driver::rules::cel::CelCache;
use tracing::Instrument as _;

use super::lookup::AdmissionLookup;
use super::review::{
    AdmissionRequest, AdmissionResponse, AdmissionReview, AdmissionReviewResponse,
};
use crate::error::Result;

/// One of the webhook's hooks, by URL path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    /// Adds the scheduling gate to pods (mutating, fail-open).
    MutatePods,
    /// Rewrites opaque parameters of claims and templates canonically (mutating, fail-open).
    MutateClaims,
    /// Checks claims and templates (validating, fail-closed).
    ValidateClaims,
    /// Checks GPU profile schedules (validating, fail-closed).
    ValidateSchedules,
}

impl Hook {
    /// Every hook.
    pub const ALL: [Self; 4] = [
        Self::MutatePods,
        Self::MutateClaims,
        Self::ValidateClaims,
        Self::ValidateSchedules,
    ];

    /// The URL path the hook is served at.
    pub const fn path(self) -> &'static str {
        match self {
            Self::MutatePods => "/mutate-pods",
            Self::MutateClaims => "/mutate-claims",
            Self::ValidateClaims => "/validate-claims",
            Self::ValidateSchedules => "/validate-schedules",
        }
    }

    /// The hook served at `path`.
    pub fn from_path(path: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|h| h.path() == path)
    }
}

/// What the hooks share: the cluster lookup and the settings.
pub struct Admission {
    lookup: Arc<dyn AdmissionLookup>,
    driver: String,
    lookup_timeout: Duration,
    cel: Arc<CelCache>,
    device_plugin: device_plugin_names::Options,
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission")
            .field("driver", &self.driver)
            .field("lookup_timeout", &self.lookup_timeout)
            .finish_non_exhaustive()
    }
}

/// The kinds the claim hooks review.
#[allow(
    clippy::large_enum_variant,
    reason = "one per review, matched at once; boxing buys nothing"
)]
enum ClaimObject {
    Claim(res::ResourceClaim),
    Template(res::ResourceClaimTemplate),
}

impl ClaimObject {
    fn spec(&self) -> &res::ResourceClaimSpec {
        match self {
            Self::Claim(c) => &c.spec,
            Self::Template(t) => &t.spec.spec,
        }
    }
}

impl Admission {
    /// Hooks reading the cluster through `lookup`, for Tessera's `driver`; every lookup of one
    /// review together may take `lookup_timeout`.
    pub fn new(lookup: Arc<dyn AdmissionLookup>, driver: &str, lookup_timeout: Duration) -> Self {
        Self {
            lookup,
            driver: driver.to_owned(),
            lookup_timeout,
            cel: Arc::new(CelCache::new()),
            device_plugin: device_plugin_names::Options {
                driver: driver.to_owned(),
                ..device_plugin_names::Options::default()
            },
        }
    }

    /// Sets how many time-sliced replicas one GPU stands for (`nvidia.com/gpu.shared`).
    #[must_use]
    pub fn with_shared_replicas(mut self, replicas: u32) -> Self {
        self.device_plugin.shared_replicas = replicas;
        self
    }

    /// Answers one `AdmissionReview` body; `Err` is a body that is not a review (HTTP 400).
    pub async fn review(
        &self,
        hook: Hook,
        body: &[u8],
    ) -> std::result::Result<AdmissionReviewResponse, String> {
        let review: AdmissionReview = serde_json::from_slice(body)
            .map_err(|e| format!("the body is not an AdmissionReview: {e}"))?;
        if review.api_version != super::review::ADMISSION_API_VERSION
            || review.kind != super::review::ADMISSION_KIND
        {
            return Err(format!(
                "expected apiVersion {} kind {}, got apiVersion {:?} kind {:?}",
                super::review::ADMISSION_API_VERSION,
                super::review::ADMISSION_KIND,
                review.api_version,
                review.kind
            ));
        }
        let request = review
            .request
            .ok_or_else(|| "the AdmissionReview has no request".to_owned())?;
        // The review's span: the object's name (or, at CREATE with `generateName`, the
        // prefix it will get a name from), so one grep follows an object through admission.
        let span = tracing::info_span!(
            "review",
            hook = hook.path(),
            uid = %request.uid,
            operation = %request.operation,
            resource = %request.resource.resource,
            namespace = request.namespace.as_deref().unwrap_or_default(),
            name = request.name.as_deref().unwrap_or_default(),
            generate_name = tracing::field::Empty,
        );
        if request.name.as_deref().unwrap_or_default().is_empty()
            && let Some(prefix) = request
                .object
                .as_ref()
                .and_then(|o| o.pointer("/metadata/generateName"))
                .and_then(serde_json::Value::as_str)
        {
            span.record("generate_name", prefix);
        }
        let response = async {
            match hook {
                Hook::MutatePods => self.mutate_pod(&request).await,
                Hook::MutateClaims => self.mutate_claim(&request).await,
                Hook::ValidateClaims => self.validate_claim(&request).await,
                Hook::ValidateSchedules => validate_schedule(&request),
            }
        }
        .instrument(span.clone())
        .await;
        span.in_scope(|| {
            tracing::debug!(
                hook = hook.path(),
                uid = %request.uid,
                operation = %request.operation,
                resource = %request.resource.resource,
                namespace = request.namespace.as_deref().unwrap_or_default(),
                name = request.name.as_deref().unwrap_or_default(),
                allowed = response.allowed,
                patched = response.patch.is_some(),
                "reviewed"
            );
        });
        Ok(AdmissionReviewResponse::new(response))
    }

    async fn mutate_pod(&self, request: &AdmissionRequest) -> AdmissionResponse {
        let allow = AdmissionResponse::allow(&request.uid);
        if request.resource.resource != names::POD.plural
            || request.operation != "CREATE"
            || request.sub_resource.is_some()
        {
            return allow;
        }
        let pod: core::Pod = match request
            .object
            .clone()
            .map(serde_json::from_value)
            .transpose()
        {
            Ok(Some(pod)) => pod,
            Ok(None) => return allow,
            Err(e) => {
                return allow.with_warnings(vec![format!(
                    "Tessera could not read the pod ({e}); kube-scheduler will allocate its claims"
                )]);
            }
        };
        let namespace = request
            .namespace
            .clone()
            .or_else(|| pod.metadata.namespace.clone())
            .unwrap_or_else(|| "default".to_owned());
        if let Some(response) = self.rewrite_device_plugin_names(request, &pod, &namespace) {
            return response;
        }
        if pod
            .spec
            .as_ref()
            .is_none_or(|s| s.resource_claims.as_ref().is_none_or(Vec::is_empty))
        {
            return allow;
        }
        let Ok(decision) =
            tokio::time::timeout(self.lookup_timeout, self.decide_gate(&pod, &namespace)).await
        else {
            tracing::warn!(
                namespace,
                pod = pod_name(&pod),
                "the claims' lookups timed out; the pod is admitted without the gate"
            );
            return allow.with_warnings(vec![format!(
                "Tessera could not read the pod's claims within {:?}; kube-scheduler will allocate them",
                self.lookup_timeout
            )]);
        };
        if decision.gated {
            tracing::info!(
                namespace,
                pod = pod_name(&pod),
                reasons = decision.reasons.join("; "),
                added = !decision.patch.is_empty(),
                "scheduling gate"
            );
        }
        for warning in &decision.warnings {
            tracing::warn!(
                namespace,
                pod = pod_name(&pod),
                warning,
                "admission warning"
            );
        }
        allow
            .with_patch(&decision.patch)
            .with_warnings(decision.warnings)
    }

    /// The rewrite of a pod that asks with device-plugin names (design §7): the answer (the
    /// patch, the pod left alone with a warning, or the refusal naming the container, resource
    /// and rule), or `None` for a pod without such names. Pure: nothing is
    /// created here (the controller makes the templates the patch refers to), so dry-run
    /// requests get the same answer with no side effect.
    fn rewrite_device_plugin_names(
        &self,
        request: &AdmissionRequest,
        pod: &core::Pod,
        namespace: &str,
    ) -> Option<AdmissionResponse> {
        let object = format!("Pod {namespace}/{}", pod_name(pod));
        let allow = AdmissionResponse::allow(&request.uid);
        match device_plugin_names::rewrite_pod(pod, &self.device_plugin, &object) {
            Ok(PodRewrite::Untouched) => None,
            Ok(PodRewrite::Skipped(warning)) => {
                tracing::warn!(
                    namespace,
                    pod = pod_name(pod),
                    warning,
                    "device-plugin names left alone"
                );
                Some(allow.with_warnings(vec![warning]))
            }
            Ok(PodRewrite::Rewritten { mapping, patch, .. }) => {
                tracing::info!(
                    namespace,
                    pod = pod_name(pod),
                    claims = mapping.claims.len(),
                    templates = mapping
                        .claims
                        .iter()
                        .map(|c| c.template.as_str())
                        .collect::<Vec<_>>()
                        .join(","),
                    dry_run = request.dry_run.unwrap_or(false),
                    "device-plugin names rewritten into claims"
                );
                Some(allow.with_patch(&patch).with_warnings(mapping.warnings))
            }
            Err(e) => {
                let message = e.to_string();
                tracing::info!(object, message, "denied");
                Some(AdmissionResponse::deny(
                    &request.uid,
                    422,
                    "Invalid",
                    message,
                ))
            }
        }
    }

    async fn decide_gate(&self, pod: &core::Pod, namespace: &str) -> admission::GateDecision {
        // Look everything up first: the decision itself is pure and synchronous.
        let mut sources = Vec::new();
        let refs = PodClaim::resolve_all(pod, |claim, template| {
            sources.push((claim.map(str::to_owned), template.map(str::to_owned)));
            ClaimSource::Empty
        });
        let mut claims = Vec::with_capacity(refs.len());
        for (mut entry, (claim, template)) in refs.into_iter().zip(sources) {
            entry.source = match (claim, template) {
                (Some(name), _) => match self.lookup.resource_claim(namespace, &name).await {
                    Ok(Some(c)) => ClaimSource::Claim(c.spec),
                    Ok(None) => ClaimSource::Missing,
                    Err(e) => ClaimSource::Failed(e.to_string()),
                },
                (None, Some(name)) => {
                    match self.lookup.resource_claim_template(namespace, &name).await {
                        Ok(Some(t)) => ClaimSource::Template(t.spec.spec),
                        Ok(None) => ClaimSource::Missing,
                        Err(e) => ClaimSource::Failed(e.to_string()),
                    }
                }
                (None, None) => ClaimSource::Empty,
            };
            claims.push(entry);
        }
        let mut classes = std::collections::BTreeMap::new();
        for entry in &claims {
            if let ClaimSource::Claim(spec) | ClaimSource::Template(spec) = &entry.source {
                for name in admission::spec_classes(spec) {
                    if let std::collections::btree_map::Entry::Vacant(slot) = classes.entry(name) {
                        let found = self
                            .lookup
                            .device_class(slot.key())
                            .await
                            .map_err(|e| e.to_string());
                        slot.insert(found);
                    }
                }
            }
        }
        admission::decide_gate(pod, &claims, &mut |name| {
            classes.get(name).cloned().unwrap_or(Ok(None))
        })
    }

    async fn validate_claim(&self, request: &AdmissionRequest) -> AdmissionResponse {
        let allow = AdmissionResponse::allow(&request.uid);
        if !matches!(request.operation.as_str(), "CREATE" | "UPDATE")
            || request.sub_resource.is_some()
        {
            return allow;
        }
        let object = match decode_claim_object(request, request.object.as_ref()) {
            Ok(Some(o)) => o,
            Ok(None) => return allow,
            Err(message) => {
                return AdmissionResponse::deny(&request.uid, 400, "BadRequest", message);
            }
        };
        if request.operation == "UPDATE"
            && let Ok(Some(old)) = decode_claim_object(request, request.old_object.as_ref())
            && old.spec() == object.spec()
        {
            // Metadata-only updates (finalizers, labels) of objects admitted before must never
            // be blocked, whatever rules they break.
            return allow;
        }
        let described = describe(request, &object);
        let classes = match tokio::time::timeout(
            self.lookup_timeout,
            self.classes_of(object.spec()),
        )
        .await
        {
            Ok(Ok(classes)) => classes,
            Ok(Err(e)) => {
                return AdmissionResponse::deny(
                    &request.uid,
                    503,
                    "ServiceUnavailable",
                    format!("{described}: cannot be checked now, retry: {e}"),
                );
            }
            Err(_) => {
                return AdmissionResponse::deny(
                    &request.uid,
                    503,
                    "ServiceUnavailable",
                    format!(
                        "{described}: cannot be checked now (DeviceClass lookups took over {:?}), retry",
                        self.lookup_timeout
                    ),
                );
            }
        };
        let prefix = match &object {
            ClaimObject::Claim(_) => "",
            ClaimObject::Template(_) => "spec.",
        };
        let spec = object.spec().clone();
        let (driver, cel) = (self.driver.clone(), Arc::clone(&self.cel));
        let checked = described.clone();
        let v1beta1 = request.kind.version == "v1beta1";
        // CEL compilation is CPU work on user input: keep it off the async workers.
        let reviewed = tokio::task::spawn_blocking(move || {
            admission::review_claim(&checked, &spec, prefix, v1beta1, &driver, &classes, &cel)
        })
        .await;
        match reviewed {
            Ok((errors, warnings)) if errors.is_empty() => allow.with_warnings(warnings),
            Ok((errors, _)) => {
                let message = errors
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; ");
                tracing::info!(object = described, message, "denied");
                AdmissionResponse::deny(&request.uid, 422, "Invalid", message)
            }
            Err(e) => AdmissionResponse::deny(
                &request.uid,
                500,
                "InternalError",
                format!("{described}: the check failed: {e}"),
            ),
        }
    }

    async fn classes_of(&self, spec: &res::ResourceClaimSpec) -> Result<Vec<res::DeviceClass>> {
        let mut found = Vec::new();
        for name in admission::spec_classes(spec) {
            if let Some(class) = self.lookup.device_class(&name).await? {
                found.push(class);
            }
        }
        Ok(found)
    }
}

impl Admission {
    async fn mutate_claim(&self, request: &AdmissionRequest) -> AdmissionResponse {
        let allow = AdmissionResponse::allow(&request.uid);
        if request.operation != "CREATE" || request.sub_resource.is_some() {
            return allow;
        }
        // A claim that cannot be decoded is the validating hook's to deny; here it stays as sent.
        match decode_claim_object(request, request.object.as_ref()) {
            Ok(Some(ClaimObject::Claim(c))) => {
                let mut ops = admission::canonical_parameters_patch(&c.spec, "/spec");
                ops.extend(self.mark(request, &c).await);
                allow.with_patch(&ops)
            }
            Ok(Some(ClaimObject::Template(t))) => allow.with_patch(
                &admission::canonical_parameters_patch(&t.spec.spec, "/spec/spec"),
            ),
            Ok(None) | Err(_) => allow,
        }
    }

    /// The controller's mark for a claim made from a template for a gated pod (nothing when
    /// the pod cannot be read in time: the controller then writes the mark itself).
    async fn mark(
        &self,
        request: &AdmissionRequest,
        claim: &res::ResourceClaim,
    ) -> Vec<admission::PatchOp> {
        let Some((pod, _)) = gate::owning_pod(claim) else {
            return Vec::new();
        };
        let namespace = request
            .namespace
            .as_deref()
            .or(claim.metadata.namespace.as_deref())
            .unwrap_or("default");
        match tokio::time::timeout(self.lookup_timeout, self.lookup.pod(namespace, pod)).await {
            Ok(Ok(Some(owner))) => admission::claim_mark_patch(claim, &owner),
            Ok(Ok(None)) => Vec::new(),
            Ok(Err(e)) => {
                tracing::debug!(namespace, pod, error = %e, "the claim's pod could not be read; the controller marks the claim");
                Vec::new()
            }
            Err(_) => {
                tracing::debug!(
                    namespace,
                    pod,
                    "the claim's pod lookup timed out; the controller marks the claim"
                );
                Vec::new()
            }
        }
    }
}

/// Decodes a reviewed claim or template in any served version; `Ok(None)` for other kinds.
/// The `/validate-schedules` hook: a `GpuProfileSchedule` created or updated must read as one
/// (every rule of `tessera_driver::node::schedule::parse`). Other resources, deletes and the
/// status subresource are allowed.
fn validate_schedule(request: &AdmissionRequest) -> AdmissionResponse {
    let allow = AdmissionResponse::allow(&request.uid);
    if !matches!(request.operation.as_str(), "CREATE" | "UPDATE")
        || request.sub_resource.is_some()
        || request.resource.resource != names::GPU_PROFILE_SCHEDULE.plural
    {
        return allow;
    }
    let Some(object) = request.object.as_ref() else {
        return AdmissionResponse::deny(
            &request.uid,
            400,
            "BadRequest",
            format!(
                "the {} review has no object",
                names::GPU_PROFILE_SCHEDULE.kind
            ),
        );
    };
    match tessera_driver::node::schedule::parse(object) {
        Ok(_) => allow,
        Err(e) => {
            tracing::info!(message = %e, "denied");
            AdmissionResponse::deny(&request.uid, 422, "Invalid", e.to_string())
        }
    }
}

fn decode_claim_object(
    request: &AdmissionRequest,
    object: Option<&serde_json::Value>,
) -> std::result::Result<Option<ClaimObject>, String> {
    let Some(value) = object else {
        return Ok(None);
    };
    let resource = request.resource.resource.as_str();
    if resource != names::RESOURCE_CLAIM.plural && resource != names::RESOURCE_CLAIM_TEMPLATE.plural
    {
        return Ok(None);
    }
    let mut value = value.clone();
    if let Some(map) = value.as_object_mut() {
        // The review's kind names the object where the object itself may not.
        if !request.kind.group.is_empty() {
            map.entry("apiVersion").or_insert_with(|| {
                format!("{}/{}", request.kind.group, request.kind.version).into()
            });
        }
        map.entry("kind")
            .or_insert_with(|| request.kind.kind.clone().into());
    }
    let context = format!(
        "{} {}/{}",
        request.kind.kind,
        request.namespace.as_deref().unwrap_or_default(),
        request.name.as_deref().unwrap_or_default()
    );
    match apiversion::decode_document(value, &context) {
        Ok(Object::ResourceClaim(c)) => Ok(Some(ClaimObject::Claim(c))),
        Ok(Object::ResourceClaimTemplate(t)) => Ok(Some(ClaimObject::Template(t))),
        Ok(_) => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

fn describe(request: &AdmissionRequest, object: &ClaimObject) -> String {
    let (kind, meta) = match object {
        ClaimObject::Claim(c) => (names::RESOURCE_CLAIM.kind, &c.metadata),
        ClaimObject::Template(t) => (names::RESOURCE_CLAIM_TEMPLATE.kind, &t.metadata),
    };
    let namespace = request
        .namespace
        .as_deref()
        .or(meta.namespace.as_deref())
        .unwrap_or("default");
    let name = meta
        .name
        .as_deref()
        .or(request.name.as_deref())
        .or(meta.generate_name.as_deref())
        .unwrap_or("<unnamed>");
    format!("{kind} {namespace}/{name}")
}

fn pod_name(pod: &core::Pod) -> &str {
    pod.metadata
        .name
        .as_deref()
        .or(pod.metadata.generate_name.as_deref())
        .unwrap_or("<unnamed>")
}
