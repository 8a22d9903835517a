//! Why a pod is still pending: not Tessera's, waiting for claims, or what the allocator says.

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::resource::v1 as res;
use serde::Serialize;

use crate::error::Result;
use crate::names;
use crate::placement::allocator::Policy;
use crate::tools::batch::{BatchInput, BatchOptions, allocate_batch};

/// The short answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Verdict {
    /// The pod is bound to a node: it is not pending on scheduling.
    Scheduled,
    /// The pod does not carry Tessera's gate: kube-scheduler schedules it.
    NotGated,
    /// Some of its claims do not exist yet.
    WaitingForClaims,
    /// Its claims fit now: the controller has not placed them yet.
    Fits,
    /// Its claims cannot be placed together on any node; the message says why.
    Unplaceable,
    /// Its claims are allocated; the controller still has to remove the gate.
    Allocated,
    /// The controller refused its claims for a fault only their owner can fix (the message
    /// says which); it tries again when the pod or one of its claims changes.
    Refused,
    /// The pod is delay-tolerant and waits for a GPU that is already partly used; the message
    /// says until when (then it is placed on any GPU).
    WaitingForFragment,
    /// The controller evicted batch pods to make room for this online pod and waits for them
    /// to terminate; the message names them.
    Preempting,
}

/// One of the pod's claims.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimState {
    /// The entry's name in the pod's `spec.resourceClaims`.
    pub pod_claim: String,
    /// The ResourceClaim's name, when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub claim: Option<String>,
    /// `allocated`, `pending` or `missing`.
    pub state: &'static str,
    /// More about it, e.g. which template has not produced its claim yet.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// Why a pod is where it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodExplanation {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub name: String,
    /// The short answer.
    pub verdict: Verdict,
    /// The answer in words.
    pub message: String,
    /// The pod's claims.
    pub claims: Vec<ClaimState>,
    /// The pod's conditions that are not true, as `type: reason: message`.
    pub conditions: Vec<String>,
}

/// What the explanation reads: the cluster's objects (claims of every namespace, since
/// allocated ones take devices from everyone).
#[derive(Debug, Clone, Copy)]
pub struct ClusterObjects<'a> {
    /// DeviceClasses.
    pub classes: &'a [res::DeviceClass],
    /// ResourceSlices.
    pub slices: &'a [res::ResourceSlice],
    /// ResourceClaims.
    pub claims: &'a [res::ResourceClaim],
    /// Nodes.
    pub nodes: &'a [core::Node],
}

fn is_allocated(claim: &res::ResourceClaim) -> bool {
    claim
        .status
        .as_ref()
        .is_some_and(|s| s.allocation.is_some())
}

/// Explains `pod`: bound, not Tessera's, waiting for claims, or the allocator's verdict on
/// its pending claims against what is allocated now (all on one node, as the controller
/// places them), with `policy`.
pub fn explain_pod(
    driver: &str,
    policy: Policy,
    pod: &core::Pod,
    cluster: &ClusterObjects<'_>,
) -> Result<PodExplanation> {
    let namespace = pod
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".to_owned());
    let mut explanation = PodExplanation {
        name: pod.metadata.name.clone().unwrap_or_default(),
        namespace: namespace.clone(),
        verdict: Verdict::NotGated,
        message: String::new(),
        claims: Vec::new(),
        conditions: unmet_conditions(pod),
    };
    let spec = pod.spec.clone().unwrap_or_default();
    if let Some(node) = spec.node_name.as_deref().filter(|n| !n.is_empty()) {
        explanation.verdict = Verdict::Scheduled;
        explanation.message = format!("bound to node {node}: not pending on scheduling");
        return Ok(explanation);
    }
    let gates: Vec<&str> = spec
        .scheduling_gates
        .iter()
        .flatten()
        .map(|g| g.name.as_str())
        .collect();
    if !gates.contains(&names::SCHEDULING_GATE) {
        explanation.message = if gates.is_empty() {
            "not gated: kube-scheduler's (see its events and the PodScheduled condition)".to_owned()
        } else {
            format!(
                "not gated by Tessera: kube-scheduler's, once these gates are removed: {}",
                gates.join(", ")
            )
        };
        return Ok(explanation);
    }

    // The pod's copy names every claim directly, so the batch allocator places exactly
    // this pod's claims together.
    let (resolved_pod, states, pending, missing) = resolve_claims(pod, &namespace, cluster.claims);
    explanation.claims = states;
    if missing {
        explanation.verdict = Verdict::WaitingForClaims;
        "gated by Tessera and waiting for its claims to exist (see claims)"
            .clone_into(&mut explanation.message);
        return Ok(explanation);
    }
    if let Some((verdict, message)) = recorded(pod, pending.is_empty()) {
        explanation.verdict = verdict;
        explanation.message = message;
        return Ok(explanation);
    }
    if pending.is_empty() {
        explanation.verdict = Verdict::Allocated;
        "every claim is allocated: the controller still has to remove the gate (is it running?)"
            .clone_into(&mut explanation.message);
        return Ok(explanation);
    }
    let mut claims: Vec<res::ResourceClaim> = cluster
        .claims
        .iter()
        .filter(|c| is_allocated(c))
        .cloned()
        .collect();
    claims.extend(pending);
    let outcomes = allocate_batch(
        &BatchInput {
            classes: cluster.classes,
            slices: cluster.slices,
            claims: &claims,
            nodes: cluster.nodes,
            pods: std::slice::from_ref(&resolved_pod),
        },
        &BatchOptions {
            driver_name: driver.to_owned(),
            policy,
            node: None,
        },
    )?;
    if let Some(failed) = outcomes.iter().find(|o| !o.allocated) {
        explanation.verdict = Verdict::Unplaceable;
        explanation.message = format!(
            "gated by Tessera; its claims cannot be placed now: {}",
            failed.reason.as_deref().unwrap_or("no reason given")
        );
    } else {
        explanation.verdict = Verdict::Fits;
        let node = outcomes
            .iter()
            .find_map(|o| o.node.clone())
            .unwrap_or_else(|| "any node".to_owned());
        explanation.message = format!(
            "gated by Tessera; its claims fit on {node} now: the controller has not placed them yet \
             (is it running and leading?)"
        );
    }
    Ok(explanation)
}

/// The pod's claims resolved: a copy of the pod naming every claim directly (so the batch
/// allocator places exactly its claims together), each entry's state, its pending claims,
/// and whether any claim is missing.
fn resolve_claims(
    pod: &core::Pod,
    namespace: &str,
    claims: &[res::ResourceClaim],
) -> (core::Pod, Vec<ClaimState>, Vec<res::ResourceClaim>, bool) {
    let statuses: Vec<&core::PodResourceClaimStatus> = pod
        .status
        .iter()
        .flat_map(|s| s.resource_claim_statuses.iter().flatten())
        .collect();
    let mut resolved_pod = pod.clone();
    let mut states = Vec::new();
    let mut pending: Vec<res::ResourceClaim> = Vec::new();
    let mut missing = false;
    let entries = resolved_pod
        .spec
        .iter_mut()
        .flat_map(|s| s.resource_claims.iter_mut().flatten());
    for entry in entries {
        let name = match (
            &entry.resource_claim_name,
            &entry.resource_claim_template_name,
        ) {
            (Some(n), _) => Some(n.clone()),
            (None, Some(_)) => statuses
                .iter()
                .find(|s| s.name == entry.name)
                .and_then(|s| s.resource_claim_name.clone()),
            (None, None) => None,
        };
        let found = name.as_ref().and_then(|n| {
            claims.iter().find(|c| {
                c.metadata.name.as_ref() == Some(n)
                    && c.metadata.namespace.as_deref().unwrap_or("default") == namespace
            })
        });
        let state = match (found, &name, &entry.resource_claim_template_name) {
            (Some(c), _, _) if is_allocated(c) => ClaimState {
                pod_claim: entry.name.clone(),
                claim: name.clone(),
                state: "allocated",
                detail: None,
            },
            (Some(c), _, _) => {
                pending.push(c.clone());
                ClaimState {
                    pod_claim: entry.name.clone(),
                    claim: name.clone(),
                    state: "pending",
                    detail: None,
                }
            }
            (None, Some(n), _) => {
                missing = true;
                ClaimState {
                    pod_claim: entry.name.clone(),
                    claim: Some(n.clone()),
                    state: "missing",
                    detail: Some(format!("ResourceClaim {namespace}/{n} does not exist")),
                }
            }
            (None, None, template) => {
                missing = true;
                ClaimState {
                    pod_claim: entry.name.clone(),
                    claim: None,
                    state: "missing",
                    detail: Some(template.as_ref().map_or_else(
                        || "names neither a claim nor a template".to_owned(),
                        |t| {
                            format!(
                                "the claim from ResourceClaimTemplate {t} has not been created yet \
                                 (kube-controller-manager creates it)"
                            )
                        },
                    )),
                }
            }
        };
        entry.resource_claim_name.clone_from(&state.claim);
        entry.resource_claim_template_name = None;
        states.push(state);
    }
    (resolved_pod, states, pending, missing)
}

/// What the controller recorded on the pod that answers for it: a refusal, or (while claims are
/// pending) that it waits on purpose.
fn recorded(pod: &core::Pod, nothing_pending: bool) -> Option<(Verdict, String)> {
    if let Some(why) = refusal(pod) {
        let message = format!(
            "gated by Tessera; the controller refused its claims: {why} (only their owner can fix \
             this: the controller tries again when the pod or one of its claims changes)"
        );
        return Some((Verdict::Refused, message));
    }
    let (verdict, why) = waiting(pod).filter(|_| !nothing_pending)?;
    Some((verdict, format!("gated by Tessera; it {why}")))
}

/// What the controller recorded that the pod waits for on purpose: its condition, false with
/// reason `WaitingForFragment` or `Preempting`, and the message (which says until when, or for
/// whom).
fn waiting(pod: &core::Pod) -> Option<(Verdict, String)> {
    let condition = pod
        .status
        .iter()
        .flat_map(|s| s.conditions.iter().flatten())
        .find(|c| c.type_ == names::CONDITION_ALLOCATED && c.status == "False")?;
    let verdict = match condition.reason.as_deref()? {
        names::REASON_WAITING_FOR_FRAGMENT => Verdict::WaitingForFragment,
        names::REASON_PREEMPTING => Verdict::Preempting,
        _ => return None,
    };
    let message = condition
        .message
        .clone()
        .unwrap_or_else(|| "waits (no reason given)".to_owned());
    let message = message
        .strip_prefix("preempting: ")
        .map_or_else(|| message.clone(), |rest| format!("is preempting: {rest}"));
    Some((verdict, message))
}

/// The controller's refusal recorded on the pod: its condition, false with reason
/// `AllocationRefused`, and the message.
fn refusal(pod: &core::Pod) -> Option<String> {
    pod.status
        .iter()
        .flat_map(|s| s.conditions.iter().flatten())
        .find(|c| {
            c.type_ == names::CONDITION_ALLOCATED
                && c.status == "False"
                && c.reason.as_deref() == Some(names::REASON_ALLOCATION_REFUSED)
        })
        .map(|c| {
            c.message
                .clone()
                .unwrap_or_else(|| "no reason given".to_owned())
        })
}

/// The pod's conditions that are not true, as `type: reason: message`.
fn unmet_conditions(pod: &core::Pod) -> Vec<String> {
    pod.status
        .iter()
        .flat_map(|s| s.conditions.iter().flatten())
        .filter(|c| c.status != "True")
        .map(|c| {
            format!(
                "{}: {}: {}",
                c.type_,
                c.reason.as_deref().unwrap_or("-"),
                c.message.as_deref().unwrap_or("-")
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {

    use serde_json::json;

    use super::*;

    fn explain(spec: &serde_json::Value) -> PodExplanation {
        let pod: core::Pod = serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns"},
            "spec": spec,
            "status": {"conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "SchedulingGated", "message": "gated"},
                {"type": "Initialized", "status": "True"},
            ]},
        }))
        .unwrap();
        let cluster = ClusterObjects {
            classes: &[],
            slices: &[],
            claims: &[],
            nodes: &[],
        };
        explain_pod(names::DEFAULT_DRIVER_NAME, Policy::FirstFit, &pod, &cluster).unwrap()
    }

    #[test]
    fn a_bound_pod_is_not_pending_on_scheduling() {
        let e = explain(&json!({"containers": [], "nodeName": "n1"}));
        assert_eq!(e.verdict, Verdict::Scheduled);
        assert!(e.message.contains("n1"));
    }

    #[test]
    fn a_pod_behind_someone_elses_gate_names_the_gate() {
        let e =
            explain(&json!({"containers": [], "schedulingGates": [{"name": "example.com/quota"}]}));
        assert_eq!(e.verdict, Verdict::NotGated);
        assert!(e.message.contains("example.com/quota"), "{}", e.message);
        assert_eq!(e.conditions, ["PodScheduled: SchedulingGated: gated"]);
    }

    #[test]
    fn a_gated_pod_with_every_claim_allocated_waits_for_the_controller() {
        let e = explain(
            &json!({"containers": [], "schedulingGates": [{"name": names::SCHEDULING_GATE}]}),
        );
        assert_eq!(e.verdict, Verdict::Allocated);
        assert!(e.message.contains("controller"));
    }

    /// Gated pod `ns/p` with claim `c`, and the controller's condition with `reason` and
    /// `message`.
    fn gated_pod_with_condition(reason: &str, message: &str) -> core::Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns"},
            "spec": {"containers": [], "schedulingGates": [{"name": names::SCHEDULING_GATE}],
                     "resourceClaims": [{"name": "gpu", "resourceClaimName": "c"}]},
            "status": {"conditions": [{"type": names::CONDITION_ALLOCATED, "status": "False",
                "reason": reason, "message": message}]},
        }))
        .unwrap()
    }

    /// Claim `ns/c`, one request of class `x`, not allocated.
    fn claim_c() -> res::ResourceClaim {
        serde_json::from_value(json!({
            "metadata": {"name": "c", "namespace": "ns"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "x"}}]}},
        }))
        .unwrap()
    }

    #[test]
    fn a_pod_the_controller_refused_says_so_and_why() {
        let pod = gated_pod_with_condition(
            names::REASON_ALLOCATION_REFUSED,
            "API server: marking ResourceClaim ns/c: field is immutable",
        );
        let claim = claim_c();
        let cluster = ClusterObjects {
            classes: &[],
            slices: &[],
            claims: &[claim],
            nodes: &[],
        };
        let e = explain_pod(names::DEFAULT_DRIVER_NAME, Policy::FirstFit, &pod, &cluster).unwrap();
        assert_eq!(e.verdict, Verdict::Refused);
        assert!(
            e.message.contains("refused") && e.message.contains("field is immutable"),
            "{}",
            e.message
        );
    }

    #[test]
    fn a_pod_waiting_for_a_fragment_says_until_when() {
        let until = "2026-11-25T01:40:00Z";
        let pod = gated_pod_with_condition(
            names::REASON_WAITING_FOR_FRAGMENT,
            &format!("waits for a fragment until {until}: the pod is delay-tolerant"),
        );
        let claim = claim_c();
        let cluster = ClusterObjects {
            classes: &[],
            slices: &[],
            claims: std::slice::from_ref(&claim),
            nodes: &[],
        };
        let e = explain_pod(names::DEFAULT_DRIVER_NAME, Policy::FirstFit, &pod, &cluster).unwrap();
        assert_eq!(e.verdict, Verdict::WaitingForFragment);
        assert!(
            e.message.contains("waits for a fragment") && e.message.contains(until),
            "{}",
            e.message
        );
        let mut preempting = pod;
        let condition = &mut preempting
            .status
            .as_mut()
            .unwrap()
            .conditions
            .as_mut()
            .unwrap()[0];
        condition.reason = Some(names::REASON_PREEMPTING.to_owned());
        condition.message = Some("preempting: evicted batch pods ns/b on node n".to_owned());
        let e = explain_pod(
            names::DEFAULT_DRIVER_NAME,
            Policy::FirstFit,
            &preempting,
            &cluster,
        )
        .unwrap();
        assert_eq!(e.verdict, Verdict::Preempting);
        assert!(
            e.message.contains("is preempting: evicted batch pods ns/b"),
            "{}",
            e.message
        );
    }
}
