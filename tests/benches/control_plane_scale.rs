//! Tessera against kube-scheduler on a real control plane: pods/s, create→bound latency, peak
//! RSS of the allocating process, CPU per placed pod of every process, and how many GPUs the
//! placements occupy beside an offline first-fit-decreasing packing of the same demands.
//!
//! Run (release; the binaries are not in the repo, see DEVELOPERS.md):
//! `cargo build --release -p tessera-controller --bin tessera-controller &&
//!  KUBEBUILDER_ASSETS=/path/to/bin cargo bench -p tessera-tests --bench control_plane_scale`.
//! `KUBEBUILDER_ASSETS` must hold etcd, kube-apiserver, kube-scheduler and
//! kube-controller-manager (which makes each pod's claim from its template, as in a real
//! cluster). Without them the bench says so and exits 0.
//!
//! Knobs: `TESSERA_BENCH_NODES` (default 500), `TESSERA_BENCH_PODS` (default 6 per node),
//! `TESSERA_BENCH_MODE` = `scheduler` (kube-scheduler alone, pods without the gate), `tessera`
//! (pods gated, tessera-controller allocates) or `both` (default, one fresh cluster each),
//! `TESSERA_BENCH_CONTROLLER` (the tessera-controller binary; default the release build beside
//! this bench), `TESSERA_BENCH_CONTROLLER_ARGS` (extra flags, space separated).
//!
//! The objects are those of issue 15's measurement: N Ready nodes (96 CPU, 512Gi, 110 pods), one
//! ResourceSlice per node with 8 A100-80G devices (NVLink islands of 4, `sharing=shared`,
//! memory and compute capacities with request policies, `allowMultipleAllocations`), and pods
//! that each use one claim from a ResourceClaimTemplate: 70 % shares (memory 5–40Gi step 5,
//! compute 5–50 step 5), 25 % whole GPUs (memory 80Gi, compute 100), 5 % two GPUs with
//! `matchAttribute: nvlinkDomain`; created by 8 concurrent clients. No kubelet runs: a pod is
//! done when it is bound (`spec.nodeName` set). kube-scheduler and kube-controller-manager get
//! client QPS limits of 1000.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::print_stdout,
    clippy::cast_precision_loss,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::too_many_lines,
    reason = "a benchmark binary that prints its numbers, its run read top to bottom"
)]

#[path = "../tests/support/envtest_cluster.rs"]
mod envtest_cluster;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1 as res;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use serde_json::{Value, json};
use tessera_driver::apiversion::{self, ApiVersion};
use tessera_driver::names;
use tessera_driver::node::slices::{self, RenderOptions};
use tessera_tests::scale::{GPUS, Rng, cpu_time, inventory, percentile, proc_status};
use tokio_stream::StreamExt as _;

const CREATORS: usize = 8;
const MEMORY_GI: u64 = 80;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Scheduler,
    Tessera,
}

impl Mode {
    fn as_str(self) -> &'static str {
        match self {
            Self::Scheduler => "kube-scheduler alone",
            Self::Tessera => "tessera-controller + kube-scheduler",
        }
    }
}

/// What one pod asks for.
#[derive(Clone, Copy, Debug)]
enum Demand {
    Share { memory_gi: u64, compute: u64 },
    Whole,
    Pair,
}

impl Demand {
    fn template(self) -> String {
        match self {
            Self::Share { memory_gi, compute } => format!("share-{memory_gi}gi-{compute}"),
            Self::Whole => "whole".to_owned(),
            Self::Pair => "pair".to_owned(),
        }
    }

    fn claim_spec(self) -> Value {
        let class = names::CLASS_SHARED_GPU;
        match self {
            Self::Share { memory_gi, compute } => json!({"devices": {"requests": [{"name": "gpu",
                "exactly": {"deviceClassName": class, "capacity": {"requests": {
                    "memory": format!("{memory_gi}Gi"), "compute": compute.to_string()}}}}]}}),
            Self::Whole => json!({"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": class,
                "capacity": {"requests": {"memory": "80Gi", "compute": "100"}}}}]}}),
            Self::Pair => json!({"devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": class, "count": 2,
                    "capacity": {"requests": {"memory": "80Gi", "compute": "100"}}}}],
                "constraints": [{"requests": ["gpu"], "matchAttribute":
                    format!("{}/{}", names::DEFAULT_DRIVER_NAME, names::ATTR_NVLINK_DOMAIN)}]}}),
        }
    }
}

fn demands(pods: usize) -> Vec<Demand> {
    let mut rng = Rng(0x5eed_1234_abcd_ef01);
    (0..pods)
        .map(|_| {
            let roll = rng.below(100);
            if roll < 70 {
                Demand::Share {
                    memory_gi: 5 * (1 + rng.below(8)),
                    compute: 5 * (1 + rng.below(10)),
                }
            } else if roll < 95 {
                Demand::Whole
            } else {
                Demand::Pair
            }
        })
        .collect()
}

/// GPUs an offline first-fit-decreasing packing needs for the demands: whole GPUs and pairs
/// take whole cards; shares are packed by (memory, compute) into cards in decreasing order of
/// their larger fraction.
fn first_fit_decreasing(demands: &[Demand]) -> usize {
    let mut whole = 0;
    let mut shares: Vec<(u64, u64)> = Vec::new();
    for d in demands {
        match *d {
            Demand::Whole => whole += 1,
            Demand::Pair => whole += 2,
            Demand::Share { memory_gi, compute } => shares.push((memory_gi, compute)),
        }
    }
    let key = |&(m, c): &(u64, u64)| (m * 100).max(c * MEMORY_GI);
    shares.sort_by_key(|s| std::cmp::Reverse(key(s)));
    let mut bins: Vec<(u64, u64)> = Vec::new();
    for (m, c) in shares {
        if let Some(bin) = bins
            .iter_mut()
            .find(|(bm, bc)| bm + m <= MEMORY_GI && bc + c <= 100)
        {
            bin.0 += m;
            bin.1 += c;
        } else {
            bins.push((m, c));
        }
    }
    whole + bins.len()
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

/// Runs `make(i)` for every `i < jobs` on `CREATORS` concurrent clients.
async fn concurrently<F, Fut>(jobs: usize, make: F)
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let mut set = tokio::task::JoinSet::new();
    for first in 0..CREATORS {
        let make = make.clone();
        set.spawn(async move {
            for i in (first..jobs).step_by(CREATORS) {
                make(i).await;
            }
        });
    }
    while let Some(done) = set.join_next().await {
        done.unwrap();
    }
}

async fn seed(
    client: &kube::Client,
    inventory: &tessera_driver::node::inventory::Inventory,
    demands: &[Demand],
) {
    let classes: Api<res::DeviceClass> = Api::all(client.clone());
    for file in ["gpu.yaml", "shared-gpu.yaml"] {
        let text = std::fs::read_to_string(repo().join("deviceclasses").join(file)).unwrap();
        let class: res::DeviceClass = serde_yaml::from_str(&text).unwrap();
        classes
            .create(&PostParams::default(), &class)
            .await
            .unwrap();
    }
    let templates: Api<res::ResourceClaimTemplate> = Api::namespaced(client.clone(), "default");
    let mut made = BTreeSet::new();
    for d in demands {
        if made.insert(d.template()) {
            let template: res::ResourceClaimTemplate = serde_json::from_value(json!({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": d.template(), "namespace": "default"},
                "spec": {"spec": d.claim_spec()}}))
            .unwrap();
            templates
                .create(&PostParams::default(), &template)
                .await
                .unwrap();
        }
    }
    let options = RenderOptions {
        consumable_capacity: true,
        ..RenderOptions::default()
    };
    let node_api: Api<Node> = Api::all(client.clone());
    let slice_api: Api<res::ResourceSlice> = Api::all(client.clone());
    let nodes = Arc::new(inventory.nodes.clone());
    concurrently(nodes.len(), move |i| {
        let nodes = Arc::clone(&nodes);
        let node_api = node_api.clone();
        let slice_api = slice_api.clone();
        let options = options.clone();
        async move {
            let node = &nodes[i];
            let object: Node = serde_json::from_value(json!({"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": node.name, "labels": {names::LABEL_HOSTNAME: node.name,
                    "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}}}))
            .unwrap();
            node_api
                .create(&PostParams::default(), &object)
                .await
                .unwrap();
            let now = "2026-01-01T00:00:00Z";
            let status = json!({"status": {
                "capacity": {"cpu": "96", "memory": "512Gi", "pods": "110"},
                "allocatable": {"cpu": "96", "memory": "512Gi", "pods": "110"},
                "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                    "message": "kubelet is posting ready status",
                    "lastHeartbeatTime": now, "lastTransitionTime": now}],
                "addresses": [{"type": "Hostname", "address": node.name}]}});
            node_api
                .patch_status(&node.name, &PatchParams::default(), &Patch::Merge(&status))
                .await
                .unwrap();
            for slice in slices::render(node, &options).unwrap() {
                let value = apiversion::encode_slice(&slice, ApiVersion::V1).unwrap();
                let slice: res::ResourceSlice = serde_json::from_value(value).unwrap();
                slice_api
                    .create(&PostParams::default(), &slice)
                    .await
                    .unwrap();
            }
        }
    })
    .await;
}

fn pod(i: usize, demand: Demand, gated: bool) -> Pod {
    let scheduling_gates = if gated {
        json!([{"name": names::SCHEDULING_GATE}])
    } else {
        json!([])
    };
    serde_json::from_value(json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("p{i:05}"), "namespace": "default",
                     "labels": {"app": "bench"}},
        "spec": {"schedulingGates": scheduling_gates,
                 "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": demand.template()}],
                 "restartPolicy": "Never",
                 "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                     "resources": {"requests": {"cpu": "1", "memory": "4Gi"},
                                   "claims": [{"name": "gpu"}]}}]}}))
    .unwrap()
}

/// Records when each pod is first seen bound, from a watch that resumes where it stopped.
async fn watch_bound(api: Api<Pod>, t0: Instant, bound: Arc<Mutex<BTreeMap<String, Duration>>>) {
    let mut version = "0".to_owned();
    loop {
        let Ok(stream) = api
            .watch(&WatchParams::default().timeout(290), &version)
            .await
        else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            match event {
                Ok(WatchEvent::Added(p) | WatchEvent::Modified(p)) => {
                    if let Some(v) = &p.metadata.resource_version {
                        version.clone_from(v);
                    }
                    if p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some() {
                        let name = p.metadata.name.unwrap_or_default();
                        bound.lock().unwrap().entry(name).or_insert(t0.elapsed());
                    }
                }
                Ok(WatchEvent::Bookmark(b)) => version = b.metadata.resource_version,
                Ok(WatchEvent::Deleted(_)) => {}
                Ok(WatchEvent::Error(_)) | Err(_) => {
                    // Gone or broken: start again from now (bound pods seen so far stay).
                    "0".clone_into(&mut version);
                    break;
                }
            }
        }
    }
}

fn peak_rss_mib(pid: u32) -> u64 {
    proc_status(pid, "VmHWM:").unwrap_or(0) / 1024
}

fn spawn(bin: &Path, args: &[String], log: &Path) -> Child {
    Command::new(bin)
        .args(args)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap_or_else(|e| panic!("{} does not start: {e}", bin.display()))
}

fn controller_binary() -> PathBuf {
    if let Ok(path) = std::env::var("TESSERA_BENCH_CONTROLLER") {
        return PathBuf::from(path);
    }
    // target/release/deps/control_plane_scale-… → target/release/tessera-controller
    let exe = std::env::current_exe().unwrap();
    exe.parent()
        .and_then(Path::parent)
        .unwrap()
        .join("tessera-controller")
}

async fn run(assets: &Path, mode: Mode, nodes: usize, pods: usize) {
    let mut cluster = envtest_cluster::start_cluster(assets).await;
    let client = tessera_kubeapi::client(Some(&cluster.kubeconfig))
        .await
        .unwrap();
    let kubeconfig = cluster.kubeconfig.to_str().unwrap().to_owned();
    let dir = cluster.dir.path().to_owned();
    let demands = demands(pods);
    let started = Instant::now();
    seed(&client, &inventory(nodes), &demands).await;
    let seeded_after = started.elapsed();

    let mut named: Vec<(&str, u32)> = vec![
        ("etcd", cluster.processes.0[0].id()),
        ("kube-apiserver", cluster.processes.0[1].id()),
    ];
    let config = dir.join("scheduler.yaml");
    std::fs::write(
        &config,
        format!(
            "apiVersion: kubescheduler.config.k8s.io/v1\nkind: KubeSchedulerConfiguration\n\
             clientConnection:\n  kubeconfig: {kubeconfig}\n  qps: 1000\n  burst: 1000\n\
             leaderElection:\n  leaderElect: false\n"
        ),
    )
    .unwrap();
    let scheduler = spawn(
        &assets.join("kube-scheduler"),
        &[
            format!("--config={}", config.display()),
            format!("--authentication-kubeconfig={kubeconfig}"),
            format!("--authorization-kubeconfig={kubeconfig}"),
            "--bind-address=127.0.0.1".to_owned(),
            format!("--secure-port={}", tessera_tests::host::free_port()),
        ],
        &dir.join("kube-scheduler.log"),
    );
    named.push(("kube-scheduler", scheduler.id()));
    cluster.processes.0.push(scheduler);
    let manager = spawn(
        &assets.join("kube-controller-manager"),
        &[
            format!("--kubeconfig={kubeconfig}"),
            format!("--authentication-kubeconfig={kubeconfig}"),
            format!("--authorization-kubeconfig={kubeconfig}"),
            "--controllers=resourceclaim-controller".to_owned(),
            "--leader-elect=false".to_owned(),
            "--kube-api-qps=1000".to_owned(),
            "--kube-api-burst=1000".to_owned(),
            "--bind-address=127.0.0.1".to_owned(),
            format!("--secure-port={}", tessera_tests::host::free_port()),
        ],
        &dir.join("kube-controller-manager.log"),
    );
    named.push(("kube-controller-manager", manager.id()));
    cluster.processes.0.push(manager);
    let mut allocator_pid = named[2].1;
    if mode == Mode::Tessera {
        let metrics = format!("127.0.0.1:{}", tessera_tests::host::free_port());
        let mut args = vec![
            format!("--kubeconfig={kubeconfig}"),
            "--leader-elect=false".to_owned(),
            format!("--metrics-addr={metrics}"),
        ];
        if let Ok(extra) = std::env::var("TESSERA_BENCH_CONTROLLER_ARGS") {
            args.extend(extra.split_whitespace().map(str::to_owned));
        }
        let controller = Command::new(controller_binary())
            .args(&args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("tessera-controller.log")).unwrap())
            .spawn()
            .expect("tessera-controller starts (build it with --release first)");
        allocator_pid = controller.id();
        named.push(("tessera-controller", controller.id()));
        cluster.processes.0.push(controller);
    }
    // Let every process list and settle before the clock starts.
    tokio::time::sleep(Duration::from_secs(10)).await;

    let pod_api: Api<Pod> = Api::namespaced(client.clone(), "default");
    let bound = Arc::new(Mutex::new(BTreeMap::new()));
    let t0 = Instant::now();
    let watcher = tokio::spawn(watch_bound(pod_api.clone(), t0, Arc::clone(&bound)));
    let cpu_before: Vec<Duration> = named.iter().map(|(_, pid)| cpu_time(*pid)).collect();
    let created = Arc::new(Mutex::new(vec![Duration::ZERO; pods]));
    let gated = mode == Mode::Tessera;
    let creator_api = pod_api.clone();
    let creator_created = Arc::clone(&created);
    let creator_demands = Arc::new(demands.clone());
    concurrently(pods, move |i| {
        let pod_api = creator_api.clone();
        let created = Arc::clone(&creator_created);
        let demand = creator_demands[i];
        async move {
            pod_api
                .create(&PostParams::default(), &pod(i, demand, gated))
                .await
                .unwrap();
            created.lock().unwrap()[i] = t0.elapsed();
        }
    })
    .await;
    let created_after = t0.elapsed();
    let deadline = Duration::from_mins(40);
    let mut last_count = 0;
    let mut last_progress = Instant::now();
    loop {
        let count = bound.lock().unwrap().len();
        if count >= pods || t0.elapsed() > deadline {
            break;
        }
        if count != last_count {
            last_count = count;
            last_progress = Instant::now();
        } else if last_progress.elapsed() > Duration::from_mins(3) {
            println!("no pod bound for 3 minutes: stopping at {count} of {pods}");
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let cpu: Vec<Duration> = named
        .iter()
        .zip(&cpu_before)
        .map(|((_, pid), before)| cpu_time(*pid).saturating_sub(*before))
        .collect();
    watcher.abort();
    let bound = bound.lock().unwrap().clone();
    let created = created.lock().unwrap().clone();
    let mut latencies: Vec<Duration> = bound
        .iter()
        .filter_map(|(name, at)| {
            let i: usize = name.strip_prefix('p')?.parse().ok()?;
            Some(at.saturating_sub(*created.get(i)?))
        })
        .collect();
    latencies.sort();
    let last = bound.values().max().copied().unwrap_or(t0.elapsed());
    let placed = bound.len();

    // Packing: distinct GPUs the allocations occupy, against first-fit-decreasing.
    let claims: Api<res::ResourceClaim> = Api::namespaced(client.clone(), "default");
    let mut used = BTreeSet::new();
    let mut params = ListParams::default().limit(500);
    loop {
        let page = claims.list(&params).await.unwrap();
        for claim in &page.items {
            let results = claim
                .status
                .as_ref()
                .and_then(|s| s.allocation.as_ref())
                .and_then(|a| a.devices.as_ref())
                .and_then(|d| d.results.clone())
                .unwrap_or_default();
            for r in results {
                used.insert((r.pool, r.device));
            }
        }
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => break,
        }
    }
    let ffd = first_fit_decreasing(&demands);

    let per_pod = |d: Duration| d.as_secs_f64() * 1000.0 / placed.max(1) as f64;
    let total: Duration = cpu.iter().sum();
    println!(
        "control_plane_scale {} nodes={nodes} gpus={} pods={pods} bound={placed}: {:.1} pods/s \
         (created in {:.1}s; create->bound p50 {:.1}s p99 {:.1}s; last bound at {:.1}s; seeded in {:.1}s)",
        mode.as_str(),
        nodes * GPUS,
        placed as f64 / last.as_secs_f64(),
        created_after.as_secs_f64(),
        percentile(&latencies, 50).as_secs_f64(),
        percentile(&latencies, 99).as_secs_f64(),
        last.as_secs_f64(),
        seeded_after.as_secs_f64(),
    );
    println!(
        "  peak RSS of the allocating process {} MiB; CPU per bound pod {:.1} ms in all: {}",
        peak_rss_mib(allocator_pid),
        per_pod(total),
        named
            .iter()
            .zip(&cpu)
            .map(|((name, pid), c)| format!(
                "{name} {:.1} ms (peak RSS {} MiB)",
                per_pod(*c),
                peak_rss_mib(*pid)
            ))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "  GPUs occupied {} vs first-fit-decreasing {ffd} ({:+.1} %)",
        used.len(),
        (used.len() as f64 / ffd.max(1) as f64 - 1.0) * 100.0
    );
    println!("  logs in {}", dir.display());
    if std::env::var_os("TESSERA_BENCH_KEEP").is_some() {
        // Keep the directory (and its logs) for a look afterwards.
        std::mem::forget(cluster.dir);
        return;
    }
    drop(cluster);
}

fn main() {
    let assets = match envtest_cluster::assets() {
        Ok(dir)
            if dir.join("kube-scheduler").is_file()
                && dir.join("kube-controller-manager").is_file() =>
        {
            dir
        }
        Ok(dir) => {
            println!(
                "control_plane_scale: skipped, {} lacks kube-scheduler or kube-controller-manager",
                dir.display()
            );
            return;
        }
        Err(why) => {
            println!("control_plane_scale: skipped, {why}");
            return;
        }
    };
    let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<usize>().ok());
    let nodes = env("TESSERA_BENCH_NODES").unwrap_or(500);
    let pods = env("TESSERA_BENCH_PODS").unwrap_or(nodes * 6);
    let modes = match std::env::var("TESSERA_BENCH_MODE").as_deref() {
        Ok("scheduler") => vec![Mode::Scheduler],
        Ok("tessera") => vec![Mode::Tessera],
        _ => vec![Mode::Scheduler, Mode::Tessera],
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    for mode in modes {
        runtime.block_on(run(&assets, mode, nodes, pods));
    }
}
