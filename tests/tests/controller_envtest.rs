//! The controller's scenarios against a real kube-apiserver and etcd, started on loopback from
//! the binaries in `KUBEBUILDER_ASSETS`. When a `kube-scheduler` binary sits beside them, it
//! runs too and the test checks that gated pods end up bound to the node of their allocation.
//! Without the binaries the test says why it skips and passes; nothing is ever downloaded.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

#[path = "support/envtest_cluster.rs"]
mod envtest;
#[path = "support/controller_scenarios.rs"]
mod scenarios;

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use scenarios::*;
use serde_json::json;
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
async fn the_fast_path_against_a_real_api_server() {
    let assets = match envtest::assets() {
        Ok(a) => a,
        Err(why) => {
            eprintln!(
                "SKIPPED the_fast_path_against_a_real_api_server: {why}; point KUBEBUILDER_ASSETS \
                 at a directory with etcd and kube-apiserver (1.34 or later)"
            );
            return;
        }
    };
    let mut cluster = envtest::start_cluster(&assets).await;
    let client = apiserver::client(Some(&cluster.kubeconfig)).await.unwrap();
    let version = apiserver::served_resource_version(&client).await.unwrap();
    if version != ApiVersion::V1 {
        eprintln!("SKIPPED the fast path check: it is run on resource.k8s.io/v1 (1.34+)");
        return;
    }
    // What the safety argument leans on: the API server refuses to bind a gated pod.
    let gated = create_pod(&client, &gated_pod("still-gated", &[], &[], "1")).await;
    let refused = Api::<Pod>::namespaced(client.clone(), NS)
        .create_subresource::<_, serde_json::Value>(
            "binding",
            "still-gated",
            &PostParams::default(),
            &json!({"apiVersion": "v1", "kind": "Binding",
                    "metadata": {"name": "still-gated", "uid": gated.metadata.uid},
                    "target": {"apiVersion": "v1", "kind": "Node", "name": node_name(0)}}),
        )
        .await;
    match refused {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 409, "{s:?}");
            assert!(s.message.contains("schedulingGates"), "{s:?}");
        }
        other => panic!("a gated pod was bound, or refused otherwise: {other:?}"),
    }
    delete_pod(&client, "still-gated").await;
    // The controller's reservedFor and binding are accepted; the pods it leaves to
    // kube-scheduler stay unbound while no scheduler runs.
    fast_path_pods_are_bound_by_the_controller(&client, version).await;
    if cluster.start_scheduler(&assets) {
        eventually(
            Duration::from_mins(1),
            "kube-scheduler binds the pods the controller only ungated",
            || async {
                pods(&client)
                    .await
                    .values()
                    .all(|p| p.spec.as_ref().is_some_and(|s| s.node_name.is_some()))
            },
        )
        .await;
        check_invariants(&client, version).await;
    } else {
        eprintln!(
            "SKIPPED the binding check: {} has no kube-scheduler",
            assets.display()
        );
    }
}
