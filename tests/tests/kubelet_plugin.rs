//! A test kubelet: drives the kubelet plugin over its real unix sockets in a temp dir, with the
//! real registration and DRA protocols, on claims the batch allocator placed on the demo
//! cluster.
#![allow(clippy::unwrap_used, missing_docs)]

#[path = "support/demo_cluster.rs"]
mod demo_cluster;
#[path = "support/plugin_run.rs"]
mod plugin_run;

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt as _;
use std::path::PathBuf;
use std::sync::Arc;

use k8s_openapi::api::resource::v1 as res;
use tessera_driver::apiversion::Object;
use tessera_driver::node::cdi::{self, Enforcement};
use tessera_driver::node::checkpoint::PrepareState;
use tessera_driver::{names, testing};
use tessera_kubelet_plugin::claims::FakeClaimSource;
use tessera_kubelet_plugin::claims::preparer::{CdiPreparer, CdiPreparerConfig};
use tessera_kubelet_plugin::kubelet::server::{self, PluginConfig, RunningPlugin};
use tessera_proto::dra::{v1, v1beta1};
use tessera_proto::pluginregistration::v1 as reg;
use tessera_tests::plugin_socket::{get_info, notify_registration};

use demo_cluster::{load, repo};
use plugin_run::connect;

const DRIVER: &str = names::DEFAULT_DRIVER_NAME;
const NODE: &str = "a100-node";

/// The example claims, allocated on the demo cluster by the batch allocator, each with a
/// deterministic UID; keyed by name, with the node each landed on.
fn allocated_claims() -> BTreeMap<String, (res::ResourceClaim, String)> {
    let mut classes = Vec::new();
    for f in ["gpu.yaml", "shared-gpu.yaml", "mig.yaml"] {
        for o in load(&repo().join("deviceclasses").join(f)) {
            if let Object::DeviceClass(c) = o {
                classes.push(c);
            }
        }
    }
    let mut claims = Vec::new();
    for f in [
        "01-whole-gpu.yaml",
        "03-share-capacity-requests.yaml",
        "04-share-opaque-config.yaml",
        "05-share-memory-only.yaml",
        "08-mig-instance.yaml",
        "09-specific-model.yaml",
    ] {
        for o in load(&repo().join("examples/claims").join(f)) {
            if let Object::ResourceClaim(c) = o {
                claims.push(c);
            }
        }
    }
    let outcomes = demo_cluster::allocate(&demo_cluster::inventory(), &classes, &claims);
    let mut out = BTreeMap::new();
    for (mut claim, outcome) in claims.into_iter().zip(outcomes) {
        assert!(outcome.allocated, "{}: {:?}", outcome.name, outcome.reason);
        let name = outcome.name.clone();
        claim.metadata.uid = Some(format!("uid-{name}"));
        claim.status = Some(res::ResourceClaimStatus {
            allocation: outcome.allocation,
            ..res::ResourceClaimStatus::default()
        });
        out.insert(name, (claim, outcome.node.unwrap()));
    }
    out
}

struct Harness {
    dir: tempfile::TempDir,
    claims: BTreeMap<String, (res::ResourceClaim, String)>,
}

impl Harness {
    fn new() -> Self {
        Self {
            dir: tempfile::tempdir().unwrap(),
            claims: allocated_claims(),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn source(&self) -> FakeClaimSource {
        let mut source = FakeClaimSource::new();
        for (claim, _) in self.claims.values() {
            source.insert(claim.clone());
        }
        source
    }

    fn preparer(&self, boot_id: &str, source: FakeClaimSource) -> CdiPreparer {
        let node = demo_cluster::node(NODE);
        CdiPreparer::new(
            CdiPreparerConfig {
                driver_name: DRIVER.to_owned(),
                cdi_dir: self.path("cdi"),
                state_dir: self.path("state"),
                enforcement: Enforcement::Mps {
                    pipe_dir_root: "/run/tessera/mps".to_owned(),
                    log_dir_root: "/var/log/tessera/mps".to_owned(),
                },
                boot_id: boot_id.to_owned(),
            },
            node,
            Arc::new(source),
        )
        .unwrap()
    }

    fn start_with(&self, preparer: CdiPreparer) -> RunningPlugin {
        server::start(
            PluginConfig {
                driver_name: DRIVER.to_owned(),
                registration_dir: self.path("plugins_registry"),
                plugin_dir: self.path("plugins").join(DRIVER),
            },
            Arc::new(preparer),
        )
        .unwrap()
    }

    fn start(&self) -> RunningPlugin {
        self.start_with(self.preparer("boot-1", self.source()))
    }

    /// Claims the allocator put on the plugin's node, by name.
    fn on_node(&self) -> Vec<String> {
        self.claims
            .iter()
            .filter(|(_, (_, node))| node == NODE)
            .map(|(name, _)| name.clone())
            .collect()
    }

    fn off_node(&self) -> String {
        self.claims
            .iter()
            .find(|(_, (_, node))| node != NODE)
            .map(|(name, _)| name.clone())
            .expect("some example claim lands on another node")
    }

    fn claim_ref(&self, name: &str) -> (String, String, String) {
        let (c, _) = &self.claims[name];
        (
            c.metadata.namespace.clone().unwrap(),
            name.to_owned(),
            c.metadata.uid.clone().unwrap(),
        )
    }
}

fn v1_claims(refs: &[(String, String, String)]) -> Vec<v1::Claim> {
    refs.iter()
        .map(|(namespace, name, uid)| v1::Claim {
            namespace: namespace.clone(),
            name: name.clone(),
            uid: uid.clone(),
        })
        .collect()
}

fn v1beta1_claims(refs: &[(String, String, String)]) -> Vec<v1beta1::Claim> {
    refs.iter()
        .map(|(namespace, name, uid)| v1beta1::Claim {
            namespace: namespace.clone(),
            name: name.clone(),
            uid: uid.clone(),
        })
        .collect()
}

async fn prepare_v1(
    plugin: &RunningPlugin,
    refs: &[(String, String, String)],
) -> BTreeMap<String, v1::NodePrepareResourceResponse> {
    let mut client =
        v1::dra_plugin_client::DraPluginClient::new(connect(&plugin.config().dra_socket()).await);
    let answer = client
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: v1_claims(refs),
        })
        .await
        .expect("prepare never fails as a call")
        .into_inner();
    answer.claims.into_iter().collect()
}

async fn unprepare_v1(plugin: &RunningPlugin, refs: &[(String, String, String)]) -> Vec<String> {
    let mut client =
        v1::dra_plugin_client::DraPluginClient::new(connect(&plugin.config().dra_socket()).await);
    let answer = client
        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
            claims: v1_claims(refs),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.claims.len(), refs.len());
    answer.claims.into_values().map(|r| r.error).collect()
}

fn expected_ids(uid: &str, device: &str) -> Vec<String> {
    vec![format!("{}={uid}-{device}", names::CDI_KIND)]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_registers_the_plugin_then_prepares_and_unprepares_through_v1() {
    let h = Harness::new();
    let plugin = h.start();
    let reg_socket = plugin.config().registration_socket();
    assert_eq!(
        reg_socket,
        h.path("plugins_registry")
            .join(format!("{DRIVER}-reg.sock"))
    );
    for socket in [&reg_socket, &plugin.config().dra_socket()] {
        let mode = std::fs::metadata(socket).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{}", socket.display());
    }

    let (mut registration, info) = get_info(connect(&reg_socket).await).await.unwrap();
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.name, DRIVER);
    assert_eq!(
        info.endpoint,
        plugin.config().dra_socket().display().to_string()
    );
    assert_eq!(
        info.supported_versions,
        vec!["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    );
    assert!(!plugin.is_registered());
    notify_registration(&mut registration, None).await.unwrap();
    assert!(plugin.is_registered());

    let names = h.on_node();
    assert!(names.len() >= 2, "claims on {NODE}: {names:?}");
    let refs: Vec<_> = names.iter().map(|n| h.claim_ref(n)).collect();
    let answer = prepare_v1(&plugin, &refs).await;
    assert_eq!(answer.len(), refs.len());
    for (_, name, uid) in &refs {
        let got = &answer[uid];
        assert_eq!(got.error, "", "{name}");
        let (claim, _) = &h.claims[name];
        let results = testing::results(testing::allocation(claim));
        assert_eq!(got.devices.len(), results.len(), "{name}");
        for (device, result) in got.devices.iter().zip(results) {
            assert_eq!(device.pool_name, NODE);
            assert_eq!(device.device_name, result.device);
            assert_eq!(device.request_names, vec![result.request.clone()]);
            assert_eq!(device.cdi_device_ids, expected_ids(uid, &result.device));
            assert_eq!(
                device.share_id, result.share_id,
                "{name}: v1 answers carry shareID"
            );
        }
        let spec_path = h.path("cdi").join(cdi::spec_file_name(uid));
        let spec: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&spec_path).unwrap()).unwrap();
        assert_eq!(spec["kind"], names::CDI_KIND);
        assert_eq!(
            spec["devices"][0]["name"],
            format!("{uid}-{}", results[0].device)
        );
        let env = spec["containerEdits"]["env"].as_array().unwrap();
        assert!(
            env.iter()
                .any(|e| e.as_str().unwrap().starts_with("NVIDIA_VISIBLE_DEVICES=")),
            "{spec}"
        );
    }

    // Kubelet retries: the same answer, nothing rewritten.
    let again = prepare_v1(&plugin, &refs).await;
    assert_eq!(again, answer);

    assert_eq!(unprepare_v1(&plugin, &refs).await, vec![""; refs.len()]);
    for (_, _, uid) in &refs {
        assert!(!h.path("cdi").join(cdi::spec_file_name(uid)).exists());
    }
    assert_eq!(unprepare_v1(&plugin, &refs).await, vec![""; refs.len()]);

    plugin.shutdown().await.unwrap();
    assert!(!reg_socket.exists());
    assert!(!h.path("plugins").join(DRIVER).join("dra.sock").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1beta1_kubelet_prepares_the_same_way() {
    let h = Harness::new();
    let plugin = h.start();
    let name = h.on_node()[0].clone();
    let refs = vec![h.claim_ref(&name)];
    let uid = refs[0].2.clone();
    let mut client = v1beta1::dra_plugin_client::DraPluginClient::new(
        connect(&plugin.config().dra_socket()).await,
    );
    for _ in 0..2 {
        let answer = client
            .node_prepare_resources(v1beta1::NodePrepareResourcesRequest {
                claims: v1beta1_claims(&refs),
            })
            .await
            .unwrap()
            .into_inner();
        let got = &answer.claims[&uid];
        assert_eq!(got.error, "");
        assert_eq!(
            got.devices[0].cdi_device_ids,
            expected_ids(&uid, &got.devices[0].device_name)
        );
    }
    assert!(h.path("cdi").join(cdi::spec_file_name(&uid)).exists());
    let answer = client
        .node_unprepare_resources(v1beta1::NodeUnprepareResourcesRequest {
            claims: v1beta1_claims(&refs),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.claims[&uid].error, "");
    assert!(!h.path("cdi").join(cdi::spec_file_name(&uid)).exists());
    plugin.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_kubelet_calls_for_different_claims_all_succeed() {
    let h = Harness::new();
    let plugin = Arc::new(h.start());
    let mut tasks = Vec::new();
    for name in h.on_node() {
        let refs = vec![h.claim_ref(&name)];
        let plugin = Arc::clone(&plugin);
        tasks.push(tokio::spawn(async move {
            let answer = prepare_v1(&plugin, &refs).await;
            (refs[0].2.clone(), answer)
        }));
    }
    for task in tasks {
        let (uid, answer) = task.await.unwrap();
        assert_eq!(answer[&uid].error, "");
        assert!(h.path("cdi").join(cdi::spec_file_name(&uid)).exists());
    }
    let checkpoint = std::fs::read_to_string(h.path("state").join("checkpoint.json")).unwrap();
    for name in h.on_node() {
        assert!(checkpoint.contains(&format!("uid-{name}")), "{checkpoint}");
    }
}

/// What would end a line of `kubectl describe` and forge the next, drive a terminal, reverse
/// the text after it, or break a line in some readers.
const FORGING: &str = "\n1999-01-01 Normal Prepared\u{1b}[31m\u{202e}\u{2028}";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_sent_to_kubelet_escape_what_names_and_texts_carry() {
    let h = Harness::new();
    // A claim allocated to another node, whose name and that node's name (its pool) carry
    // the forging characters; and a claim that does not exist, named and with a UID the same.
    let (mut elsewhere, _) = h.claims[&h.off_node()].clone();
    let name = format!("moved{FORGING}");
    let node = format!("node{FORGING}");
    elsewhere.metadata.name = Some(name.clone());
    elsewhere.metadata.uid = Some("uid-moved".to_owned());
    let results = elsewhere
        .status
        .as_mut()
        .unwrap()
        .allocation
        .as_mut()
        .unwrap();
    for result in results.devices.as_mut().unwrap().results.as_mut().unwrap() {
        result.pool.clone_from(&node);
    }
    let namespace = elsewhere.metadata.namespace.clone().unwrap();
    let mut source = h.source();
    source.insert(elsewhere);
    let plugin = h.start_with(h.preparer("boot-1", source));
    let gone = (
        format!("ns{FORGING}"),
        format!("gone{FORGING}"),
        format!("uid{FORGING}"),
    );
    let answer = prepare_v1(
        &plugin,
        &[(namespace, name, "uid-moved".to_owned()), gone.clone()],
    )
    .await;
    for (uid, claim) in &answer {
        assert!(!claim.error.is_empty(), "{uid:?} is refused");
        assert!(
            !claim.error.chars().any(tessera_kubeapi::text::is_hidden),
            "{uid:?}: {:?}",
            claim.error
        );
    }
    let escaped = tessera_kubeapi::text::escaped(FORGING);
    let moved = &answer["uid-moved"].error;
    assert!(
        moved.contains(&format!("allocated to node node{escaped}")),
        "the node it is allocated to, escaped: {moved}"
    );
    assert!(moved.contains(&format!("moved{escaped}")), "{moved}");
    assert!(
        answer[&gone.2].error.contains(&format!("gone{escaped}")),
        "{}",
        answer[&gone.2].error
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_claims_get_per_claim_errors_and_good_ones_still_prepare() {
    let h = Harness::new();
    let plugin = h.start();
    let good = h.claim_ref(&h.on_node()[0]);
    let (ns, name, _) = h.claim_ref(&h.on_node()[0]);
    let refs = vec![
        good.clone(),
        (
            "default".to_owned(),
            "no-such-claim".to_owned(),
            "uid-x".to_owned(),
        ),
        (ns, name, "uid-from-a-deleted-claim".to_owned()),
        h.claim_ref(&h.off_node()),
        ("default".to_owned(), "empty-uid".to_owned(), String::new()),
    ];
    let answer = prepare_v1(&plugin, &refs).await;
    assert_eq!(answer[&good.2].error, "");
    assert!(
        answer["uid-x"].error.contains("not found"),
        "{:?}",
        answer["uid-x"]
    );
    let mismatch = &answer["uid-from-a-deleted-claim"].error;
    assert!(mismatch.contains("has UID"), "{mismatch}");
    let other = &answer[&h.claim_ref(&h.off_node()).2].error;
    assert!(other.contains(NODE), "{other}");
    let allocated_to = &h.claims[&h.off_node()].1;
    assert!(
        other.contains(&format!("allocated to node {allocated_to}")),
        "{other}"
    );
    assert!(
        answer[""].error.contains("uid is empty"),
        "{:?}",
        answer[""]
    );
    for (uid, got) in &answer {
        if *uid != good.2 {
            assert!(got.devices.is_empty());
            assert!(!h.path("cdi").join(cdi::spec_file_name(uid)).exists());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_gpu_held_by_one_claim_is_refused_to_another() {
    let h = Harness::new();
    let whole = "whole-gpu";
    assert_eq!(
        h.claims[whole].1, NODE,
        "the whole-GPU example lands on {NODE}"
    );
    let mut twin = h.claims[whole].0.clone();
    twin.metadata.name = Some("twin".to_owned());
    twin.metadata.uid = Some("uid-twin".to_owned());
    let mut source = h.source();
    source.insert(twin);
    let plugin = h.start_with(h.preparer("boot-1", source));
    let first = h.claim_ref(whole);
    let twin = (
        "default".to_owned(),
        "twin".to_owned(),
        "uid-twin".to_owned(),
    );
    assert_eq!(
        prepare_v1(&plugin, std::slice::from_ref(&first)).await[&first.2].error,
        ""
    );
    let refused = prepare_v1(&plugin, std::slice::from_ref(&twin)).await;
    assert!(
        refused["uid-twin"]
            .error
            .contains("held by claim uid-whole-gpu"),
        "{refused:?}"
    );
    unprepare_v1(&plugin, &[first]).await;
    assert_eq!(
        prepare_v1(&plugin, std::slice::from_ref(&twin)).await["uid-twin"].error,
        ""
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_plugin_remembers_prepared_claims_until_reboot() {
    let h = Harness::new();
    let refs: Vec<_> = h.on_node().iter().map(|n| h.claim_ref(n)).collect();
    let plugin = h.start();
    let answer = prepare_v1(&plugin, &refs).await;
    plugin.shutdown().await.unwrap();

    // Same boot: the new instance knows every claim without asking the claim source.
    let preparer = h.preparer("boot-1", FakeClaimSource::new());
    let known = preparer.claims().unwrap();
    assert_eq!(known.len(), refs.len());
    assert!(
        known
            .iter()
            .all(|(_, s)| *s == PrepareState::PrepareCompleted)
    );
    // A crashed run leaves its sockets behind; the new run replaces them.
    let stale = h
        .path("plugins_registry")
        .join(format!("{DRIVER}-reg.sock"));
    std::fs::write(&stale, b"stale").unwrap();
    let plugin = h.start_with(preparer);
    let mut registration = reg::registration_client::RegistrationClient::new(connect(&stale).await);
    assert_eq!(
        registration
            .get_info(reg::InfoRequest {})
            .await
            .unwrap()
            .into_inner()
            .name,
        DRIVER
    );
    assert_eq!(prepare_v1(&plugin, &refs).await, answer);
    assert_eq!(unprepare_v1(&plugin, &refs[..1]).await, vec![""]);
    assert!(!h.path("cdi").join(cdi::spec_file_name(&refs[0].2)).exists());
    plugin.shutdown().await.unwrap();

    // After a reboot the record is stale and dropped.
    let preparer = h.preparer("boot-2", h.source());
    assert!(preparer.claims().unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hami_core_share_gets_the_library_and_the_limits_its_allocation_records() {
    let h = Harness::new();
    let (node, share) = h
        .claims
        .iter()
        .find(|(name, (_, node))| name.contains("share") && node != NODE)
        .map(|(name, (_, node))| (node.clone(), h.claim_ref(name)))
        .unwrap();
    let inventory = demo_cluster::node(&node);
    // What the allocation records for the claim's device, as the node reads it.
    let recorded =
        tessera_driver::node::prepare::prepare_on_node(&h.claims[&share.1].0, DRIVER, &inventory)
            .unwrap();
    let limit = recorded.devices[0].share.expect("a share");
    let cache = h.path("hami");
    let preparer = CdiPreparer::new(
        CdiPreparerConfig {
            driver_name: DRIVER.to_owned(),
            cdi_dir: h.path("cdi"),
            state_dir: h.path("state"),
            enforcement: Enforcement::HamiCore {
                library_path: "/usr/local/vgpu/libvgpu.so".to_owned(),
                cache_dir: cache.display().to_string(),
            },
            boot_id: "boot-1".to_owned(),
        },
        inventory,
        Arc::new(h.source()),
    )
    .unwrap();
    let plugin = h.start_with(preparer);
    assert_eq!(
        prepare_v1(&plugin, std::slice::from_ref(&share)).await[&share.2].error,
        ""
    );

    let spec: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(h.path("cdi").join(cdi::spec_file_name(&share.2))).unwrap(),
    )
    .unwrap();
    // Enforcement edits apply to the whole claim: the spec's own containerEdits.
    let edits = &spec["containerEdits"];
    let env: Vec<&str> = edits["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    let mib = limit.memory_bytes >> 20;
    assert!(
        env.contains(&format!("CUDA_DEVICE_MEMORY_LIMIT_0={mib}m").as_str()),
        "{env:?}"
    );
    if limit.compute_percent > 0 {
        let sm = format!("CUDA_DEVICE_SM_LIMIT={}", limit.compute_percent);
        assert!(env.contains(&sm.as_str()), "{env:?}");
    }
    assert!(
        env.contains(&"LD_PRELOAD=/usr/local/tessera/hami/libvgpu.so"),
        "{env:?}"
    );
    let mounts = edits["mounts"].as_array().unwrap();
    assert_eq!(mounts[0]["hostPath"], "/usr/local/vgpu/libvgpu.so");
    assert!(cache.join(&share.2).join("vgpulock").is_dir());

    assert_eq!(
        unprepare_v1(&plugin, std::slice::from_ref(&share)).await,
        [""]
    );
    assert!(!cache.join(&share.2).exists());
    plugin.shutdown().await.unwrap();
}

/// A claim made for an Aliyun-style pod (the template's forms annotation, copied onto the
/// claim) gives the container gpushare's variables, from its allocation and the node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_made_for_an_aliyun_pod_gets_gpushares_environment() {
    let mut h = Harness::new();
    let (name, node) = h
        .claims
        .iter()
        .find(|(name, (_, node))| name.contains("share") && node != NODE)
        .map(|(name, (_, node))| (name.clone(), node.clone()))
        .unwrap();
    let claim = &mut h.claims.get_mut(&name).unwrap().0;
    claim.metadata.annotations = Some(BTreeMap::from([(
        names::ANNOTATION_DEVICE_PLUGIN_FORMS.to_owned(),
        "aliyun".to_owned(),
    )]));
    let inventory = demo_cluster::node(&node);
    let recorded =
        tessera_driver::node::prepare::prepare_on_node(&h.claims[&name].0, DRIVER, &inventory)
            .unwrap();
    let device = &recorded.devices[0];
    let card = inventory
        .gpus
        .iter()
        .find(|g| g.index == device.gpu.index)
        .unwrap()
        .memory_bytes
        >> 30;
    let share = device.share.expect("a share").memory_bytes >> 30;
    let preparer = CdiPreparer::new(
        CdiPreparerConfig {
            driver_name: DRIVER.to_owned(),
            cdi_dir: h.path("cdi"),
            state_dir: h.path("state"),
            enforcement: Enforcement::None,
            boot_id: "boot-1".to_owned(),
        },
        inventory,
        Arc::new(h.source()),
    )
    .unwrap();
    let plugin = h.start_with(preparer);
    let reference = h.claim_ref(&name);
    assert_eq!(
        prepare_v1(&plugin, std::slice::from_ref(&reference)).await[&reference.2].error,
        ""
    );
    let spec: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(h.path("cdi").join(cdi::spec_file_name(&reference.2))).unwrap(),
    )
    .unwrap();
    let env: Vec<&str> = spec["containerEdits"]["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    for expected in [
        format!("ALIYUN_COM_GPU_MEM_IDX={}", device.gpu.index),
        format!("ALIYUN_COM_GPU_MEM_DEV={card}"),
        format!("ALIYUN_COM_GPU_MEM_CONTAINER={share}"),
        format!("ALIYUN_COM_GPU_MEM_POD={share}"),
    ] {
        assert!(
            env.contains(&expected.as_str()),
            "{expected} not in {env:?}"
        );
    }
    plugin.shutdown().await.unwrap();
}
