//! Device health end to end: the plugin's whole wiring on a fake inventory file, publishing to
//! the in-process fake API server, watched by a test kubelet over the real DRA socket's
//! `v1alpha1.DRAResourceHealth` stream.
#![allow(clippy::unwrap_used, missing_docs)]

#[path = "support/plugin_run.rs"]
mod plugin_run;

use std::time::Duration;

use plugin_run::{RunningArgs, connect, server_with_node, wait_for_device};
use serde_json::Value;
use tessera_driver::names;
use tessera_proto::health::v1alpha1 as health;
use tessera_proto::pluginregistration::v1 as reg;
use tessera_tests::fake_apiserver::FakeApiServer;

const NODE: &str = "health-node";

fn inventory(gpu1_healthy: bool) -> String {
    format!(
        "nodes:\n- name: {NODE}\n  gpus:\n  - model: a100-80g\n  - model: a100-80g\n    healthy: {gpu1_healthy}\n"
    )
}

fn taint_keys(device: &Value) -> Vec<String> {
    device["taints"]
        .as_array()
        .map(|t| {
            t.iter()
                .map(|t| t["key"].as_str().unwrap().to_owned())
                .collect()
        })
        .unwrap_or_default()
}

async fn wait_for_taints(server: &FakeApiServer, name: &str, want: &[&str]) {
    wait_for_device(server, name, &format!("tainted {want:?}"), |d| {
        taint_keys(d) == want
    })
    .await;
}

/// The first report on the stream of `device` with health `want` (reports of the old health
/// may come first: the stream repeats the whole list every refresh).
async fn wait_status(
    stream: &mut tonic::Streaming<health::NodeWatchResourcesResponse>,
    device: &str,
    want: health::HealthStatus,
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
            .find(|d| d.device.as_ref().unwrap().device_name == device && d.health() == want)
        {
            return d;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unhealthy_gpu_is_streamed_and_tainted_until_it_recovers() {
    let server = server_with_node(NODE).await;
    let plugin = RunningArgs::start(&server, NODE, &inventory(true), &[]);

    let reg_socket = plugin
        .path("registry")
        .join(format!("{}-reg.sock", names::DEFAULT_DRIVER_NAME));
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
        connect(&plugin.path("plugin").join("dra.sock")).await,
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

    plugin.write_inventory(&inventory(false));
    let sick = wait_status(&mut stream, "gpu-1", health::HealthStatus::Unhealthy).await;
    assert!(sick.last_updated_time > 0);
    wait_for_taints(&server, "gpu-1", &[names::TAINT_UNHEALTHY]).await;
    wait_for_taints(&server, "gpu-0", &[]).await;

    plugin.write_inventory(&inventory(true));
    let well = wait_status(&mut stream, "gpu-1", health::HealthStatus::Healthy).await;
    assert!(well.last_updated_time >= sick.last_updated_time);
    wait_for_taints(&server, "gpu-1", &[]).await;

    plugin.stop().await;
}
