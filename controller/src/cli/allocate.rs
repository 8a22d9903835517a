//! `tessera allocate`: the pending claims of the input, allocated against its slices.
//!
//! As `kubectl apply -f` goes on past an invalid object, every object that can be used gets its
//! result and every one that cannot gets its error, in one run (which then exits 2). What
//! cannot be used: what the loader refused (see [`Objects::load_skipping_refused`]), a pod the
//! pod webhook would refuse, and a claim with a capacity request Tessera refuses (negative, or
//! not a quantity). A pod's claims are placed together or not at all, so a claim whose pod was
//! refused, or whose pod names a refused claim, is not tried: it is reported not allocated,
//! with the reason.

use std::collections::{BTreeMap, BTreeSet};

use tessera_driver::placement::allocator::Policy;
use tessera_driver::rules::validation::capacity_request_errors;
use tessera_driver::tools::batch::{BatchInput, BatchOptions, ClaimOutcome, allocate_batch};

use crate::cli::input::{Objects, Refusal};
use crate::error::Result;

/// What `allocate` answers.
#[derive(Debug, Clone, Default)]
pub struct Answer {
    /// One outcome per pending claim that was not refused, in input order.
    pub outcomes: Vec<ClaimOutcome>,
    /// One line per object left out, in input order (loader refusals first).
    pub errors: Vec<String>,
    /// The input's claims refused by Tessera (namespace, name): they are not written back.
    pub refused_claims: BTreeSet<(String, String)>,
}

fn claim_key(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> (String, String) {
    (
        meta.namespace
            .clone()
            .unwrap_or_else(|| "default".to_owned()),
        meta.name.clone().unwrap_or_default(),
    )
}

fn is_pending(claim: &k8s_openapi::api::resource::v1::ResourceClaim) -> bool {
    claim.status.as_ref().is_none_or(|s| s.allocation.is_none())
}

/// Allocates every pending claim of `objects` in input order; what cannot be used is left out
/// of the allocation and answered with its error.
pub fn run(objects: &Objects, driver: &str, policy: Policy, node: Option<&str>) -> Result<Answer> {
    let mut errors: Vec<String> = objects.refusals.iter().map(|r| r.message.clone()).collect();
    let mut refused: BTreeSet<(String, String)> = BTreeSet::new();
    // Claims Tessera refuses although the API server accepts them.
    for claim in objects.claims.iter().filter(|c| is_pending(c)) {
        let key = claim_key(&claim.metadata);
        let object = format!("ResourceClaim {}/{}", key.0, key.1);
        let problems = capacity_request_errors(&object, &claim.spec);
        if problems.is_empty() {
            continue;
        }
        let source = objects.source(
            "ResourceClaim",
            claim.metadata.namespace.as_deref().unwrap_or_default(),
            &key.1,
        );
        errors.extend(problems.iter().map(|p| match source {
            Some(source) => format!("{source}: {p}"),
            None => p.to_string(),
        }));
        refused.insert(key);
    }
    let order: Vec<(String, String)> = objects
        .claims
        .iter()
        .filter(|c| is_pending(c))
        .map(|c| claim_key(&c.metadata))
        .filter(|k| !refused.contains(k))
        .collect();
    let blocked = blocked_claims(objects, &objects.refusals, &refused);
    let tried: Vec<_> = objects
        .claims
        .iter()
        .filter(|c| {
            let key = claim_key(&c.metadata);
            !refused.contains(&key) && !blocked.contains_key(&key)
        })
        .cloned()
        .collect();
    let input = BatchInput {
        claims: &tried,
        ..objects.batch_input()
    };
    let options = BatchOptions {
        driver_name: driver.to_owned(),
        policy,
        node: node.map(str::to_owned),
    };
    let mut placed: BTreeMap<(String, String), ClaimOutcome> = allocate_batch(&input, &options)?
        .into_iter()
        .map(|o| ((o.namespace.clone(), o.name.clone()), o))
        .collect();
    let outcomes = order
        .into_iter()
        .filter_map(|key| {
            placed.remove(&key).or_else(|| {
                blocked.get(&key).map(|reason| ClaimOutcome {
                    namespace: key.0.clone(),
                    name: key.1.clone(),
                    allocated: false,
                    allocation: None,
                    reason: Some(reason.clone()),
                    node: None,
                })
            })
        })
        .collect();
    Ok(Answer {
        outcomes,
        errors,
        refused_claims: refused,
    })
}

/// The pending claims that are not tried because their pod cannot be placed whole: the pod was
/// refused, or it names a claim that was; each with the reason.
fn blocked_claims(
    objects: &Objects,
    refusals: &[Refusal],
    refused_claims: &BTreeSet<(String, String)>,
) -> BTreeMap<(String, String), String> {
    let pending: BTreeSet<(String, String)> = objects
        .claims
        .iter()
        .filter(|c| is_pending(c))
        .map(|c| claim_key(&c.metadata))
        .collect();
    let mut refused = refused_claims.clone();
    refused.extend(refusals.iter().filter_map(|r| match &r.object {
        Some((kind, namespace, name)) if kind == "ResourceClaim" => {
            Some((namespace.clone(), name.clone()))
        }
        _ => None,
    }));
    let mut blocked = BTreeMap::new();
    for r in refusals {
        let Some((kind, namespace, pod)) = &r.object else {
            continue;
        };
        if kind != "Pod" {
            continue;
        }
        for claim in &r.pod_claims {
            let key = (namespace.clone(), claim.clone());
            if pending.contains(&key) {
                blocked.entry(key).or_insert_with(|| {
                    format!("not allocated: its Pod {namespace}/{pod} was refused (see its error)")
                });
            }
        }
    }
    for pod in &objects.pods {
        let (namespace, name) = claim_key(&pod.metadata);
        let claims: Vec<(String, String)> = pod
            .spec
            .iter()
            .flat_map(|s| s.resource_claims.iter().flatten())
            .filter_map(|c| c.resource_claim_name.clone())
            .map(|c| (namespace.clone(), c))
            .collect();
        let Some(bad) = claims.iter().find(|c| refused.contains(*c)) else {
            continue;
        };
        for key in claims
            .iter()
            .filter(|c| pending.contains(*c) && !refused.contains(*c))
        {
            blocked.entry(key.clone()).or_insert_with(|| {
                format!(
                    "not allocated: ResourceClaim {}/{} of its Pod {namespace}/{name} was refused \
                     (see its error), and a pod's claims are placed together or not at all",
                    bad.0, bad.1
                )
            });
        }
    }
    blocked
}
