//! The fake API server itself, through a real kube client: what the controller's tests will
//! rely on.
#![allow(clippy::unwrap_used, missing_docs)]

use kube::api::{
    Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams, WatchEvent,
    WatchParams,
};
use serde_json::{Value, json};
use tessera_driver::apiversion::ApiVersion;
use tessera_tests::fake_apiserver::{FakeApiServer, Verb};
use tokio_stream::StreamExt as _;

fn client(server: &FakeApiServer) -> kube::Client {
    kube::Client::try_from(kube::Config::new(server.url().parse().unwrap())).unwrap()
}

fn claims(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(
        client.clone(),
        ns,
        &tessera_kubeapi::resource(ApiVersion::V1, tessera_driver::names::RESOURCE_CLAIM),
    )
}

fn claim(name: &str, labels: &Value) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "labels": labels},
        "spec": {"devices": {"requests": []}},
    }))
    .unwrap()
}

fn name(o: &DynamicObject) -> &str {
    o.metadata.name.as_deref().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crud_selectors_patches_and_status() {
    let server = FakeApiServer::start(&["v1"]).await.unwrap();
    let client = client(&server);
    let api = claims(&client, "ns1");
    let pp = PostParams::default();
    let a = api
        .create(&pp, &claim("a", &json!({"app": "x"})))
        .await
        .unwrap();
    api.create(&pp, &claim("b", &json!({"app": "y"})))
        .await
        .unwrap();
    claims(&client, "ns2")
        .create(&pp, &claim("c", &json!({"app": "x"})))
        .await
        .unwrap();
    assert!(a.metadata.uid.is_some());
    let err = api.create(&pp, &claim("a", &json!({}))).await.unwrap_err();
    assert!(matches!(err, kube::Error::Api(ref s) if s.code == 409 && s.reason == "AlreadyExists"));

    let listed = api
        .list(&ListParams::default().labels("app=x"))
        .await
        .unwrap();
    assert_eq!(listed.items.iter().map(name).collect::<Vec<_>>(), ["a"]);
    let all: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &tessera_kubeapi::resource(ApiVersion::V1, tessera_driver::names::RESOURCE_CLAIM),
    );
    let everywhere = all
        .list(&ListParams::default().labels("app in (x)"))
        .await
        .unwrap();
    assert_eq!(everywhere.items.len(), 2);
    let by_field = all
        .list(&ListParams::default().fields("metadata.namespace=ns2"))
        .await
        .unwrap();
    assert_eq!(by_field.items.iter().map(name).collect::<Vec<_>>(), ["c"]);

    // Status is written only through the subresource, and the main resource keeps it.
    let with_status = api
        .patch_status(
            "a",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"status": {"reservedFor": [{"resource": "pods", "name": "p", "uid": "1"}]}}),
            ),
        )
        .await
        .unwrap();
    assert_eq!(with_status.data["status"]["reservedFor"][0]["name"], "p");
    let patched = api
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"metadata": {"labels": {"app": null, "new": "1"}}, "status": null}),
            ),
        )
        .await
        .unwrap();
    assert_eq!(patched.metadata.labels.unwrap().len(), 1);
    assert_eq!(patched.data["status"]["reservedFor"][0]["name"], "p");

    // A stale resourceVersion in a merge patch is a conflict too.
    let err = api
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"resourceVersion": "1"}})),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, kube::Error::Api(ref s) if s.code == 409));

    api.delete_collection(
        &DeleteParams::default(),
        &ListParams::default().labels("app=y"),
    )
    .await
    .unwrap();
    assert!(server.get("resourceclaims", Some("ns1"), "b").is_none());
    api.delete("a", &DeleteParams::default()).await.unwrap();
    let err = api.get("a").await.unwrap_err();
    assert!(matches!(err, kube::Error::Api(ref s) if s.code == 404 && s.reason == "NotFound"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_resumes_from_a_resource_version_and_filters() {
    let server = FakeApiServer::start(&["v1"]).await.unwrap();
    let client = client(&server);
    let api = claims(&client, "ns");
    let pp = PostParams::default();
    api.create(&pp, &claim("before", &json!({"app": "x"})))
        .await
        .unwrap();
    let rv = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    api.create(&pp, &claim("other", &json!({"app": "y"})))
        .await
        .unwrap();
    api.create(&pp, &claim("after", &json!({"app": "x"})))
        .await
        .unwrap();
    let mut events = Box::pin(
        api.watch(&WatchParams::default().labels("app=x"), &rv)
            .await
            .unwrap(),
    );
    match events.next().await.unwrap().unwrap() {
        WatchEvent::Added(o) => assert_eq!(name(&o), "after"),
        other => panic!("{other:?}"),
    }
    api.delete("before", &DeleteParams::default())
        .await
        .unwrap();
    match events.next().await.unwrap().unwrap() {
        WatchEvent::Deleted(o) => assert_eq!(name(&o), "before"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unserved_versions_are_not_found_and_faults_are_queued() {
    let server = FakeApiServer::start(&["v1beta1"]).await.unwrap();
    let client = client(&server);
    let err = claims(&client, "ns")
        .list(&ListParams::default())
        .await
        .unwrap_err();
    assert!(
        matches!(err, kube::Error::Api(ref s) if s.code == 404),
        "{err}"
    );

    server.set_versions(&["v1"]);
    server.inject(Verb::List, "resourceclaims", 500, 1);
    let api = claims(&client, "ns");
    let err = api.list(&ListParams::default()).await.unwrap_err();
    assert!(
        matches!(err, kube::Error::Api(ref s) if s.code == 500),
        "{err}"
    );
    assert!(api.list(&ListParams::default()).await.is_ok());
    let codes: Vec<u16> = server.requests().iter().map(|r| r.code).collect();
    assert_eq!(codes, [500, 200], "unserved paths are not recorded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_lists_and_server_side_apply() {
    let server = FakeApiServer::start(&["v1"]).await.unwrap();
    let client = client(&server);
    let api = claims(&client, "ns");
    // Apply creates, then merges.
    let applied = api
        .patch(
            "a",
            &PatchParams::apply("test"),
            &Patch::Apply(json!({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": "a", "labels": {"app": "x"}},
                "spec": {"devices": {"requests": []}},
            })),
        )
        .await
        .unwrap();
    assert_eq!(name(&applied), "a");
    let merged = api
        .patch(
            "a",
            &PatchParams::apply("test"),
            &Patch::Apply(json!({"metadata": {"labels": {"tier": "1"}}})),
        )
        .await
        .unwrap();
    assert_eq!(merged.metadata.labels.unwrap().len(), 2);

    let mut events = Box::pin(
        api.watch(&WatchParams::streaming_lists(), "")
            .await
            .unwrap(),
    );
    match events.next().await.unwrap().unwrap() {
        WatchEvent::Added(o) => assert_eq!(name(&o), "a"),
        other => panic!("{other:?}"),
    }
    match events.next().await.unwrap().unwrap() {
        WatchEvent::Bookmark(b) => assert_eq!(
            b.metadata
                .annotations
                .get("k8s.io/initial-events-end")
                .map(String::as_str),
            Some("true")
        ),
        other => panic!("{other:?}"),
    }
    api.create(&PostParams::default(), &claim("b", &json!({})))
        .await
        .unwrap();
    match events.next().await.unwrap().unwrap() {
        WatchEvent::Added(o) => assert_eq!(name(&o), "b"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_are_bound_through_the_binding_subresource_as_a_real_server_binds_them() {
    let server = FakeApiServer::start(&["v1"]).await.unwrap();
    let client = client(&server);
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client, "default");
    let created = server
        .create(
            "pods",
            json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
                   "spec": {"containers": [{"name": "c", "image": "i"}],
                            "schedulingGates": [{"name": "example.com/wait"}]}}),
        )
        .unwrap();
    let bind = |uid: Value| {
        let pods = pods.clone();
        async move {
            pods.create_subresource::<_, Value>(
                "binding",
                "p",
                &PostParams::default(),
                &json!({"apiVersion": "v1", "kind": "Binding",
                        "metadata": {"name": "p", "uid": uid},
                        "target": {"apiVersion": "v1", "kind": "Node", "name": "n1"}}),
            )
            .await
        }
    };
    let code = |r: kube::Result<Value>| match r {
        Err(kube::Error::Api(s)) => s.code,
        Ok(_) => 201,
        Err(e) => panic!("{e}"),
    };
    let uid = created["metadata"]["uid"].clone();
    // Gated: refused, as a real server refuses it.
    assert_eq!(code(bind(uid.clone()).await), 409);
    pods.patch(
        "p",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"schedulingGates": null}})),
    )
    .await
    .unwrap();
    // Another pod's UID: refused; then bound once, and not again.
    assert_eq!(code(bind(json!("not-the-uid")).await), 409);
    assert_eq!(code(bind(uid.clone()).await), 201);
    assert_eq!(code(bind(uid).await), 409);
    let stored = pods.get("p").await.unwrap();
    assert_eq!(stored.spec.unwrap().node_name.as_deref(), Some("n1"));
    assert!(
        server
            .requests()
            .iter()
            .any(|r| r.resource == "pods/binding" && r.verb == Verb::Create && r.code == 201)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evictions_respect_disruption_budgets_as_the_real_handler_does() {
    let server = FakeApiServer::start(&["v1"]).await.unwrap();
    // No retrying inside the client: a 429 is the answer under test.
    let mut config = kube::Config::new(server.url().parse().unwrap());
    config.default_retry = false;
    let client = kube::Client::try_from(config).unwrap();
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client, "ns");
    let pod = |name: &str, app: &str| {
        json!({"metadata": {"name": name, "namespace": "ns", "labels": {"app": app}},
               "spec": {"containers": [{"name": "c", "image": "x"}]}})
    };
    for (name, app) in [("guarded", "db"), ("pending", "db"), ("free", "web")] {
        server.create("pods", pod(name, app)).unwrap();
    }
    for name in ["guarded", "free"] {
        server
            .set_status("pods", Some("ns"), name, &json!({"phase": "Running"}))
            .unwrap();
    }
    server
        .create(
            "poddisruptionbudgets",
            json!({"metadata": {"name": "db", "namespace": "ns"},
                   "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "db"}}}}),
        )
        .unwrap();
    let evict = |name: &'static str, dry_run: bool, uid: Option<&str>| {
        let pods = pods.clone();
        let body = json!({"apiVersion": "policy/v1", "kind": "Eviction",
            "metadata": {"name": name, "namespace": "ns"},
            "deleteOptions": {"preconditions": {"uid": uid}}});
        async move {
            let params = PostParams {
                dry_run,
                ..PostParams::default()
            };
            match pods
                .create_subresource::<Value, Value>("eviction", name, &params, &body)
                .await
            {
                Ok(_) => 201,
                Err(kube::Error::Api(s)) => s.code,
                Err(e) => panic!("{e}"),
            }
        }
    };
    let exists = |name: &str| server.get("pods", Some("ns"), name).is_some();
    // A budget the disruption controller has not processed yet refuses, as does one at zero.
    assert_eq!(evict("guarded", false, None).await, 429);
    server
        .set_status(
            "poddisruptionbudgets",
            Some("ns"),
            "db",
            &json!({"observedGeneration": 1, "disruptionsAllowed": 0}),
        )
        .unwrap();
    assert_eq!(evict("guarded", true, None).await, 429);
    assert_eq!(evict("guarded", false, None).await, 429);
    assert!(exists("guarded"));
    // A pending pod is evicted whatever its budget says; a pod no budget covers too.
    assert_eq!(evict("pending", false, None).await, 201);
    assert!(!exists("pending"));
    assert_eq!(evict("free", true, None).await, 201);
    assert!(exists("free"), "a dry run deletes nothing");
    assert_eq!(evict("free", false, Some("another-uid")).await, 409);
    assert_eq!(evict("free", false, None).await, 201);
    assert!(!exists("free"));
    // Once the budget allows one disruption, one eviction uses it up.
    server
        .set_status(
            "poddisruptionbudgets",
            Some("ns"),
            "db",
            &json!({"observedGeneration": 1, "disruptionsAllowed": 1}),
        )
        .unwrap();
    assert_eq!(evict("guarded", false, None).await, 201);
    assert!(!exists("guarded"));
    let budget = server
        .get("poddisruptionbudgets", Some("ns"), "db")
        .unwrap();
    assert_eq!(budget["status"]["disruptionsAllowed"], 0);
    assert_eq!(evict("gone", false, None).await, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_come_in_pages_with_limit_and_continue() {
    let server = FakeApiServer::start(&["v1"]).await.unwrap();
    let client = client(&server);
    let api = claims(&client, "ns1");
    for n in ["e", "a", "d", "b", "c"] {
        api.create(&PostParams::default(), &claim(n, &json!({})))
            .await
            .unwrap();
    }
    let first = api.list(&ListParams::default().limit(2)).await.unwrap();
    let version = first.metadata.resource_version.clone();
    let mut names: Vec<String> = first.items.iter().map(|o| name(o).to_owned()).collect();
    let mut token = first.metadata.continue_.clone();
    assert!(token.is_some());
    // Created after the first page, before the cursor: not in this list; a watch from the
    // list's version sees it.
    api.create(&PostParams::default(), &claim("0", &json!({})))
        .await
        .unwrap();
    while let Some(t) = token.filter(|t| !t.is_empty()) {
        let page = api
            .list(&ListParams::default().limit(2).continue_token(&t))
            .await
            .unwrap();
        assert!(page.items.len() <= 2);
        assert_eq!(page.metadata.resource_version, version);
        names.extend(page.items.iter().map(|o| name(o).to_owned()));
        token = page.metadata.continue_.clone();
    }
    assert_eq!(names, ["a", "b", "c", "d", "e"]);
    // Without a limit, one answer holds everything.
    let all = api.list(&ListParams::default()).await.unwrap();
    assert_eq!(all.items.len(), 6);
    assert!(all.metadata.continue_.is_none());
}

/// A pod `p` in `ns` to hang Events on.
fn regarding_pod() -> k8s_openapi::api::core::v1::ObjectReference {
    k8s_openapi::api::core::v1::ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: Some("ns".into()),
        name: Some("p".into()),
        uid: Some("u-1".into()),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_are_one_set_served_as_core_and_as_events_k8s_io_and_repeats_are_a_series() {
    use k8s_openapi::api::core::v1::Event as CoreEvent;
    use k8s_openapi::api::events::v1::Event;
    use kube::runtime::events::{Event as Note, EventType, Recorder, Reporter};

    let server = FakeApiServer::start(&["v1"]).await.unwrap();
    let client = client(&server);
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "tessera-controller".into(),
            instance: Some("replica-0".into()),
        },
    );
    let note = Note {
        type_: EventType::Warning,
        reason: "FailedAllocation".into(),
        note: Some("no node fits".into()),
        action: "Allocate".into(),
        secondary: None,
    };
    recorder.publish(&note, &regarding_pod()).await.unwrap();

    // Through events.k8s.io/v1, as written.
    let events = Api::<Event>::namespaced(client.clone(), "ns")
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    assert_eq!(events.len(), 1);
    let event = &events[0];
    assert_eq!(event.note.as_deref(), Some("no node fits"));
    assert_eq!(event.regarding.as_ref().unwrap().name.as_deref(), Some("p"));
    assert_eq!(
        event.reporting_controller.as_deref(),
        Some("tessera-controller")
    );
    assert_eq!(event.action.as_deref(), Some("Allocate"));
    assert!(event.series.is_none());

    // The same object through core v1, in its field names.
    let core = Api::<CoreEvent>::namespaced(client.clone(), "ns")
        .get(event.metadata.name.as_deref().unwrap())
        .await
        .unwrap();
    assert_eq!(core.message.as_deref(), Some("no node fits"));
    assert_eq!(core.involved_object.name.as_deref(), Some("p"));
    assert_eq!(
        core.reporting_component.as_deref(),
        Some("tessera-controller")
    );
    assert_eq!(core.reason.as_deref(), Some("FailedAllocation"));

    // The same action and reason again: the recorder patches a series onto the first Event.
    recorder.publish(&note, &regarding_pod()).await.unwrap();
    let events = Api::<Event>::namespaced(client.clone(), "ns")
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].series.as_ref().unwrap().count, 2);
    assert_eq!(events[0].note.as_deref(), Some("no node fits"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_k8s_io_refuses_what_the_api_server_refuses() {
    use k8s_openapi::api::events::v1::Event;

    let server = FakeApiServer::start(&["v1"]).await.unwrap();
    let api = Api::<Event>::namespaced(client(&server), "ns");
    let good = json!({
        "apiVersion": "events.k8s.io/v1", "kind": "Event",
        "metadata": {"name": "p.1", "namespace": "ns"},
        "eventTime": "2026-01-01T00:00:00.000000Z",
        "type": "Normal", "reason": "Placed", "action": "Allocate", "note": "ok",
        "reportingController": "tessera-controller", "reportingInstance": "replica-0",
        "regarding": {"apiVersion": "v1", "kind": "Pod", "namespace": "ns", "name": "p"},
    });
    let refused = |mut event: Value, field: &str, value: Value| {
        event[field] = value;
        serde_json::from_value::<Event>(event).unwrap()
    };
    let pp = PostParams::default();
    for (field, value, says) in [
        ("eventTime", Value::Null, "eventTime: Required value"),
        ("action", Value::Null, "action: Required value"),
        (
            "reportingController",
            json!("Not A Name"),
            "reportingController",
        ),
        ("note", json!("x".repeat(1025)), "note: Invalid value"),
        ("type", json!("Bad"), "type: Invalid value"),
        (
            "deprecatedCount",
            json!(3),
            "deprecatedCount: Invalid value",
        ),
    ] {
        let err = api
            .create(&pp, &refused(good.clone(), field, value))
            .await
            .unwrap_err();
        assert!(
            matches!(err, kube::Error::Api(ref s) if s.code == 422 && s.message.contains(says)),
            "{field}: {err}"
        );
    }
    api.create(&pp, &serde_json::from_value(good).unwrap())
        .await
        .unwrap();
    // Only the series and the metadata change once it is written.
    let err = api
        .patch(
            "p.1",
            &PatchParams::default(),
            &Patch::Merge(json!({"note": "changed"})),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, kube::Error::Api(ref s) if s.code == 422 && s.message.contains("note: Invalid value: field is immutable"))
    );
    let series = json!({"series": {"count": 2, "lastObservedTime": "2026-01-01T00:00:01.000000Z"}});
    let patched = api
        .patch("p.1", &PatchParams::default(), &Patch::Merge(series))
        .await
        .unwrap();
    assert_eq!(patched.series.unwrap().count, 2);
}
