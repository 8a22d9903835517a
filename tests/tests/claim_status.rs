//! A prepared claim says what it got: a share claim allocated by the real allocator on the demo
//! cluster, stored on the fake API server and prepared through kubelet's gRPC API under MPS,
//! gets this driver's `status.devices` entry (enforced share, backend, isolation, MPS daemon,
//! `Ready`), written after kubelet's call; the accounting's measure turns `MemoryWithinBooking`
//! false with the use and back; unprepare removes the entry; a claim deleted meanwhile and an
//! API server that refuses writes for a while are no error of prepare.
#![allow(clippy::unwrap_used, missing_docs)]

#[path = "support/demo_cluster.rs"]
mod demo_cluster;
#[path = "support/plugin_run.rs"]
mod plugin_run;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1 as res;
use kube::api::{Api, DynamicObject, PostParams};
use serde_json::{Value, json};
use tessera_driver::apiversion::Object;
use tessera_driver::names;
use tessera_driver::node::cdi::Enforcement;
use tessera_driver::node::claim_status::{CONDITION_MEMORY_WITHIN_BOOKING, CONDITION_READY};
use tessera_driver::node::inventory::{Inventory, NodeInventory};
use tessera_kubelet_plugin::accounting::{
    Accountant, FakeGpu, FakeHostProcesses, FakeMpsControl, FakeMpsDaemon, Seams,
};
use tessera_kubelet_plugin::claims::apiserver::ApiClaimSource;
use tessera_kubelet_plugin::claims::preparer::{CdiPreparer, CdiPreparerConfig};
use tessera_kubelet_plugin::claims::status::{KubeClaimStatus, StatusReporter, StatusReporting};
use tessera_kubelet_plugin::kubelet::server::{self, PluginConfig};
use tessera_kubelet_plugin::ops::metrics::Metrics;
use tessera_proto::dra::v1;
use tessera_tests::fake_apiserver::{FakeApiServer, Verb};

use demo_cluster::{load, repo};
use plugin_run::connect;

const DRIVER: &str = names::DEFAULT_DRIVER_NAME;
const POD_UID: &str = "0c6f33a4-5e2b-4a1b-9e0c-51d4b2a3f7e1";
const GIB: u64 = 1 << 30;

/// The example share claim (10 GiB, 50 % compute) allocated on the demo cluster, with the node
/// it landed on.
fn allocated_share() -> (res::ResourceClaim, NodeInventory) {
    let inventory: Inventory = demo_cluster::inventory();
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
    let node = inventory.node(&outcome.node.unwrap()).cloned().unwrap();
    (claim, node)
}

/// Stores the claim with its allocation, reserved for the pod `trainer`; returns its UID.
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
    let mut status = body.as_object_mut().unwrap().remove("status").unwrap();
    let mut created = api
        .create(
            &PostParams::default(),
            &serde_json::from_value(body).unwrap(),
        )
        .await
        .unwrap();
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

/// A plugin on the claim's node whose kubelet calls are reported by `reporter`, which a test
/// runs by hand ([`StatusReporter::run_due`]) so that nothing waits on a clock.
struct Node {
    server: FakeApiServer,
    client: kube::Client,
    preparer: Arc<CdiPreparer>,
    source: Arc<ApiClaimSource>,
    reporter: Arc<StatusReporter>,
    plugin: server::RunningPlugin,
    kubelet: v1::dra_plugin_client::DraPluginClient<tonic::transport::Channel>,
    claim: res::ResourceClaim,
    inventory: NodeInventory,
    _dir: tempfile::TempDir,
}

impl Node {
    async fn start() -> Self {
        let server = FakeApiServer::start(&["v1"]).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("kubeconfig"), server.kubeconfig()).unwrap();
        let client = tessera_kubeapi::client(Some(&dir.path().join("kubeconfig")))
            .await
            .unwrap();
        let path = |p: &str| dir.path().join(p);
        let (claim, inventory) = allocated_share();
        let source = Arc::new(ApiClaimSource::new(client.clone()));
        let enforcement = Enforcement::Mps {
            pipe_dir_root: path("mps").display().to_string(),
            log_dir_root: path("mps-log").display().to_string(),
        };
        let preparer = Arc::new(
            CdiPreparer::new(
                CdiPreparerConfig {
                    driver_name: DRIVER.to_owned(),
                    cdi_dir: path("cdi"),
                    state_dir: path("state"),
                    enforcement: enforcement.clone(),
                    boot_id: "boot-1".to_owned(),
                },
                inventory.clone(),
                source.clone(),
            )
            .unwrap(),
        );
        let reporter = Arc::new(StatusReporter::new(
            Arc::new(KubeClaimStatus::new(ApiClaimSource::new(client.clone()))),
            preparer.clone(),
            DRIVER,
            enforcement,
        ));
        let plugin = server::start(
            PluginConfig {
                driver_name: DRIVER.to_owned(),
                registration_dir: path("registry"),
                plugin_dir: path("plugin"),
            },
            Arc::new(StatusReporting::new(preparer.clone(), reporter.clone())),
        )
        .unwrap();
        let kubelet = v1::dra_plugin_client::DraPluginClient::new(
            connect(&plugin.config().dra_socket()).await,
        );
        Self {
            server,
            client,
            preparer,
            source,
            reporter,
            plugin,
            kubelet,
            claim,
            inventory,
            _dir: dir,
        }
    }

    fn name(&self) -> String {
        self.claim.metadata.name.clone().unwrap()
    }

    async fn prepare(&mut self, uid: &str) -> String {
        let answer = self
            .kubelet
            .node_prepare_resources(v1::NodePrepareResourcesRequest {
                claims: vec![v1::Claim {
                    namespace: "default".to_owned(),
                    name: self.name(),
                    uid: uid.to_owned(),
                }],
            })
            .await
            .unwrap()
            .into_inner()
            .claims;
        answer[uid].error.clone()
    }

    async fn unprepare(&mut self, uid: &str) -> String {
        let answer = self
            .kubelet
            .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
                claims: vec![v1::Claim {
                    namespace: "default".to_owned(),
                    name: self.name(),
                    uid: uid.to_owned(),
                }],
            })
            .await
            .unwrap()
            .into_inner()
            .claims;
        answer[uid].error.clone()
    }

    /// The claim as `kubectl get resourceclaim -o yaml` would show it.
    fn stored(&self) -> Value {
        self.server
            .get("resourceclaims", Some("default"), &self.name())
            .unwrap()
    }

    /// This driver's entries of the stored claim's `status.devices`.
    fn ours(&self) -> Vec<Value> {
        self.stored()["status"]["devices"]
            .as_array()
            .map(|ds| {
                ds.iter()
                    .filter(|d| d["driver"] == DRIVER)
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }
}

fn condition<'a>(entry: &'a Value, type_: &str) -> &'a Value {
    entry["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == type_)
        .unwrap_or_else(|| panic!("no {type_} condition in {entry}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepared_share_shows_its_enforced_share_backend_and_isolation_and_is_ready() {
    let mut node = Node::start().await;
    let uid = store(&node.client, &node.claim).await;
    assert_eq!(node.prepare(&uid).await, "");
    // Kubelet's answer did not wait for the write: the claim is queued, not yet written.
    assert_eq!(node.reporter.pending(), 1);
    assert!(node.ours().is_empty());

    assert_eq!(node.reporter.run_due(Instant::now()).await, 0);
    let stored = node.stored();
    println!("{}", serde_yaml::to_string(&stored).unwrap());
    let ours = node.ours();
    assert_eq!(ours.len(), 1, "{stored}");
    let entry = &ours[0];
    let allocated = &stored["status"]["allocation"]["devices"]["results"][0];
    for key in ["driver", "pool", "device", "shareID"] {
        assert_eq!(entry[key], allocated[key], "{key}");
    }
    let held = node.preparer.record().unwrap().claims[&uid].clone();
    let gpu = node
        .inventory
        .gpus
        .iter()
        .find(|g| g.uuid == held.devices[0].gpu_uuid)
        .unwrap();
    let data = &entry["data"];
    assert_eq!(data["apiVersion"], names::CONFIG_API_VERSION);
    assert_eq!(data["backend"], "mps");
    assert_eq!(data["memoryLimitBytes"], 10 * GIB);
    assert_eq!(data["computePercent"], 50);
    assert_eq!(data["tier"], "online");
    assert_eq!(data["gpu"], gpu.uuid.as_str());
    assert_eq!(data["isolation"], gpu.isolation.as_str());
    assert_eq!(data["mpsDaemon"], held.mps_daemon.unwrap().id.as_str());
    assert_eq!(condition(entry, CONDITION_READY)["status"], "True");
    assert_eq!(
        condition(entry, CONDITION_MEMORY_WITHIN_BOOKING)["status"],
        "Unknown",
        "no accounting pass has measured it"
    );
    // A repeated prepare (kubelet retries) writes nothing new.
    let version = stored["metadata"]["resourceVersion"].clone();
    assert_eq!(node.prepare(&uid).await, "");
    node.reporter.run_due(Instant::now()).await;
    assert_eq!(node.stored()["metadata"]["resourceVersion"], version);
    node.plugin.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_within_booking_turns_false_with_the_use_while_the_accounting_sees_it_over_and_back()
{
    let mut node = Node::start().await;
    let uid = store(&node.client, &node.claim).await;
    assert_eq!(node.prepare(&uid).await, "");
    node.reporter.run_due(Instant::now()).await;

    let record = node.preparer.record().unwrap();
    let entry = &record.claims[&uid];
    let daemon = entry.mps_daemon.clone().unwrap();
    let gpu_uuid = entry.devices[0].gpu_uuid.clone();
    let gpu = FakeGpu::new();
    let host = FakeHostProcesses::new(gpu.clone());
    let mps = FakeMpsDaemon::start(Path::new(&daemon.pipe_dir), gpu.clone()).unwrap();
    let cgroup = format!(
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-9.scope\n",
        POD_UID.replace('-', "_")
    );
    // Two workers of 6 GiB each: 12 GiB of a 10 GiB booking.
    for (i, pid) in [4001u32, 4002].into_iter().enumerate() {
        gpu.run(pid, &gpu_uuid, 6 * GIB);
        host.spawn(pid, &cgroup, 5000 + i as u64);
        mps.add_client(4000, pid);
    }
    let metrics = Arc::new(Metrics::new());
    let accountant = Accountant::new(
        Seams {
            prepared: node.preparer.clone(),
            claims: node.source.clone(),
            gpus: Arc::new(gpu.clone()),
            host: Arc::new(host.clone()),
            mps: Arc::new(FakeMpsControl::new()),
            events: None,
        },
        Some(metrics.clone()),
    )
    .with_status(node.reporter.clone());

    let report = accountant.pass(Instant::now()).await.unwrap();
    assert_eq!(report.terminated, [4002]);
    node.reporter.run_due(Instant::now()).await;
    let over = condition(&node.ours()[0], CONDITION_MEMORY_WITHIN_BOOKING).clone();
    assert_eq!(over["status"], "False", "{over}");
    assert_eq!(over["reason"], "OverBooking");
    let message = over["message"].as_str().unwrap();
    assert!(message.contains("use 12288 MiB"), "{message}");
    assert!(
        message.contains(&format!("10240 MiB booked on GPU {gpu_uuid}")),
        "{message}"
    );
    assert_eq!(node.ours()[0]["data"]["memoryUsedBytes"], 12 * GIB);
    let text = metrics.encode().unwrap();
    let series = format!(
        "tessera_kubelet_plugin_claim_gpu_memory_used_bytes{{namespace=\"default\",claim=\"{}\",uuid=\"{gpu_uuid}\"}} {}",
        node.name(),
        12 * GIB
    );
    assert!(text.contains(&series), "{text}");

    // The newest worker was stopped: the next pass sees the claim back within its booking.
    accountant.pass(Instant::now()).await.unwrap();
    node.reporter.run_due(Instant::now()).await;
    let back = condition(&node.ours()[0], CONDITION_MEMORY_WITHIN_BOOKING).clone();
    assert_eq!(back["status"], "True", "{back}");
    assert!(
        back["message"].as_str().unwrap().contains("use 6144 MiB"),
        "{back}"
    );
    assert_eq!(node.ours()[0]["data"]["memoryUsedBytes"], 6 * GIB);

    // Unprepared: the entry goes, and with the claim's processes gone the metrics forget it.
    assert_eq!(node.unprepare(&uid).await, "");
    node.reporter.run_due(Instant::now()).await;
    assert!(node.ours().is_empty(), "{}", node.stored());
    gpu.end(4001);
    accountant.pass(Instant::now()).await.unwrap();
    let text = metrics.encode().unwrap();
    assert!(
        !text.contains(&format!("claim=\"{}\"", node.name())),
        "an ended claim's series stay: {text}"
    );
    node.plugin.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_deleted_before_its_status_is_written_is_no_error() {
    let mut node = Node::start().await;
    let uid = store(&node.client, &node.claim).await;
    assert_eq!(node.prepare(&uid).await, "");
    node.server
        .delete("resourceclaims", Some("default"), &node.name())
        .unwrap();
    assert_eq!(node.reporter.run_due(Instant::now()).await, 0);
    assert_eq!(node.reporter.failed_writes(), 0);
    node.plugin.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepare_succeeds_while_the_api_server_refuses_writes_and_the_status_follows_once_it_is_back()
 {
    let mut node = Node::start().await;
    let uid = store(&node.client, &node.claim).await;
    node.server
        .inject(Verb::Patch, "resourceclaims/status", 503, 2);
    assert_eq!(node.prepare(&uid).await, "");

    let start = Instant::now();
    assert_eq!(
        node.reporter.run_due(start).await,
        1,
        "the write failed and waits"
    );
    assert!(node.ours().is_empty());
    // Not due yet: the retry waits its delay.
    assert_eq!(node.reporter.run_due(start).await, 1);
    assert_eq!(node.reporter.failed_writes(), 1);
    assert_eq!(
        node.reporter.run_due(start + Duration::from_secs(1)).await,
        1
    );
    assert_eq!(node.reporter.failed_writes(), 2);
    assert_eq!(
        node.reporter.run_due(start + Duration::from_mins(1)).await,
        0
    );
    assert_eq!(
        condition(&node.ours()[0], CONDITION_READY)["status"],
        "True"
    );
    node.plugin.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conflicting_writer_in_between_is_read_again_and_its_change_kept() {
    let mut node = Node::start().await;
    let uid = store(&node.client, &node.claim).await;
    node.server
        .inject(Verb::Patch, "resourceclaims/status", 409, 1);
    assert_eq!(node.prepare(&uid).await, "");
    assert_eq!(node.reporter.run_due(Instant::now()).await, 0);
    assert_eq!(node.reporter.failed_writes(), 0);
    assert_eq!(node.ours().len(), 1);
    assert_eq!(node.stored()["status"]["reservedFor"][0]["uid"], POD_UID);
    node.plugin.shutdown().await.unwrap();
}
