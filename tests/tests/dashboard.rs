//! The Grafana dashboard in deploy/grafana reads only metrics the kubelet plugin produces: every
//! metric name in its queries is a series the plugin's `/metrics` text holds once a node has a
//! prepared share, an accounting pass, an isolation verdict and a stopped process.
#![allow(clippy::unwrap_used, missing_docs)]

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde_json::Value;
use tessera_driver::node::accounting::{self, Consumer, Consumers, GpuProcess};
use tessera_driver::node::checkpoint::{Checkpoint, ClaimEntry, HeldDevice, PrepareState};
use tessera_driver::node::inventory::Isolation;
use tessera_driver::node::isolation::Verdict;
use tessera_driver::testing::demo_node;
use tessera_kubelet_plugin::ops::metrics::Metrics;

const GIB: u64 = 1 << 30;

fn dashboard() -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/grafana/tessera-gpu-shares.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Every query of the dashboard: the panels' targets and the variables' queries.
fn queries(dashboard: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            out.push(target["expr"].as_str().unwrap().to_owned());
        }
    }
    for variable in dashboard["templating"]["list"].as_array().unwrap() {
        if variable["type"] == "query" {
            out.push(variable["query"].as_str().unwrap().to_owned());
        }
    }
    out
}

/// The metric names a query reads: the words that start with the plugin's prefix.
fn metric_names(query: &str) -> BTreeSet<String> {
    query
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("tessera_"))
        .map(str::to_owned)
        .collect()
}

/// The series names of the plugin's metrics on a node with one prepared share, measured.
fn produced() -> BTreeSet<String> {
    let node = demo_node("t4-node");
    let gpu = &node.gpus[0];
    let mut record = Checkpoint::new("boot");
    record.claims.insert(
        "uid-1".to_owned(),
        ClaimEntry {
            namespace: "team".to_owned(),
            name: "train".to_owned(),
            state: PrepareState::PrepareCompleted,
            devices: vec![HeldDevice {
                request: "gpu".to_owned(),
                pool: node.name.clone(),
                device: gpu.device_name(),
                gpu_uuid: gpu.uuid.clone(),
                mig: false,
                exclusive: false,
                cdi_ids: Vec::new(),
                share_memory_bytes: Some(4 * GIB),
                share_compute_percent: Some(25),
                share_id: Some("s1".to_owned()),
                share_tier: None,
            }],
            host_dirs: Vec::new(),
            mps_daemon: None,
        },
    );
    let consumers: Consumers = BTreeMap::from([(
        "uid-1".to_owned(),
        vec![Consumer {
            uid: "pod-1".to_owned(),
            name: "trainer".to_owned(),
        }],
    )]);
    let processes = vec![GpuProcess {
        pid: 7,
        gpu_uuid: gpu.uuid.clone(),
        used_bytes: 3 * GIB,
        start_ticks: 1,
        pod_uid: Some("pod-1".to_owned()),
    }];
    let metrics = Metrics::new();
    metrics.observe_state(&node, &record);
    metrics.observe_use(
        &record,
        &accounting::usage(&record, &consumers, &processes),
        &processes,
    );
    metrics.observe_isolation(
        &node,
        &BTreeMap::from([(
            gpu.device_name(),
            Verdict {
                isolation: Isolation::Verified,
                code: "probe-held",
                reason: "the probe held".to_owned(),
            },
        )]),
    );
    metrics.observe_accounting_stop("kill");
    metrics.observe_call("prepare", Duration::from_millis(3), None);
    metrics
        .encode()
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect()
}

#[test]
fn every_query_of_the_dashboard_names_a_metric_the_plugin_produces() {
    let produced = produced();
    let queries = queries(&dashboard());
    assert!(queries.len() >= 10, "{queries:?}");
    for query in &queries {
        let names = metric_names(query);
        assert!(
            !names.is_empty(),
            "a query reads no Tessera metric: {query}"
        );
        for name in names {
            assert!(
                produced.contains(&name),
                "{name} (in {query}) is not a series of the plugin's metrics: {produced:?}"
            );
        }
    }
}

#[test]
fn the_dashboard_shows_claims_use_beside_their_booking_and_each_gpus_isolation() {
    let read: BTreeSet<String> = queries(&dashboard())
        .iter()
        .flat_map(|q| metric_names(q))
        .collect();
    for wanted in [
        "tessera_kubelet_plugin_claim_gpu_memory_used_bytes",
        "tessera_kubelet_plugin_claim_gpu_memory_booked_bytes",
        "tessera_kubelet_plugin_claim_gpu_compute_booked_percent",
        "tessera_kubelet_plugin_gpu_memory_used_bytes",
        "tessera_kubelet_plugin_gpu_allocated_memory_bytes",
        "tessera_kubelet_plugin_gpu_allocated_compute_percent",
        "tessera_kubelet_plugin_gpu_isolation",
    ] {
        assert!(
            read.contains(wanted),
            "the dashboard does not show {wanted}"
        );
    }
}

#[test]
fn a_metric_name_the_plugin_does_not_produce_is_caught() {
    let produced = produced();
    let names = metric_names("sum(rate(tessera_kubelet_plugin_claim_sm_utilization[5m]))");
    assert!(names.iter().any(|n| !produced.contains(n)));
}
