//! A tenant inside a share container plays its attacks against the real plugin (issue 29):
//! what a container writes through its read-write mounts, processes it renames to bytes that are
//! not UTF-8, cgroups it is put in that name another pod. Everything is real where the machine
//! allows it: the plugin binary on its sockets and files, the CDI spec's binds applied in real
//! mount namespaces the way a runtime applies them (`mount --bind`, which follows a link in
//! the source as runc does), real processes in real cgroups, real `/proc`, real pidfd kills,
//! and NVML a fake `libnvidia-ml.so.1` (built from `support/fake_nvml.c`) listing real pids.
//!
//! Each test states the rule it guards; a test that needs what the machine lacks (a mount
//! namespace needs `CAP_SYS_ADMIN`, cgroups must be writable, the fake NVML needs a C compiler)
//! says so on stderr and passes without playing its attack. The MPS attacks join this file.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fmt::Write as _;
use std::io::{Read as _, Write as _};
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::fs::{PermissionsExt as _, symlink};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1 as res;
use tessera_driver::node::cdi::{CdiSpec, Mount};
use tessera_proto::dra::v1;
use tonic::transport::Channel;

mod support;
use support::{NODE, NodeDir, Plugin, share_claim, stop};

type Dra = v1::dra_plugin_client::DraPluginClient<Channel>;

const POD_A: &str = "a0a0a0a0-1111-4222-8333-444444444444";
const POD_B: &str = "b0b0b0b0-1111-4222-8333-444444444444";
const POD_C: &str = "c0c0c0c0-1111-4222-8333-444444444444";
const POD_D: &str = "d0d0d0d0-1111-4222-8333-444444444444";
const GIB: u64 = 1 << 30;

// ---------------------------------------------------------------------------------------------
// The node

/// Claim `claim-<i>` with UUID-shaped UID `uid`, a 10 GiB share of `gpu-0` reserved for `pods`.
fn share(i: usize, uid: &str, pods: &[&str]) -> res::ResourceClaim {
    let mut claim = share_claim(i, 0, "10Gi");
    claim.metadata.uid = Some(uid.to_owned());
    let status = claim.status.as_mut().unwrap();
    status.reserved_for = Some(
        pods.iter()
            .enumerate()
            .map(|(n, uid)| res::ResourceClaimConsumerReference {
                resource: "pods".to_owned(),
                name: format!("pod-{n}"),
                uid: (*uid).to_owned(),
                ..res::ResourceClaimConsumerReference::default()
            })
            .collect(),
    );
    claim
}

fn claim_ref(i: usize, uid: &str) -> v1::Claim {
    v1::Claim {
        namespace: "default".to_owned(),
        name: format!("claim-{i}"),
        uid: uid.to_owned(),
    }
}

/// A node's directories on a tmpfs where there is one (as `/run` is in production).
struct Node {
    dir: NodeDir,
}

impl Node {
    fn new(claims: &[res::ResourceClaim]) -> Self {
        let dir = tempfile::tempdir_in("/dev/shm")
            .or_else(|_| tempfile::tempdir())
            .unwrap();
        let node = Self {
            dir: NodeDir::new(dir, claims),
        };
        std::fs::write(node.path("libvgpu.so"), b"not a library").unwrap();
        node
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path(name)
    }

    /// The plugin on the fake backend, every GPU shared, HAMi-core; `args` win.
    fn command(&self, args: &[&str]) -> Command {
        let hami = self.path("hami").display().to_string();
        let library = self.path("libvgpu.so").display().to_string();
        let defaults = [
            ("--gpu-mode", "shared"),
            ("--enforcement", "hami-core"),
            ("--hami-cache-dir", hami.as_str()),
            ("--hami-library-path", library.as_str()),
        ];
        self.dir.plugin_command(NODE, &defaults, args)
    }

    async fn start(&self, command: Command) -> (Plugin, Dra) {
        let mut command = command;
        let mut plugin = Plugin(command.spawn().unwrap());
        let socket = self.path("plugin").join("dra.sock");
        let channel = support::dial_until_up(&mut plugin, &socket, Duration::from_mins(1)).await;
        (plugin, Dra::new(channel))
    }

    /// The mounts of claim `uid`'s spec, claim-wide and per device.
    fn mounts(&self, uid: &str) -> Vec<Mount> {
        let file = self
            .path("cdi")
            .join(format!("k8s.gpu.tessera.dev-claim_{uid}.json"));
        let spec: CdiSpec = serde_json::from_slice(&std::fs::read(file).unwrap()).unwrap();
        spec.container_edits
            .iter()
            .chain(spec.devices.iter().map(|d| &d.container_edits))
            .flat_map(|e| e.mounts.clone())
            .collect()
    }
}

async fn prepare(dra: &mut Dra, claim: v1::Claim) -> String {
    let uid = claim.uid.clone();
    let answer = dra
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![claim],
        })
        .await
        .unwrap()
        .into_inner();
    answer.claims[&uid].error.clone()
}

fn read_write(m: &Mount) -> bool {
    !m.options.iter().any(|o| o == "ro")
}

// ---------------------------------------------------------------------------------------------
// What the machine allows

/// Whether this process may make mount namespaces (root with `CAP_SYS_ADMIN`).
fn mount_namespaces() -> bool {
    let ok = Command::new("unshare")
        .args(["-m", "true"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("skipped: no mount namespace here (`unshare -m` needs CAP_SYS_ADMIN)");
    }
    ok
}

/// Where the cgroup hierarchies are mounted: the v2 one, and v1's `name=systemd`.
fn cgroup_mounts() -> (Option<PathBuf>, Option<PathBuf>) {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let (mut v2, mut systemd) = (None, None);
    for line in info.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let point = left.split(' ').nth(4).map(PathBuf::from);
        let mut right = right.split(' ');
        let fstype = right.next().unwrap_or_default();
        let options = right.nth(1).unwrap_or_default();
        if fstype == "cgroup2" && v2.is_none() {
            v2 = point;
        } else if fstype == "cgroup" && options.split(',').any(|o| o == "name=systemd") {
            systemd = point;
        }
    }
    (v2, systemd)
}

/// Cgroups a test made; removed (deepest first) when it ends, after its processes.
struct Cgroups(Vec<PathBuf>);

impl Cgroups {
    /// The cgroup `path` below `root`, made; `None` (with the reason on stderr) when the
    /// hierarchy is not writable here.
    fn make(&mut self, root: &Path, path: &[&OsStr]) -> Option<PathBuf> {
        let mut dir = root.to_owned();
        for segment in path {
            dir.push(segment);
            match std::fs::create_dir(&dir) {
                Ok(()) => self.0.push(dir.clone()),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => {
                    eprintln!("skipped: cannot make cgroup {}: {e}", dir.display());
                    return None;
                }
            }
        }
        Some(dir)
    }

    fn join(cgroup: &Path, pid: u32) {
        std::fs::write(cgroup.join("cgroup.procs"), pid.to_string()).unwrap();
    }
}

impl Drop for Cgroups {
    fn drop(&mut self) {
        for dir in self.0.iter().rev() {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// A pod's cgroup segments as kubelet's cgroupfs driver names them, then the container's.
fn pod_path(pod: &str) -> Vec<String> {
    vec![
        "kubepods".to_owned(),
        "besteffort".to_owned(),
        format!("pod{pod}"),
        "ctr".to_owned(),
    ]
}

fn os(segments: &[String]) -> Vec<&OsStr> {
    segments.iter().map(OsStr::new).collect()
}

/// A process that sleeps until it is killed; with `comm`, it first renames itself to those
/// bytes (a process may rename only itself: the shell's builtin `printf` writes its own
/// `/proc/<pid>/comm`), then waits in the builtin `read`, so it stays one process.
struct Sleeper(Child);

impl Sleeper {
    fn start(comm: Option<&[u8]>) -> Self {
        let script = match comm {
            None => "exec sleep 100000".to_owned(),
            Some(bytes) => {
                let octal = bytes.iter().fold(String::new(), |mut out, b| {
                    let _ = write!(out, "\\{b:03o}");
                    out
                });
                format!("printf '{octal}' > /proc/$$/comm && read line")
            }
        };
        let child = Command::new("sh")
            .args(["-c", &script])
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        let sleeper = Self(child);
        if let Some(bytes) = comm {
            let deadline = Instant::now() + Duration::from_secs(10);
            while std::fs::read(format!("/proc/{}/comm", sleeper.pid()))
                .map_or(true, |c| !c.starts_with(bytes))
            {
                assert!(
                    Instant::now() < deadline,
                    "the process never renamed itself"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        // Start times are clock ticks (10 ms): the next process is younger.
        std::thread::sleep(Duration::from_millis(50));
        sleeper
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }

    fn alive(&mut self) -> bool {
        self.0.try_wait().unwrap().is_none()
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The plugin's metrics, fetched over plain HTTP.
fn metrics(addr: &str) -> String {
    let Ok(mut stream) = std::net::TcpStream::connect(addr) else {
        return String::new();
    };
    let _ = stream.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n");
    let mut text = String::new();
    let _ = stream.read_to_string(&mut text);
    text
}

/// Waits until `done` holds, at most `timeout`; whether it did.
fn wait_for(timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    done()
}

/// The plugin on NVML (the fake library listing `processes`), enforcing nothing, accounting
/// every second and serving metrics at `addr`.
fn nvml_command(node: &Node, library: &Path, processes: &Path, addr: &str) -> Command {
    let library = library.display().to_string();
    let mut command = node.command(&[
        "--gpu-backend",
        "nvml",
        "--nvml-library",
        &library,
        "--enforcement",
        "none",
        "--accept-unverified-isolation",
        "true",
        "--accounting-interval-seconds",
        "1",
        "--metrics-addr",
        addr,
    ]);
    command
        .env("TESSERA_FAKE_NVML_GPUS", "1")
        .env("TESSERA_FAKE_NVML_PROCESSES", processes);
    command
}

/// NVML's process list: `(pid, bytes)` on GPU 0.
fn list(file: &Path, processes: &[(u32, u64)]) {
    let text = processes
        .iter()
        .fold(String::new(), |mut out, (pid, bytes)| {
            let _ = writeln!(out, "0 {pid} {bytes}");
            out
        });
    std::fs::write(file, text).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Host paths

/// The shell script that binds `mounts` under `root` in the mount namespace it runs in, as a
/// runtime does at a container start, then runs `then`.
fn bind_script(root: &Path, mounts: &[Mount], then: &str) -> String {
    let mut script = String::from("set -e\n");
    for m in mounts {
        let target = format!("{}{}", root.display(), m.container_path);
        let source = &m.host_path;
        let _ = write!(
            script,
            "if [ -d '{source}' ]; then mkdir -p '{target}'; else mkdir -p \"$(dirname '{target}')\"; touch '{target}'; fi\n\
             mount --bind '{source}' '{target}'\n"
        );
    }
    script.push_str(then);
    script
}

fn in_mount_namespace(script: &str) -> String {
    let out = Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c", script])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// What a tenant does with every read-write mount of its container: every entry in it becomes
/// a link to `target`, and links to `target` appear under the names the node uses
/// (`vgpulock`, `cache`, `hami`, the claim's own directory's name). A step that fails (its
/// directory went with an earlier step) is skipped, as a tenant would.
fn tenant_links_script(root: &Path, mounts: &[Mount], target: &str, names: &[&str]) -> String {
    let mut script = String::new();
    for m in mounts.iter().filter(|m| read_write(m)) {
        let dir = format!("{}{}", root.display(), m.container_path);
        let _ = writeln!(
            script,
            "for e in '{dir}'/* '{dir}'/.[!.]*; do if [ -e \"$e\" ] || [ -L \"$e\" ]; then rm -rf \"$e\"; ln -s '{target}' \"$e\" || true; fi; done"
        );
        for name in names {
            let _ = writeln!(
                script,
                "[ -e '{dir}/{name}' ] || [ -L '{dir}/{name}' ] || ln -s '{target}' '{dir}/{name}' || true"
            );
        }
    }
    script
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_links_never_redirect_a_bind_at_the_next_container_start() {
    // Rule: no bind source lies inside a directory a container can write, so whatever a tenant
    // puts in its read-write mounts, the next container start binds the claim's own
    // directories, never the host's `/`.
    if !mount_namespaces() {
        return;
    }
    let uid = "5e1f0000-1111-4222-8333-000000000001";
    let node = Node::new(&[share(0, uid, &[POD_A])]);
    let (plugin, mut dra) = node.start(node.command(&[])).await;
    assert_eq!(prepare(&mut dra, claim_ref(0, uid)).await, "");
    let mounts = node.mounts(uid);
    assert!(mounts.iter().any(read_write), "{mounts:?}");

    // The first container: the tenant puts links to `/` wherever it can write.
    let first = tempfile::tempdir().unwrap();
    let attack = tenant_links_script(
        first.path(),
        &mounts,
        "/",
        &["vgpulock", "cache", "hami", uid],
    );
    in_mount_namespace(&bind_script(first.path(), &mounts, &attack));

    // The next container of the pod binds the spec's sources again.
    let next = tempfile::tempdir().unwrap();
    let mut show = String::from("stat -L -c '/ %d:%i' /\n");
    for m in &mounts {
        let _ = writeln!(
            show,
            "stat -L -c '{} %d:%i' '{}{}'",
            m.container_path,
            next.path().display(),
            m.container_path
        );
    }
    let out = in_mount_namespace(&bind_script(next.path(), &mounts, &show));
    let seen: BTreeMap<&str, &str> = out.lines().filter_map(|l| l.split_once(' ')).collect();
    let host_root = seen["/"];
    for m in &mounts {
        assert_ne!(
            seen[m.container_path.as_str()],
            host_root,
            "{} was bound to the host's / (its source {} was redirected)",
            m.container_path,
            m.host_path
        );
        let source = std::fs::symlink_metadata(&m.host_path).unwrap();
        assert!(
            !source.file_type().is_symlink(),
            "the source {} is a link now",
            m.host_path
        );
    }
    stop(plugin);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_a_tenant_left_never_gets_a_directory_opened_up_when_its_record_is_dropped() {
    // Rule: the node's directories are made through handles that never follow a link, and a
    // directory of a dropped record (another boot, a lost checkpoint) is never reused, so a
    // claim prepared again never changes the mode of what a tenant's link points at.
    let uid = "5e1f0000-1111-4222-8333-000000000002";
    for drop_record in ["another boot", "a lost checkpoint"] {
        let node = Node::new(&[share(0, uid, &[POD_A])]);
        let secret = node.path("secret");
        std::fs::create_dir(&secret).unwrap();
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o700)).unwrap();

        let (plugin, mut dra) = node.start(node.command(&[])).await;
        assert_eq!(prepare(&mut dra, claim_ref(0, uid)).await, "");
        // What the claim's containers write at a read-write mount's target lands in its source:
        // the tenant leaves links to the secret directory wherever it can write.
        for m in node.mounts(uid).iter().filter(|m| read_write(m)) {
            let dir = Path::new(&m.host_path);
            if std::fs::symlink_metadata(dir)
                .unwrap()
                .file_type()
                .is_symlink()
            {
                continue; // Replaced through another mount already.
            }
            for entry in std::fs::read_dir(dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() && !path.is_symlink() {
                    std::fs::remove_dir_all(&path).unwrap();
                } else {
                    std::fs::remove_file(&path).unwrap();
                }
                symlink(&secret, &path).unwrap();
            }
            for name in ["vgpulock", "cache", uid] {
                let _ = symlink(&secret, dir.join(name));
            }
        }
        stop(plugin);
        match drop_record {
            "another boot" => std::fs::write(node.path("boot_id"), "boot-2\n").unwrap(),
            _ => std::fs::remove_file(node.path("plugin").join("checkpoint.json")).unwrap(),
        }

        let (plugin, mut dra) = node.start(node.command(&[])).await;
        let error = prepare(&mut dra, claim_ref(0, uid)).await;
        let mode = std::fs::metadata(&secret).unwrap().permissions().mode() & 0o7777;
        assert_eq!(
            mode, 0o700,
            "after {drop_record}, preparing the claim again changed the mode of a directory a \
             tenant's link pointed at (prepare said {error:?})"
        );
        assert_eq!(error, "", "after {drop_record}");
        for m in node.mounts(uid) {
            let meta = std::fs::symlink_metadata(&m.host_path).unwrap();
            assert!(!meta.file_type().is_symlink(), "{} is a link", m.host_path);
        }
        stop(plugin);
    }
}

// ---------------------------------------------------------------------------------------------
// Accounting

/// The fake NVML library, built into `dir`; `None` (said on stderr) without a C compiler.
fn fake_nvml(dir: &Path) -> Option<PathBuf> {
    let out = dir.join("libnvidia-ml.so.1");
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/fake_nvml.c");
    let built = Command::new("cc")
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(&out)
        .arg(&source)
        .status();
    if built.is_ok_and(|s| s.success()) {
        Some(out)
    } else {
        eprintln!("skipped: no C compiler (`cc`) to build the fake NVML library");
        None
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_named_with_bytes_that_are_not_utf8_never_switches_accounting_off() {
    // Rule: /proc is read as bytes, and a process that cannot be read or attributed is left
    // out of that pass only: another claim's processes over its booking are still stopped.
    let (Some(v2), _) = cgroup_mounts() else {
        eprintln!("skipped: no cgroup v2 hierarchy here");
        return;
    };
    let uid = "5e1f0000-1111-4222-8333-000000000003";
    let node = Node::new(&[share(0, uid, &[POD_A])]);
    let Some(library) = fake_nvml(node.path("").as_path()) else {
        return;
    };
    let mut cgroups = Cgroups(Vec::new());
    let Some(pod_a) = cgroups.make(&v2, &os(&pod_path(POD_A))) else {
        return;
    };
    // The odd tenant: pod B's process, renamed to bytes that are not UTF-8, in a sub-cgroup
    // whose name is not UTF-8 either.
    let pod_b = pod_path(POD_B);
    let mut odd_path = os(&pod_b);
    odd_path.push(OsStr::from_bytes(b"\xff\xfe"));
    let Some(odd_cgroup) = cgroups.make(&v2, &odd_path) else {
        return;
    };

    let mut first = Sleeper::start(None);
    let mut second = Sleeper::start(None);
    let mut odd = Sleeper::start(Some(b"\xff\xfe)"));
    Cgroups::join(&pod_a, first.pid());
    Cgroups::join(&pod_a, second.pid());
    Cgroups::join(&odd_cgroup, odd.pid());
    let processes = node.path("processes");
    // Pod A's two workers use 18 GiB of their claim's 10; the odd process 1 GiB of nothing.
    list(
        &processes,
        &[
            (first.pid(), 9 * GIB),
            (second.pid(), 9 * GIB),
            (odd.pid(), GIB),
        ],
    );

    let addr = format!("127.0.0.1:{}", tessera_tests::host::free_port());
    let (plugin, mut dra) = node
        .start(nvml_command(&node, &library, &processes, &addr))
        .await;
    assert_eq!(prepare(&mut dra, claim_ref(0, uid)).await, "");

    let stopped = wait_for(Duration::from_secs(30), || !second.alive());
    assert!(
        stopped,
        "the claim's newest worker over its booking still runs: the odd process switched the \
         accounting off"
    );
    assert!(first.alive(), "the oldest worker fits the booking");
    assert!(
        odd.alive(),
        "the odd process books nothing and is left alone"
    );
    stop(plugin);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_whose_cgroups_name_two_pods_is_never_counted_against_either() {
    // Rule: a process belongs to a pod only when every cgroup line that names a pod names the
    // same one; pod D's process whose v1 `name=systemd` group names pod C is not C's, so C's
    // process is never killed for D's memory.
    let (Some(v2), Some(systemd)) = cgroup_mounts() else {
        eprintln!("skipped: this machine has no cgroup v1 `name=systemd` hierarchy beside v2");
        return;
    };
    let uid = "5e1f0000-1111-4222-8333-000000000004";
    let node = Node::new(&[share(0, uid, &[POD_C])]);
    let Some(library) = fake_nvml(node.path("").as_path()) else {
        return;
    };
    let mut cgroups = Cgroups(Vec::new());
    let (Some(a_v2), Some(a_v1), Some(b_v2)) = (
        cgroups.make(&v2, &os(&pod_path(POD_C))),
        cgroups.make(&systemd, &os(&pod_path(POD_C))),
        cgroups.make(&v2, &os(&pod_path(POD_D))),
    ) else {
        return;
    };
    // D's process started first; C's own process after it.
    let mut b = Sleeper::start(None);
    let mut a = Sleeper::start(None);
    Cgroups::join(&b_v2, b.pid());
    Cgroups::join(&a_v1, b.pid());
    Cgroups::join(&a_v2, a.pid());
    Cgroups::join(&a_v1, a.pid());
    let processes = node.path("processes");
    list(&processes, &[(b.pid(), 6 * GIB), (a.pid(), 6 * GIB)]);

    let addr = format!("127.0.0.1:{}", tessera_tests::host::free_port());
    let (plugin, mut dra) = node
        .start(nvml_command(&node, &library, &processes, &addr))
        .await;
    assert_eq!(prepare(&mut dra, claim_ref(0, uid)).await, "");

    // Several passes (one a second).
    let skipped =
        "tessera_kubelet_plugin_accounting_skipped_processes_total{reason=\"pods_disagree\"}";
    let counted = wait_for(Duration::from_secs(20), || {
        metrics(&addr)
            .lines()
            .find_map(|l| l.strip_prefix(skipped))
            .and_then(|n| n.trim().parse::<u64>().ok())
            .is_some_and(|n| n >= 3)
    });
    assert!(a.alive(), "pod C's process was killed for pod D's memory");
    assert!(b.alive(), "pod D's process books nothing and is left alone");
    assert!(
        counted,
        "the process of two pods is not counted as skipped:\n{}",
        metrics(&addr)
    );
    stop(plugin);
}
