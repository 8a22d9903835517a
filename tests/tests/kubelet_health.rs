//! Device health end to end: the plugin binary's wiring (`Args::run`) on a fake inventory file,
//! publishing to the in-process fake API server, watched by a test kubelet over the real DRA
//! socket's `v1alpha1.DRAResourceHealth` stream.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::path::Path;
use std::time::{Duration, Instant};

use clap::Parser as _;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tessera_driver::names;
use tessera_proto::health::v1alpha1 as health;
use tessera_proto::pluginregistration::v1 as reg;
use tessera_tests::fake_apiserver::FakeApiServer;
use tonic::transport::{Channel, Endpoint};

const NODE: &str = "health-node";

fn inventory(gpu1_healthy: bool) -> String {
    format!(
        "nodes:\n- name: {NODE}\n  gpus:\n  - model: a100-80g\n  - model: a100-80g\n    healthy: {gpu1_healthy}\n"
    )
}

async fn connect(socket: &Path) -> Channel {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !socket.exists() {
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            socket.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let socket = socket.to_owned();
    Endpoint::try_from("http://[::]:50051")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_| {
            let socket = socket.clone();
            async move {
                Ok::<_, std::io::Error>(TokioIo::new(
                    tokio::net::UnixStream::connect(socket).await?,
                ))
            }
        }))
        .await
        .unwrap()
}

/// The taint keys of device `name` in the stored slices, once some slice lists it.
fn taints(server: &FakeApiServer, name: &str) -> Option<Vec<String>> {
    server
        .objects("resourceslices")
        .iter()
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
        .find(|d| d["name"] == name)
        .map(|d| {
            d["taints"]
                .as_array()
                .map(|t| {
                    t.iter()
                        .map(|t| t["key"].as_str().unwrap().to_owned())
                        .collect()
                })
                .unwrap_or_default()
        })
}

async fn wait_for_taints(server: &FakeApiServer, name: &str, want: &[&str]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let got = taints(server, name);
        if got.as_deref().is_some_and(|t| t == want) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{name}: taints {got:?}, want {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The next message on the stream that names `device`, with its status.
async fn next_status(
    stream: &mut tonic::Streaming<health::NodeWatchResourcesResponse>,
    device: &str,
) -> health::DeviceHealth {
    loop {
        let message = tokio::time::timeout(Duration::from_secs(30), stream.message())
            .await
            .expect("a health update within 30 s")
            .unwrap()
            .expect("the stream stays open");
        if let Some(d) = message
            .devices
            .into_iter()
            .find(|d| d.device.as_ref().unwrap().device_name == device)
        {
            return d;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unhealthy_gpu_is_streamed_and_tainted_until_it_recovers() {
    let server = FakeApiServer::start(&["v1"]).await.unwrap();
    server
        .create(
            "nodes",
            json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}),
        )
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = |p: &str| dir.path().join(p);
    std::fs::write(path("kubeconfig"), server.kubeconfig()).unwrap();
    std::fs::write(path("boot_id"), "boot-1\n").unwrap();
    std::fs::write(path("inventory.yaml"), inventory(true)).unwrap();
    let arg = |p: &str| path(p).display().to_string();
    let args = tessera_kubelet_plugin::args::Args::try_parse_from([
        "tessera-kubelet-plugin",
        "--node-name",
        NODE,
        "--gpu-backend",
        "fake",
        "--fake-inventory",
        &arg("inventory.yaml"),
        "--inventory-poll-seconds",
        "1",
        "--kubeconfig",
        &arg("kubeconfig"),
        "--registration-dir",
        &arg("registry"),
        "--plugin-dir",
        &arg("plugin"),
        "--cdi-dir",
        &arg("cdi"),
        "--enforcement",
        "none",
        "--boot-id-file",
        &arg("boot_id"),
    ])
    .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(args.run(async move {
        let _ = stopped.await;
    }));

    let reg_socket = path("registry").join(format!("{}-reg.sock", names::DEFAULT_DRIVER_NAME));
    let info = reg::registration_client::RegistrationClient::new(connect(&reg_socket).await)
        .get_info(reg::InfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        info.supported_versions,
        [
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1alpha1.DRAResourceHealth"
        ]
    );

    let mut stream = health::dra_resource_health_client::DraResourceHealthClient::new(
        connect(&path("plugin").join("dra.sock")).await,
    )
    .node_watch_resources(health::NodeWatchResourcesRequest {})
    .await
    .unwrap()
    .into_inner();
    let first = stream.message().await.unwrap().unwrap();
    let mut seen: Vec<(String, String, i32)> = first
        .devices
        .iter()
        .map(|d| {
            let id = d.device.as_ref().unwrap();
            (id.pool_name.clone(), id.device_name.clone(), d.health)
        })
        .collect();
    seen.sort();
    let healthy = health::HealthStatus::Healthy as i32;
    assert_eq!(
        seen,
        [
            (NODE.to_owned(), "gpu-0".to_owned(), healthy),
            (NODE.to_owned(), "gpu-1".to_owned(), healthy)
        ]
    );
    wait_for_taints(&server, "gpu-1", &[]).await;

    std::fs::write(path("inventory.yaml"), inventory(false)).unwrap();
    let sick = next_status(&mut stream, "gpu-1").await;
    assert_eq!(sick.health(), health::HealthStatus::Unhealthy);
    assert!(sick.last_updated_time > 0);
    wait_for_taints(&server, "gpu-1", &[names::TAINT_UNHEALTHY]).await;
    assert_eq!(taints(&server, "gpu-0").unwrap(), Vec::<String>::new());

    std::fs::write(path("inventory.yaml"), inventory(true)).unwrap();
    let well = next_status(&mut stream, "gpu-1").await;
    assert_eq!(well.health(), health::HealthStatus::Healthy);
    assert!(well.last_updated_time >= sick.last_updated_time);
    wait_for_taints(&server, "gpu-1", &[]).await;

    let slices: Vec<Value> = server.objects("resourceslices");
    assert!(slices.iter().all(|s| s["spec"]["nodeName"] == NODE));
    stop.send(()).unwrap();
    running.await.unwrap().unwrap();
}
