//! Which pods Tessera's controller allocates: the scheduling gate, decided at pod creation.
//!
//! A pod gets the gate `gpu.tessera.dev/allocation` when one of its claims (named directly or
//! through a claim template) has a request, or a `firstAvailable` subrequest, whose DeviceClass
//! is marked for Tessera allocation: by default the shared and MIG classes, plus any class
//! annotated `gpu.tessera.dev/allocate: "true"`; `"false"` opts a class out. Gates can only be
//! set at creation, so this is the one chance to decide.
//!
//! The mutating hook never rejects a pod. Whatever it cannot decide (a claim that does not
//! exist yet, an API error) means "no gate" and a warning: kube-scheduler then allocates the
//! claims first-fit, which is how the pod would run without Tessera's controller at all.

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::resource::v1 as res;
use serde_json::json;

use super::PatchOp;
use crate::names;

/// Whether pods using `class_name` are allocated by Tessera's controller.
///
/// `class` is the DeviceClass when known; without it only the default rule applies.
pub fn class_is_gated(class_name: &str, class: Option<&res::DeviceClass>) -> bool {
    let annotation = class
        .and_then(|c| c.metadata.annotations.as_ref())
        .and_then(|a| a.get(names::ANNOTATION_ALLOCATE))
        .map(|v| v.trim().to_ascii_lowercase());
    match annotation.as_deref() {
        Some("true") => true,
        Some("false") => false,
        _ => class_name == names::CLASS_SHARED_GPU || class_name == names::CLASS_MIG_GPU,
    }
}

/// The DeviceClass names a claim spec uses, in `exactly` requests and `firstAvailable`
/// subrequests.
pub fn spec_classes(spec: &res::ResourceClaimSpec) -> BTreeSet<String> {
    let mut classes = BTreeSet::new();
    for request in spec
        .devices
        .iter()
        .flat_map(|d| d.requests.iter().flatten())
    {
        if let Some(exactly) = &request.exactly {
            classes.insert(exactly.device_class_name.clone());
        }
        for sub in request.first_available.iter().flatten() {
            classes.insert(sub.device_class_name.clone());
        }
    }
    classes
}

/// What one entry of a pod's `spec.resourceClaims` resolved to.
#[derive(Debug, Clone, PartialEq)]
pub enum ClaimSource {
    /// The named ResourceClaim exists; its spec.
    Claim(res::ResourceClaimSpec),
    /// The named ResourceClaimTemplate exists; the spec of the claims it makes.
    Template(res::ResourceClaimSpec),
    /// The named object does not exist (yet).
    Missing,
    /// The lookup failed; the message says why.
    Failed(String),
    /// The entry names neither a claim nor a template.
    Empty,
}

/// One entry of a pod's `spec.resourceClaims`, resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct PodClaim {
    /// The entry's name in the pod.
    pub name: String,
    /// What it names, for messages: `ResourceClaim x` or `ResourceClaimTemplate y`.
    pub reference: String,
    /// What the lookup found.
    pub source: ClaimSource,
}

impl PodClaim {
    /// The entries of `pod`'s `spec.resourceClaims`, with `resolve(claim_name, template_name)`
    /// looking each up (in the pod's namespace).
    pub fn resolve_all(
        pod: &core::Pod,
        mut resolve: impl FnMut(Option<&str>, Option<&str>) -> ClaimSource,
    ) -> Vec<Self> {
        pod.spec
            .iter()
            .flat_map(|s| s.resource_claims.iter().flatten())
            .map(|rc| {
                let claim = rc.resource_claim_name.as_deref();
                let template = rc.resource_claim_template_name.as_deref();
                let reference = match (claim, template) {
                    (Some(c), _) => format!("ResourceClaim {c}"),
                    (None, Some(t)) => format!("ResourceClaimTemplate {t}"),
                    (None, None) => format!("pod claim {}", rc.name),
                };
                Self {
                    name: rc.name.clone(),
                    reference,
                    source: resolve(claim, template),
                }
            })
            .collect()
    }
}

/// What the mutating hook does with a pod.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GateDecision {
    /// Whether the pod is (or will be) gated for Tessera's controller.
    pub gated: bool,
    /// The JSON patch adding the gate; empty when nothing changes.
    pub patch: Vec<PatchOp>,
    /// Why it is gated, e.g. `ResourceClaim train uses class shared.gpu.tessera.dev`.
    pub reasons: Vec<String>,
    /// What the user should know: claims that could not be checked, a gate that cannot be set.
    pub warnings: Vec<String>,
}

/// Decides whether `pod` gets the scheduling gate.
///
/// `claims` are the pod's resolved claim entries ([`PodClaim::resolve_all`]); `class` looks up
/// a DeviceClass by name: `Ok(None)` when it does not exist, `Err` when the lookup failed (the
/// default rule then applies, with a warning).
pub fn decide_gate(
    pod: &core::Pod,
    claims: &[PodClaim],
    class: &mut dyn FnMut(&str) -> Result<Option<res::DeviceClass>, String>,
) -> GateDecision {
    let mut decision = GateDecision::default();
    let mut gated_entries: BTreeSet<&str> = BTreeSet::new();
    let gates = pod.spec.as_ref().and_then(|s| s.scheduling_gates.as_ref());
    let already = gates
        .into_iter()
        .flatten()
        .any(|g| g.name == names::SCHEDULING_GATE);
    for entry in claims {
        let spec = match &entry.source {
            ClaimSource::Claim(spec) | ClaimSource::Template(spec) => spec,
            ClaimSource::Missing => {
                decision.warnings.push(format!(
                    "{} (pod claim {}) does not exist yet, so Tessera cannot tell whether to allocate it: \
                     kube-scheduler will; create claims before their pods",
                    entry.reference, entry.name
                ));
                continue;
            }
            ClaimSource::Failed(message) => {
                decision.warnings.push(format!(
                    "{} (pod claim {}) could not be read ({message}): kube-scheduler will allocate it",
                    entry.reference, entry.name
                ));
                continue;
            }
            ClaimSource::Empty => continue,
        };
        for class_name in spec_classes(spec) {
            let found = match class(&class_name) {
                Ok(found) => found,
                Err(message) => {
                    decision.warnings.push(format!(
                        "DeviceClass {class_name} could not be read ({message}); its default applies"
                    ));
                    None
                }
            };
            if class_is_gated(&class_name, found.as_ref()) {
                decision
                    .reasons
                    .push(format!("{} uses class {class_name}", entry.reference));
                gated_entries.insert(entry.name.as_str());
            }
        }
    }
    decision
        .warnings
        .extend(mps_user_warnings(pod, claims, &gated_entries));
    if decision.reasons.is_empty() {
        return decision;
    }
    if already {
        decision.gated = true;
        return decision;
    }
    if pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.as_ref())
        .is_some_and(|n| !n.is_empty())
    {
        decision.warnings.push(format!(
            "spec.nodeName is set, so the pod bypasses scheduling and cannot carry the gate {}: \
             its claims ({}) must already be allocated",
            names::SCHEDULING_GATE,
            decision.reasons.join("; ")
        ));
        return decision;
    }
    let gate = json!({ "name": names::SCHEDULING_GATE });
    decision.gated = true;
    decision.patch.push(match gates {
        Some(_) => PatchOp {
            op: "add",
            path: "/spec/schedulingGates/-".to_owned(),
            value: gate,
        },
        None => PatchOp {
            op: "add",
            path: "/spec/schedulingGates".to_owned(),
            value: json!([gate]),
        },
    });
    decision
}

/// What a node that enforces shares with MPS will refuse about `pod`'s user, said at creation
/// (`crate::node::mps_user`): a container that uses one of the Tessera claims in `gated` with no
/// `runAsUser` at container or pod level, or a pod in a user namespace. An MPS daemon serves one
/// Unix user, so such a node runs one per GPU set and user and must know the user at prepare.
fn mps_user_warnings(pod: &core::Pod, claims: &[PodClaim], gated: &BTreeSet<&str>) -> Vec<String> {
    let Some(spec) = &pod.spec else {
        return Vec::new();
    };
    let pod_user = spec.security_context.as_ref().and_then(|s| s.run_as_user);
    let mut warnings = Vec::new();
    for entry in claims.iter().filter(|e| gated.contains(e.name.as_str())) {
        let users: Vec<&core::Container> = spec
            .init_containers
            .iter()
            .flatten()
            .chain(&spec.containers)
            .filter(|c| {
                c.resources
                    .iter()
                    .flat_map(|r| r.claims.iter().flatten())
                    .any(|c| c.name == entry.name)
            })
            .collect();
        if users.is_empty() {
            continue;
        }
        if spec.host_users == Some(false) {
            warnings.push(format!(
                "the pod runs in a user namespace (hostUsers: false) and uses {}: a node that \
                 enforces GPU shares with MPS refuses to prepare it, since it cannot know the \
                 host uid the pod's processes get (an MPS daemon serves one Unix user)",
                entry.reference
            ));
            continue;
        }
        for container in users {
            let user = container
                .security_context
                .as_ref()
                .and_then(|s| s.run_as_user)
                .or(pod_user);
            if user.is_none() {
                warnings.push(format!(
                    "container {} uses {} and sets no securityContext.runAsUser (nor does the \
                     pod): a node that enforces GPU shares with MPS refuses to prepare it, since \
                     an MPS daemon serves one Unix user and the node cannot know the image's \
                     user; set runAsUser (0 for an image that runs as root)",
                    container.name, entry.reference
                ));
            }
        }
    }
    warnings
}

#[cfg(test)]
mod tests {

    use std::collections::BTreeMap;

    use super::*;

    fn class(name: &str, allocate: Option<&str>) -> res::DeviceClass {
        serde_json::from_value(json!({
            "metadata": {
                "name": name,
                "annotations": allocate.map(|v| BTreeMap::from([(names::ANNOTATION_ALLOCATE, v)])),
            },
            "spec": {},
        }))
        .unwrap()
    }

    fn spec(classes: &[&str]) -> res::ResourceClaimSpec {
        let requests: Vec<_> = classes
            .iter()
            .enumerate()
            .map(|(i, c)| json!({"name": format!("r{i}"), "exactly": {"deviceClassName": c}}))
            .collect();
        serde_json::from_value(json!({"devices": {"requests": requests}})).unwrap()
    }

    fn pod(gates: Option<&[&str]>, node_name: Option<&str>) -> core::Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns"},
            "spec": {
                "containers": [{"name": "c", "image": "i"}],
                "nodeName": node_name,
                "schedulingGates": gates.map(|g| g.iter().map(|n| json!({"name": n})).collect::<Vec<_>>()),
                "resourceClaims": [{"name": "gpu", "resourceClaimName": "train"}],
            },
        }))
        .unwrap()
    }

    fn entry(source: ClaimSource) -> Vec<PodClaim> {
        vec![PodClaim {
            name: "gpu".into(),
            reference: "ResourceClaim train".into(),
            source,
        }]
    }

    /// [`decide_gate`] for `pod` with one claim entry from `source`, where no class is found.
    fn decide(pod: &core::Pod, source: ClaimSource) -> GateDecision {
        decide_gate(pod, &entry(source), &mut |_| Ok(None))
    }

    /// [`pod`] whose container uses the claim entry, with the pod's and the container's
    /// `runAsUser`.
    fn pod_using_the_claim(pod_user: Option<i64>, container_user: Option<i64>) -> core::Pod {
        let mut p = pod(None, None);
        let spec = p.spec.as_mut().unwrap();
        spec.containers[0] = serde_json::from_value(json!({
            "name": "c", "image": "i",
            "resources": {"claims": [{"name": "gpu"}]},
            "securityContext": container_user.map(|u| json!({"runAsUser": u})),
        }))
        .unwrap();
        spec.security_context =
            pod_user.map(|u| serde_json::from_value(json!({"runAsUser": u})).unwrap());
        p
    }

    #[test]
    fn a_share_container_without_a_user_is_warned_that_an_mps_node_refuses_it() {
        let d = decide(
            &pod_using_the_claim(None, None),
            ClaimSource::Claim(spec(&[names::CLASS_SHARED_GPU])),
        );
        assert_eq!(d.warnings.len(), 1, "{:?}", d.warnings);
        assert!(
            d.warnings[0].starts_with("container c uses ResourceClaim train and sets no"),
            "{}",
            d.warnings[0]
        );
        assert!(d.gated, "a warning, never a refusal");
        for (pod_user, container_user) in [(Some(1000), None), (None, Some(0))] {
            let d = decide(
                &pod_using_the_claim(pod_user, container_user),
                ClaimSource::Claim(spec(&[names::CLASS_SHARED_GPU])),
            );
            assert!(d.warnings.is_empty(), "{:?}", d.warnings);
        }
        let d = decide(
            &pod_using_the_claim(None, None),
            ClaimSource::Claim(spec(&[names::CLASS_GPU])),
        );
        assert!(d.warnings.is_empty(), "whole GPUs need no MPS daemon");
    }

    #[test]
    fn a_share_pod_in_a_user_namespace_is_warned() {
        let mut p = pod_using_the_claim(Some(0), None);
        p.spec.as_mut().unwrap().host_users = Some(false);
        let d = decide(&p, ClaimSource::Claim(spec(&[names::CLASS_SHARED_GPU])));
        assert_eq!(d.warnings.len(), 1);
        assert!(
            d.warnings[0].contains("hostUsers: false"),
            "{}",
            d.warnings[0]
        );
    }

    #[test]
    fn shared_and_mig_classes_are_gated_by_default_and_whole_gpus_are_not() {
        assert!(class_is_gated(names::CLASS_SHARED_GPU, None));
        assert!(class_is_gated(names::CLASS_MIG_GPU, None));
        assert!(!class_is_gated(names::CLASS_GPU, None));
    }

    #[test]
    fn the_annotation_marks_a_class_or_opts_one_out() {
        assert!(class_is_gated("fancy", Some(&class("fancy", Some("true")))));
        assert!(!class_is_gated(
            names::CLASS_SHARED_GPU,
            Some(&class(names::CLASS_SHARED_GPU, Some("false")))
        ));
        assert!(class_is_gated(
            names::CLASS_MIG_GPU,
            Some(&class(names::CLASS_MIG_GPU, Some("maybe")))
        ));
    }

    #[test]
    fn first_available_subrequests_count() {
        let spec: res::ResourceClaimSpec = serde_json::from_value(json!({"devices": {"requests": [
            {"name": "r", "firstAvailable": [
                {"name": "a", "deviceClassName": "gpu.tessera.dev"},
                {"name": "b", "deviceClassName": "mig.gpu.tessera.dev"},
            ]},
        ]}}))
        .unwrap();
        let classes: Vec<String> = spec_classes(&spec).into_iter().collect();
        assert_eq!(classes, ["gpu.tessera.dev", "mig.gpu.tessera.dev"]);
    }

    #[test]
    fn a_pod_with_a_share_claim_gets_the_gate_added() {
        let d = decide(
            &pod(None, None),
            ClaimSource::Claim(spec(&[names::CLASS_SHARED_GPU])),
        );
        assert!(d.gated);
        assert_eq!(d.patch.len(), 1);
        assert_eq!(d.patch[0].path, "/spec/schedulingGates");
        assert_eq!(d.patch[0].value, json!([{"name": names::SCHEDULING_GATE}]));
    }

    #[test]
    fn other_gates_are_kept_and_ours_is_appended() {
        let d = decide(
            &pod(Some(&["example.com/other"]), None),
            ClaimSource::Template(spec(&[names::CLASS_MIG_GPU])),
        );
        assert_eq!(d.patch[0].path, "/spec/schedulingGates/-");
        assert_eq!(d.patch[0].value, json!({"name": names::SCHEDULING_GATE}));
    }

    #[test]
    fn an_already_gated_pod_needs_no_patch() {
        let d = decide(
            &pod(Some(&[names::SCHEDULING_GATE]), None),
            ClaimSource::Claim(spec(&[names::CLASS_SHARED_GPU])),
        );
        assert!(d.gated);
        assert!(d.patch.is_empty());
    }

    #[test]
    fn whole_gpu_claims_stay_with_kube_scheduler() {
        let d = decide(
            &pod(None, None),
            ClaimSource::Claim(spec(&[names::CLASS_GPU])),
        );
        assert!(!d.gated);
        assert!(d.patch.is_empty());
        assert!(d.warnings.is_empty());
    }

    #[test]
    fn a_missing_claim_means_no_gate_and_a_warning() {
        let d = decide(&pod(None, None), ClaimSource::Missing);
        assert!(!d.gated);
        assert!(
            d.warnings[0].contains("ResourceClaim train"),
            "{:?}",
            d.warnings
        );
    }

    #[test]
    fn a_failed_class_lookup_falls_back_to_the_default_with_a_warning() {
        let d = decide_gate(
            &pod(None, None),
            &entry(ClaimSource::Claim(spec(&[
                names::CLASS_SHARED_GPU,
                "custom",
            ]))),
            &mut |_| Err("timed out".to_owned()),
        );
        assert!(d.gated);
        assert_eq!(d.warnings.len(), 2, "{:?}", d.warnings);
    }

    #[test]
    fn a_pod_with_a_node_name_cannot_be_gated_and_is_warned() {
        let d = decide(
            &pod(None, Some("node-a")),
            ClaimSource::Claim(spec(&[names::CLASS_SHARED_GPU])),
        );
        assert!(!d.gated);
        assert!(d.patch.is_empty());
        assert!(d.warnings[0].contains("spec.nodeName"));
    }
}
