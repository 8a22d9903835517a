//! Property-based fuzzing of every parser and decision that takes user input: documents in
//! every served version, `GpuShare` configs, CEL selectors, CSV traces and kubelet gRPC
//! requests. Each property asserts no panic, an error or a result, and the bound that makes
//! the work finite (input limits, the CEL cost limit); time is measured, never asserted.
//!
//! The suite runs [`DEFAULT_CASES`] cases per property; a longer run is started by hand:
//!
//! ```sh
//! TESSERA_FUZZ_CASES=20000 cargo test --release -p tessera-tests --test fuzz
//! ```
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::fmt::Write as _;

use proptest::prelude::*;
use prost::Message as _;
use tessera_controller::cli::input::Objects;
use tessera_controller::cli::{allocate, validate};
use tessera_driver::apiversion::nesting::{MAX_NESTING, check_nesting};
use tessera_driver::placement::allocator::Policy;
use tessera_driver::rules::cel::{self, CelDevice, MAX_COST};
use tessera_driver::rules::config::{self, TesseraConfig};
use tessera_driver::rules::published::PublishedDevice;
use tessera_driver::rules::quantity::Quantity;
use tessera_driver::rules::share::ShareRequest;
use tessera_driver::tools::simulate::{parse_nodes, parse_pods};

/// Cases per property in the ordinary test run.
const DEFAULT_CASES: u32 = 64;

fn config() -> ProptestConfig {
    let cases = std::env::var("TESSERA_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CASES);
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// ------------------------------------------------------------------ building blocks

/// Names: valid DNS labels, near misses, and hostile text.
fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z][a-z0-9-]{0,10}[a-z0-9]",
        "[A-Za-z0-9._-]{0,70}",
        Just(String::new()),
        Just("a\u{1b}[31mred".to_owned()),
        Just("x".repeat(300)),
    ]
}

/// Quantities: valid, odd and broken.
fn quantity() -> impl Strategy<Value = String> {
    prop_oneof![
        (0u64..200).prop_map(|n| format!("{n}Gi")),
        (0u64..200).prop_map(|n| n.to_string()),
        "-?[0-9]{1,30}(\\.[0-9]{0,12})?(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E|e[0-9]{1,6})?",
        Just("10Gi ".to_owned()),
        Just("1e400".to_owned()),
        "[ -~]{0,12}",
    ]
}

fn count() -> impl Strategy<Value = String> {
    prop_oneof![
        (-3i64..40).prop_map(|n| n.to_string()),
        Just("4294967296".to_owned()),
        Just("9223372036854775807".to_owned()),
        Just("\"1\"".to_owned()),
    ]
}

fn version() -> impl Strategy<Value = &'static str> {
    prop_oneof![Just("v1"), Just("v1beta2"), Just("v1beta1")]
}

/// A CEL expression from a small grammar over the `device` variable, with regexes.
fn cel_expression() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        Just("device.driver".to_owned()),
        Just("device.attributes[\"gpu.tessera.dev\"].model".to_owned()),
        Just("device.attributes[\"gpu.tessera.dev\"].index".to_owned()),
        Just("device.capacity[\"gpu.tessera.dev\"].memory".to_owned()),
        Just("device.allowMultipleAllocations".to_owned()),
        "\"[a-z0-9.\\\\{}()*+?|\\[\\]^$-]{0,12}\"".prop_map(|s| s),
        (0i64..1000).prop_map(|n| n.to_string()),
        Just("[1, 2, 3]".to_owned()),
        Just("quantity(\"10Gi\")".to_owned()),
    ];
    leaf.prop_recursive(4, 24, 3, |inner| {
        prop_oneof![
            (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("{a} == {b}")),
            (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("({a}) && ({b})")),
            (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("{a} + {b}")),
            (inner.clone(), "[a-z\\\\w.{}0-9*+]{0,10}")
                .prop_map(|(a, p)| format!("{a}.matches(\"{p}\")")),
            inner
                .clone()
                .prop_map(|a| format!("{a}.split(\"\").all(x, x != \"z\")")),
            inner.clone().prop_map(|a| format!("size({a}) > 2")),
            (inner.clone(), inner).prop_map(|(a, b)| format!("[{a}, {b}].exists(x, x == {b})")),
        ]
    })
}

fn slice_doc(api: &str, slice: &str, devices: &[(String, String, String)], nodes: u8) -> String {
    let v1beta1 = api == "v1beta1";
    let mut text = format!(
        "apiVersion: resource.k8s.io/{api}\nkind: ResourceSlice\nmetadata: {{name: {slice}}}\nspec:\n  driver: gpu.tessera.dev\n  pool: {{name: n, generation: 1, resourceSliceCount: 1}}\n"
    );
    if nodes & 1 != 0 {
        text.push_str("  nodeName: node-1\n");
    }
    if nodes & 2 != 0 {
        text.push_str("  allNodes: true\n");
    }
    text.push_str("  devices:\n");
    for (device, model, memory) in devices {
        let attributes = format!("{{model: {{string: {model:?}}}, type: {{string: gpu}}}}");
        let capacity = format!("{{memory: {{value: {memory:?}}}}}");
        if v1beta1 {
            let _ = writeln!(
                text,
                "  - name: {device:?}\n    basic: {{attributes: {attributes}, capacity: {capacity}}}"
            );
        } else {
            let _ = writeln!(
                text,
                "  - name: {device:?}\n    attributes: {attributes}\n    capacity: {capacity}"
            );
        }
    }
    text
}

fn claim_doc(
    api: &str,
    claim: &str,
    request: &str,
    class: &str,
    count: &str,
    selector: &str,
    memory: &str,
) -> String {
    let fields = format!(
        "deviceClassName: {class:?}, count: {count}, selectors: [{{cel: {{expression: {selector:?}}}}}], capacity: {{requests: {{memory: {memory:?}}}}}"
    );
    let request = if api == "v1beta1" {
        format!("{{name: {request:?}, {fields}}}")
    } else {
        format!("{{name: {request:?}, exactly: {{{fields}}}}}")
    };
    format!(
        "apiVersion: resource.k8s.io/{api}\nkind: ResourceClaim\nmetadata: {{name: {claim:?}, namespace: default}}\nspec:\n  devices:\n    requests: [{request}]\n"
    )
}

fn classes() -> String {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap();
    ["gpu.yaml", "shared-gpu.yaml"]
        .iter()
        .map(|f| std::fs::read_to_string(repo.join("deviceclasses").join(f)).unwrap())
        .collect::<Vec<_>>()
        .join("\n---\n")
}

proptest! {
    #![proptest_config(config())]

    /// Slices and claims in every served version, with hostile names, counts, quantities and
    /// selectors, go through loading (the API's validation), `validate` and `allocate`.
    #[test]
    fn documents_in_every_version_load_or_fail_cleanly(
        api in version(),
        slice in name(),
        devices in prop::collection::vec((name(), name(), quantity()), 0..6),
        nodes in 0u8..4,
        claim in name(),
        request in name(),
        class in prop_oneof![Just("gpu.tessera.dev".to_owned()), Just("shared.gpu.tessera.dev".to_owned()), name()],
        count in count(),
        selector in cel_expression(),
        memory in quantity(),
    ) {
        let text = format!(
            "{}\n---\n{}\n---\n{}",
            classes(),
            slice_doc(api, &slice, &devices, nodes),
            claim_doc(api, &claim, &request, &class, &count, &selector, &memory)
        );
        let mut objects = Objects::default();
        match objects.load_text("fuzz.yaml", &text) {
            Ok(()) => {
                // Loaded objects are what the API server accepts: a slice within its limits.
                prop_assert!(objects.slices.iter().all(|s| s.spec.devices.as_ref().is_none_or(|d| d.len() <= 128)));
                let mut report = String::new();
                let _ = validate::run(&objects, "gpu.tessera.dev", &mut report);
                for policy in [Policy::FirstFit, Policy::Binpack] {
                    let outcomes = allocate::run(&objects, "gpu.tessera.dev", policy, None);
                    if let Ok(answer) = outcomes {
                        // Every claim is answered: a result, or an error when Tessera refuses it.
                        prop_assert_eq!(
                            answer.outcomes.len() + answer.refused_claims.len(),
                            objects.claims.len()
                        );
                        prop_assert!(answer.errors.len() >= answer.refused_claims.len());
                    }
                }
            }
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
    }

    /// Arbitrary text, nesting included, is refused or read; never a panic.
    #[test]
    fn arbitrary_text_never_panics(text in prop_oneof![
        "[ -~\\n\\t\u{feff}]{0,400}",
        (1usize..5000).prop_map(|n| format!("{}{}", "[".repeat(n), "]".repeat(n))),
        (1usize..300).prop_map(|n| format!("{}x\n", "- ".repeat(n))),
    ]) {
        let deep = check_nesting(&text, MAX_NESTING).is_err();
        let mut objects = Objects::default();
        let loaded = objects.load_text("text.yaml", &text);
        if deep {
            prop_assert!(loaded.is_err());
        }
    }

    /// `GpuShare` parameters with any field values decode and validate, or fail with an error.
    #[test]
    fn gpu_shares_validate_or_fail_cleanly(
        memory in prop::option::of(quantity()),
        percent in prop::option::of(-5i64..300),
        compute in prop::option::of(-20i64..300),
        tier in prop::option::of(name()),
        cards in 0u32..10,
        extra in prop::option::of(name()),
    ) {
        let mut p = serde_json::json!({"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuShare"});
        if let Some(m) = memory { p["memory"] = m.into(); }
        if let Some(v) = percent { p["memoryPercent"] = v.into(); }
        if let Some(c) = compute { p["compute"] = c.into(); }
        if let Some(t) = tier { p["tier"] = t.into(); }
        if let Some(x) = extra { p[x] = 1.into(); }
        if let Ok(TesseraConfig::GpuShare(share)) = config::decode(&p, "parameters")
            && let Ok(request) = ShareRequest::from_gpu_share(&share, cards, "parameters")
        {
            for card in [15u64 << 30, 80 << 30] {
                if let Ok(per) = request.per_device(card) {
                    prop_assert!(per.memory_bytes <= card);
                    prop_assert!((0..=100).contains(&per.compute_percent));
                }
            }
        }
    }

    /// Native capacity requests are rounded or refused; a rounded share stays within the policy.
    #[test]
    fn native_requests_round_within_the_policy(memory in quantity(), compute in quantity()) {
        let mut req = BTreeMap::new();
        if let Ok(m) = Quantity::parse(&memory) { req.insert("memory".to_owned(), m); }
        if let Ok(c) = Quantity::parse(&compute) { req.insert("compute".to_owned(), c); }
        if let Ok(r) = tessera_driver::rules::share::round_capacity_requests(&req, "c") {
            prop_assert!(r.memory_bytes >= 1 << 30 && r.memory_bytes % (1 << 30) == 0);
            prop_assert!((0..=100).contains(&r.compute) && r.compute % 5 == 0);
        }
    }

    /// CEL selectors compile within the cost limit or are refused; an accepted one evaluates
    /// to a bool or a runtime error on a real device.
    #[test]
    fn cel_selectors_compile_within_the_limit_and_evaluate(expression in cel_expression()) {
        if let Ok(compiled) = cel::compile(&expression) {
            prop_assert!(compiled.max_cost() <= MAX_COST);
            let device: k8s_openapi::api::resource::v1::Device = serde_json::from_value(serde_json::json!({
                "name": "gpu-0",
                "attributes": {"model": {"string": "a100-80g"}, "index": {"int": 3}},
                "capacity": {"memory": {"value": "80Gi"}},
            })).unwrap();
            let _ = compiled.evaluate(&CelDevice::new("gpu.tessera.dev", &PublishedDevice::from(device)));
        }
    }

    /// CSV traces with any headers, cells and byte-order marks parse or fail with an error.
    #[test]
    fn csv_traces_parse_or_fail_cleanly(
        bom in any::<bool>(),
        header in prop_oneof![
            Just("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec".to_owned()),
            Just("sn,cpu_milli,memory_mib,gpu,model".to_owned()),
            "[a-z_,]{0,40}",
        ],
        rows in prop::collection::vec("[a-zA-Z0-9_|,. -]{0,40}", 0..8),
    ) {
        let text = format!("{}{header}\n{}\n", if bom { "\u{feff}" } else { "" }, rows.join("\n"));
        if let Ok(pods) = parse_pods("pods.csv", &text) {
            prop_assert!(!pods.is_empty());
        }
        let _ = parse_nodes("nodes.csv", &text);
    }

    /// Any bytes a kubelet could send decode into a request of either served DRA version, or
    /// fail to decode; never a panic.
    #[test]
    fn kubelet_requests_decode_or_fail_cleanly(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        use tessera_proto::dra::{v1, v1beta1};
        let _ = v1::NodePrepareResourcesRequest::decode(bytes.as_slice());
        let _ = v1::NodeUnprepareResourcesRequest::decode(bytes.as_slice());
        let _ = v1beta1::NodePrepareResourcesRequest::decode(bytes.as_slice());
        let _ = v1beta1::NodeUnprepareResourcesRequest::decode(bytes.as_slice());
    }
}
