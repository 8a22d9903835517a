//! `tessera allocate -o claims` writes what the kubelet plugin's `--fake-claims` reads: the
//! claims the CLI allocated, found by the plugin with their allocation (issue 23).
#![allow(clippy::unwrap_used, missing_docs)]

use clap::Parser as _;
use tessera_controller::cli::Cli;
use tessera_kubelet_plugin::claims::{ClaimRef, FakeClaimSource};

const INPUT: &str = r#"
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {name: gpu.tessera.dev}
spec:
  selectors: [{cel: {expression: 'device.driver == "gpu.tessera.dev"'}}]
---
apiVersion: resource.k8s.io/v1
kind: ResourceSlice
metadata: {name: node-1-gpus}
spec:
  driver: gpu.tessera.dev
  nodeName: node-1
  pool: {name: node-1, generation: 1, resourceSliceCount: 1}
  devices:
  - {name: gpu-0, attributes: {type: {string: gpu}, sharing: {string: exclusive}}}
---
apiVersion: resource.k8s.io/v1beta1
kind: ResourceClaim
metadata: {name: train, namespace: team-a, uid: 7d0f8a56-3c1e-4b8e-9f55-0a1b2c3d4e5f}
spec:
  devices:
    requests: [{name: gpu, deviceClassName: gpu.tessera.dev}]
"#;

#[test]
fn the_plugin_reads_the_claims_the_cli_allocated() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("input.yaml");
    std::fs::write(&input, INPUT).unwrap();
    let cli = Cli::try_parse_from([
        "tessera",
        "allocate",
        "-f",
        input.to_str().unwrap(),
        "-o",
        "claims",
    ])
    .unwrap();
    let mut written = String::new();
    cli.run(&mut written).unwrap();
    let source = FakeClaimSource::from_yaml(&written, "claims.yaml").unwrap();
    let claim = source
        .get(&ClaimRef {
            namespace: "team-a".to_owned(),
            name: "train".to_owned(),
            uid: "7d0f8a56-3c1e-4b8e-9f55-0a1b2c3d4e5f".to_owned(),
        })
        .unwrap();
    let allocation = claim.status.unwrap().allocation.expect("allocated");
    let result = &allocation.devices.unwrap().results.unwrap()[0];
    assert_eq!(
        (result.pool.as_str(), result.device.as_str()),
        ("node-1", "gpu-0")
    );
}
