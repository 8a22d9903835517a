//! Admission of ResourceClaims and ResourceClaimTemplates: the share rules, and opaque
//! parameters rewritten canonically.

use k8s_openapi::api::resource::v1 as res;

use super::PatchOp;
use crate::cel::CelCache;
use crate::error::Error;
use crate::validation::{share_classes, validate_claim_spec};

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
    validate_claim_spec(object, spec, driver, &shares, &lookup, cel)
        .into_iter()
        .map(|e| match e {
            Error::Invalid {
                object,
                field,
                message,
            } => Error::Invalid {
                object,
                field: format!("{field_prefix}{field}"),
                message,
            },
            other => other,
        })
        .collect()
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
    #![allow(clippy::unwrap_used)]

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

    #[test]
    fn template_errors_name_the_field_one_level_deeper() {
        let share = json!({"apiVersion": names::CONFIG_API_VERSION, "kind": "GpuShare", "memory": "10Gi", "compute": 7});
        let errors = review_claim_spec(
            "ResourceClaimTemplate ns/t",
            &spec(&share),
            "spec.",
            names::DEFAULT_DRIVER_NAME,
            &[],
            &CelCache::new(),
        );
        assert_eq!(errors.len(), 1, "{errors:?}");
        let text = errors[0].to_string();
        assert!(
            text.contains("spec.spec.devices.requests[0]") && text.contains("compute"),
            "{text}"
        );
    }

    #[test]
    fn a_valid_share_passes() {
        let share = json!({"apiVersion": names::CONFIG_API_VERSION, "kind": "GpuShare", "memory": "10Gi", "compute": 50});
        let errors = review_claim_spec(
            "ResourceClaim ns/c",
            &spec(&share),
            "",
            names::DEFAULT_DRIVER_NAME,
            &[],
            &CelCache::new(),
        );
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
