//! The controller's scenarios against a real kube-apiserver and etcd, started on loopback from
//! the binaries in `KUBEBUILDER_ASSETS`. When a `kube-scheduler` binary sits beside them, it
//! runs too and the test checks that gated pods end up bound to the node of their allocation.
//! Without the binaries the test says why it skips and passes; nothing is ever downloaded.
#![allow(clippy::unwrap_used, missing_docs)]

#[path = "support/envtest_cluster.rs"]
mod envtest;
#[path = "support/controller_scenarios.rs"]
mod scenarios;
#[path = "support/tier_scenarios.rs"]
mod tiers;

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1 as res;
use kube::api::{Api, Patch, PatchParams, PostParams};
use scenarios::*;
use serde_json::json;
use tessera_controller::writer::Writes as _;
use tessera_driver::apiversion::ApiVersion;
use tessera_driver::placement::allocator::Policy;
use tessera_driver::{names, placement::gate};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gate_protocol_against_a_real_api_server() {
    let Some(envtest::Connected {
        assets,
        mut cluster,
        client,
        version,
    }) = envtest::connect("the_gate_protocol_against_a_real_api_server").await
    else {
        return;
    };
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
    envtest::run(
        "device_plugin_templates_against_a_real_api_server",
        |client, version| async move {
            device_plugin_pods_get_their_templates(&client, version).await;
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fast_path_against_a_real_api_server() {
    let Some(envtest::Connected {
        assets,
        mut cluster,
        client,
        version,
    }) = envtest::connect("the_fast_path_against_a_real_api_server").await
    else {
        return;
    };
    if version != ApiVersion::V1 {
        eprintln!("SKIPPED the fast path check: it is run on resource.k8s.io/v1 (1.34+)");
        return;
    }
    // What the safety argument leans on: the API server refuses to bind a gated pod.
    let gated = create_pod(&client, &gated_pod("still-gated", &[], &[], "1")).await;
    let refused = bind(&client, &gated, &node_name(0)).await;
    match refused {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 409, "{s:?}");
            assert!(s.message.contains("schedulingGates"), "{s:?}");
        }
        other => panic!("a gated pod was bound, or refused otherwise: {other:?}"),
    }
    delete_pod(&client, "still-gated").await;
    // The controller's allocation and reservation in one status write are accepted.
    fast_path_pods_get_their_claims_reserved(&client, version).await;
    if cluster.start_scheduler(&assets) {
        // kube-scheduler binds every pod where its claims are allocated, and leaves the
        // controller's reservations in place (the invariants check both).
        eventually(
            Duration::from_mins(1),
            "kube-scheduler binds every pod",
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

/// CPU time (user + system) of process `pid` so far, in milliseconds.
fn cpu_ms(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    // Linux reports in USER_HZ, 100 per second.
    ticks * 10.0
}

/// A realistic share allocation, as the controller writes it (one 10 GiB, 50 % share).
fn share_allocation(i: usize) -> res::AllocationResult {
    let node = node_name(0);
    serde_json::from_value(json!({
        "devices": {
            "results": [{"request": "gpu", "driver": DRIVER, "pool": node,
                "device": format!("gpu-{}", i % 8),
                "shareID": format!("{:08x}-0000-4000-8000-{:012x}", i, i),
                "consumedCapacity": {"memory": "10Gi", "compute": "50"}}],
            "config": [{"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": DRIVER,
                "parameters": {"apiVersion": names::CONFIG_API_VERSION,
                    "kind": names::ALLOCATED_SHARES_KIND,
                    "devices": [{"request": "gpu", "pool": node,
                        "device": format!("gpu-{}", i % 8),
                        "memory": "10737418240", "compute": 50}]}}}],
        },
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}]}]},
        "allocationTimestamp": "2026-11-25T00:00:00Z",
    }))
    .unwrap()
}

/// Runs `write` for every index, 8 at a time, and answers the CPU milliseconds kube-apiserver
/// and etcd spent per write and the wall time.
#[allow(
    clippy::cast_precision_loss,
    reason = "a few hundred writes, as a float for the rate"
)]
async fn per_write<F, Fut>(pids: (u32, u32), n: usize, write: F) -> (f64, f64, f64)
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (api0, etcd0, t0) = (cpu_ms(pids.0), cpu_ms(pids.1), std::time::Instant::now());
    let mut set = tokio::task::JoinSet::new();
    for i in 0..n {
        while set.len() >= 8 {
            set.join_next().await.unwrap().unwrap();
        }
        set.spawn(write(i));
    }
    while let Some(r) = set.join_next().await {
        r.unwrap();
    }
    // Let the watch fan-out of the last writes finish.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let n = n as f64;
    (
        (cpu_ms(pids.0) - api0) / n,
        (cpu_ms(pids.1) - etcd0) / n,
        t0.elapsed().as_secs_f64() * 1000.0 / n,
    )
}

/// One write on a pod's way to its node, as [`write_costs`] measures it: the controller's
/// mark, allocation (with the reservation on the fast path), ungate; kube-scheduler's
/// reservation and binding.
#[derive(Clone, Copy)]
enum Step {
    Mark,
    Allocate { reserve: bool },
    Ungate,
    Reserve,
    Bind,
}

/// What each of the controller's writes costs a real kube-apiserver and etcd (CPU per write,
/// request bytes), for docs/controller.md. Not a pass/fail test: run it by hand with
/// `KUBEBUILDER_ASSETS=/work/k8s/bin cargo test -p tessera-tests --test controller_envtest
/// write_costs -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement, run by hand"]
#[allow(
    clippy::too_many_lines,
    reason = "the measured writes read best in protocol order, one after another"
)]
async fn write_costs() {
    let Some(envtest::Connected {
        cluster,
        client,
        version,
        ..
    }) = envtest::connect("write_costs").await
    else {
        return;
    };
    let n: usize = std::env::var("TESSERA_WRITE_COST_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let pids = (cluster.processes.0[1].id(), cluster.processes.0[0].id());
    seed(&client, version, &inventory(1, 8, true), "96").await;
    // Two watchers on pods and claims, as the controller and kube-scheduler keep (each write
    // is also encoded for them).
    let mut watchers = Vec::new();
    for _ in 0..2 {
        for kind in ["pods", "claims"] {
            let c = client.clone();
            watchers.push(tokio::spawn(async move {
                use tokio_stream::StreamExt as _;
                let params = kube::api::WatchParams::default();
                if kind == "pods" {
                    let api = Api::<Pod>::namespaced(c, NS);
                    let s = api.watch(&params, "0").await.unwrap();
                    tokio::pin!(s);
                    while s.next().await.is_some() {}
                } else {
                    let api = claims_api(&c, version);
                    let s = api.watch(&params, "0").await.unwrap();
                    tokio::pin!(s);
                    while s.next().await.is_some() {}
                }
            }));
        }
    }
    let writer = tessera_controller::writer::Writer::new(client.clone(), version);
    let mut rows: Vec<(String, (f64, f64, f64), usize)> = Vec::new();
    let bytes = |v: &serde_json::Value| v.to_string().len();
    for set in ["gate", "fast"] {
        let c = client.clone();
        let cost = per_write(pids, n, move |i| {
            let c = c.clone();
            async move {
                create_claim(&c, version, share_claim(&format!("{set}-{i}"), 10)).await;
            }
        })
        .await;
        rows.push((format!("create claim ({set})"), cost, 0));
        let c = client.clone();
        let cost = per_write(pids, n, move |i| {
            let c = c.clone();
            async move {
                create_pod(
                    &c,
                    &gated_pod(&format!("{set}-{i}"), &[&format!("{set}-{i}")], &[], "1"),
                )
                .await;
            }
        })
        .await;
        rows.push((format!("create pod ({set})"), cost, 0));
    }
    let claim = {
        let w = writer.clone();
        move |name: String| {
            let w = w.clone();
            async move { w.get_claim(NS, &name).await.unwrap().unwrap() }
        }
    };
    let pod = {
        let c = client.clone();
        move |name: String| {
            let c = c.clone();
            async move { Api::<Pod>::namespaced(c, NS).get(&name).await.unwrap() }
        }
    };
    let sample_claim = claim("gate-0".into()).await;
    let sample_pod = pod("gate-0".into()).await;
    // The gate path: mark, allocate, ungate; then kube-scheduler's reservation and binding.
    // The fast path: allocation and reservation in one status write, ungate, bind.
    let gate = [
        ("mark (merge patch: finalizer + annotation)", Step::Mark),
        (
            "allocate (status merge patch)",
            Step::Allocate { reserve: false },
        ),
        ("ungate (merge patch)", Step::Ungate),
        (
            "kube-scheduler: reserve (status patch of reservedFor)",
            Step::Reserve,
        ),
        ("bind (pods/binding)", Step::Bind),
    ];
    let fast = [
        ("mark (merge patch: finalizer + annotation)", Step::Mark),
        (
            "allocate + reserve (one status merge patch)",
            Step::Allocate { reserve: true },
        ),
        ("ungate (merge patch)", Step::Ungate),
        ("bind (pods/binding)", Step::Bind),
    ];
    for (set, row_prefix, steps) in [("gate", "", &gate[..]), ("fast", "fast: ", &fast[..])] {
        for &(label, step) in steps {
            let (w, claim, pod, c) = (writer.clone(), claim.clone(), pod.clone(), client.clone());
            let cost = per_write(pids, n, move |i| {
                let (w, claim, pod, c) = (w.clone(), claim.clone(), pod.clone(), c.clone());
                async move {
                    let name = format!("{set}-{i}");
                    match step {
                        Step::Mark => {
                            w.mark_claim(&claim(name.clone()).await, &name)
                                .await
                                .unwrap();
                        }
                        Step::Allocate { reserve } => {
                            let p = if reserve {
                                Some(pod(name.clone()).await)
                            } else {
                                None
                            };
                            w.write_allocation(
                                &claim(name).await,
                                &share_allocation(i),
                                p.as_ref(),
                            )
                            .await
                            .unwrap();
                        }
                        Step::Ungate => {
                            w.ungate(&pod(name).await).await.unwrap();
                        }
                        Step::Reserve => {
                            let p = pod(name.clone()).await;
                            let body = json!({"status": {"reservedFor": [
                                {"resource": "pods", "name": name, "uid": p.metadata.uid}]}});
                            claims_api(&c, version)
                                .patch_status(&name, &PatchParams::default(), &Patch::Merge(&body))
                                .await
                                .unwrap();
                        }
                        Step::Bind => {
                            bind(&c, &pod(name).await, &node_name(0)).await.unwrap();
                        }
                    }
                }
            })
            .await;
            rows.push((format!("{row_prefix}{label}"), cost, 0));
        }
    }
    // Reads alone (every write above also did one GET first): subtract this row.
    let cost = per_write(pids, n, move |i| {
        let claim = claim.clone();
        async move {
            claim(format!("fast-{i}")).await;
        }
    })
    .await;
    rows.push((
        "GET claim (in every row above but creates)".to_owned(),
        cost,
        0,
    ));
    let stored_claim = serde_json::to_value(claim_owned(&writer, "fast-0").await).unwrap();
    let stored_pod = serde_json::to_value(pod("fast-0".into()).await).unwrap();
    println!("| write | kube-apiserver CPU ms | etcd CPU ms | wall ms (8 in flight) |");
    println!("|---|---|---|---|");
    for (label, (api, etcd, wall), _) in &rows {
        println!("| {label} | {api:.2} | {etcd:.2} | {wall:.2} |");
    }
    println!(
        "object sizes (JSON): claim before {} B, after (allocated, reserved) {} B; pod before {} B, after {} B; allocation {} B",
        bytes(&serde_json::to_value(&sample_claim).unwrap()),
        bytes(&stored_claim),
        bytes(&serde_json::to_value(&sample_pod).unwrap()),
        bytes(&stored_pod),
        bytes(&serde_json::to_value(share_allocation(0)).unwrap()),
    );
    for w in watchers {
        w.abort();
    }
}

async fn claim_owned(w: &tessera_controller::writer::Writer, name: &str) -> res::ResourceClaim {
    w.get_claim(NS, name).await.unwrap().unwrap()
}

/// Places `n` gated share pods with the controller (fast path on or off; claims marked as the
/// claim webhook marks them, or not) while kube-scheduler runs, and answers the CPU milliseconds per pod of kube-apiserver, etcd and kube-scheduler
/// from the first create to the last pod bound, and the seconds that took.
#[allow(
    clippy::cast_precision_loss,
    reason = "a few hundred pods, as a float for the rate"
)]
async fn placement_cost(
    assets: &std::path::Path,
    n: usize,
    fast_path: bool,
    marked: bool,
) -> [f64; 4] {
    let envtest::Connected {
        mut cluster,
        client,
        version,
        ..
    } = envtest::start_connected(assets.to_owned()).await;
    seed(&client, version, &inventory(20, 8, true), "96").await;
    assert!(cluster.start_scheduler(assets), "no kube-scheduler");
    let pids: Vec<u32> = cluster
        .processes
        .0
        .iter()
        .map(std::process::Child::id)
        .collect();
    let (etcd, api, scheduler) = (pids[0], pids[1], pids[2]);
    let mut config = config(Policy::DemandFgd, None);
    config.fast_path = fast_path;
    let running = start_controller(&client, config);
    let mut synced = running.synced.clone();
    synced.wait_for(|s| *s).await.unwrap();
    // Let kube-scheduler finish starting up before counting.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = [cpu_ms(api), cpu_ms(etcd), cpu_ms(scheduler)];
    let t0 = std::time::Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for i in 0..n {
        while set.len() >= 8 {
            set.join_next().await.unwrap().unwrap();
        }
        let c = client.clone();
        set.spawn(async move {
            let name = format!("p-{i}");
            let mut claim = share_claim(&name, 5 * (1 + u32::try_from(i % 8).unwrap()));
            if marked {
                // As the claim webhook marks a template claim of a gated pod.
                claim["metadata"]["finalizers"] = json!([names::CLAIM_FINALIZER]);
                claim["metadata"]["annotations"] = json!({names::ANNOTATION_ALLOCATED_BY: name});
            }
            create_claim(&c, version, claim).await;
            create_pod(&c, &gated_pod(&name, &[&name], &[], "1")).await;
        });
    }
    while let Some(r) = set.join_next().await {
        r.unwrap();
    }
    eventually(Duration::from_mins(5), "every pod is bound", || async {
        pods(&client)
            .await
            .values()
            .filter(|p| p.spec.as_ref().is_some_and(|s| s.node_name.is_some()))
            .count()
            == n
    })
    .await;
    let took = t0.elapsed().as_secs_f64();
    let after = [cpu_ms(api), cpu_ms(etcd), cpu_ms(scheduler)];
    check_invariants(&client, version).await;
    running.stop().await;
    let per_pod = |i: usize| (after[i] - before[i]) / n as f64;
    [per_pod(0), per_pod(1), per_pod(2), took]
}

/// The control plane's CPU per placed pod with and without the fast path, for
/// docs/controller.md. Run by hand: `KUBEBUILDER_ASSETS=/work/k8s/bin cargo test -p
/// tessera-tests --test controller_envtest placement_costs -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement, run by hand"]
async fn placement_costs() {
    let Ok(assets) = envtest::assets() else {
        eprintln!("SKIPPED placement_costs: KUBEBUILDER_ASSETS has no binaries");
        return;
    };
    let n: usize = std::env::var("TESSERA_PLACEMENT_COST_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(400);
    println!(
        "| pods | path | claims marked at admission | kube-apiserver CPU ms/pod | etcd | \
         kube-scheduler | seconds to all bound |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (fast_path, marked) in [(false, false), (false, true), (true, true)] {
        let [api, etcd, scheduler, took] = placement_cost(&assets, n, fast_path, marked).await;
        let path = if fast_path {
            "fast path"
        } else {
            "gate protocol"
        };
        println!("| {n} | {path} | {marked} | {api:.2} | {etcd:.2} | {scheduler:.2} | {took:.1} |");
    }
}

/// Binds `pod` to `node` through `pods/binding`, as kube-scheduler does.
async fn bind(client: &kube::Client, pod: &Pod, node: &str) -> kube::Result<serde_json::Value> {
    let name = pod.metadata.name.clone().unwrap();
    Api::<Pod>::namespaced(client.clone(), NS)
        .create_subresource(
            "binding",
            &name,
            &PostParams::default(),
            &json!({"apiVersion": "v1", "kind": "Binding",
                    "metadata": {"name": name, "uid": pod.metadata.uid},
                    "target": {"apiVersion": "v1", "kind": "Node", "name": node}}),
        )
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preemption_against_a_real_api_server() {
    envtest::run(
        "preemption_against_a_real_api_server",
        |client, version| async move {
            // The real server's own eviction handler and PodDisruptionBudget checks decide here.
            tiers::preemption_evicts_batch_pods_through_the_eviction_api(&client, version).await;
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delay_tolerance_against_a_real_api_server() {
    envtest::run(
        "delay_tolerance_against_a_real_api_server",
        |client, version| async move {
            tiers::a_delay_tolerant_pod_waits_for_a_fragment(&client, version).await;
        },
    )
    .await;
}
