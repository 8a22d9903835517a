//! A share is a share, however many processes use it: a share claim allocated by the real
//! allocator, stored on the fake API server with the pod it is reserved for, prepared through
//! the kubelet gRPC API under MPS; three processes of its pod each stay under the per-process
//! limit but together go over the booking. One accounting pass ends the newest two through the
//! MPS control socket (a `SOCK_SEQPACKET` fake daemon) and posts a Warning Event on the pod
//! through the plugin's API client.
#![allow(clippy::unwrap_used, missing_docs)]

#[path = "support/demo_cluster.rs"]
mod demo_cluster;
#[path = "support/plugin_run.rs"]
mod plugin_run;

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::api::resource::v1 as res;
use kube::api::{Api, DynamicObject, PostParams};
use serde_json::json;
use tessera_driver::apiversion::Object;
use tessera_driver::names;
use tessera_driver::node::cdi::Enforcement;
use tessera_driver::node::inventory::Inventory;
use tessera_kubelet_plugin::accounting::{
    Accountant, FakeGpu, FakeHostProcesses, FakeMpsControl, FakeMpsDaemon, KubeEvents, Seams,
};
use tessera_kubelet_plugin::claims::apiserver::ApiClaimSource;
use tessera_kubelet_plugin::claims::preparer::{CdiPreparer, CdiPreparerConfig};
use tessera_kubelet_plugin::kubelet::server::{self, PluginConfig};
use tessera_kubelet_plugin::ops::metrics::Metrics;
use tessera_proto::dra::v1;
use tessera_tests::fake_apiserver::FakeApiServer;

use demo_cluster::{load, repo};
use plugin_run::connect;

const DRIVER: &str = names::DEFAULT_DRIVER_NAME;
const POD_UID: &str = "0c6f33a4-5e2b-4a1b-9e0c-51d4b2a3f7e1";

/// The example share claim (10 GiB, 50 % compute) allocated by the allocator on the demo
/// cluster; returns it with the node it landed on.
fn allocated_share() -> (res::ResourceClaim, String, Inventory) {
    let inventory = demo_cluster::inventory();
    let classes: Vec<res::DeviceClass> = load(&repo().join("deviceclasses/shared-gpu.yaml"))
        .into_iter()
        .filter_map(|o| match o {
            Object::DeviceClass(c) => Some(c),
            _ => None,
        })
        .collect();
    let claims: Vec<res::ResourceClaim> =
        load(&repo().join("examples/claims/04-share-opaque-config.yaml"))
            .into_iter()
            .filter_map(|o| match o {
                Object::ResourceClaim(c) => Some(c),
                _ => None,
            })
            .collect();
    let outcome = demo_cluster::allocate(&inventory, &classes, &claims).remove(0);
    assert!(outcome.allocated, "{:?}", outcome.reason);
    let mut claim = claims[0].clone();
    claim.status = Some(res::ResourceClaimStatus {
        allocation: outcome.allocation,
        ..res::ResourceClaimStatus::default()
    });
    (claim, outcome.node.unwrap(), inventory)
}

/// Stores the claim with its allocation and the pod it is reserved for; returns its UID.
async fn store(client: &kube::Client, claim: &res::ResourceClaim) -> String {
    let api: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        "default",
        &tessera_kubeapi::resource(
            tessera_driver::apiversion::ApiVersion::V1,
            names::RESOURCE_CLAIM,
        ),
    );
    let mut body = serde_json::to_value(claim).unwrap();
    body["apiVersion"] = json!("resource.k8s.io/v1");
    body["kind"] = json!("ResourceClaim");
    let status = body.as_object_mut().unwrap().remove("status").unwrap();
    let mut created = api
        .create(
            &PostParams::default(),
            &serde_json::from_value(body).unwrap(),
        )
        .await
        .unwrap();
    let mut status = status;
    status["reservedFor"] = json!([{"resource": "pods", "name": "trainer", "uid": POD_UID}]);
    created.data["status"] = status;
    let name = created.metadata.name.clone().unwrap();
    api.replace_status(&name, &PostParams::default(), &created)
        .await
        .unwrap()
        .metadata
        .uid
        .unwrap()
}

/// The claim stored, and prepared through kubelet's gRPC API by a plugin fetching it from the
/// API server.
struct Prepared {
    preparer: Arc<CdiPreparer>,
    source: Arc<ApiClaimSource>,
    plugin: server::RunningPlugin,
    uid: String,
    name: String,
    node: String,
}

async fn prepare_share(client: &kube::Client, dir: &Path) -> Prepared {
    let path = |p: &str| dir.join(p);
    let (claim, node, inventory) = allocated_share();
    let uid = store(client, &claim).await;
    let name = claim.metadata.name.clone().unwrap();
    let source = Arc::new(ApiClaimSource::new(client.clone()));
    let preparer = Arc::new(
        CdiPreparer::new(
            CdiPreparerConfig {
                driver_name: DRIVER.to_owned(),
                cdi_dir: path("cdi"),
                state_dir: path("state"),
                enforcement: Enforcement::Mps {
                    pipe_dir_root: path("mps").display().to_string(),
                    log_dir_root: path("mps-log").display().to_string(),
                },
                boot_id: "boot-1".to_owned(),
            },
            inventory.node(&node).cloned().unwrap(),
            source.clone(),
        )
        .unwrap(),
    );
    let plugin = server::start(
        PluginConfig {
            driver_name: DRIVER.to_owned(),
            registration_dir: path("registry"),
            plugin_dir: path("plugin"),
        },
        preparer.clone(),
    )
    .unwrap();
    let mut kubelet =
        v1::dra_plugin_client::DraPluginClient::new(connect(&plugin.config().dra_socket()).await);
    let answer = kubelet
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![v1::Claim {
                namespace: "default".to_owned(),
                name: name.clone(),
                uid: uid.clone(),
            }],
        })
        .await
        .unwrap()
        .into_inner()
        .claims;
    assert_eq!(answer[&uid].error, "");
    Prepared {
        preparer,
        source,
        plugin,
        uid,
        name,
        node,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_workers_of_one_share_over_its_booking_lose_the_newest_two_and_the_pod_gets_an_event()
{
    let server = FakeApiServer::start(&["v1"]).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("kubeconfig"), server.kubeconfig()).unwrap();
    let client = tessera_kubeapi::client(Some(&dir.path().join("kubeconfig")))
        .await
        .unwrap();
    let Prepared {
        preparer,
        source,
        plugin,
        uid,
        name,
        node,
    } = prepare_share(&client, dir.path()).await;

    // The node as the claim's container uses it: the claim's daemon (a fake one on a real
    // SEQPACKET socket in the pipe directory the CDI spec names) and three workers in the pod's
    // cgroup, each under the 10 GiB per-process limit.
    let record = preparer.record().unwrap();
    let entry = &record.claims[&uid];
    let daemon = entry
        .mps_daemon
        .clone()
        .expect("a share under MPS has a daemon");
    let gpu_uuid = entry.devices[0].gpu_uuid.clone();
    let booked = entry.devices[0].share_memory_bytes.unwrap();
    assert_eq!(booked, 10 << 30);
    let gpu = FakeGpu::new();
    let host = FakeHostProcesses::new(gpu.clone());
    let mps = FakeMpsDaemon::start(Path::new(&daemon.pipe_dir), gpu.clone()).unwrap();
    let cgroup = format!(
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-9.scope\n",
        POD_UID.replace('-', "_")
    );
    for (i, pid) in [4001u32, 4002, 4003].into_iter().enumerate() {
        gpu.run(pid, &gpu_uuid, booked / 20 * 19);
        host.spawn(pid, &cgroup, 5000 + i as u64);
        mps.add_client(4000, pid);
    }

    let metrics = Arc::new(Metrics::new());
    let accountant = Accountant::new(
        Seams {
            prepared: preparer.clone(),
            claims: source,
            gpus: Arc::new(gpu.clone()),
            host: Arc::new(host.clone()),
            mps: Arc::new(FakeMpsControl::new()),
            events: Some(Arc::new(KubeEvents::new(client.clone(), node.clone()))),
        },
        Some(metrics.clone()),
    );
    let report = accountant.pass(Instant::now()).await.unwrap();
    assert_eq!(report.terminated, [4003, 4002]);
    assert_eq!(report.events, 1);
    assert_eq!(mps.terminated(), [(4000, 4003), (4000, 4002)]);
    assert_eq!(gpu.pids(), BTreeSet::from([4001]));
    assert!(host.killed().is_empty());

    let events = server.events();
    assert_eq!(events.len(), 1, "{events:?}");
    let event = &events[0];
    assert_eq!(event["apiVersion"], "events.k8s.io/v1");
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["reason"], names::REASON_GPU_MEMORY_OVER_BOOKING);
    assert_eq!(event["metadata"]["namespace"], "default");
    assert_eq!(event["regarding"]["kind"], "Pod");
    assert_eq!(event["regarding"]["name"], "trainer");
    assert_eq!(event["regarding"]["uid"], POD_UID);
    assert_eq!(
        event["reportingController"],
        names::KUBELET_PLUGIN_COMPONENT
    );
    assert_eq!(event["reportingInstance"], node.as_str());
    let message = event["note"].as_str().unwrap();
    assert!(
        message.contains(&format!(
            "ResourceClaim default/{name} booked 10240 MiB of GPU {gpu_uuid}"
        )),
        "{message}"
    );
    assert!(message.contains("used 29184 MiB"), "{message}");
    assert!(
        metrics
            .encode()
            .unwrap()
            .contains("accounting_stopped_processes_total{means=\"mps_terminate\"} 2")
    );

    // Back within its booking: the next pass leaves the last worker alone.
    let again = accountant.pass(Instant::now()).await.unwrap();
    assert!(again.terminated.is_empty() && again.killed.is_empty());
    assert_eq!(server.events().len(), 1);
    plugin.shutdown().await.unwrap();
}
