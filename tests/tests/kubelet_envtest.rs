//! The kubelet plugin's API-server scenarios against a real kube-apiserver and etcd, started
//! on loopback from the binaries in `KUBEBUILDER_ASSETS` (as controller-runtime's envtest lays
//! them out: `etcd` and `kube-apiserver` side by side). Without them the test says why it
//! skips and passes; nothing is ever downloaded.
//!
//! Needs `openssl` on the PATH for the service-account key kube-apiserver insists on.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

#[path = "support/envtest_cluster.rs"]
mod envtest;
#[path = "support/apiserver_scenarios.rs"]
mod scenarios;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_and_prepare_against_a_real_api_server() {
    let assets = match envtest::assets() {
        Ok(a) => a,
        Err(why) => {
            eprintln!(
                "SKIPPED kubelet_envtest: {why}; point KUBEBUILDER_ASSETS at a directory with \
                 etcd and kube-apiserver (1.32 or later) to run it"
            );
            return;
        }
    };
    let cluster = envtest::start_cluster(&assets).await;
    let client = tessera_kubeapi::client(Some(&cluster.kubeconfig))
        .await
        .unwrap();
    let version = tessera_kubeapi::served_resource_version(&client)
        .await
        .unwrap();
    scenarios::publish_and_check_shape(&client, version).await;
    scenarios::republish_after_inventory_change(&client, version).await;
    scenarios::slices_come_back(&client, version).await;
    let work = tempfile::tempdir().unwrap();
    scenarios::prepare_through_kubelet(&client, version, work.path()).await;
}
