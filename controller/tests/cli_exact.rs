//! `tessera` gives exact answers: what kube-scheduler 1.36 and the API server decide, every
//! valid object its result and every invalid one its error in one run, and output that can be
//! fed back (issue 23).
#![allow(clippy::unwrap_used)]

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Output;

use serde_json::Value;

mod support;
use support::{allocate, assert_success, printed, success_json, tessera};

/// A fresh folder for one test's files, removed when the test ends.
fn folder() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn json(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", printed(out)))
}

/// Runs `tessera allocate -o json` on `path`, expects exit 2 (some input refused) and parses
/// the results and errors it printed.
fn allocate_refusing(path: &Path) -> Value {
    let out = allocate(&[path], "json");
    assert_eq!(out.status.code(), Some(2), "{}", printed(&out));
    json(&out)
}

const NIC_CLASS: &str = "apiVersion: resource.k8s.io/v1\nkind: DeviceClass\nmetadata: {name: nic.example.com}\nspec:\n  selectors: [{cel: {expression: 'device.driver == \"nic.example.com\"'}}]\n";

fn nic_slice(device: &str) -> String {
    format!(
        "---\napiVersion: resource.k8s.io/v1\nkind: ResourceSlice\nmetadata: {{name: nics}}\nspec:\n  driver: nic.example.com\n  nodeName: node-1\n  pool: {{name: node-1, generation: 1, resourceSliceCount: 1}}\n  devices: [{device}]\n"
    )
}

/// A ResourceClaim document `default/{name}` with the one request `request`.
fn claim(name: &str, request: &str) -> String {
    format!(
        "---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: {name}, namespace: default}}\nspec: {{devices: {{requests: [{request}]}}}}\n"
    )
}

#[test]
fn a_multi_allocatable_device_without_capacities_is_shared_by_every_claim() {
    let dir = folder();
    let mut input = format!(
        "{NIC_CLASS}{}",
        nic_slice("{name: nic-0, allowMultipleAllocations: true}")
    );
    for name in ["a", "b", "c", "d"] {
        input.push_str(&claim(
            name,
            "{name: nic, exactly: {deviceClassName: nic.example.com}}",
        ));
    }
    let path = write(dir.path(), "input.yaml", &input);
    let results = success_json(&allocate(&[&path], "json"))["results"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(results.len(), 4);
    let mut shares = std::collections::BTreeSet::new();
    for r in &results {
        assert_eq!(r["allocated"], true, "{r}");
        let device = &r["allocation"]["devices"]["results"][0];
        assert_eq!(device["device"], "nic-0");
        shares.insert(device["shareID"].as_str().unwrap().to_owned());
    }
    assert_eq!(shares.len(), 4, "each allocation has its own shareID");
}

const GPU_SLICE: &str = "---\napiVersion: resource.k8s.io/v1\nkind: ResourceSlice\nmetadata: {name: node-1-gpus}\nspec:\n  driver: gpu.tessera.dev\n  nodeName: node-1\n  pool: {name: node-1, generation: 1, resourceSliceCount: 1}\n  devices:\n  - name: gpu-0\n    allowMultipleAllocations: true\n    attributes: {type: {string: gpu}, sharing: {string: shared}, isolation: {string: verified}, model: {string: a100-80g}}\n    capacity:\n      memory: {value: 80Gi, requestPolicy: {default: 1Gi, validRange: {min: 1Gi, step: 1Gi}}}\n      compute: {value: '100', requestPolicy: {default: '0', validRange: {min: '0', max: '100', step: '5'}}}\n";

fn class(file: &str) -> String {
    std::fs::read_to_string(support::repo().join("deviceclasses").join(file)).unwrap()
}

fn share_claim(name: &str, memory: &str) -> String {
    claim(
        name,
        &format!(
            "{{name: gpu, exactly: {{deviceClassName: shared.gpu.tessera.dev, capacity: {{requests: {{memory: {memory}}}}}}}}}"
        ),
    )
}

#[test]
fn a_negative_capacity_request_is_refused_naming_claim_request_and_field() {
    let dir = folder();
    let input = format!(
        "{}{GPU_SLICE}{}{}",
        class("shared-gpu.yaml"),
        share_claim("neg", "-1Gi"),
        share_claim("fine", "10Gi")
    );
    let path = write(dir.path(), "input.yaml", &input);
    let answer = allocate_refusing(&path);
    let errors = answer["errors"].as_array().unwrap();
    assert_eq!(errors.len(), 1, "{answer}");
    let error = errors[0].as_str().unwrap();
    for needle in [
        "input.yaml: document 3",
        "ResourceClaim default/neg",
        "spec.devices.requests[0].exactly.capacity.requests.memory",
        "-1Gi is negative",
        "(request gpu)",
    ] {
        assert!(error.contains(needle), "{needle:?} missing from {error}");
    }
    assert!(!error.contains("too full"), "{error}");
    // The other claim still gets its result; the refused one gets none.
    let results = answer["results"].as_array().unwrap();
    assert_eq!(results.len(), 1, "{answer}");
    assert_eq!(results[0]["name"], "fine");
    assert_eq!(results[0]["allocated"], true);
}

#[test]
fn validate_escapes_control_characters_in_names() {
    let dir = folder();
    let input = "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {name: \"a\\e[31mb\\nerror: forged\\a\", namespace: default}\nspec: {devices: {requests: [{name: gpu, exactly: {deviceClassName: gpu.tessera.dev}}]}}\n";
    let path = write(dir.path(), "escape.yaml", input);
    let out = tessera(&["validate", "-f", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", printed(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        !stdout.contains('\u{1b}') && !stdout.contains('\u{7}'),
        "{stdout:?}"
    );
    assert!(
        !stdout.lines().any(|l| l.starts_with("error: forged")),
        "a name forged an output line: {stdout}"
    );
    assert!(
        stdout.contains("a\\u{1b}[31mb\\u{a}error: forged\\u{7}"),
        "{stdout}"
    );
}

#[test]
fn validate_escapes_bidi_and_format_characters_in_names() {
    // A right-to-left override (U+202E) would make `gpu-\u{202e}txt.exe` read as `gpu-exe.txt`;
    // isolates (U+2067) and zero-width spaces (U+200B) reorder or hide text as well.
    let dir = folder();
    for c in ['\u{202e}', '\u{2067}', '\u{200b}'] {
        let input = format!(
            "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: \"gpu-\\u{:04x}txt.exe\", namespace: default}}\nspec: {{devices: {{requests: [{{name: gpu, exactly: {{deviceClassName: gpu.tessera.dev}}}}]}}}}\n",
            u32::from(c)
        );
        let path = write(dir.path(), "format.yaml", &input);
        let out = tessera(&["validate", "-f", path.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(2), "{}", printed(&out));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(!stdout.contains(c), "{stdout:?}");
        let escaped = format!("gpu-{}txt.exe", c.escape_unicode());
        assert!(stdout.contains(&escaped), "{escaped} missing from {stdout}");
    }
}

#[test]
fn validate_reports_a_count_over_the_claim_limit_as_allocate_does() {
    let dir = folder();
    let input = format!(
        "{}---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: many, namespace: default}}\nspec: {{devices: {{requests: [{{name: gpu, exactly: {{deviceClassName: gpu.tessera.dev, count: 4294967296}}}}]}}}}\n",
        class("gpu.yaml")
    );
    let path = write(dir.path(), "count.yaml", &input);
    let out = tessera(&["validate", "-f", path.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    let rule = "4294967296 devices requested exceed the claim limit of 32 devices";
    assert!(
        stdout.contains(&format!(
            "ResourceClaim default/many: spec.devices.requests[0]: {rule}"
        )),
        "{stdout}"
    );
    let out = allocate(&[&path], "json");
    assert!(
        json(&out)["results"][0]["reason"]
            .as_str()
            .unwrap()
            .contains(rule)
    );
}

#[test]
fn an_annotation_over_the_api_servers_256_kib_is_refused() {
    let dir = folder();
    let claim = |name: &str, bytes: usize| {
        format!(
            "---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata:\n  name: {name}\n  namespace: default\n  annotations: {{example.com/blob: {}}}\nspec: {{devices: {{requests: [{{name: gpu, exactly: {{deviceClassName: gpu.tessera.dev}}}}]}}}}\n",
            "x".repeat(bytes)
        )
    };
    let key = "example.com/blob".len();
    // At the limit: accepted. One byte over it, or 50 MB: refused, naming the field.
    let input = format!(
        "{}{}{}{}",
        class("gpu.yaml"),
        claim("at-limit", 256 * 1024 - key),
        claim("one-over", 256 * 1024 - key + 1),
        claim("huge", 50_000_000)
    );
    let path = write(dir.path(), "annotations.yaml", &input);
    let out = tessera(&["validate", "-f", path.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(2), "{stdout}");
    assert!(!stdout.contains("default/at-limit"), "{stdout}");
    for (name, bytes) in [("one-over", 262_145), ("huge", 50_000_016)] {
        assert!(
            stdout.contains(&format!(
                "ResourceClaim default/{name}: metadata.annotations: keys and values take {bytes} bytes together; at most 262144 bytes (256 KiB) are allowed"
            )),
            "{stdout}"
        );
    }
}

/// Five pods in five files, each with its own claim of one whole GPU (four GPUs on the node).
fn five_pods(dir: &Path, broken: usize) {
    let mut devices = String::new();
    for i in 0..4 {
        let _ = writeln!(
            devices,
            "  - name: gpu-{i}\n    attributes: {{type: {{string: gpu}}, sharing: {{string: exclusive}}}}"
        );
    }
    write(
        dir,
        "0-cluster.yaml",
        &format!(
            "{}---\napiVersion: resource.k8s.io/v1\nkind: ResourceSlice\nmetadata: {{name: node-1-gpus}}\nspec:\n  driver: gpu.tessera.dev\n  nodeName: node-1\n  pool: {{name: node-1, generation: 1, resourceSliceCount: 1}}\n  devices:\n{devices}",
            class("gpu.yaml")
        ),
    );
    for i in 1..=5 {
        // The broken pod's containers are not a list: it does not decode.
        let containers = if i == broken {
            "main"
        } else {
            "[{name: main, image: cuda}]"
        };
        write(
            dir,
            &format!("pod-{i}.yaml"),
            &format!(
                "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: gpu-{i}, namespace: default}}\nspec: {{devices: {{requests: [{{name: gpu, exactly: {{deviceClassName: gpu.tessera.dev}}}}]}}}}\n---\napiVersion: v1\nkind: Pod\nmetadata: {{name: pod-{i}, namespace: default}}\nspec:\n  containers: {containers}\n  resourceClaims: [{{name: gpu, resourceClaimName: gpu-{i}}}]\n"
            ),
        );
    }
}

#[test]
fn a_folder_with_one_invalid_pod_gives_every_other_object_its_result() {
    let dir = folder();
    five_pods(dir.path(), 3);
    let answer = allocate_refusing(dir.path());
    let errors: Vec<&str> = answer["errors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap())
        .collect();
    assert_eq!(errors.len(), 1, "{answer}");
    assert!(
        errors[0].contains("pod-3.yaml: document 2"),
        "{}",
        errors[0]
    );
    assert!(errors[0].contains("Pod default/pod-3"), "{}", errors[0]);
    let results = answer["results"].as_array().unwrap();
    let by_name = |n: &str| results.iter().find(|r| r["name"] == n).unwrap();
    for placed in ["gpu-1", "gpu-2", "gpu-4", "gpu-5"] {
        assert_eq!(by_name(placed)["allocated"], true, "{answer}");
    }
    // The refused pod's claim is not placed on its own: the pod will never run.
    let orphan = by_name("gpu-3");
    assert_eq!(orphan["allocated"], false);
    assert!(
        orphan["reason"]
            .as_str()
            .unwrap()
            .contains("its Pod default/pod-3 was refused"),
        "{orphan}"
    );
    // The table shows the same, results and errors in one output.
    let out = tessera(&["allocate", "-f", dir.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.matches(" allocated ").count(), 4, "{stdout}");
    assert!(
        stdout.contains("error: ") && stdout.contains("Pod default/pod-3"),
        "{stdout}"
    );
}

#[test]
fn a_file_that_does_not_parse_is_an_error_and_the_others_are_allocated() {
    let dir = folder();
    five_pods(dir.path(), 0);
    write(dir.path(), "pod-3.yaml", "kind: [unclosed\n");
    let answer = allocate_refusing(dir.path());
    assert!(
        answer["errors"][0]
            .as_str()
            .unwrap()
            .contains("pod-3.yaml: document 1: not valid YAML"),
        "{answer}"
    );
    let allocated = answer["results"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["allocated"] == true)
        .count();
    assert_eq!(allocated, 4, "{answer}");
}

#[test]
fn the_claims_output_round_trips_through_allocate() {
    let dir = folder();
    let cluster = write(
        dir.path(),
        "cluster.yaml",
        &format!("{}{GPU_SLICE}", class("shared-gpu.yaml")),
    );
    // One claim in v1beta1 (request fields flat), one in v1.
    let first = write(
        dir.path(),
        "claims.yaml",
        &format!(
            "apiVersion: resource.k8s.io/v1beta1\nkind: ResourceClaim\nmetadata: {{name: old, namespace: default, uid: 0b7c4a3e-1111-4222-8333-444455556666}}\nspec: {{devices: {{requests: [{{name: gpu, deviceClassName: shared.gpu.tessera.dev, capacity: {{requests: {{memory: 40Gi}}}}}}]}}}}\n{}",
            share_claim("new", "30Gi")
        ),
    );
    let results = json(&allocate(&[&cluster, &first], "json"))["results"].clone();
    let out = allocate(&[&cluster, &first], "claims");
    assert_success(&out);
    let written = String::from_utf8(out.stdout).unwrap();
    let documents: Vec<serde_yaml::Value> = serde_yaml::Deserializer::from_str(&written)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect();
    assert_eq!(documents.len(), 2, "{written}");
    // Each claim as the input wrote it, in its own version, with the allocation of the results.
    assert_eq!(documents[0]["apiVersion"], "resource.k8s.io/v1beta1");
    assert_eq!(
        documents[0]["spec"]["devices"]["requests"][0]["deviceClassName"],
        "shared.gpu.tessera.dev"
    );
    assert_eq!(
        documents[0]["metadata"]["uid"],
        "0b7c4a3e-1111-4222-8333-444455556666"
    );
    assert_eq!(documents[1]["apiVersion"], "resource.k8s.io/v1");
    for (i, doc) in documents.iter().enumerate() {
        let allocation: Value = serde_json::to_value(&doc["status"]["allocation"]).unwrap();
        assert_eq!(allocation, results[i]["allocation"], "{written}");
    }
    // Fed back with one more claim: the written ones count as used (70 of 80 GiB), so a
    // 20 GiB share no longer fits and a 10 GiB one does.
    let claims = write(dir.path(), "allocated.yaml", &written);
    let more = write(
        dir.path(),
        "more.yaml",
        &format!(
            "{}{}",
            share_claim("too-big", "20Gi"),
            share_claim("fits", "10Gi")
        ),
    );
    let again = success_json(&allocate(&[&cluster, &claims, &more], "json"))["results"].clone();
    assert_eq!(again.as_array().unwrap().len(), 2, "{again}");
    assert_eq!(again[0]["name"], "too-big");
    assert_eq!(again[0]["allocated"], false, "{again}");
    assert_eq!(again[1]["name"], "fits");
    assert_eq!(again[1]["allocated"], true, "{again}");
}

#[test]
fn a_pod_whose_claim_is_refused_has_none_of_its_claims_placed() {
    let dir = folder();
    let pod = "---\napiVersion: v1\nkind: Pod\nmetadata: {name: two, namespace: default}\nspec:\n  containers: [{name: main, image: cuda}]\n  resourceClaims: [{name: a, resourceClaimName: good}, {name: b, resourceClaimName: neg}]\n";
    let input = format!(
        "{}{GPU_SLICE}{}{}{pod}{}",
        class("shared-gpu.yaml"),
        share_claim("good", "10Gi"),
        share_claim("neg", "-1Gi"),
        share_claim("alone", "10Gi")
    );
    let path = write(dir.path(), "input.yaml", &input);
    let answer = allocate_refusing(&path);
    assert!(
        answer["errors"][0]
            .as_str()
            .unwrap()
            .contains("ResourceClaim default/neg"),
        "{answer}"
    );
    let results = answer["results"].as_array().unwrap();
    assert_eq!(results.len(), 2, "{answer}");
    assert_eq!(results[0]["name"], "good");
    assert_eq!(results[0]["allocated"], false);
    assert!(
        results[0]["reason"]
            .as_str()
            .unwrap()
            .contains("ResourceClaim default/neg of its Pod default/two was refused"),
        "{answer}"
    );
    assert_eq!(results[1]["name"], "alone");
    assert_eq!(results[1]["allocated"], true);
}
