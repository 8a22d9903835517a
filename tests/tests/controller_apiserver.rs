//! The controller against the in-process fake API server: the gate protocol with several pods
//! and nodes, conflicts on status writes, a leader killed mid-allocation, pods deleted
//! mid-allocation, template claims appearing late. Each scenario ends with the invariants: no
//! device double-booked, no claim left allocated for a pod that is gone.
#![allow(clippy::unwrap_used, missing_docs)]

#[path = "support/defrag_scenarios.rs"]
mod defrag;
#[path = "support/controller_scenarios.rs"]
mod scenarios;
#[path = "support/tidal_scenarios.rs"]
mod tidal;
#[path = "support/tier_scenarios.rs"]
mod tiers;

use std::time::Duration;

use scenarios::*;
use tessera_driver::apiversion::ApiVersion;
use tessera_driver::placement::allocator::Policy;
use tessera_driver::{names, placement::gate, testing};
use tessera_tests::fake_apiserver::{FakeApiServer, Verb};

async fn start(versions: &[&str]) -> (FakeApiServer, kube::Client, tempfile::TempDir) {
    let server = FakeApiServer::start(versions).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubeconfig");
    std::fs::write(&path, server.kubeconfig()).unwrap();
    let client = tessera_kubeapi::client(Some(&path)).await.unwrap();
    (server, client, dir)
}

const WAIT: Duration = Duration::from_secs(20);

/// The controller without the fast path: kube-scheduler (absent here) binds every pod, so
/// claims stay unreserved until then.
fn gate_protocol_only(policy: Policy) -> tessera_controller::service::ControllerConfig {
    let mut config = config(policy, None);
    config.fast_path = false;
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_pods_are_placed_on_several_nodes_without_double_booking() {
    let (_server, client, _dir) = start(&["v1"]).await;
    place_several_pods(&client, ApiVersion::V1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_path_pods_get_their_claims_reserved_in_the_allocation_write() {
    let (server, client, _dir) = start(&["v1"]).await;
    fast_path_pods_get_their_claims_reserved(&client, ApiVersion::V1).await;
    // One status write per claim, allocation and reservation together; no binding.
    let writes = |resource: &str| {
        server
            .requests()
            .iter()
            .filter(|r| r.resource == resource && r.verb == Verb::Patch)
            .count()
    };
    assert_eq!(writes("resourceclaims/status"), 8);
    assert_eq!(writes("pods/binding"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_v1beta2_server_is_served_the_same_protocol() {
    let (_server, client, _dir) = start(&["v1beta2"]).await;
    place_several_pods(&client, ApiVersion::V1beta2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_v1beta1_server_is_served_the_same_protocol() {
    let (_server, client, _dir) = start(&["v1beta1"]).await;
    place_several_pods(&client, ApiVersion::V1beta1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_allocation_is_written_as_kube_scheduler_writes_it() {
    let (server, client, _dir) = start(&["v1"]).await;
    seed(&client, ApiVersion::V1, &inventory(1, 4, true), "8").await;
    let running = start_controller(&client, config(Policy::FirstFit, None));
    create_claim(&client, ApiVersion::V1, share_claim("share", 10)).await;
    create_pod(&client, &gated_pod("p", &["share"], &[], "1")).await;
    eventually(WAIT, "the pod is ungated", || is_ungated(&client, "p")).await;
    let claim = server.get("resourceclaims", Some(NS), "share").unwrap();
    let allocation = &claim["status"]["allocation"];
    assert!(allocation["allocationTimestamp"].is_string(), "{claim}");
    let result = &allocation["devices"]["results"][0];
    assert_eq!(result["driver"], DRIVER);
    assert_eq!(result["pool"], node_name(0));
    assert!(result["shareID"].is_string(), "{result}");
    assert_eq!(result["consumedCapacity"]["memory"], "10Gi", "{result}");
    let config = &allocation["devices"]["config"];
    assert!(
        config.to_string().contains(names::ALLOCATED_SHARES_KIND),
        "{config}"
    );
    let term = &allocation["nodeSelector"]["nodeSelectorTerms"][0];
    assert_eq!(
        term["matchFields"][0]["values"][0],
        node_name(0),
        "{allocation}"
    );
    assert_eq!(claim["metadata"]["finalizers"][0], names::CLAIM_FINALIZER);
    assert_eq!(
        claim["metadata"]["annotations"][names::ANNOTATION_ALLOCATED_BY],
        "p"
    );
    // The finalizer came before the allocation, and every claim write named a resourceVersion
    // (the fake answers 409 to a stale one, so a lost race cannot overwrite).
    let writes: Vec<_> = server
        .requests()
        .into_iter()
        .filter(|r| r.resource.starts_with("resourceclaims") && r.verb == Verb::Patch)
        .map(|r| r.resource)
        .collect();
    assert_eq!(writes, ["resourceclaims", "resourceclaims/status"]);
    check_invariants(&client, ApiVersion::V1).await;
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicts_on_status_writes_are_re_read_and_retried() {
    let (server, client, _dir) = start(&["v1"]).await;
    seed(&client, ApiVersion::V1, &inventory(2, 2, false), "8").await;
    server.inject(Verb::Patch, "resourceclaims/status", 409, 3);
    server.inject(Verb::Patch, "pods", 409, 2);
    let running = start_controller(&client, config(Policy::Spread, None));
    let mut names = Vec::new();
    for i in 0..4 {
        let claim = format!("c{i}");
        create_claim(&client, ApiVersion::V1, whole_gpu_claim(&claim, 1)).await;
        create_pod(&client, &gated_pod(&format!("p{i}"), &[&claim], &[], "1")).await;
        names.push(format!("p{i}"));
    }
    eventually(WAIT, "every pod is ungated", || {
        all_ungated(&client, &names)
    })
    .await;
    let conflicts = server.requests().iter().filter(|r| r.code == 409).count();
    assert_eq!(conflicts, 5);
    assert!(
        running
            .metrics
            .encode()
            .unwrap()
            .contains("tessera_controller_write_conflicts_total 5")
    );
    check_invariants(&client, ApiVersion::V1).await;
    running.stop().await;
}

async fn synced(running: &Running) {
    let mut synced = running.synced.clone();
    tokio::time::timeout(WAIT, synced.wait_for(|s| *s))
        .await
        .expect("the controller synced")
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_error_on_the_second_claim_rolls_back_the_first_and_retries() {
    let (server, client, _dir) = start(&["v1"]).await;
    seed(&client, ApiVersion::V1, &inventory(1, 4, false), "8").await;
    create_claim(&client, ApiVersion::V1, whole_gpu_claim("a", 1)).await;
    create_claim(&client, ApiVersion::V1, whole_gpu_claim("b", 1)).await;
    let running = start_controller(&client, config(Policy::FirstFit, None));
    synced(&running).await;
    // The first allocation write goes through, the second fails with a server error.
    server.inject(Verb::Patch, "resourceclaims/status", 0, 1);
    server.inject(Verb::Patch, "resourceclaims/status", 500, 1);
    create_pod(&client, &gated_pod("p", &["a", "b"], &[], "1")).await;
    eventually(WAIT, "the pod is ungated", || is_ungated(&client, "p")).await;
    let log: Vec<(String, Option<String>, u16)> = server
        .requests()
        .into_iter()
        .filter(|r| r.verb == Verb::Patch && r.resource == "resourceclaims/status")
        .map(|r| (r.resource, r.name, r.code))
        .collect();
    // a allocated, b failed, a deallocated (rollback), then both allocated on the retry.
    let status = "resourceclaims/status".to_owned();
    assert_eq!(
        log,
        [
            (status.clone(), Some("a".to_owned()), 200),
            (status.clone(), Some("b".to_owned()), 500),
            (status.clone(), Some("a".to_owned()), 200),
            (status.clone(), Some("a".to_owned()), 200),
            (status.clone(), Some("b".to_owned()), 200),
        ]
    );
    check_invariants(&client, ApiVersion::V1).await;
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_from_templates_appearing_late_are_allocated_with_the_pods_other_claims() {
    let (_server, client, _dir) = start(&["v1"]).await;
    seed(&client, ApiVersion::V1, &inventory(2, 2, true), "8").await;
    let running = start_controller(&client, config(Policy::Binpack, None));
    create_claim(&client, ApiVersion::V1, share_claim("named", 8)).await;
    let pod = create_pod(
        &client,
        &gated_pod("p", &["named"], &["share-template"], "1"),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        gate::is_gated(&pods(&client).await["p"]),
        "ungated before its template claim exists"
    );
    assert!(!gate::is_allocated(
        &claims(&client, ApiVersion::V1).await["named"]
    ));
    generate_template_claim(&client, ApiVersion::V1, &pod, "t0", share_claim("x", 8)).await;
    eventually(WAIT, "the pod is ungated", || is_ungated(&client, "p")).await;
    check_invariants(&client, ApiVersion::V1).await;
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_deleted_before_it_binds_gets_its_claims_released() {
    let (_server, client, _dir) = start(&["v1"]).await;
    seed(&client, ApiVersion::V1, &inventory(1, 2, false), "8").await;
    let running = start_controller(&client, gate_protocol_only(Policy::FirstFit));
    create_claim(&client, ApiVersion::V1, whole_gpu_claim("c", 2)).await;
    create_pod(&client, &gated_pod("p", &["c"], &[], "1")).await;
    eventually(WAIT, "the pod is ungated", || is_ungated(&client, "p")).await;
    delete_pod(&client, "p").await;
    eventually(WAIT, "the claim is released", || async {
        let c = &claims(&client, ApiVersion::V1).await["c"];
        !gate::is_allocated(c)
            && !gate::is_ours(c)
            && c.metadata.finalizers.iter().flatten().next().is_none()
    })
    .await;
    // The freed GPUs go to the next pod.
    create_claim(&client, ApiVersion::V1, whole_gpu_claim("d", 2)).await;
    create_pod(&client, &gated_pod("q", &["d"], &[], "1")).await;
    eventually(WAIT, "the next pod is ungated", || is_ungated(&client, "q")).await;
    check_invariants(&client, ApiVersion::V1).await;
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_claim_is_deallocated_and_its_finalizer_removed() {
    let (server, client, _dir) = start(&["v1"]).await;
    seed(&client, ApiVersion::V1, &inventory(1, 2, false), "8").await;
    let running = start_controller(&client, gate_protocol_only(Policy::FirstFit));
    create_claim(&client, ApiVersion::V1, whole_gpu_claim("c", 1)).await;
    create_pod(&client, &gated_pod("p", &["c"], &[], "1")).await;
    eventually(WAIT, "the pod is ungated", || is_ungated(&client, "p")).await;
    server.delete("resourceclaims", Some(NS), "c").unwrap();
    eventually(WAIT, "the claim is gone", || async {
        server.get("resourceclaims", Some(NS), "c").is_none()
    })
    .await;
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_deleted_mid_allocation_leave_nothing_allocated() {
    let (_server, client, _dir) = start(&["v1"]).await;
    seed(&client, ApiVersion::V1, &inventory(4, 4, true), "64").await;
    let running = start_controller(&client, config(Policy::Spread, None));
    let mut kept = Vec::new();
    for i in 0..30 {
        let claim = format!("c{i}");
        create_claim(&client, ApiVersion::V1, share_claim(&claim, 4)).await;
        create_pod(&client, &gated_pod(&format!("p{i}"), &[&claim], &[], "1")).await;
        if i % 3 == 0 {
            delete_pod(&client, &format!("p{i}")).await;
        } else {
            kept.push(format!("p{i}"));
        }
    }
    eventually(WAIT, "the kept pods are ungated", || {
        all_ungated(&client, &kept)
    })
    .await;
    // A pod deleted after the controller ungated it holds a reserved claim, which
    // kube-controller-manager releases; the controller then gives the allocation back.
    eventually(
        WAIT,
        "nothing is left allocated for the deleted pods",
        || async {
            release_claims_of_gone_pods(&client, ApiVersion::V1).await;
            let claims = claims(&client, ApiVersion::V1).await;
            (0..30).step_by(3).all(|i| {
                let c = &claims[&format!("c{i}")];
                !gate::is_allocated(c) && !gate::is_ours(c)
            })
        },
    )
    .await;
    check_invariants(&client, ApiVersion::V1).await;
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_killed_mid_allocation_is_replaced_without_double_booking() {
    let (server, client, _dir) = start(&["v1"]).await;
    seed(&client, ApiVersion::V1, &inventory(4, 4, false), "64").await;
    let first = start_controller(
        &client,
        config(Policy::FirstFit, Some(leader_config("first"))),
    );
    eventually(WAIT, "the first replica leads", || async {
        server
            .get("leases", Some(NS), names::LEADER_LEASE)
            .is_some_and(|l| l["spec"]["holderIdentity"] == "first")
    })
    .await;
    let standby = start_controller(
        &client,
        config(Policy::FirstFit, Some(leader_config("second"))),
    );
    let mut names = Vec::new();
    for i in 0..14 {
        let claim = format!("c{i}");
        create_claim(&client, ApiVersion::V1, whole_gpu_claim(&claim, 1)).await;
        names.push(format!("p{i}"));
    }
    // A slow server, so the kill lands between the writes of a pod or between pods.
    server.set_write_delay(Duration::from_millis(15));
    for (i, name) in names.iter().enumerate() {
        create_pod(&client, &gated_pod(name, &[&format!("c{i}")], &[], "1")).await;
    }
    // Kill the leader as soon as it has written some allocations, but not all.
    eventually(WAIT, "the first leader is writing", || async {
        server
            .requests()
            .iter()
            .any(|r| r.resource == "resourceclaims/status" && r.code == 200)
    })
    .await;
    let leader_line = |m: &Running| {
        let text = m.metrics.encode().unwrap();
        text.lines()
            .find(|l| l.starts_with("tessera_controller_leader "))
            .map(str::to_owned)
    };
    let lease_log: Vec<_> = server
        .requests()
        .into_iter()
        .filter(|r| r.resource == "leases")
        .collect();
    assert_eq!(
        leader_line(&first).as_deref(),
        Some("tessera_controller_leader 1"),
        "{:?} {lease_log:?}",
        server.get("leases", Some(NS), names::LEADER_LEASE)
    );
    assert_eq!(
        leader_line(&standby).as_deref(),
        Some("tessera_controller_leader 0")
    );
    first.kill();
    let written = server
        .requests()
        .iter()
        .filter(|r| r.resource == "resourceclaims/status" && r.code == 200)
        .count();
    assert!(
        written < names.len(),
        "the leader finished before it was killed"
    );
    server.set_write_delay(Duration::ZERO);
    eventually(
        Duration::from_secs(30),
        "the standby finishes every pod",
        || all_ungated(&client, &names),
    )
    .await;
    let lease = server.get("leases", Some(NS), names::LEADER_LEASE).unwrap();
    assert_eq!(lease["spec"]["holderIdentity"], "second");
    assert_eq!(lease["spec"]["leaseTransitions"], 1, "{lease}");
    // 14 GPUs on 16: the last pod wants 3, so it fits nowhere and stays gated.
    create_claim(&client, ApiVersion::V1, whole_gpu_claim("big", 3)).await;
    create_pod(&client, &gated_pod("big", &["big"], &[], "1")).await;
    eventually(WAIT, "the big pod is reported", || async {
        pods(&client).await["big"]
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == names::CONDITION_ALLOCATED))
    })
    .await;
    check_invariants(&client, ApiVersion::V1).await;
    standby.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_that_fits_nowhere_is_reported_and_retried_when_a_node_appears() {
    let (server, client, _dir) = start(&["v1"]).await;
    seed(&client, ApiVersion::V1, &inventory(1, 2, false), "8").await;
    let running = start_controller(&client, config(Policy::FirstFit, None));
    create_claim(&client, ApiVersion::V1, whole_gpu_claim("c", 4)).await;
    create_pod(&client, &gated_pod("p", &["c"], &[], "1")).await;
    eventually(WAIT, "an Event says why", || async {
        server.events().iter().any(|e| {
            e["reason"] == "FailedAllocation"
                && e["regarding"]["name"] == "p"
                && e["note"].as_str().is_some_and(|m| m.contains("default/c"))
        })
    })
    .await;
    let bigger = inventory(2, 4, false);
    let mut only_new = bigger.clone();
    only_new.nodes.remove(0);
    seed(&client, ApiVersion::V1, &only_new, "8").await;
    eventually(WAIT, "the pod is placed on the new node", || {
        is_ungated(&client, "p")
    })
    .await;
    let claim = &claims(&client, ApiVersion::V1).await["c"];
    let node = gate::allocation_node(claim.status.as_ref().unwrap().allocation.as_ref().unwrap());
    assert_eq!(node, Some(node_name(1)));
    let condition = pods(&client).await["p"]
        .status
        .clone()
        .unwrap()
        .conditions
        .unwrap()
        .into_iter()
        .find(|c| c.type_ == names::CONDITION_ALLOCATED)
        .unwrap();
    assert_eq!(condition.status, "True");
    check_invariants(&client, ApiVersion::V1).await;
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_selectors_taints_cordons_and_cpu_steer_the_choice_of_node() {
    let (server, client, _dir) = start(&["v1"]).await;
    seed(&client, ApiVersion::V1, &inventory(4, 2, false), "4").await;
    let nodes = kube::Api::<k8s_openapi::api::core::v1::Node>::all(client.clone());
    let patch = |body: serde_json::Value| kube::api::Patch::Merge(body);
    let pp = kube::api::PatchParams::default();
    nodes
        .patch(
            &node_name(0),
            &pp,
            &patch(serde_json::json!({"spec": {"unschedulable": true}})),
        )
        .await
        .unwrap();
    nodes
        .patch(&node_name(1), &pp, &patch(serde_json::json!({"spec": {"taints": [{"key": "dedicated", "value": "infra", "effect": "NoSchedule"}]}})))
        .await
        .unwrap();
    nodes
        .patch(
            &node_name(2),
            &pp,
            &patch(serde_json::json!({"metadata": {"labels": {"zone": "b"}}})),
        )
        .await
        .unwrap();
    let running = start_controller(&client, config(Policy::FirstFit, None));
    // A pod wanting zone b lands on node 2 although nodes 0 and 1 come first.
    create_claim(&client, ApiVersion::V1, whole_gpu_claim("zoned", 1)).await;
    let mut zoned = gated_pod("zoned", &["zoned"], &[], "3");
    zoned.spec.as_mut().unwrap().node_selector = Some([("zone".to_owned(), "b".to_owned())].into());
    create_pod(&client, &zoned).await;
    eventually(WAIT, "the zoned pod is ungated", || {
        is_ungated(&client, "zoned")
    })
    .await;
    // The next pod needs 3 CPUs: node 2 has 1 left, so node 3 it is.
    create_claim(&client, ApiVersion::V1, whole_gpu_claim("cpu", 1)).await;
    create_pod(&client, &gated_pod("cpu", &["cpu"], &[], "3")).await;
    eventually(WAIT, "the cpu pod is ungated", || {
        is_ungated(&client, "cpu")
    })
    .await;
    let claims = claims(&client, ApiVersion::V1).await;
    let node_of = |n: &str| {
        gate::allocation_node(
            claims[n]
                .status
                .as_ref()
                .unwrap()
                .allocation
                .as_ref()
                .unwrap(),
        )
    };
    assert_eq!(node_of("zoned"), Some(node_name(2)));
    assert_eq!(node_of("cpu"), Some(node_name(3)));
    // A third 3-CPU pod fits nowhere: the reason counts the nodes per filter.
    create_claim(&client, ApiVersion::V1, whole_gpu_claim("none", 1)).await;
    create_pod(&client, &gated_pod("none", &["none"], &[], "3")).await;
    eventually(WAIT, "the reason names every filter", || async {
        server.events().iter().any(|e| {
            e["regarding"]["name"] == "none"
                && e["note"].as_str().is_some_and(|m| {
                    m.contains("1 node(s) were unschedulable")
                        && m.contains(
                            "1 node(s) had untolerated taint {dedicated=infra:NoSchedule}",
                        )
                        && m.contains("2 node(s) had insufficient cpu")
                })
        })
    })
    .await;
    check_invariants(&client, ApiVersion::V1).await;
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_of_ungated_pods_are_left_to_kube_scheduler_and_counted_as_used() {
    let (server, client, _dir) = start(&["v1"]).await;
    seed(&client, ApiVersion::V1, &inventory(1, 2, false), "8").await;
    // kube-scheduler allocated gpu-0 to a claim of an ungated pod.
    create_claim(&client, ApiVersion::V1, whole_gpu_claim("schedulers", 1)).await;
    let allocation = serde_json::json!({"allocation": {
        "devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": node_name(0), "device": "gpu-0"}]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node_name(0)]}]}]},
    }});
    server
        .set_status("resourceclaims", Some(NS), "schedulers", &allocation)
        .unwrap();
    create_claim(
        &client,
        ApiVersion::V1,
        whole_gpu_claim("pending-of-ungated", 1),
    )
    .await;
    let mut ungated = gated_pod("ungated", &["pending-of-ungated"], &[], "1");
    ungated.spec.as_mut().unwrap().scheduling_gates = None;
    create_pod(&client, &ungated).await;
    let running = start_controller(&client, config(Policy::FirstFit, None));
    create_claim(&client, ApiVersion::V1, whole_gpu_claim("mine", 1)).await;
    create_pod(&client, &gated_pod("mine", &["mine"], &[], "1")).await;
    eventually(WAIT, "the gated pod is ungated", || {
        is_ungated(&client, "mine")
    })
    .await;
    let claims = claims(&client, ApiVersion::V1).await;
    let device = |n: &str| testing::first_device(&claims[n]);
    assert_eq!(device("mine"), "gpu-1");
    assert!(!gate::is_allocated(&claims["pending-of-ungated"]));
    assert!(!gate::is_ours(&claims["schedulers"]));
    let touched: Vec<_> = server
        .requests()
        .into_iter()
        .filter(|r| r.verb == Verb::Patch && r.name.as_deref() != Some("mine"))
        .filter(|r| r.resource.starts_with("resourceclaims"))
        .collect();
    assert!(touched.is_empty(), "{touched:?}");
    check_invariants(&client, ApiVersion::V1).await;
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_the_server_refuses_to_change_is_reported_not_retried_forever() {
    let (server, client, _dir) = start(&["v1"]).await;
    seed(&client, ApiVersion::V1, &inventory(1, 2, false), "8").await;
    // As for a claim with non-canonical opaque JSON: every metadata change is refused.
    server.inject(Verb::Patch, "resourceclaims", 422, 100);
    let running = start_controller(&client, config(Policy::FirstFit, None));
    create_claim(&client, ApiVersion::V1, whole_gpu_claim("broken", 1)).await;
    create_pod(&client, &gated_pod("p", &["broken"], &[], "1")).await;
    eventually(WAIT, "the pod is reported", || async {
        server
            .events()
            .iter()
            .any(|e| e["reason"] == "AllocationRefused" && e["regarding"]["name"] == "p")
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let attempts = server
        .requests()
        .iter()
        .filter(|r| r.resource == "resourceclaims" && r.verb == Verb::Patch)
        .count();
    assert_eq!(
        attempts, 1,
        "a refused claim is not retried until something changes"
    );
    // Changes elsewhere (pods come and go, a node joins) do not make the refusal pass.
    for i in 0..5 {
        let mut other = gated_pod(&format!("unrelated-{i}"), &[], &[], "1");
        other.spec.as_mut().unwrap().scheduling_gates = None;
        create_pod(&client, &other).await;
        delete_pod(&client, &format!("unrelated-{i}")).await;
    }
    server
        .create(
            "nodes",
            serde_json::json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "late-node"}}),
        )
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let claim_patches = || {
        server
            .requests()
            .iter()
            .filter(|r| r.resource == "resourceclaims" && r.verb == Verb::Patch)
            .count()
    };
    assert_eq!(
        claim_patches(),
        1,
        "unrelated changes retried a refused claim"
    );
    assert!(
        running.metrics.encode().unwrap().contains(
            "tessera_controller_allocations_total{outcome=\"refused\",policy=\"first-fit\"} 1"
        ),
        "{}",
        running.metrics.encode().unwrap()
    );
    // A change of the claim itself is worth one more try.
    server
        .set_status("resourceclaims", Some(NS), "broken", &serde_json::json!({}))
        .unwrap();
    eventually(WAIT, "the changed claim is tried once more", || async {
        claim_patches() == 2
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(claim_patches(), 2);
    assert!(gate::is_gated(&pods(&client).await["p"]));
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_probes_are_served_over_http() {
    let (_server, client, _dir) = start(&["v1"]).await;
    seed(&client, ApiVersion::V1, &inventory(1, 2, true), "8").await;
    let metrics = std::sync::Arc::new(tessera_controller::metrics::Metrics::new("binpack"));
    let (synced_tx, synced) = tokio::sync::watch::channel(false);
    let ops = tessera_controller::health_http::OpsServer::start(
        "127.0.0.1:0".parse().unwrap(),
        std::sync::Arc::clone(&metrics),
        synced,
    )
    .await
    .unwrap();
    let get = |path: &'static str| {
        let addr = ops.local_addr();
        async move {
            use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(
                format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes(),
            )
            .await
            .unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).await.unwrap();
            out
        }
    };
    assert!(get("/readyz").await.starts_with("HTTP/1.1 503"));
    assert!(get("/healthz").await.starts_with("HTTP/1.1 200"));
    assert!(get("/nowhere").await.starts_with("HTTP/1.1 404"));
    {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut s = tokio::net::TcpStream::connect(ops.local_addr())
            .await
            .unwrap();
        s.write_all(
            b"PUT /metrics HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
        )
        .await
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        assert!(out.starts_with("HTTP/1.1 405"), "{out}");
    }
    let config = config(Policy::Binpack, None);
    let task = {
        let client = client.clone();
        let metrics = std::sync::Arc::clone(&metrics);
        tokio::spawn(async move {
            tessera_controller::service::run_with(
                client,
                config,
                metrics,
                synced_tx,
                std::future::pending(),
            )
            .await
        })
    };
    create_claim(&client, ApiVersion::V1, share_claim("s", 20)).await;
    create_pod(&client, &gated_pod("p", &["s"], &[], "1")).await;
    eventually(WAIT, "the pod is ungated", || is_ungated(&client, "p")).await;
    eventually(WAIT, "ready", || async {
        get("/readyz").await.starts_with("HTTP/1.1 200")
    })
    .await;
    eventually(WAIT, "the gauges follow the pass", || async {
        let text = get("/metrics").await;
        text.contains("tessera_controller_allocations_total{outcome=\"allocated\",policy=\"binpack\"} 1")
            && text.contains(&format!(
                "tessera_controller_gpu_memory_allocated_bytes{{pool=\"{}\",device=\"gpu-0\"}} 21474836480",
                node_name(0)
            ))
            && text.contains("tessera_controller_pending_gated_pods 0")
            && text.contains("tessera_controller_allocation_duration_seconds_count 1")
    })
    .await;
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_negative_capacity_request_is_refused_and_frees_nothing() {
    let (server, client, _dir) = start(&["v1"]).await;
    seed(&client, ApiVersion::V1, &inventory(1, 2, true), "8").await;
    let running = start_controller(&client, config(Policy::FirstFit, None));
    let mut negative = share_claim("negative", 1);
    negative["spec"]["devices"]["config"] = serde_json::Value::Null;
    negative["spec"]["devices"]["requests"][0]["exactly"]["capacity"] =
        serde_json::json!({"requests": {"memory": "-5Gi"}});
    create_claim(&client, ApiVersion::V1, negative).await;
    create_pod(&client, &gated_pod("p", &["negative"], &[], "1")).await;
    eventually(WAIT, "the pod is refused with the rule", || async {
        server.events().iter().any(|e| {
            e["reason"] == "AllocationRefused"
                && e["note"].as_str().is_some_and(|m| m.contains("negative"))
        })
    })
    .await;
    assert!(gate::is_gated(&pods(&client).await["p"]));
    assert!(!gate::is_allocated(
        &claims(&client, ApiVersion::V1).await["negative"]
    ));
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_plugin_pods_get_the_templates_they_refer_to_and_lose_them_with_the_last_pod() {
    let (_server, client, _dir) = start(&["v1"]).await;
    device_plugin_pods_get_their_templates(&client, ApiVersion::V1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_plugin_templates_are_written_in_v1beta1_on_a_v1beta1_server() {
    let (_server, client, _dir) = start(&["v1beta1"]).await;
    device_plugin_pods_get_their_templates(&client, ApiVersion::V1beta1).await;
}

/// kube-scheduler serving an extended resource name natively (1.35+, `extendedResourceName` on
/// the whole-GPU class) writes a claim of its own for the pod; the controller counts its
/// devices as used like any other allocation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpus_kube_scheduler_gave_for_an_extended_resource_count_as_used() {
    use k8s_openapi::api::core::v1::Pod;
    use kube::api::{Api, Patch, PatchParams};
    let (_server, client, _dir) = start(&["v1"]).await;
    seed(&client, ApiVersion::V1, &inventory(1, 2, false), "8").await;
    let node = node_name(0);
    let mut scheduler_claim = whole_gpu_claim("ext-pod-extended-resources-abcde", 2);
    scheduler_claim["metadata"]["annotations"] =
        serde_json::json!({"resource.kubernetes.io/extended-resource-claim": "true"});
    create_claim(&client, ApiVersion::V1, scheduler_claim).await;
    let status = serde_json::json!({"status": {"allocation": {
        "devices": {"results": [
            {"request": "gpu", "driver": names::DEFAULT_DRIVER_NAME, "pool": node, "device": "gpu-0"},
            {"request": "gpu", "driver": names::DEFAULT_DRIVER_NAME, "pool": node, "device": "gpu-1"},
        ]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}]}]},
        "allocationTimestamp": "2026-01-01T00:00:00Z",
    }}});
    claims_api(&client, ApiVersion::V1)
        .patch_status(
            "ext-pod-extended-resources-abcde",
            &PatchParams::default(),
            &Patch::Merge(&status),
        )
        .await
        .unwrap();
    let running = start_controller(&client, config(Policy::FirstFit, None));
    create_claim(&client, ApiVersion::V1, whole_gpu_claim("mine", 1)).await;
    create_pod(&client, &gated_pod("p", &["mine"], &[], "1")).await;
    eventually(WAIT, "the pod is reported as not placed", || async {
        let pod: Pod = Api::namespaced(client.clone(), NS).get("p").await.unwrap();
        pod.status
            .and_then(|s| s.conditions)
            .into_iter()
            .flatten()
            .any(|c| c.type_ == names::CONDITION_ALLOCATED && c.status == "False")
    })
    .await;
    assert!(!is_ungated(&client, "p").await);
    claims_api(&client, ApiVersion::V1)
        .delete(
            "ext-pod-extended-resources-abcde",
            &kube::api::DeleteParams::default(),
        )
        .await
        .unwrap();
    eventually(WAIT, "the pod is placed once the GPUs are free", || {
        is_ungated(&client, "p")
    })
    .await;
    check_invariants(&client, ApiVersion::V1).await;
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preemption_evicts_the_fewest_lowest_priority_batch_pods_a_budget_allows() {
    let (_server, client, _dir) = start(&["v1"]).await;
    tiers::preemption_evicts_batch_pods_through_the_eviction_api(&client, ApiVersion::V1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delay_tolerant_pod_waits_for_a_fragment_then_takes_one() {
    let (server, client, _dir) = start(&["v1"]).await;
    server.use_wall_clock(true);
    tiers::a_delay_tolerant_pod_waits_for_a_fragment(&client, ApiVersion::V1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduled_profile_drains_evicts_only_preemptible_pods_and_survives_a_restart() {
    let (server, client, _dir) = start(&["v1"]).await;
    server.use_wall_clock(true);
    tidal::a_scheduled_profile_drains_evicts_only_preemptible_pods_and_survives_a_restart(
        &client,
        ApiVersion::V1,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defragmentation_moves_the_fewest_batch_pods_within_its_budget() {
    let (server, client, _dir) = start(&["v1"]).await;
    server.use_wall_clock(true);
    defrag::defragmentation_moves_the_fewest_batch_pods_within_its_budget(&client, ApiVersion::V1)
        .await;
}
