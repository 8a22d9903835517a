//! The `pods/eviction` subresource (policy/v1 Eviction) with `PodDisruptionBudget` checks, as
//! the real API server's eviction handler decides, in the fake's terms:
//!
//! * a pod that is already being deleted, or whose phase is `Pending` (or unset: the fake does
//!   not default it), `Succeeded` or `Failed`, is deleted without looking at budgets;
//! * otherwise the `PodDisruptionBudgets` of the pod's namespace whose `spec.selector` matches
//!   it (`matchLabels` and `matchExpressions`; an empty selector matches every pod) decide:
//!   more than one is a 500; one whose `status.observedGeneration` is behind its
//!   `metadata.generation`, or whose `status.disruptionsAllowed` is not positive, is a 429
//!   (nothing is deleted); else its `disruptionsAllowed` goes down by one and the pod is
//!   deleted (a pod with finalizers only marked, as any delete in the fake);
//! * `deleteOptions.preconditions.uid` that names another pod is a 409;
//! * `dryRun=All` decides the same and changes nothing.
//!
//! Nothing recomputes a budget's status afterwards (that is kube-controller-manager's
//! disruption controller): a test writes the status it wants through the status subresource.

use serde_json::{Value, json};

use super::store::{StatusError, Store};
use super::{Kind, kind};

fn pdb_kind() -> Kind {
    kind("poddisruptionbudgets").unwrap_or(super::KINDS[0])
}

fn pod_kind() -> Kind {
    kind("pods").unwrap_or(super::KINDS[0])
}

/// Whether a `LabelSelector` (as JSON) selects an object with `labels`.
fn selects(selector: &Value, labels: &serde_json::Map<String, Value>) -> Result<bool, StatusError> {
    let label = |k: &str| labels.get(k).and_then(Value::as_str);
    if let Some(m) = selector.get("matchLabels").and_then(Value::as_object)
        && !m.iter().all(|(k, v)| label(k) == v.as_str())
    {
        return Ok(false);
    }
    for e in selector
        .get("matchExpressions")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let key = e.get("key").and_then(Value::as_str).unwrap_or_default();
        let values: Vec<&str> = e
            .get("values")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        let have = label(key);
        let ok = match e.get("operator").and_then(Value::as_str) {
            Some("In") => have.is_some_and(|h| values.contains(&h)),
            Some("NotIn") => have.is_none_or(|h| !values.contains(&h)),
            Some("Exists") => have.is_some(),
            Some("DoesNotExist") => have.is_none(),
            other => {
                return Err(StatusError::bad_request(format!(
                    "selector operator {other:?} is not one the API knows"
                )));
            }
        };
        if !ok {
            return Ok(false);
        }
    }
    Ok(true)
}

fn too_many(message: String) -> StatusError {
    StatusError::new(429, "TooManyRequests", message)
}

/// Evicts pod `namespace/name` as the body (an Eviction) asks; see the module docs.
pub(crate) fn evict(
    store: &mut Store,
    namespace: &String,
    name: &str,
    body: &Value,
    dry_run: bool,
) -> Result<(u16, Value), StatusError> {
    let pods = pod_kind();
    let pod = store.get(&pods, Some(namespace), name)?;
    let uid = pod.pointer("/metadata/uid").and_then(Value::as_str);
    if let Some(wanted) = body
        .pointer("/deleteOptions/preconditions/uid")
        .and_then(Value::as_str)
        && Some(wanted) != uid
    {
        return Err(StatusError::new(
            409,
            "Conflict",
            format!(
                "Precondition failed: UID in precondition: {wanted}, UID in object meta: {}",
                uid.unwrap_or_default()
            ),
        ));
    }
    let phase = pod
        .pointer("/status/phase")
        .and_then(Value::as_str)
        .unwrap_or("Pending");
    let ignores_budgets = pod.pointer("/metadata/deletionTimestamp").is_some()
        || matches!(phase, "Pending" | "Succeeded" | "Failed");
    if !ignores_budgets {
        let empty = serde_json::Map::new();
        let labels = pod
            .pointer("/metadata/labels")
            .and_then(Value::as_object)
            .unwrap_or(&empty);
        let pdbs = pdb_kind();
        let mut matching = Vec::new();
        for pdb in store.list(&pdbs, Some(namespace)) {
            let selector = pdb.pointer("/spec/selector").cloned().unwrap_or(json!({}));
            if selects(&selector, labels)? {
                matching.push(pdb);
            }
        }
        if matching.len() > 1 {
            return Err(StatusError::new(
                500,
                "InternalError",
                "This pod has more than one PodDisruptionBudget, which the eviction subresource \
                 does not support.",
            ));
        }
        if let Some(pdb) = matching.pop() {
            let pdb_name = pdb
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            let generation = pdb
                .pointer("/metadata/generation")
                .and_then(Value::as_i64)
                .unwrap_or(1);
            let observed = pdb
                .pointer("/status/observedGeneration")
                .and_then(Value::as_i64)
                .unwrap_or(0);
            if observed < generation {
                return Err(too_many(format!(
                    "Cannot evict pod as it would violate the pod's disruption budget. The \
                     disruption budget {pdb_name} is still being processed by the server."
                )));
            }
            let allowed = pdb
                .pointer("/status/disruptionsAllowed")
                .and_then(Value::as_i64)
                .unwrap_or(0);
            if allowed <= 0 {
                return Err(too_many(format!(
                    "Cannot evict pod as it would violate the pod's disruption budget. The \
                     disruption budget {pdb_name} needs more healthy pods and has {allowed} \
                     disruptions allowed."
                )));
            }
            if !dry_run {
                let mut updated = pdb.clone();
                updated["status"]["disruptionsAllowed"] = json!(allowed - 1);
                store.update(&pdbs, Some(namespace), &pdb_name, updated, true)?;
            }
        }
    }
    if !dry_run {
        store.delete(&pods, Some(namespace), name)?;
    }
    Ok((
        201,
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}),
    ))
}
