//! Golden files: every node of examples/inventory/demo-cluster.yaml rendered in every served
//! API version. Run with `TESSERA_UPDATE_GOLDEN=1` to rewrite driver/tests/golden/ after an
//! intended change, then review the diff.

use std::path::{Path, PathBuf};

use serde_json::Value;
use tessera_driver::apiversion::{ApiVersion, encode_slice, to_kubectl_yaml};
use tessera_driver::node::inventory::Inventory;
use tessera_driver::node::slices::{RenderOptions, render};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// (file suffix, API version, consumable capacity): what a 1.34+, 1.33 and 1.32 cluster gets.
const VARIANTS: [(&str, ApiVersion, bool); 4] = [
    ("v1", ApiVersion::V1, false),
    ("v1-consumable", ApiVersion::V1, true),
    ("v1beta2", ApiVersion::V1beta2, false),
    ("v1beta1", ApiVersion::V1beta1, false),
];

#[test]
fn demo_cluster_slices_match_golden_files() {
    let text = std::fs::read_to_string(repo_root().join("examples/inventory/demo-cluster.yaml"))
        .expect("demo inventory");
    let inventory = Inventory::from_yaml(&text).expect("demo inventory parses");
    assert_eq!(inventory.nodes.len(), 4);
    let update = std::env::var_os("TESSERA_UPDATE_GOLDEN").is_some_and(|v| v == "1");
    let golden_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
    let mut mismatches = Vec::new();
    for node in &inventory.nodes {
        for (suffix, version, consumable) in VARIANTS {
            let opts = RenderOptions {
                consumable_capacity: consumable,
                ..RenderOptions::default()
            };
            let slices = render(node, &opts).expect("renders");
            let docs: Vec<Value> = slices
                .iter()
                .map(|s| encode_slice(s, version).expect("encodes"))
                .collect();
            let got = to_kubectl_yaml(&Value::Array(docs));
            let path = golden_dir.join(format!("{}.{suffix}.yaml", node.name));
            if update {
                std::fs::write(&path, &got).expect("write golden");
                continue;
            }
            let want = std::fs::read_to_string(&path).unwrap_or_default();
            if want != got {
                mismatches.push(format!(
                    "{} differs (rerun with TESSERA_UPDATE_GOLDEN=1 and review the diff); got:\n{got}",
                    path.display()
                ));
            }
        }
    }
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
}
