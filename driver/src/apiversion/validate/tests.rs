use super::*;
use crate::apiversion::decode_document;

fn object(yaml: &str) -> Object {
    let value: serde_json::Value = serde_yaml::from_str(yaml).expect("test YAML");
    decode_document(value, "test").expect("decodes")
}

fn problems(yaml: &str) -> Vec<String> {
    validate_object(&object(yaml), &CelCache::new())
        .iter()
        .map(ToString::to_string)
        .collect()
}

fn slice(spec_extra: &str, devices: &str) -> String {
    format!(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceSlice\nmetadata: {{name: s}}\nspec:\n  driver: gpu.tessera.dev\n  pool: {{name: n, generation: 1, resourceSliceCount: 1}}\n{spec_extra}  devices: {devices}\n"
    )
}

fn claim(requests: &str) -> String {
    format!(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: c, namespace: default}}\nspec:\n  devices:\n    requests: {requests}\n"
    )
}

fn assert_one(found: &[String], field: &str, words: &str) {
    assert!(
        found.iter().any(|p| p.contains(field) && p.contains(words)),
        "expected a problem at {field} saying {words:?}, got {found:#?}"
    );
}

#[test]
fn a_valid_slice_and_claim_pass() {
    assert_eq!(
        problems(&slice(
            "  nodeName: n\n",
            "[{name: gpu-0, attributes: {model: {string: a100}}, capacity: {memory: {value: 80Gi}}}]"
        )),
        Vec::<String>::new()
    );
    assert_eq!(
        problems(&claim(
            "[{name: gpu, exactly: {deviceClassName: gpu.tessera.dev, count: 2}}]"
        )),
        Vec::<String>::new()
    );
}

#[test]
fn a_slice_of_more_than_128_devices_is_refused() {
    let devices: Vec<String> = (0..129).map(|i| format!("{{name: d{i}}}")).collect();
    let found = problems(&slice(
        "  nodeName: n\n",
        &format!("[{}]", devices.join(",")),
    ));
    assert_eq!(found.len(), 1, "{found:?}");
    assert_one(&found, "spec.devices", "129 devices; at most 128");
}

#[test]
fn a_slice_must_name_exactly_one_node_selection() {
    let found = problems(&slice("  nodeName: n\n  allNodes: true\n", "[]"));
    assert_one(&found, "spec", "but nodeName, allNodes are set");
    let found = problems(&slice("", "[]"));
    assert_one(&found, "spec", "exactly one of `nodeName`");
}

#[test]
fn attribute_values_and_counts_follow_the_api_limits() {
    let long = "x".repeat(100_000);
    let found = problems(&slice(
        "  allNodes: true\n",
        &format!("[{{name: d, attributes: {{model: {{string: {long}}}, v: {{version: '1.2'}}}}}}]"),
    ));
    assert_one(
        &found,
        "spec.devices[0].attributes[model].string",
        "100000 characters; at most 64",
    );
    assert_one(
        &found,
        "spec.devices[0].attributes[v].version",
        "semantic version",
    );
    let attrs: Vec<String> = (0..33).map(|i| format!("a{i}: {{int: 1}}")).collect();
    let found = problems(&slice(
        "  allNodes: true\n",
        &format!("[{{name: d, attributes: {{{}}}}}]", attrs.join(",")),
    ));
    assert_one(
        &found,
        "spec.devices[0]",
        "33 attributes and capacities; at most 32",
    );
}

#[test]
fn duplicate_devices_and_bad_names_are_refused() {
    let found = problems(&slice(
        "  allNodes: true\n",
        "[{name: d}, {name: d}, {name: Bad_Name}]",
    ));
    assert_one(&found, "spec.devices[1].name", "duplicate device name");
    assert_one(&found, "spec.devices[2].name", "DNS label");
}

#[test]
fn a_request_policy_needs_a_shareable_device_and_a_default() {
    let found = problems(&slice(
        "  allNodes: true\n",
        "[{name: d, capacity: {memory: {value: 8Gi, requestPolicy: {default: 1Gi}}}}, {name: e, allowMultipleAllocations: true, capacity: {memory: {value: 8Gi, requestPolicy: {validRange: {min: 1Gi, step: 1Gi}}}}}]",
    ));
    assert_one(
        &found,
        "spec.devices[0].capacity[memory].requestPolicy",
        "allowMultipleAllocations must be true",
    );
    assert_one(
        &found,
        "spec.devices[1].capacity[memory].requestPolicy.default",
        "required",
    );
}

#[test]
fn out_of_range_capacity_is_refused() {
    let found = problems(&slice(
        "  allNodes: true\n",
        "[{name: d, capacity: {memory: {value: 1e400}}}]",
    ));
    assert_one(
        &found,
        "spec.devices[0].capacity[memory].value",
        "out of range",
    );
}

#[test]
fn objects_need_a_name() {
    let found = problems(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {namespace: default}\nspec: {}\n",
    );
    assert_one(&found, "metadata.name", "required");
}

#[test]
fn requests_need_unique_names_and_a_class() {
    let found = problems(&claim(
        "[{name: '', exactly: {deviceClassName: a}}, {name: r, exactly: {deviceClassName: a}}, {name: r, exactly: {deviceClassName: ''}}]",
    ));
    assert_one(&found, "spec.devices.requests[0].name", "required");
    assert_one(
        &found,
        "spec.devices.requests[2].name",
        "duplicate request name",
    );
    assert_one(
        &found,
        "spec.devices.requests[2].exactly.deviceClassName",
        "required",
    );
}

#[test]
fn counts_and_modes_follow_the_api() {
    let found = problems(&claim(
        "[{name: a, exactly: {deviceClassName: c, count: 0}}, {name: b, exactly: {deviceClassName: c, allocationMode: All, count: 2}}, {name: d, exactly: {deviceClassName: c, allocationMode: Some}}]",
    ));
    assert_one(&found, "requests[0].exactly.count", "greater than zero");
    assert_one(&found, "requests[1].exactly.count", "must not be specified");
    assert_one(
        &found,
        "requests[2].exactly.allocationMode",
        "unsupported value",
    );
}

#[test]
fn a_cel_syntax_error_is_refused() {
    let found = problems(&claim(
        "[{name: a, exactly: {deviceClassName: c, selectors: [{cel: {expression: 'device.driver =='}}]}}]",
    ));
    assert_one(
        &found,
        "requests[0].exactly.selectors[0].cel.expression",
        "CEL",
    );
}

#[test]
fn constraints_and_configs_name_existing_requests() {
    let found = problems(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {name: c}\nspec:\n  devices:\n    requests: [{name: a, exactly: {deviceClassName: c}}]\n    constraints: [{requests: [b], matchAttribute: gpu.tessera.dev/model}, {requests: [a], matchAttribute: model}]\n    config: [{requests: [a/x], opaque: {driver: gpu.tessera.dev, parameters: {}}}]\n",
    );
    assert_one(
        &found,
        "constraints[0].requests[0]",
        "must be the name of a request",
    );
    assert_one(&found, "constraints[1].matchAttribute", "fully qualified");
    assert_one(
        &found,
        "config[0].requests[0]",
        "must be the name of a request",
    );
}

#[test]
fn template_paths_start_at_the_template_spec() {
    let found = problems(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\nmetadata: {name: t}\nspec:\n  spec:\n    devices:\n      requests: [{name: a, exactly: {deviceClassName: c, count: -1}}]\n",
    );
    assert_eq!(found.len(), 1, "{found:?}");
    assert_one(
        &found,
        "ResourceClaimTemplate default/t: spec.spec.devices.requests[0].exactly.count",
        "greater than zero",
    );
}
