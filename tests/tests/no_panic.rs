//! No input makes the CLI panic: mutated versions of real manifests go through loading,
//! validation and allocation, and each either works or fails with an error.
#![allow(clippy::unwrap_used)]

use std::path::Path;

use proptest::prelude::*;
use tessera_controller::cli::input::Objects;
use tessera_controller::cli::{allocate, validate};
use tessera_driver::placement::allocator::Policy;

fn corpus() -> String {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut docs = Vec::new();
    for dir in [
        "deviceclasses",
        "examples/claims",
        "tests/fixtures/no-panic",
    ] {
        let Ok(entries) = std::fs::read_dir(repo.join(dir)) else {
            continue;
        };
        let mut paths: Vec<_> = entries.map(|e| e.unwrap().path()).collect();
        paths.sort();
        for p in paths {
            docs.push(std::fs::read_to_string(p).unwrap());
        }
    }
    docs.join("\n---\n")
}

const ODD_VALUES: &[&str] = &[
    "-1",
    "0",
    "-5Gi",
    "1e99999",
    "99999999999999999999999",
    "null",
    "[]",
    "{}",
    "\"\"",
    "true",
    "0.0000000001",
    "1Ei",
    "\"device.attributes[\\\"x\\\"].y\"",
    "[1, [2, [3]]]",
    "\"a\\u0000b\"",
    "\"gpu.tessera.dev/v1alpha1\"",
    "All",
    "\"*\"",
    "7",
    "1Gi",
];

/// Replaces the value after the first `:` on a line, drops a line, or duplicates one.
fn mutate(text: &str, ops: &[(usize, u8, usize)]) -> String {
    let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
    for &(at, op, value) in ops {
        if lines.is_empty() {
            break;
        }
        let at = at % lines.len();
        match op % 3 {
            0 => {
                if let Some((key, _)) = lines[at].split_once(':') {
                    lines[at] = format!("{key}: {}", ODD_VALUES[value % ODD_VALUES.len()]);
                }
            }
            1 => {
                lines.remove(at);
            }
            _ => {
                let copy = lines[at].clone();
                lines.insert(at, copy);
            }
        }
    }
    lines.join("\n")
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn mutated_manifests_never_panic(ops in prop::collection::vec((0usize..10_000, 0u8..3, 0usize..100), 1..6)) {
        let text = mutate(&corpus(), &ops);
        let mut objects = Objects::default();
        if objects.load_text("mutated.yaml", &text).is_ok() {
            let mut report = String::new();
            let _ = validate::run(&objects, "gpu.tessera.dev", &mut report);
            for policy in [Policy::FirstFit, Policy::Binpack] {
                let _ = allocate::run(&objects, "gpu.tessera.dev", policy, None);
            }
        }
    }
}
