//! The kubelet plugin against the in-process fake API server: publishing ResourceSlices in
//! each served resource.k8s.io version, republishing, retries of injected errors, and
//! prepare with claims fetched from the API server.
#![allow(clippy::unwrap_used, missing_docs)]

#[path = "support/plugin_run.rs"]
mod plugin_run;
#[path = "support/apiserver_scenarios.rs"]
mod scenarios;

use std::collections::BTreeMap;

use scenarios::{DRIVER, NODE};
use serde_json::json;
use tessera_driver::apiversion::ApiVersion;
use tessera_driver::names;
use tessera_kubelet_plugin::publisher::SlicePublisher;
use tessera_tests::fake_apiserver::{FakeApiServer, Verb};

async fn start(versions: &[&str]) -> (FakeApiServer, kube::Client, tempfile::TempDir) {
    let server = FakeApiServer::start(versions).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, server.kubeconfig()).unwrap();
    let client = tessera_kubeapi::client(Some(&kubeconfig)).await.unwrap();
    (server, client, dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_on_a_v1_server() {
    let (server, client, _dir) = start(&["v1", "v1beta2", "v1beta1"]).await;
    scenarios::publish_and_check_shape(&client, ApiVersion::V1).await;
    for slice in server.objects("resourceslices") {
        assert_eq!(slice["apiVersion"], "resource.k8s.io/v1");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_on_a_v1beta2_server() {
    let (server, client, _dir) = start(&["v1beta2", "v1beta1"]).await;
    scenarios::publish_and_check_shape(&client, ApiVersion::V1beta2).await;
    for slice in server.objects("resourceslices") {
        assert_eq!(slice["apiVersion"], "resource.k8s.io/v1beta2");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_on_a_v1beta1_server() {
    let (server, client, _dir) = start(&["v1beta1"]).await;
    scenarios::publish_and_check_shape(&client, ApiVersion::V1beta1).await;
    for slice in server.objects("resourceslices") {
        assert_eq!(slice["apiVersion"], "resource.k8s.io/v1beta1");
        assert!(slice["spec"]["devices"][0]["basic"].is_object(), "{slice}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_dra_is_an_error_not_a_crash() {
    let (_server, client, _dir) = start(&[]).await;
    let err = tessera_kubeapi::served_resource_version(&client)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("1.32"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inventory_change_bumps_the_generation_and_deletes_surplus_slices() {
    let (server, client, _dir) = start(&["v1"]).await;
    scenarios::republish_after_inventory_change(&client, ApiVersion::V1).await;
    let deletes = server
        .requests()
        .iter()
        .filter(|r| r.verb == Verb::Delete && r.resource == "resourceslices")
        .count();
    assert_eq!(deletes, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_slices_of_this_node_go_and_others_stay() {
    let (server, client, _dir) = start(&["v1"]).await;
    let labels = json!({names::LABEL_MANAGED_BY: names::KUBELET_PLUGIN_MANAGER});
    let slice = |name: &str, node: &str, driver: &str| {
        json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": name, "labels": labels},
            "spec": {"driver": driver, "nodeName": node,
                     "pool": {"name": node, "generation": 7, "resourceSliceCount": 1}},
        })
    };
    server
        .create("resourceslices", slice("stale", NODE, DRIVER))
        .unwrap();
    server
        .create("resourceslices", slice("other-node", "t4-node", DRIVER))
        .unwrap();
    server
        .create(
            "resourceslices",
            slice("other-driver", NODE, "other.example.com"),
        )
        .unwrap();
    scenarios::create_node(&client).await;
    let slice_publisher = SlicePublisher::new(client.clone(), scenarios::fast_config());
    let published = slice_publisher
        .publish_once(&scenarios::node_inventory())
        .await
        .unwrap();
    // Above any generation seen, so consumers never mix old and new slices.
    assert_eq!(published.generation, 8);
    assert!(server.get("resourceslices", None, "stale").is_none());
    assert!(server.get("resourceslices", None, "other-node").is_some());
    assert!(server.get("resourceslices", None, "other-driver").is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn injected_conflicts_and_outages_are_retried() {
    let (server, client, _dir) = start(&["v1"]).await;
    scenarios::create_node(&client).await;
    let slice_publisher = SlicePublisher::new(client.clone(), scenarios::fast_config());
    let mut node = scenarios::node_inventory();

    server.inject(Verb::Create, "resourceslices", 500, 2);
    server.inject(Verb::Create, "resourceslices", 409, 1);
    server.inject(Verb::Get, "nodes", 500, 1);
    let first = slice_publisher.publish(&node).await;
    assert_eq!(first.generation, 1);
    let failed: Vec<u16> = server
        .requests()
        .iter()
        .filter(|r| r.code >= 400)
        .map(|r| r.code)
        .collect();
    assert_eq!(failed, vec![500, 500, 500, 409]);

    node.gpus.pop();
    server.inject(Verb::Update, "resourceslices", 409, 2);
    server.inject(Verb::Update, "resourceslices", 500, 1);
    server.inject(Verb::List, "resourceslices", 500, 1);
    let second = slice_publisher.publish(&node).await;
    assert!(second.changed);
    assert_eq!(second.generation, 2);
    for slice in server.objects("resourceslices") {
        assert_eq!(slice["spec"]["pool"]["generation"], 2);
        assert_eq!(
            slice["spec"]["devices"].as_array().unwrap().len(),
            node.gpus.len()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepare_fetches_claims_from_a_v1_server() {
    let (_server, client, dir) = start(&["v1"]).await;
    scenarios::prepare_through_kubelet(&client, ApiVersion::V1, dir.path()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepare_fetches_claims_from_a_v1beta1_server() {
    let (_server, client, dir) = start(&["v1beta1"]).await;
    scenarios::prepare_through_kubelet(&client, ApiVersion::V1beta1, dir.path()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fake_server_watches_and_enforces_resource_versions() {
    use kube::api::{Api, DynamicObject, PostParams, WatchEvent, WatchParams};
    use tokio_stream::StreamExt as _;
    let (_server, client, _dir) = start(&["v1"]).await;
    let api: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &tessera_kubeapi::resource(ApiVersion::V1, tessera_driver::names::RESOURCE_SLICE),
    );
    let mut stream = Box::pin(api.watch(&WatchParams::default(), "0").await.unwrap());
    let slice: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": "s"},
        "spec": {"driver": DRIVER, "nodeName": NODE, "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1}},
    }))
    .unwrap();
    let created = api.create(&PostParams::default(), &slice).await.unwrap();
    match stream.next().await.unwrap().unwrap() {
        WatchEvent::Added(o) => assert_eq!(o.metadata.name.as_deref(), Some("s")),
        other => panic!("{other:?}"),
    }
    let mut stale = created.clone();
    stale.metadata.resource_version = Some("0".to_owned());
    let err = api
        .replace("s", &PostParams::default(), &stale)
        .await
        .unwrap_err();
    assert!(
        matches!(err, kube::Error::Api(ref s) if s.code == 409),
        "{err}"
    );
    let mut fresh = created;
    fresh.data["spec"]["pool"]["generation"] = json!(2);
    api.replace("s", &PostParams::default(), &fresh)
        .await
        .unwrap();
    match stream.next().await.unwrap().unwrap() {
        WatchEvent::Modified(o) => assert_eq!(o.data["spec"]["pool"]["generation"], 2),
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_server_is_a_claim_error_not_a_crash() {
    use std::time::Duration;
    use tessera_kubelet_plugin::claims::apiserver::ApiClaimSource;
    use tessera_kubelet_plugin::claims::{ClaimRef, ClaimSource as _};
    let (server, client, _dir) = start(&["v1"]).await;
    drop(server);
    let source = ApiClaimSource::new(client).with_timeout(Duration::from_secs(5));
    let err = source
        .claim(&ClaimRef::new("default", "c", "u"))
        .await
        .unwrap_err();
    assert!(err.is_retryable(), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plugin_with_a_kubeconfig_publishes_its_slices() {
    use clap::Parser as _;
    let (server, client, dir) = start(&["v1beta2"]).await;
    scenarios::create_node(&client).await;
    let boot_id = dir.path().join("boot_id");
    std::fs::write(&boot_id, "boot-1\n").unwrap();
    let path = |p: &str| dir.path().join(p).display().to_string();
    let inventory = scenarios::repo().join("examples/inventory/demo-cluster.yaml");
    let args = tessera_kubelet_plugin::cli::args::Args::try_parse_from([
        "tessera-kubelet-plugin",
        "--node-name",
        NODE,
        "--gpu-backend",
        "fake",
        "--fake-inventory",
        inventory.to_str().unwrap(),
        "--kubeconfig",
        &path("kubeconfig"),
        "--registration-dir",
        &path("registry"),
        "--plugin-dir",
        &path("plugin"),
        "--cdi-dir",
        &path("cdi"),
        "--enforcement",
        "none",
        "--boot-id-file",
        boot_id.to_str().unwrap(),
    ])
    .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(args.run(async move {
        let _ = stopped.await;
    }));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while server.objects("resourceslices").is_empty() {
        assert!(std::time::Instant::now() < deadline, "no slices published");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let slices = server.objects("resourceslices");
    assert_eq!(slices[0]["apiVersion"], "resource.k8s.io/v1beta2");
    assert_eq!(slices[0]["spec"]["nodeName"], NODE);
    stop.send(()).unwrap();
    running.await.unwrap().unwrap();
}

/// Writes to ResourceSlices, by verb.
fn slice_writes(server: &FakeApiServer) -> BTreeMap<String, usize> {
    let mut writes = BTreeMap::new();
    for r in server.requests() {
        if r.resource == "resourceslices"
            && r.code < 400
            && !matches!(r.verb, Verb::Get | Verb::List | Verb::Watch)
        {
            *writes.entry(format!("{:?}", r.verb)).or_default() += 1;
        }
    }
    writes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_and_edited_slices_come_back_without_a_rewrite_storm() {
    let (server, client, _dir) = start(&["v1"]).await;
    let (slices, generations) = scenarios::slices_come_back(&client, ApiVersion::V1).await;
    assert_eq!(generations, [1, 2, 3, 4]);
    // Every write is accounted for: the plugin's first publication, the test's wipe and the
    // re-creation, then per edit the test's update and one rewrite of every slice. A rewrite
    // caused by the plugin's own writes would show up here. (The server logs a request just
    // after carrying it out, so the last entries may lag the state the test saw.)
    let expected = BTreeMap::from([
        ("Create".to_owned(), 2 * slices),
        ("DeleteCollection".to_owned(), 1),
        ("Update".to_owned(), 2 * (1 + slices)),
    ]);
    let total: usize = expected.values().sum();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while slice_writes(&server).values().sum::<usize>() < total
        && std::time::Instant::now() < deadline
    {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(slice_writes(&server), expected);
}

/// A slice publisher of the scenarios' node inventory, spawned; returns once it has published
/// and a watch of ResourceSlices was answered 200, failing the test at `deadline`. Returns its
/// task and the inventory's sender, which keeps it following.
async fn publish_and_watch(
    server: &FakeApiServer,
    client: &kube::Client,
    deadline: std::time::Instant,
) -> (
    tokio::task::JoinHandle<()>,
    tokio::sync::watch::Sender<tessera_driver::node::inventory::NodeInventory>,
) {
    let publisher = std::sync::Arc::new(SlicePublisher::new(
        client.clone(),
        scenarios::fast_config(),
    ));
    let (inventory, receiver) = tokio::sync::watch::channel(scenarios::node_inventory());
    let running = std::sync::Arc::clone(&publisher).spawn(receiver);
    let watching = || {
        server
            .requests()
            .iter()
            .any(|r| r.verb == Verb::Watch && r.resource == "resourceslices" && r.code == 200)
    };
    while !(watching()
        && publisher
            .record()
            .await
            .is_some_and(|r| r.pending.is_none()))
    {
        assert!(
            std::time::Instant::now() < deadline,
            "never published and watched"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    (running, inventory)
}

/// The names of the stored ResourceSlices.
fn slice_names(server: &FakeApiServer) -> Vec<String> {
    server
        .objects("resourceslices")
        .iter()
        .map(|s| s["metadata"]["name"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slice_watch_backs_off_and_recovers_from_server_errors() {
    use std::time::{Duration, Instant};
    let (server, client, _dir) = start(&["v1"]).await;
    scenarios::create_node(&client).await;
    // The first lists and watches of ResourceSlices fail (the publisher's listing may take
    // some of them; it retries too).
    server.inject(Verb::List, "resourceslices", 500, 3);
    server.inject(Verb::Watch, "resourceslices", 503, 3);
    let deadline = Instant::now() + Duration::from_mins(1);
    let (running, _inventory) = publish_and_watch(&server, &client, deadline).await;
    let failed: Vec<u16> = server
        .requests()
        .iter()
        .filter(|r| r.resource == "resourceslices" && r.code >= 500)
        .map(|r| r.code)
        .collect();
    assert_eq!(failed.len(), 6, "{failed:?}");
    let names = slice_names(&server);
    for name in &names {
        server.delete("resourceslices", None, name).unwrap();
    }
    while server.objects("resourceslices").len() != names.len() {
        assert!(
            Instant::now() < deadline,
            "the deleted slices never came back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    running.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slice_that_lost_its_label_is_put_right_not_created_again() {
    let (server, client, _dir) = start(&["v1"]).await;
    scenarios::create_node(&client).await;
    let slice_publisher = SlicePublisher::new(client.clone(), scenarios::fast_config());
    let first = slice_publisher
        .publish_once(&scenarios::node_inventory())
        .await
        .unwrap();
    let name = &first.slices[0];
    let api = scenarios::slices_api(&client, ApiVersion::V1);
    let mut slice = api.get(name).await.unwrap();
    slice.metadata.labels = None;
    api.replace(name, &kube::api::PostParams::default(), &slice)
        .await
        .unwrap();
    let again = slice_publisher
        .publish_once(&scenarios::node_inventory())
        .await
        .unwrap();
    assert!(again.changed);
    let stored = server.get("resourceslices", None, name).unwrap();
    assert_eq!(
        stored["metadata"]["labels"][names::LABEL_MANAGED_BY],
        names::KUBELET_PLUGIN_MANAGER
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slice_deleted_while_the_watch_was_away_comes_back_after_the_410_relist() {
    use std::time::{Duration, Instant};
    let (server, client, _dir) = start(&["v1"]).await;
    scenarios::create_node(&client).await;
    let deadline = Instant::now() + Duration::from_mins(1);
    let (running, _inventory) = publish_and_watch(&server, &client, deadline).await;
    let names = slice_names(&server);
    // The watch ends; while it is away a slice is deleted and the history compacted, so the
    // resumed watch is answered 410 and only the new list shows the slice missing.
    server.hold_watches(true);
    server.end_watches();
    server.delete("resourceslices", None, &names[0]).unwrap();
    server.compact();
    let lists_before = server
        .requests()
        .iter()
        .filter(|r| r.verb == Verb::List && r.resource == "resourceslices")
        .count();
    server.hold_watches(false);
    while server.objects("resourceslices").len() != names.len() {
        assert!(
            Instant::now() < deadline,
            "the deleted slice never came back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let lists_after = server
        .requests()
        .iter()
        .filter(|r| r.verb == Verb::List && r.resource == "resourceslices")
        .count();
    // The watch's relist, and the publisher's listing before it wrote the slice again.
    assert!(
        lists_after >= lists_before + 2,
        "{lists_before} -> {lists_after}"
    );
    running.abort();
}
