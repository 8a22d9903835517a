//! The binary's operations side over real loopback HTTP: `/healthz`, `/readyz` following
//! kubelet's registration verdict, `/metrics` after prepare calls, JSON logs, and the inventory
//! file watched, with a mode change of a held GPU refused until its claim is unprepared.
#![allow(clippy::unwrap_used, missing_docs)]

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use tessera_proto::dra::v1;
use tessera_proto::pluginregistration::v1 as reg;
use tessera_tests::host::free_port;
use tessera_tests::plugin_socket::notify_registration;
use tonic::transport::Channel;

mod support;
use support::{DRIVER, NODE, NodeDir, Plugin, claim};

const INVENTORY: &str = "nodes:\n- name: a100-node\n  gpus:\n  - model: a100-80g\n    count: 2\n";
/// Both GPUs switched to MIG mode, seven instances each.
const INVENTORY_MIG: &str = "nodes:\n- name: a100-node\n  gpus:\n  - model: a100-80g\n    count: 2\n    mig:\n    - profile: 1g.10gb\n      count: 7\n";

async fn connect(socket: &Path) -> Channel {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(channel) = support::dial(socket).await {
            return channel;
        }
        assert!(Instant::now() < deadline, "the plugin did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One request over a fresh connection (the server closes it after the answer): status, head
/// and body.
fn request(addr: SocketAddr, method: &str, path: &str) -> (u16, String, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    write!(stream, "{method} {path} HTTP/1.1\r\nHost: test\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let status = response[9..12].parse().unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    (status, head.to_ascii_lowercase(), body.to_owned())
}

/// One GET over a fresh connection: status and body.
fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let (status, _, body) = request(addr, "GET", path);
    (status, body)
}

/// The value of the sample whose line starts with `prefix` (name and labels).
fn sample(metrics: &str, prefix: &str) -> Option<f64> {
    metrics
        .lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

async fn wait_for_sample(addr: SocketAddr, prefix: &str, value: f64) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, metrics) = get(addr, "/metrics");
        if sample(&metrics, prefix) == Some(value) {
            return metrics;
        }
        assert!(
            Instant::now() < deadline,
            "{prefix} never became {value}:\n{metrics}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(clippy::too_many_lines)] // Reason: one scenario, read top to bottom.
async fn metrics_health_readiness_and_inventory_watch() {
    let node = NodeDir::new(tempfile::tempdir().unwrap(), &[claim(0), claim(1)]);
    let inventory = node.path("inventory.yaml");
    std::fs::write(&inventory, INVENTORY).unwrap();
    let log = std::fs::File::create(node.path("log.json")).unwrap();
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let addr_arg = addr.to_string();
    let inventory_arg = inventory.display().to_string();
    let args = [
        "--log-format",
        "json",
        "--inventory-poll-seconds",
        "1",
        "--metrics-addr",
        &addr_arg,
        "--fake-inventory",
        &inventory_arg,
    ];
    let _plugin = Plugin(
        node.plugin_command(NODE, &[("--enforcement", "none")], &args)
            .env("RUST_LOG", "info")
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap(),
    );
    let reg_socket = node.path("registry").join(format!("{DRIVER}-reg.sock"));
    let mut registration =
        reg::registration_client::RegistrationClient::new(connect(&reg_socket).await);
    // The endpoint starts right after the sockets.
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(addr).is_err() {
        assert!(Instant::now() < deadline, "the endpoint did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    assert_eq!(get(addr, "/healthz"), (200, "ok\n".to_owned()));
    let (status, body) = get(addr, "/readyz");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("not registered"), "{body}");
    assert_eq!(get(addr, "/nope").0, 404);
    assert_eq!(request(addr, "POST", "/metrics").0, 405);
    let (status, head, _) = request(addr, "GET", "/metrics");
    assert_eq!(status, 200);
    assert!(
        head.contains("content-type: application/openmetrics-text; version=1.0.0; charset=utf-8"),
        "{head}"
    );
    assert!(head.contains("connection: close"), "{head}");
    // A request head over the 8 KiB bound is refused, not buffered: 431, or a reset when the
    // server closes with the rest of the head unread (seen by the client as a reset while
    // reading, or as a broken pipe while still writing the head).
    let mut stream = TcpStream::connect(addr).unwrap();
    let filler = "a".repeat(16 * 1024);
    let sent = write!(
        stream,
        "GET /healthz HTTP/1.1\r\nHost: test\r\nX-Filler: {filler}\r\n\r\n"
    );
    let mut response = String::new();
    match sent.and_then(|()| stream.read_to_string(&mut response)) {
        Ok(_) => assert!(response.starts_with("HTTP/1.1 431 "), "{response}"),
        Err(e) => assert!(
            matches!(
                e.kind(),
                std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
            ),
            "{e}"
        ),
    }

    notify_registration(&mut registration, Some("version mismatch"))
        .await
        .unwrap();
    let (status, body) = get(addr, "/readyz");
    assert_eq!(status, 503);
    assert!(body.contains("version mismatch"), "{body}");
    notify_registration(&mut registration, None).await.unwrap();
    assert_eq!(get(addr, "/readyz").0, 200);

    let mut dra = v1::dra_plugin_client::DraPluginClient::new(
        connect(&node.path("plugin").join("dra.sock")).await,
    );
    let answer = dra
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![
                v1::Claim {
                    namespace: "default".to_owned(),
                    name: "claim-0".to_owned(),
                    uid: "uid-0".to_owned(),
                },
                v1::Claim {
                    namespace: "default".to_owned(),
                    name: "missing".to_owned(),
                    uid: "uid-x".to_owned(),
                },
            ],
        })
        .await
        .unwrap()
        .into_inner();
    assert!(answer.claims["uid-0"].error.is_empty());
    assert!(!answer.claims["uid-x"].error.is_empty());

    let (status, metrics) = get(addr, "/metrics");
    assert_eq!(status, 200);
    let p = "tessera_kubelet_plugin_";
    assert_eq!(
        sample(
            &metrics,
            &format!("{p}calls_total{{operation=\"prepare\"}}")
        ),
        Some(2.0),
        "{metrics}"
    );
    assert_eq!(
        sample(
            &metrics,
            &format!("{p}errors_total{{operation=\"prepare\",retryable=\"true\"}}")
        ),
        Some(1.0),
        "{metrics}"
    );
    assert_eq!(
        sample(
            &metrics,
            &format!("{p}call_duration_seconds_count{{operation=\"prepare\"}}")
        ),
        Some(2.0),
        "{metrics}"
    );
    assert!(metrics.contains(&format!("{p}call_duration_seconds_bucket{{le=")));
    assert_eq!(sample(&metrics, &format!("{p}prepared_claims ")), Some(1.0));
    assert_eq!(
        sample(&metrics, &format!("{p}published_devices ")),
        Some(2.0)
    );
    assert_eq!(
        sample(
            &metrics,
            &format!("{p}gpu_allocated_compute_percent{{gpu=\"gpu-0\"")
        ),
        Some(100.0),
        "{metrics}"
    );
    assert_eq!(
        sample(
            &metrics,
            &format!("{p}gpu_allocated_compute_percent{{gpu=\"gpu-1\"")
        ),
        Some(0.0),
        "{metrics}"
    );
    let memory = sample(
        &metrics,
        &format!("{p}gpu_allocated_memory_bytes{{gpu=\"gpu-0\""),
    )
    .unwrap();
    assert!(memory > 70e9, "{metrics}");

    // Both GPUs switch to MIG: gpu-1 is free and takes it (7 instances), gpu-0 is held and
    // keeps its mode.
    std::fs::write(&inventory, INVENTORY_MIG).unwrap();
    let metrics = wait_for_sample(addr, &format!("{p}published_devices "), 8.0).await;
    assert!(
        sample(
            &metrics,
            &format!("{p}gpu_mode_changes_refused_total{{gpu=\"gpu-0\"")
        )
        .unwrap()
            >= 1.0,
        "{metrics}"
    );
    // Once its claim is gone, gpu-0 takes the change too, without another edit of the file.
    let answer = dra
        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
            claims: vec![v1::Claim {
                namespace: "default".to_owned(),
                name: "claim-0".to_owned(),
                uid: "uid-0".to_owned(),
            }],
        })
        .await
        .unwrap()
        .into_inner();
    assert!(answer.claims["uid-0"].error.is_empty());
    let metrics = wait_for_sample(addr, &format!("{p}published_devices "), 14.0).await;
    assert_eq!(sample(&metrics, &format!("{p}prepared_claims ")), Some(0.0));

    let log = std::fs::read_to_string(node.path("log.json")).unwrap();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert!(
        lines
            .iter()
            .any(|l| l["fields"]["message"] == "inventory change refused")
    );
}
