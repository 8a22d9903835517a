//! The controller at scale, as a separate process: pods/s, create-to-ungated latency, peak RSS
//! and CPU per placed pod of `tessera-controller` against the in-process fake API server.
//!
//! Run: `cargo bench -p tessera-controller --bench controller_scale` (both sizes), or with
//! `TESSERA_BENCH_NODES=500` (and optionally `TESSERA_BENCH_PODS`, `TESSERA_BENCH_LATENCY_MS`,
//! default 2) for one. The objects are those of issue 15's measurement on a real control plane:
//! N Ready nodes (96 CPU, 512Gi, 110 pods), one ResourceSlice per node with 8 A100-80G devices
//! (NVLink islands of 4, two NUMA nodes, `sharing=shared`, memory and compute capacities with
//! request policies, `allowMultipleAllocations`), and gated pods that each use one claim from a
//! ResourceClaimTemplate: 70 % shares (memory 5-40Gi step 5, compute 5-50 step 5), 25 % whole
//! GPUs (memory 80Gi, compute 100), 5 % two GPUs with `matchAttribute: nvlinkDomain`. The bench
//! plays kube-controller-manager (it creates each pod's claim and records it in the pod's
//! status). The fake serves every object with `managedFields`, as a real server does, and
//! answers every request after a fixed latency.
//!
//! The controller runs as its own process (the `tessera-controller` binary, default flags but
//! no leader election; `TESSERA_BENCH_CONTROLLER=path` runs another build), so its peak RSS (`VmHWM`) and CPU time (`utime + stime`) are its own;
//! CPU per pod counts from the first pod created to the last gate removed. The bench also
//! plays kube-scheduler's binding: each ungated pod is bound to its claim's node as soon as
//! the bench sees it ungated, so the controller watches bound pods as on a real cluster. `TESSERA_BENCH_FAST_PATH=false` passes `--fast-path=false` (the
//! controller then leaves the reservation to kube-scheduler). `TESSERA_BENCH_ADMISSION_MARK`
//! (default `true`) creates each claim with the finalizer and annotation the admission webhook
//! adds to claims of gated pods; `false` leaves marking to the controller (no webhook). The
//! controller's writes per pod are printed by resource.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::print_stdout,
    clippy::cast_precision_loss,
    clippy::too_many_lines,
    reason = "a benchmark binary that prints its numbers, its run read top to bottom"
)]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tessera_driver::names;
use tessera_tests::fake_apiserver::{FakeApiServer, Verb};
use tessera_tests::host::free_port;
use tessera_tests::scale::{
    GPUS, Rng, claim_spec, cpu_time, inventory, percentile, proc_status, seed_fake,
};

/// A Ready node's status as a kubelet reports it (96 CPU, 512Gi, 110 pods).
fn node_status(name: &str) -> Value {
    json!({
        "capacity": {"cpu": "96", "memory": "512Gi", "pods": "110"},
        "allocatable": {"cpu": "96", "memory": "512Gi", "pods": "110"},
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                        "message": "kubelet is posting ready status",
                        "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                        "lastTransitionTime": "2026-01-01T00:00:00Z"}],
        "nodeInfo": {"kubeletVersion": "v1.36.2", "containerRuntimeVersion": "containerd://2.1.0",
                     "kernelVersion": "6.8.0", "osImage": "Ubuntu 24.04", "architecture": "amd64",
                     "operatingSystem": "linux", "machineID": "x", "systemUUID": "x", "bootID": "x",
                     "kubeProxyVersion": ""},
        "addresses": [{"type": "InternalIP", "address": "10.0.0.1"},
                      {"type": "Hostname", "address": name}],
    })
}

/// Creates gated pod `i` and, as kube-controller-manager would, its claim from the template,
/// then records the claim's name in the pod's status.
fn create_pod(server: &FakeApiServer, i: usize, spec: &Value, admission_mark: bool) {
    let name = format!("p{i:05}");
    let claim = format!("{name}-gpu");
    let pod = server
        .create(
            "pods",
            json!({"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": name, "namespace": "default",
                                "labels": {"app": "bench", "tier": "gpu"}},
                   "spec": {"schedulingGates": [{"name": names::SCHEDULING_GATE}],
                            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}],
                            "restartPolicy": "Never",
                            "terminationGracePeriodSeconds": 30,
                            "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                                "imagePullPolicy": "IfNotPresent",
                                "env": [{"name": "MODE", "value": "bench"}],
                                "resources": {"requests": {"cpu": "1", "memory": "4Gi"},
                                              "claims": [{"name": "gpu"}]}}]}}),
        )
        .unwrap();
    let uid = pod["metadata"]["uid"].clone();
    let mut claim_object = json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
           "metadata": {"name": claim, "namespace": "default",
                        "annotations": {"resource.kubernetes.io/pod-claim-name": "gpu"},
                        "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": name,
                            "uid": uid, "controller": true, "blockOwnerDeletion": true}]},
           "spec": spec.clone()});
    if admission_mark {
        // What the claim webhook adds to a claim made for a gated pod.
        claim_object["metadata"]["finalizers"] = json!([names::CLAIM_FINALIZER]);
        claim_object["metadata"]["annotations"][names::ANNOTATION_ALLOCATED_BY] = json!(name);
    }
    server.create("resourceclaims", claim_object).unwrap();
    server
        .set_status(
            "pods",
            Some("default"),
            &name,
            &json!({"phase": "Pending",
                    "conditions": [{"type": "PodScheduled", "status": "False", "reason": "SchedulingGated",
                                    "message": "Scheduling is blocked due to non-empty scheduling gates"}],
                    "resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": claim}]}),
        )
        .unwrap();
}

/// Binds an ungated pod to the node its claim was allocated on, as kube-scheduler would, so
/// that the controller's view holds bound pods (as on a real control plane) by the end.
fn bind(server: &FakeApiServer, pod: &str) {
    let claim = server.get("resourceclaims", Some("default"), &format!("{pod}-gpu"));
    let node = claim.as_ref().and_then(|c| {
        c.pointer("/status/allocation/nodeSelector/nodeSelectorTerms/0/matchFields/0/values/0")
            .and_then(Value::as_str)
    });
    if let Some(node) = node {
        let _ = server.bind("default", pod, node);
    }
}

fn get(addr: &str, path: &str) -> Option<String> {
    use std::io::{Read as _, Write as _};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes())
        .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        // SIGTERM first (the controller exits cleanly, and profilers wrapped around it write
        // their output), then SIGKILL after a grace period.
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        for _ in 0..300 {
            if matches!(self.0.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn run(nodes: usize, pods: usize, latency: Duration, fast_path: bool, admission_mark: bool) {
    let server = FakeApiServer::start(&["v1"]).await.unwrap();
    server.set_managed_fields(true);
    seed_fake(&server, &inventory(nodes), node_status);
    server.set_request_delay(latency);
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, server.kubeconfig()).unwrap();
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    // TESSERA_BENCH_CONTROLLER runs another build (e.g. an older one, for before/after).
    let program = std::env::var("TESSERA_BENCH_CONTROLLER")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_tessera-controller").to_owned());
    let child = Command::new(program)
        .args(["--kubeconfig", kubeconfig.to_str().unwrap()])
        .args(["--leader-elect=false", "--metrics-addr", &metrics_addr])
        .args(fast_path.then_some("--fast-path=true"))
        .args((!fast_path).then_some("--fast-path=false"))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("tessera-controller starts");
    let pid = child.id();
    let child = Killed(child);
    let started = Instant::now();
    while !get(&metrics_addr, "/readyz").is_some_and(|r| r.starts_with("HTTP/1.1 200")) {
        assert!(
            started.elapsed() < Duration::from_mins(10),
            "the controller never synced"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let synced_after = started.elapsed();
    let rss_synced = proc_status(pid, "VmHWM:").unwrap_or(0);
    server.clear_requests();
    let cpu_before = cpu_time(pid);
    let t0 = Instant::now();
    // Pods are created as fast as the store takes them (the controller, another process,
    // starts on them at once), then watched until every gate is gone.
    let creator = {
        let mut rng = Rng(0x5eed_1234_abcd_ef01);
        let specs: Vec<Value> = (0..pods).map(|_| claim_spec(&mut rng)).collect();
        let mut created = Vec::with_capacity(pods);
        for (i, spec) in specs.into_iter().enumerate() {
            create_pod(&server, i, &spec, admission_mark);
            created.push(t0.elapsed());
        }
        created
    };
    let mut done_at: Vec<Option<Duration>> = vec![None; pods];
    let mut done = 0;
    let deadline = Duration::from_mins(30);
    while done < pods && t0.elapsed() < deadline {
        let now = t0.elapsed();
        for name in server.names_where("pods", |o| {
            o.pointer("/spec/schedulingGates")
                .and_then(Value::as_array)
                .is_none_or(Vec::is_empty)
        }) {
            if let Some(i) = name.strip_prefix('p').and_then(|n| n.parse::<usize>().ok())
                && i < pods
                && done_at[i].is_none()
            {
                done_at[i] = Some(now);
                done += 1;
                bind(&server, &name);
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let took = t0.elapsed();
    let cpu = cpu_time(pid).saturating_sub(cpu_before);
    let rss = proc_status(pid, "VmHWM:").unwrap_or(0);
    let rss_now = proc_status(pid, "VmRSS:").unwrap_or(0);
    let requests = server.requests();
    let writes = requests
        .iter()
        .filter(|r| !matches!(r.verb, Verb::Get | Verb::List | Verb::Watch))
        .count();
    let reads = requests
        .iter()
        .filter(|r| matches!(r.verb, Verb::Get | Verb::List))
        .count();
    let mut by_resource = std::collections::BTreeMap::<String, usize>::new();
    for r in requests
        .iter()
        .filter(|r| !matches!(r.verb, Verb::Get | Verb::List | Verb::Watch))
    {
        *by_resource.entry(r.resource.clone()).or_default() += 1;
    }
    let by_resource: Vec<String> = by_resource
        .iter()
        .map(|(r, n)| format!("{r} {:.2}", *n as f64 / done.max(1) as f64))
        .collect();
    let mut latencies: Vec<Duration> = done_at
        .iter()
        .zip(&creator)
        .filter_map(|(d, c)| d.map(|d| d.saturating_sub(*c)))
        .collect();
    latencies.sort();
    let last = done_at.iter().flatten().max().copied().unwrap_or(took);
    println!(
        "controller_scale nodes={nodes} gpus={} pods={pods} fast_path={fast_path} \
         admission_mark={admission_mark} placed={done} latency={}ms: \
         {:.1} pods/s (create->ungated p50 {:.2}s p99 {:.2}s), peak RSS {} MiB (after sync {} MiB, synced in {:.1}s; at the end {} MiB), \
         CPU {:.2} ms/pod, {:.2} writes/pod ({}), {:.2} reads/pod",
        nodes * GPUS,
        latency.as_millis(),
        done as f64 / last.as_secs_f64(),
        percentile(&latencies, 50).as_secs_f64(),
        percentile(&latencies, 99).as_secs_f64(),
        rss / 1024,
        rss_synced / 1024,
        synced_after.as_secs_f64(),
        rss_now / 1024,
        cpu.as_secs_f64() * 1000.0 / done.max(1) as f64,
        writes as f64 / done.max(1) as f64,
        by_resource.join(", "),
        reads as f64 / done.max(1) as f64,
    );
    drop(child);
}

fn main() {
    let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<usize>().ok());
    let latency = Duration::from_millis(env("TESSERA_BENCH_LATENCY_MS").unwrap_or(2) as u64);
    let sizes: Vec<(usize, usize)> = match env("TESSERA_BENCH_NODES") {
        Some(n) => vec![(n, env("TESSERA_BENCH_PODS").unwrap_or(n * 5))],
        None => vec![(500, 3000), (1000, 5000)],
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let flag = |k: &str| std::env::var(k).map_or(true, |v| v != "false" && v != "0");
    let (fast_path, admission_mark) = (
        flag("TESSERA_BENCH_FAST_PATH"),
        flag("TESSERA_BENCH_ADMISSION_MARK"),
    );
    for (nodes, pods) in sizes {
        runtime.block_on(run(nodes, pods, latency, fast_path, admission_mark));
    }
}
