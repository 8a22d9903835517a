//! The kubelet plugin's API-server scenarios against a real kube-apiserver and etcd, started
//! on loopback from the binaries in `KUBEBUILDER_ASSETS` (as controller-runtime's envtest lays
//! them out: `etcd` and `kube-apiserver` side by side). Without them the test says why it
//! skips and passes; nothing is ever downloaded.
//!
//! Needs `openssl` on the PATH for the service-account key kube-apiserver insists on.
#![allow(clippy::unwrap_used, missing_docs)]

#[path = "support/envtest_cluster.rs"]
mod envtest;
#[path = "support/plugin_run.rs"]
mod plugin_run;
#[path = "support/apiserver_scenarios.rs"]
mod scenarios;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_and_prepare_against_a_real_api_server() {
    envtest::run(
        "publish_and_prepare_against_a_real_api_server",
        |client, version| async move {
            scenarios::publish_and_check_shape(&client, version).await;
            scenarios::republish_after_inventory_change(&client, version).await;
            scenarios::slices_come_back(&client, version).await;
            let work = tempfile::tempdir().unwrap();
            scenarios::prepare_through_kubelet(&client, version, work.path()).await;
        },
    )
    .await;
}
