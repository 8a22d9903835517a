//! `tessera` against hostile and careless input: every refusal exits 2 and names the file, the
//! object and the field; nothing is accepted that the API server would refuse.
#![allow(clippy::unwrap_used)]

use std::process::Output;

mod support;
use support::{allocate, assert_success, printed, repo, success_json, tessera, write_temp};

/// Runs `tessera` on one file and expects exit 2 with every `needle` in stderr.
fn refused(command: &str, name: &str, text: &str, needles: &[&str]) -> String {
    let path = write_temp(name, text);
    let out = tessera(
        &[command, "-f", path.to_str().unwrap(), "-o", "json"]
            [..if command == "validate" { 3 } else { 5 }],
    );
    let text = printed(&out);
    assert_eq!(out.status.code(), Some(2), "{text}");
    for needle in needles {
        assert!(text.contains(needle), "{needle:?} missing from: {text}");
    }
    text
}

const CLASS: &str = "apiVersion: resource.k8s.io/v1\nkind: DeviceClass\nmetadata: {name: gpu.tessera.dev}\nspec:\n  selectors: [{cel: {expression: 'device.driver == \"gpu.tessera.dev\"'}}]\n";

fn claim(name: &str, request: &str) -> String {
    format!(
        "---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  devices:\n    requests: [{request}]\n"
    )
}

#[test]
fn deep_flow_nesting_is_refused_before_parsing() {
    let text = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    refused(
        "allocate",
        "deep.yaml",
        &text,
        &["deep.yaml: line 1: nested 101 levels deep"],
    );
}

#[test]
fn a_second_object_with_the_same_name_is_refused() {
    let one = claim(
        "c",
        "{name: gpu, exactly: {deviceClassName: gpu.tessera.dev}}",
    );
    let text = format!("{CLASS}{one}{one}");
    refused(
        "allocate",
        "dup.yaml",
        &text,
        &[
            "dup.yaml: document 3",
            "ResourceClaim default/c",
            "already defined in",
            "document 2",
        ],
    );
}

#[test]
fn a_slice_the_api_server_would_refuse_is_refused() {
    let devices: Vec<String> = (0..129).map(|i| format!("{{name: gpu-{i}}}")).collect();
    let text = format!(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceSlice\nmetadata: {{name: s}}\nspec:\n  driver: gpu.tessera.dev\n  nodeName: n\n  allNodes: true\n  pool: {{name: n, generation: 1, resourceSliceCount: 1}}\n  devices: [{}]\n",
        devices.join(",")
    );
    refused(
        "allocate",
        "slice.yaml",
        &text,
        &[
            "slice.yaml: document 1",
            "ResourceSlice s: spec.devices: 129 devices; at most 128",
            "ResourceSlice s: spec: exactly one of",
        ],
    );
}

#[test]
fn a_request_without_a_class_or_a_name_is_refused_by_validate() {
    let text = format!(
        "{CLASS}{}{}",
        claim("a", "{name: gpu, exactly: {deviceClassName: ''}}"),
        claim(
            "b",
            "{name: x, exactly: {deviceClassName: gpu.tessera.dev}}, {name: x, exactly: {deviceClassName: gpu.tessera.dev}}"
        ),
    );
    refused(
        "validate",
        "noclass.yaml",
        &text,
        &["ResourceClaim default/a: spec.devices.requests[0].exactly.deviceClassName: required"],
    );
    let text = format!(
        "{CLASS}{}",
        claim(
            "b",
            "{name: x, exactly: {deviceClassName: gpu.tessera.dev}}, {name: x, exactly: {deviceClassName: gpu.tessera.dev}}"
        )
    );
    refused(
        "validate",
        "dupreq.yaml",
        &text,
        &["spec.devices.requests[1].name: duplicate request name \"x\""],
    );
}

#[test]
fn a_cel_syntax_error_is_malformed_input_for_allocate() {
    let text = format!(
        "{CLASS}{}",
        claim(
            "a",
            "{name: gpu, exactly: {deviceClassName: gpu.tessera.dev, selectors: [{cel: {expression: 'device.driver =='}}]}}"
        )
    );
    refused(
        "allocate",
        "cel.yaml",
        &text,
        &["ResourceClaim default/a: spec.devices.requests[0].exactly.selectors[0].cel.expression"],
    );
}

#[test]
fn a_byte_order_mark_is_accepted() {
    let path = write_temp("bom.yaml", &format!("\u{feff}{CLASS}"));
    assert_success(&tessera(&["validate", "-f", path.to_str().unwrap()]));
}

#[test]
fn validate_lists_each_problem_once() {
    let text = format!(
        "{CLASS}{}",
        claim(
            "a",
            "{name: gpu, exactly: {deviceClassName: gpu.tessera.dev, selectors: [{cel: {expression: 'device.driver =='}}]}}"
        )
    );
    let out = refused("validate", "once.yaml", &text, &["cel.expression"]);
    assert_eq!(
        out.matches("selectors[0].cel.expression").count(),
        1,
        "{out}"
    );
}

const NODES: &str = "sn,cpu_milli,memory_mib,gpu,model\nnode-a,32000,131072,2,G2\n";

fn simulate(pods: &str, name: &str) -> Output {
    let nodes = write_temp(&format!("nodes-{name}"), NODES);
    let pods = write_temp(name, pods);
    support::simulate(&nodes, &pods, &["--seed", "1", "-o", "json"])
}

/// Runs `simulate` on the pod list `pods` and expects exit 2 with `needle` in stderr.
fn simulate_refused(pods: &str, name: &str, needle: &str) {
    let out = simulate(pods, name);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains(needle), "{stderr}");
}

#[test]
fn simulate_refuses_a_pod_list_without_gpu_demand() {
    simulate_refused(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1000,1024,0,0\np1,2000,1024,0,0\n",
        "cpu-only.csv",
        "cpu-only.csv: none of the 2 tasks asks for a GPU",
    );
}

#[test]
fn simulate_refuses_a_pod_list_of_only_a_header() {
    simulate_refused(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n",
        "header.csv",
        "header.csv: rows: the pod list has a header but no tasks",
    );
}

#[test]
fn simulate_reads_a_csv_with_a_byte_order_mark() {
    assert_success(&simulate(
        "\u{feff}name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1000,1024,1,500\n",
        "bom.csv",
    ));
}

#[test]
fn out_of_range_slice_quantities_are_malformed_input() {
    let text = "apiVersion: resource.k8s.io/v1\nkind: ResourceSlice\nmetadata: {name: s}\nspec:\n  driver: gpu.tessera.dev\n  nodeName: n\n  pool: {name: n, generation: 1, resourceSliceCount: 1}\n  devices: [{name: gpu-0, capacity: {memory: {value: 1e400}}}]\n";
    refused(
        "allocate",
        "range.yaml",
        text,
        &["spec.devices[0].capacity[memory].value", "out of range"],
    );
}

#[test]
fn the_table_escapes_control_characters() {
    let text = format!(
        "{CLASS}{}",
        claim(
            "a",
            "{name: gpu, exactly: {deviceClassName: gpu.tessera.dev, selectors: [{cel: {expression: 'device.attributes[\"gpu.tessera.dev\"][\"\\x1b[31mred\"] == 1'}}]}}"
        )
    );
    let slice = "---\napiVersion: resource.k8s.io/v1\nkind: ResourceSlice\nmetadata: {name: s}\nspec:\n  driver: gpu.tessera.dev\n  nodeName: n\n  pool: {name: n, generation: 1, resourceSliceCount: 1}\n  devices: [{name: gpu-0}]\n";
    let path = write_temp("escape.yaml", &format!("{text}{slice}"));
    let out = allocate(&[&path], "table");
    assert_success(&out);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("pending"), "{stdout}");
    assert!(!stdout.contains('\u{1b}'), "{stdout:?}");
    assert!(stdout.contains("\\u{1b}[31mred"), "{stdout}");
}

const SHARED_SLICE: &str = "---\napiVersion: resource.k8s.io/v1\nkind: ResourceSlice\nmetadata: {name: node-1-gpus}\nspec:\n  driver: gpu.tessera.dev\n  nodeName: node-1\n  pool: {name: node-1, generation: 1, resourceSliceCount: 1}\n  devices:\n  - name: gpu-0\n    allowMultipleAllocations: true\n    attributes: {type: {string: gpu}, sharing: {string: shared}, isolation: {string: verified}, model: {string: a100-80g}}\n    capacity:\n      memory: {value: 80Gi, requestPolicy: {default: 1Gi, validRange: {min: 1Gi, step: 1Gi}}}\n      compute: {value: '100', requestPolicy: {default: '0', validRange: {min: '0', max: '100', step: '5'}}}\n";

fn shared_class() -> String {
    std::fs::read_to_string(repo().join("deviceclasses/shared-gpu.yaml")).unwrap()
}

#[test]
fn a_share_larger_than_any_card_is_explained_as_such() {
    let text = format!(
        "{}{SHARED_SLICE}{}",
        shared_class(),
        claim(
            "big",
            "{name: gpu, exactly: {deviceClassName: shared.gpu.tessera.dev, capacity: {requests: {memory: 200Gi}}}}"
        )
    );
    let path = write_temp("big-share.yaml", &text);
    let json = success_json(&allocate(&[&path], "json"));
    let reason = json["results"][0]["reason"].as_str().unwrap();
    assert!(
        reason.contains("1 smaller than the share asked of one card"),
        "{reason}"
    );
    assert!(!reason.contains("too full"), "{reason}");
}

#[test]
fn a_huge_count_is_explained_as_too_many_not_too_few() {
    let text = format!(
        "{}{}",
        shared_class(),
        "---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {name: many, namespace: default}\nspec:\n  devices:\n    requests: [{name: gpu, exactly: {deviceClassName: shared.gpu.tessera.dev, count: 4294967296}}]\n    config: [{opaque: {driver: gpu.tessera.dev, parameters: {apiVersion: gpu.tessera.dev/v1alpha1, kind: GpuShare, memory: 10Gi}}}]\n"
    );
    let path = write_temp("count.yaml", &text);
    let out = tessera(&["validate", "-f", path.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains("count 4294967296 is more than the 32 devices one claim can be allocated"),
        "{stdout}"
    );
    assert!(!stdout.contains("at least 1"), "{stdout}");
}

#[test]
fn native_requests_are_rounded_as_kube_scheduler_rounds_them() {
    let text = format!(
        "{}{SHARED_SLICE}{}",
        shared_class(),
        claim(
            "round",
            "{name: gpu, exactly: {deviceClassName: shared.gpu.tessera.dev, capacity: {requests: {memory: 1500Mi, compute: '7'}}}}"
        )
    );
    let path = write_temp("round.yaml", &text);
    let out = tessera(&["validate", "-f", path.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("warning: ResourceClaim default/round: spec.devices.requests[0].exactly.capacity.requests: memory 1500Mi rounds up to 2Gi"), "{stdout}");
    let json = success_json(&allocate(&[&path], "json"));
    assert_eq!(json["results"][0]["allocated"], true, "{json}");
    let consumed = &json["results"][0]["allocation"]["devices"]["results"][0]["consumedCapacity"];
    assert_eq!(consumed["memory"], "2Gi", "{json}");
    assert_eq!(consumed["compute"], "10", "{json}");
}
