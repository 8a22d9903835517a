//! Admission of ResourceClaims and ResourceClaimTemplates: the share rules, and opaque
//! parameters rewritten canonically.

use k8s_openapi::api::resource::v1 as res;

use super::PatchOp;
use crate::error::Error;
use crate::rules::cel::CelCache;
use crate::rules::validation::{share_classes, validate_claim_spec};

/// Checks a claim spec the way `tessera validate` does: CEL selectors compile, Tessera opaque
/// configs decode, capacity requests are not negative, and every share obeys the share rules.
///
/// `object` names the object in messages (`ResourceClaim ns/name`); `field_prefix` is put in
/// front of every field path (`spec.` for a template, whose claim spec sits at `spec.spec`);
/// `classes` are the DeviceClasses the spec uses that exist (a missing class is not an error:
/// it may be created later).
pub fn review_claim_spec(
    object: &str,
    spec: &res::ResourceClaimSpec,
    field_prefix: &str,
    driver: &str,
    classes: &[res::DeviceClass],
    cel: &CelCache,
) -> Vec<Error> {
    let shares = share_classes(classes);
    let shares: Vec<&str> = shares.iter().map(String::as_str).collect();
    let lookup = |name: &str| {
        classes
            .iter()
            .find(|c| c.metadata.name.as_deref() == Some(name))
            .cloned()
    };
    let errors = validate_claim_spec(object, spec, driver, &shares, &lookup, cel);
    rewrite_fields(errors, |field| format!("{field_prefix}{field}"))
}

/// `errors` with the field path of each invalid-object error rewritten by `rewrite`.
fn rewrite_fields(errors: Vec<Error>, rewrite: impl Fn(String) -> String) -> Vec<Error> {
    errors
        .into_iter()
        .map(|e| match e {
            Error::Invalid {
                object,
                field,
                message,
            } => Error::Invalid {
                object,
                field: rewrite(field),
                message,
            },
            other => other,
        })
        .collect()
}

/// The webhook's whole review of a claim spec: the problems that refuse it (see
/// [`review_claim_spec`]) and the warnings that admit it (native requests the request policies
/// round, see [`crate::rules::validation::capacity_rounding_warnings`]). Field paths start at the
/// object's root (`field_prefix` is `spec.` for a template) and follow the object's version:
/// with `v1beta1` a request's fields are not nested under `exactly`.
pub fn review_claim(
    object: &str,
    spec: &res::ResourceClaimSpec,
    field_prefix: &str,
    v1beta1: bool,
    driver: &str,
    classes: &[res::DeviceClass],
    cel: &CelCache,
) -> (Vec<Error>, Vec<String>) {
    let as_written = |field: String| {
        if v1beta1 {
            v1beta1_field(&field)
        } else {
            field
        }
    };
    let errors = rewrite_fields(
        review_claim_spec(object, spec, field_prefix, driver, classes, cel),
        as_written,
    );
    let shares = share_classes(classes);
    let shares: Vec<&str> = shares.iter().map(String::as_str).collect();
    let warnings = crate::rules::validation::capacity_rounding_warnings(object, spec, &shares)
        .into_iter()
        .map(|w| {
            as_written(w.replacen(
                ": spec.devices",
                &format!(": {field_prefix}spec.devices"),
                1,
            ))
        })
        .collect();
    (errors, warnings)
}

/// A v1 field path as a v1beta1 object names it: v1beta1 keeps a request's fields flat where
/// v1 nests them under `exactly` (`spec.devices.requests[0].exactly.count` becomes
/// `spec.devices.requests[0].count`).
pub fn v1beta1_field(field: &str) -> String {
    let mut out = String::with_capacity(field.len());
    let mut rest = field;
    while let Some(at) = rest.find("].exactly") {
        let after = &rest[at + "].exactly".len()..];
        if after.is_empty() || after.starts_with('.') {
            out.push_str(&rest[..=at]);
            rest = after;
        } else {
            out.push_str(&rest[..at + "].exactly".len()]);
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// The JSON patch that rewrites every opaque `parameters` of a claim spec in canonical (compact)
/// JSON; `pointer` is where the claim spec sits in the object (`/spec`, or `/spec/spec` in a
/// template).
///
/// Why: the API server keeps opaque parameters as the raw bytes it was sent, while every client
/// re-encodes them compactly when it writes the object back, so a claim created with extra
/// whitespace fails every later update with "spec: field is immutable" (the claim finalizer
/// cannot be added, so it can never be allocated). A mutation that returns a patch makes the API
/// server decode the object again from the patched, compact JSON before it is stored.
pub fn canonical_parameters_patch(spec: &res::ResourceClaimSpec, pointer: &str) -> Vec<PatchOp> {
    spec.devices
        .iter()
        .flat_map(|d| d.config.iter().flatten())
        .enumerate()
        .filter_map(|(i, config)| {
            config.opaque.as_ref().map(|opaque| PatchOp {
                op: "replace",
                path: format!("{pointer}/devices/config/{i}/opaque/parameters"),
                value: opaque.parameters.0.clone(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {

    use serde_json::json;

    use super::*;
    use crate::names;

    fn spec(parameters: &serde_json::Value) -> res::ResourceClaimSpec {
        serde_json::from_value(json!({"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": names::CLASS_SHARED_GPU}}],
            "config": [
                {"requests": ["gpu"], "opaque": {"driver": names::DEFAULT_DRIVER_NAME, "parameters": parameters}},
                {"requests": ["gpu"], "opaque": {"driver": "other.example.com", "parameters": {"a": 1}}},
            ],
        }}))
        .unwrap()
    }

    /// Reviews `spec` as Tessera's driver with no classes; `object` and `field_prefix` as in
    /// [`review_claim_spec`].
    fn review(spec: &res::ResourceClaimSpec, object: &str, field_prefix: &str) -> Vec<Error> {
        let cel = CelCache::new();
        review_claim_spec(
            object,
            spec,
            field_prefix,
            names::DEFAULT_DRIVER_NAME,
            &[],
            &cel,
        )
    }

    #[test]
    fn template_errors_name_the_field_one_level_deeper() {
        let share = json!({"apiVersion": names::CONFIG_API_VERSION, "kind": "GpuShare", "memory": "10Gi", "compute": 7});
        let errors = review(&spec(&share), "ResourceClaimTemplate ns/t", "spec.");
        assert_eq!(errors.len(), 1, "{errors:?}");
        let text = errors[0].to_string();
        assert!(
            text.contains(
                "ResourceClaimTemplate ns/t: spec.spec.devices.config[0].opaque.parameters"
            ) && text.contains("compute")
                && text.contains("(request gpu)"),
            "{text}"
        );
        assert_eq!(text.matches("spec.devices").count(), 1, "{text}");
    }

    #[test]
    fn a_negative_request_in_a_template_is_reported_once_with_one_path() {
        let spec: res::ResourceClaimSpec = serde_json::from_value(json!({"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": names::CLASS_SHARED_GPU,
             "capacity": {"requests": {"memory": "-1Gi"}}}}]}}))
        .unwrap();
        let errors = review(&spec, "ResourceClaimTemplate ns/t", "spec.");
        assert_eq!(errors.len(), 1, "{errors:?}");
        let text = errors[0].to_string();
        assert!(
            text.starts_with(
                "ResourceClaimTemplate ns/t: spec.spec.devices.requests[0].exactly.capacity.requests.memory: -1Gi is negative"
            ),
            "{text}"
        );
    }

    #[test]
    fn v1beta1_paths_have_no_exactly() {
        assert_eq!(
            v1beta1_field("spec.spec.devices.requests[3].exactly.capacity.requests.memory"),
            "spec.spec.devices.requests[3].capacity.requests.memory"
        );
        assert_eq!(
            v1beta1_field("spec.devices.requests[0].firstAvailable[1].count"),
            "spec.devices.requests[0].firstAvailable[1].count"
        );
    }

    #[test]
    fn a_valid_share_passes() {
        let share = json!({"apiVersion": names::CONFIG_API_VERSION, "kind": "GpuShare", "memory": "10Gi", "compute": 50});
        let errors = review(&spec(&share), "ResourceClaim ns/c", "");
        assert!(errors.is_empty(), "{errors:?}");
    }

    #[test]
    fn every_opaque_config_is_rewritten_in_place() {
        let share =
            json!({"apiVersion": names::CONFIG_API_VERSION, "kind": "GpuShare", "memory": "1Gi"});
        let patch = canonical_parameters_patch(&spec(&share), "/spec/spec");
        let paths: Vec<&str> = patch.iter().map(|p| p.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "/spec/spec/devices/config/0/opaque/parameters",
                "/spec/spec/devices/config/1/opaque/parameters"
            ]
        );
        assert_eq!(patch[0].op, "replace");
        assert_eq!(patch[0].value, share);
    }
}
