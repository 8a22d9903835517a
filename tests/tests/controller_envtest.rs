//! The controller's scenarios against a real kube-apiserver and etcd, started on loopback from
//! the binaries in `KUBEBUILDER_ASSETS`. When a `kube-scheduler` binary sits beside them, it
//! runs too and the test checks that gated pods end up bound to the node of their allocation.
//! Without the binaries the test says why it skips and passes; nothing is ever downloaded.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

#[path = "support/envtest_cluster.rs"]
mod envtest;
#[path = "support/controller_scenarios.rs"]
mod scenarios;
#[path = "support/tier_scenarios.rs"]
mod tiers;

use std::time::Duration;

use scenarios::*;
use tessera_controller::apiserver;
use tessera_driver::allocator::Policy;
use tessera_driver::apiversion::ApiVersion;
use tessera_driver::gate;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gate_protocol_against_a_real_api_server() {
    let assets = match envtest::assets() {
        Ok(a) => a,
        Err(why) => {
            eprintln!(
                "SKIPPED controller_envtest: {why}; point KUBEBUILDER_ASSETS at a directory with \
                 etcd and kube-apiserver (1.32 or later), and kube-scheduler to check binding"
            );
            return;
        }
    };
    let mut cluster = envtest::start_cluster(&assets).await;
    let client = apiserver::client(Some(&cluster.kubeconfig)).await.unwrap();
    let version = apiserver::served_resource_version(&client).await.unwrap();
    place_several_pods(&client, version).await;
    if version != ApiVersion::V1 {
        eprintln!("kube-scheduler binding check needs resource.k8s.io/v1 (1.34+); skipped");
        return;
    }
    if !cluster.start_scheduler(&assets) {
        eprintln!(
            "SKIPPED the binding check: {} has no kube-scheduler",
            assets.display()
        );
        return;
    }
    // The pods placed above are bound by the scheduler to the node their claims name.
    let running = start_controller(&client, config(Policy::Binpack, None));
    create_claim(&client, version, share_claim("bound-share", 10)).await;
    create_pod(&client, &gated_pod("bound", &["bound-share"], &[], "1")).await;
    eventually(
        Duration::from_mins(1),
        "every ungated pod is bound to its allocation's node",
        || async {
            let pods = pods(&client).await;
            let claims = claims(&client, version).await;
            pods.values().filter(|p| !gate::is_gated(p)).all(|p| {
                let bound = p.spec.as_ref().and_then(|s| s.node_name.clone());
                let claim_nodes: Vec<Option<String>> = gate::claim_names(p)
                    .unwrap()
                    .iter()
                    .map(|n| {
                        gate::allocation_node(claims.get(n)?.status.as_ref()?.allocation.as_ref()?)
                    })
                    .collect();
                bound.is_some() && claim_nodes.iter().all(|n| *n == bound)
            })
        },
    )
    .await;
    check_invariants(&client, version).await;
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_plugin_templates_against_a_real_api_server() {
    let assets = match envtest::assets() {
        Ok(a) => a,
        Err(why) => {
            eprintln!(
                "SKIPPED device_plugin_templates_against_a_real_api_server: {why}; point \
                 KUBEBUILDER_ASSETS at a directory with etcd and kube-apiserver (1.32 or later)"
            );
            return;
        }
    };
    let cluster = envtest::start_cluster(&assets).await;
    let client = apiserver::client(Some(&cluster.kubeconfig)).await.unwrap();
    let version = apiserver::served_resource_version(&client).await.unwrap();
    device_plugin_pods_get_their_templates(&client, version).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preemption_against_a_real_api_server() {
    let assets = match envtest::assets() {
        Ok(a) => a,
        Err(why) => {
            eprintln!(
                "SKIPPED preemption_against_a_real_api_server: {why}; point \
                 KUBEBUILDER_ASSETS at a directory with etcd and kube-apiserver (1.32 or later)"
            );
            return;
        }
    };
    let cluster = envtest::start_cluster(&assets).await;
    let client = apiserver::client(Some(&cluster.kubeconfig)).await.unwrap();
    let version = apiserver::served_resource_version(&client).await.unwrap();
    // The real server's own eviction handler and PodDisruptionBudget checks decide here.
    tiers::preemption_evicts_batch_pods_through_the_eviction_api(&client, version).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delay_tolerance_against_a_real_api_server() {
    let assets = match envtest::assets() {
        Ok(a) => a,
        Err(why) => {
            eprintln!(
                "SKIPPED delay_tolerance_against_a_real_api_server: {why}; point \
                 KUBEBUILDER_ASSETS at a directory with etcd and kube-apiserver (1.32 or later)"
            );
            return;
        }
    };
    let cluster = envtest::start_cluster(&assets).await;
    let client = apiserver::client(Some(&cluster.kubeconfig)).await.unwrap();
    let version = apiserver::served_resource_version(&client).await.unwrap();
    tiers::a_delay_tolerant_pod_waits_for_a_fragment(&client, version).await;
}
