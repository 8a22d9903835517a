//! The shipped chart on a node, with nothing but what the image and the chart's mounts give:
//! the plugin and the MPS host each run in a container made of the image's binaries (with the
//! libraries they load, as the distroless image has them), the runtime's `/proc`, `/sys` and
//! `/dev`, and the rendered `DaemonSets`' hostPath mounts, changed root into. The node has the
//! NVIDIA driver (the fake backend's control binary) at one of the usual driver roots. A share
//! is prepared, a CUDA client of the fake attaches, the plugin's container is killed and a new
//! one started (a rollout), and the new plugin adopts the daemon: one start, no `quit`, the
//! client still attached, the same CDI ids; the daemon quits once the claim is unprepared.
//! Before that, the isolation probe's child runs in a container of the plugin's image and
//! applies its claim's mounts with no shell, `unshare` or `mount` there.
//!
//! It needs `CAP_SYS_ADMIN` and `CAP_SYS_CHROOT` (mount namespaces, binds, chroot) and the
//! workspace's binaries (`cargo build -p tessera-kubelet-plugin --bins`, which `cargo test
//! --workspace` does); without them it says so and passes.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::mount::{MsFlags, mount};
use serde_yaml::Value;
use tessera_driver::node::cdi;
use tessera_driver::node::isolation;
use tessera_driver::node::mps::ControlSocket;
use tessera_kubelet_plugin::mps::socket;
use tessera_proto::dra::v1;
use tessera_tests::host::{free_port, libraries, may_mount_and_chroot};
use tessera_tests::plugin_socket::{Dra, prepare_one, unprepare_one};

#[path = "support/chart.rs"]
mod chart;

const NODE: &str = "t4-node";
const UID: &str = "uid-share";

/// A child killed and reaped when the test lets go of it.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The directory of the workspace's binaries, when the three this test runs are built.
fn binaries() -> Option<PathBuf> {
    let dir = std::env::current_exe().ok()?.parent()?.parent()?.to_owned();
    [
        "tessera-kubelet-plugin",
        "tessera-mps",
        "tessera-fake-mps-control",
    ]
    .iter()
    .all(|b| dir.join(b).is_file())
    .then_some(dir)
}

fn under(root: &Path, path: &str) -> PathBuf {
    root.join(path.trim_start_matches('/'))
}

/// Copies `binary` to `at` under `root`, with the libraries it loads at their own paths.
fn install(root: &Path, binary: &Path, at: &str) {
    for lib in libraries(binary).expect("the dynamic loader lists the libraries") {
        let to = under(root, &lib.display().to_string());
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(&lib, &to).unwrap();
    }
    let to = under(root, at);
    std::fs::create_dir_all(to.parent().unwrap()).unwrap();
    std::fs::copy(binary, &to).unwrap();
}

fn bind(source: &Path, target: &Path) {
    std::fs::create_dir_all(target).unwrap();
    mount(
        Some(source),
        target,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        None::<&str>,
    )
    .unwrap_or_else(|e| panic!("binding {} on {}: {e}", source.display(), target.display()));
}

/// Builds container `name`'s root from the image's binaries, the runtime's mounts and
/// `container`'s hostPath mounts (from `node`), plus the test's own inputs at `/test`.
fn container(work: &Path, name: &str, pod: &Value, container: &Value, bins: &Path) -> PathBuf {
    let root = work.join("containers").join(name);
    // A container's root is a mount point (the runtime pivots into its root file system).
    bind(&root, &root);
    for binary in ["tessera-kubelet-plugin", "tessera-mps"] {
        install(
            &root,
            &bins.join(binary),
            &format!("/usr/local/bin/{binary}"),
        );
    }
    for runtime in ["/proc", "/sys", "/dev"] {
        bind(Path::new(runtime), &under(&root, runtime));
    }
    let node = work.join("node");
    let volumes = pod["volumes"].as_sequence().unwrap();
    for m in container["volumeMounts"].as_sequence().unwrap() {
        let volume = volumes.iter().find(|v| v["name"] == m["name"]).unwrap();
        let host = volume["hostPath"]["path"].as_str().unwrap();
        let source = under(&node, host);
        match volume["hostPath"]["type"].as_str() {
            Some("Directory") => assert!(source.is_dir(), "{host} must exist on the node"),
            _ => std::fs::create_dir_all(&source).unwrap(),
        }
        bind(&source, &under(&root, m["mountPath"].as_str().unwrap()));
    }
    bind(&work.join("test"), &root.join("test"));
    root
}

/// Runs `program` (inside the container) with `args` in the container `root`, through
/// `tessera-mps exec` (a change of root; no shell).
fn run_in(bins: &Path, root: &Path, program: &str, args: &[String]) -> Reaped {
    let child = Command::new(bins.join("tessera-mps"))
        .arg("exec")
        .arg("--root")
        .arg(root)
        .arg("--")
        .arg(program)
        .args(args)
        .env("RUST_LOG", "info")
        .env("NODE_NAME", NODE)
        .env("NVIDIA_VISIBLE_DEVICES", "void")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    Reaped(child)
}

fn share_claim() -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": "default", "name": "share", "uid": UID},
        "spec": {},
        "status": {"allocation": {"devices": {"results": [{
            "request": "gpu",
            "driver": "gpu.tessera.dev",
            "pool": NODE,
            "device": "gpu-0",
            "shareID": "7f3a1c52-0d1e-4b7a-9c44-1b2f3e4d5a6b",
            "consumedCapacity": {"memory": "4Gi", "compute": "50"}
        }]}},
        "reservedFor": [{"resource": "pods", "name": "share-pod", "uid": "pod-share"}]}
    })
}

/// The pod the share claim is reserved for, running as root: the chart runs one MPS daemon
/// per GPU set and user, taken from it.
fn share_pod() -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"namespace": "default", "name": "share-pod", "uid": "pod-share"},
        "spec": {
            "nodeName": NODE,
            "securityContext": {"runAsUser": 0},
            "resourceClaims": [{"name": "gpu", "resourceClaimName": "share"}],
            "containers": [{"name": "main", "image": "cuda", "resources": {"claims": [{"name": "gpu"}]}}]
        }
    })
}

fn claim_ref() -> v1::Claim {
    v1::Claim {
        namespace: "default".to_owned(),
        uid: UID.to_owned(),
        name: "share".to_owned(),
    }
}

async fn dial(socket: &Path, plugin: &mut Reaped) -> Dra {
    let deadline = Instant::now() + Duration::from_mins(1);
    loop {
        assert!(plugin.0.try_wait().unwrap().is_none(), "the plugin exited");
        if let Ok(channel) = tessera_tests::plugin_socket::dial(socket).await {
            return Dra::new(channel);
        }
        assert!(Instant::now() < deadline, "the plugin did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn prepare(dra: &mut Dra) -> Vec<String> {
    prepare_one(dra, claim_ref()).await.unwrap()
}

/// A free TCP port for the plugin's metrics (other suites may run beside this one).
fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The node: the driver (the fake control binary and its libraries) at `driver_root`, and the
/// test's inputs (inventory and claims) at `<work>/test`.
fn prepare_node(work: &Path, bins: &Path, driver_root: &str) {
    let node = work.join("node");
    install(
        &under(&node, driver_root),
        &bins.join("tessera-fake-mps-control"),
        "/usr/bin/nvidia-cuda-mps-control",
    );
    let test = work.join("test");
    std::fs::create_dir_all(&test).unwrap();
    std::fs::copy(
        chart::repo().join("examples/inventory/demo-cluster.yaml"),
        test.join("inventory.yaml"),
    )
    .unwrap();
    std::fs::write(
        test.join("claims.yaml"),
        format!(
            "---\n{}\n---\n{}\n",
            serde_json::to_string(&share_claim()).unwrap(),
            serde_json::to_string(&share_pod()).unwrap()
        ),
    )
    .unwrap();
}

/// The chart for `driver_root` and the fake GPU backend.
fn rendered(driver_root: &str) -> Vec<(String, Value)> {
    let mut values = chart::with_driver_root(driver_root);
    for (path, value) in [
        ("kubeletPlugin.gpuBackend", Value::from("fake")),
        (
            "kubeletPlugin.fakeInventory",
            Value::from("/test/inventory.yaml"),
        ),
        ("kubeletPlugin.logFormat", Value::from("plain")),
        (
            "kubeletPlugin.metricsPort",
            Value::from(u64::from(free_port())),
        ),
    ] {
        values = chart::with_value(&values, path, value);
    }
    chart::documents_with(&values)
}

/// The node's one MPS daemon: its pipe directory, its control log and its pid.
fn the_daemon(node: &Path) -> (PathBuf, PathBuf, i32) {
    let ids_dir: Vec<_> = std::fs::read_dir(node.join("run/tessera/mps"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(ids_dir.len(), 1, "{ids_dir:?}");
    let id = &ids_dir[0];
    let pipe = node.join("run/tessera/mps").join(id).join("pipe");
    let log = node
        .join("var/log/tessera/mps")
        .join(id)
        .join("control.log");
    let control_log = lines(&log);
    let daemon_pid: i32 = control_log
        .first()
        .and_then(|l| l.strip_prefix("start pid="))
        .and_then(|r| r.split_whitespace().next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no daemon start in {control_log:?}"));
    assert_eq!(control_log.len(), 1, "{control_log:?}");
    (pipe, log, daemon_pid)
}

/// A CUDA client of the fake, attached to the daemon on `pipe` until it is dropped.
async fn attach(bins: &Path, pipe: &Path, log: &Path) -> Reaped {
    let client = Reaped(
        Command::new(bins.join("tessera-fake-mps-control"))
            .arg("client")
            .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_until("the client attaches", || {
        lines(log).iter().any(|l| l.starts_with("client connected"))
    })
    .await;
    client
}

/// The whole run for driver root `driver_root`, on this thread (its own mount namespace).
async fn on_node(work: &Path, bins: &Path, driver_root: &str) {
    // Dropped last, whether the run passes or panics.
    let _contained = KillContained(work.to_owned());
    prepare_node(work, bins, driver_root);
    let node = work.join("node");

    let docs = rendered(driver_root);
    let plugin_ds = chart::find(&docs, "DaemonSet", "tessera-kubelet-plugin");
    let host_ds = chart::find(&docs, "DaemonSet", "tessera-mps");
    let plugin_pod = &plugin_ds["spec"]["template"]["spec"];
    let host_pod = &host_ds["spec"]["template"]["spec"];
    let plugin_container = &plugin_pod["containers"][0];
    let host_container = &host_pod["containers"][0];

    let host_root = container(work, "mps-host", host_pod, host_container, bins);
    let host_command = chart::strings(&host_container["command"]);
    let _host = run_in(
        bins,
        &host_root,
        &format!("/usr/local/bin/{}", host_command[0]),
        &chart::strings(&host_container["args"]),
    );

    let mut plugin_args = chart::strings(&plugin_container["args"]);
    plugin_args.push("--fake-claims=/test/claims.yaml".to_owned());
    let plugin_command = format!(
        "/usr/local/bin/{}",
        chart::strings(&plugin_container["command"])[0]
    );
    let start_plugin = |generation: u32| {
        let root = container(
            work,
            &format!("plugin-{generation}"),
            plugin_pod,
            plugin_container,
            bins,
        );
        run_in(bins, &root, &plugin_command, &plugin_args)
    };
    let dra_socket = node.join("var/lib/kubelet/plugins/gpu.tessera.dev/dra.sock");

    probe_in_the_plugins_container(
        bins,
        &container(work, "probe", plugin_pod, plugin_container, bins),
    );

    let mut plugin = start_plugin(1);
    let mut dra = dial(&dra_socket, &mut plugin).await;
    let ids = prepare(&mut dra).await;

    // The daemon runs from the driver root, with the node's directories.
    let (pipe, log, daemon_pid) = the_daemon(&node);
    // The daemon's root is the host container's /driver-root, the node's driver root.
    assert_eq!(
        std::fs::read_link(format!("/proc/{daemon_pid}/root")).unwrap(),
        host_root.join("driver-root"),
        "the daemon runs with the driver root as its root"
    );
    assert!(
        Path::new(&format!(
            "/proc/{daemon_pid}/root/usr/bin/nvidia-cuda-mps-control"
        ))
        .is_file()
    );

    // A CUDA client attaches from outside, through the node's pipe directory.
    let client = attach(bins, &pipe, &log).await;

    // A rollout: the plugin's container goes, a new one comes.
    drop(dra);
    drop(plugin);
    let mut plugin = start_plugin(2);
    let mut dra = dial(&dra_socket, &mut plugin).await;
    assert_eq!(prepare(&mut dra).await, ids, "the same CDI ids");
    let after = lines(&log);
    assert_eq!(
        after.iter().filter(|l| l.starts_with("start ")).count(),
        1,
        "no second daemon: {after:?}"
    );
    assert!(
        !after.iter().any(|l| l == "command quit"),
        "no quit: {after:?}"
    );
    assert!(
        !after.iter().any(|l| l.starts_with("client disconnected")),
        "the client stayed attached: {after:?}"
    );

    drop(client);
    unprepare_one(&mut dra, claim_ref()).await.unwrap();
    let control = pipe.join("control");
    wait_until("the host stops the daemon", || {
        socket::probe(&control) == ControlSocket::Missing
    })
    .await;
    assert!(lines(&log).iter().any(|l| l == "command quit"));
}

/// The isolation probe's child in a container of the plugin's image, which has no shell,
/// `unshare` or `mount`: started as the plugin starts it (`isolation::probe_command` for the
/// MPS claim of a 1 GiB share), it applies the claim's mounts itself (the probe daemon's pipe
/// directory, its shm directory over `/dev/shm`) and runs the probe, which gets as far as CUDA:
/// the container has no `libcuda.so.1` (on a node the driver root provides it).
fn probe_in_the_plugins_container(bins: &Path, root: &Path) {
    let gpu = tessera_driver::node::inventory::Inventory::from_yaml(
        "nodes:\n- name: t4-node\n  mode: shared\n  gpus:\n  - model: t4-16g\n",
    )
    .unwrap()
    .nodes
    .remove(0)
    .gpus
    .remove(0);
    let claim = isolation::probe_claim(NODE, &gpu);
    let rendered = cdi::render(
        &claim,
        &cdi::Enforcement::Mps {
            pipe_dir_root: "/run/tessera/mps/probe".to_owned(),
            log_dir_root: "/var/log/tessera/mps/probe".to_owned(),
        },
    )
    .unwrap();
    let daemon = rendered.mps_daemon.unwrap();
    for dir in [&daemon.pipe_dir, &daemon.shm_dir] {
        std::fs::create_dir_all(under(root, dir)).unwrap();
    }
    let plugin = "/usr/local/bin/tessera-kubelet-plugin";
    let edits = rendered.spec.container_edits.unwrap();
    let command = isolation::probe_command(
        &edits,
        plugin,
        &[isolation::PROBE_SUBCOMMAND.to_owned()],
        &[],
        Some(plugin),
    );
    assert!(
        ["/bin/sh", "/usr/bin/unshare", "/bin/mount"]
            .iter()
            .all(|tool| !under(root, tool).exists())
    );
    let out = Command::new(bins.join("tessera-mps"))
        .arg("exec")
        .arg("--root")
        .arg(root)
        .arg("--")
        .arg(&command.program)
        .args(&command.args)
        .env_clear()
        .envs(command.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains("isolation probe: CUDA is not usable"),
        "{stderr}"
    );
    // The binds stayed in the child's namespace.
    assert_eq!(
        std::fs::read_dir(under(root, "/tmp/nvidia-mps"))
            .unwrap()
            .count(),
        0
    );
    // The node's MPS directories hold the containers' daemons only, as after a real probe.
    std::fs::remove_dir_all(under(root, "/run/tessera/mps/probe")).unwrap();
}

/// Kills, when dropped, every process whose root is inside the test's directory: the
/// containers' processes and the MPS daemons they started, which outlive a killed parent
/// (reparented to init). So a run that fails half-way leaves no daemon behind holding the test's
/// output open.
struct KillContained(PathBuf);

impl Drop for KillContained {
    fn drop(&mut self) {
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return;
        };
        for entry in entries.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|p| p.parse().ok()) else {
                continue;
            };
            if std::fs::read_link(entry.path().join("root")).is_ok_and(|r| r.starts_with(&self.0)) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
    }
}

/// Detaches, when dropped, every mount under the test's directory in this thread's mount
/// namespace (the containers' roots, with the host's `/proc`, `/sys` and `/dev` bound into
/// them), so that removing the directory afterwards deletes only the test's own files, never
/// what a bind shows of the host, and leaves no copy of the binaries behind.
struct UnmountUnder(PathBuf);

impl Drop for UnmountUnder {
    fn drop(&mut self) {
        let mounts = std::fs::read_to_string("/proc/thread-self/mountinfo").unwrap_or_default();
        // The mount point is the fifth field (octal escapes for spaces do not occur under a
        // temporary directory's name); the deepest first, though a detach takes the children
        // along.
        let mut points: Vec<PathBuf> = mounts
            .lines()
            .filter_map(|l| l.split_whitespace().nth(4))
            .map(PathBuf::from)
            .filter(|p| p.starts_with(&self.0))
            .collect();
        points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for point in points {
            let _ = nix::mount::umount2(&point, nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

/// Runs [`on_node`] on a thread of its own in a private mount namespace (mount namespaces are
/// per thread: the test's other threads and the host are untouched).
fn run(driver_root: &'static str) {
    if !may_mount_and_chroot() {
        eprintln!("skipped: needs CAP_SYS_ADMIN and CAP_SYS_CHROOT (containers from mounts)");
        return;
    }
    let Some(bins) = binaries() else {
        eprintln!(
            "skipped: build the binaries first (cargo build -p tessera-kubelet-plugin --bins)"
        );
        return;
    };
    if libraries(&bins.join("tessera-mps")).is_none() {
        eprintln!("skipped: no dynamic loader to list the binaries' libraries");
        return;
    }
    std::thread::spawn(move || {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS).unwrap();
        mount(
            None::<&str>,
            "/",
            None::<&str>,
            MsFlags::MS_REC | MsFlags::MS_PRIVATE,
            None::<&str>,
        )
        .unwrap();
        let work = tempfile::tempdir().unwrap();
        // Dropped before `work`: its removal must not walk into the host's /dev or /sys.
        let _unmount = UnmountUnder(work.path().to_owned());
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(on_node(work.path(), &bins, driver_root));
    })
    .join()
    .unwrap();
}

#[test]
fn with_the_driver_on_the_host_a_rollout_of_the_plugin_leaves_the_daemon_and_its_client() {
    run("/");
}

#[test]
fn with_the_operators_driver_root_a_rollout_of_the_plugin_leaves_the_daemon_and_its_client() {
    run("/run/nvidia/driver");
}
