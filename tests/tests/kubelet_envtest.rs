//! The kubelet plugin's API-server scenarios against a real kube-apiserver and etcd, started
//! on loopback from the binaries in `KUBEBUILDER_ASSETS` (as controller-runtime's envtest lays
//! them out: `etcd` and `kube-apiserver` side by side). Without them the test says why it
//! skips and passes; nothing is ever downloaded.
//!
//! Needs `openssl` on the PATH for the service-account key kube-apiserver insists on.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

#[path = "support/apiserver_scenarios.rs"]
mod scenarios;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tessera_kubelet_plugin::apiserver;

const TOKEN: &str = "tessera-envtest-token";

fn free_port() -> u16 {
    std::net::TcpListener::bind(("127.0.0.1", 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Children killed when dropped, so a failed assertion leaves no server behind.
struct Processes(Vec<Child>);

impl Drop for Processes {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn assets() -> Result<PathBuf, String> {
    let dir = std::env::var_os("KUBEBUILDER_ASSETS").ok_or("KUBEBUILDER_ASSETS is not set")?;
    let dir = PathBuf::from(dir);
    for binary in ["etcd", "kube-apiserver"] {
        if !dir.join(binary).is_file() {
            return Err(format!("{} has no {binary}", dir.display()));
        }
    }
    let openssl = Command::new("openssl").arg("version").output();
    if !openssl.is_ok_and(|o| o.status.success()) {
        return Err("openssl is not on the PATH".to_owned());
    }
    Ok(dir)
}

/// `(major, minor)` of the kube-apiserver binary.
fn server_version(bin: &Path) -> (u32, u32) {
    let out = Command::new(bin).arg("--version").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    // "Kubernetes v1.34.1"
    let version = text
        .split_whitespace()
        .find_map(|w| w.strip_prefix('v'))
        .expect("kube-apiserver --version prints a version");
    let mut parts = version.split('.');
    let major = parts.next().unwrap().parse().unwrap();
    let minor = parts
        .next()
        .unwrap()
        .trim_end_matches(|c: char| !c.is_ascii_digit())
        .parse()
        .unwrap();
    (major, minor)
}

struct Cluster {
    _processes: Processes,
    _dir: tempfile::TempDir,
    kubeconfig: PathBuf,
}

#[allow(
    clippy::too_many_lines,
    reason = "the start-up sequence reads best in order"
)]
async fn start_cluster(assets: &Path) -> Cluster {
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name);
    let etcd_port = free_port();
    let etcd_url = format!("http://127.0.0.1:{etcd_port}");
    let etcd = Command::new(assets.join("etcd"))
        .args(["--data-dir", path("etcd").to_str().unwrap()])
        .args(["--listen-client-urls", &etcd_url])
        .args(["--advertise-client-urls", &etcd_url])
        .args([
            "--listen-peer-urls",
            &format!("http://127.0.0.1:{}", free_port()),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut processes = Processes(vec![etcd]);

    let status = Command::new("openssl")
        .args(["genrsa", "-out", path("sa.key").to_str().unwrap(), "2048"])
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "openssl genrsa failed");
    std::fs::write(
        path("tokens.csv"),
        format!("{TOKEN},admin,admin,system:masters\n"),
    )
    .unwrap();

    let apiserver_bin = assets.join("kube-apiserver");
    let (_, minor) = server_version(&apiserver_bin);
    let port = free_port();
    let mut command = Command::new(&apiserver_bin);
    command
        .args(["--etcd-servers", &etcd_url])
        .args(["--bind-address", "127.0.0.1"])
        .args(["--advertise-address", "127.0.0.1"])
        .args(["--secure-port", &port.to_string()])
        .args(["--cert-dir", path("certs").to_str().unwrap()])
        .args(["--token-auth-file", path("tokens.csv").to_str().unwrap()])
        .args(["--authorization-mode", "AlwaysAllow"])
        .args(["--service-cluster-ip-range", "10.0.0.0/24"])
        .args(["--service-account-issuer", "https://localhost"])
        .args([
            "--service-account-key-file",
            path("sa.key").to_str().unwrap(),
        ])
        .args([
            "--service-account-signing-key-file",
            path("sa.key").to_str().unwrap(),
        ])
        .args(["--disable-admission-plugins", "ServiceAccount"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(path("kube-apiserver.log")).unwrap());
    // Before 1.34 DRA is beta: off unless asked for.
    match minor {
        32 => {
            command
                .arg("--feature-gates=DynamicResourceAllocation=true")
                .arg("--runtime-config=resource.k8s.io/v1beta1=true");
        }
        33 => {
            command
                .arg("--feature-gates=DynamicResourceAllocation=true")
                .arg("--runtime-config=resource.k8s.io/v1beta1=true,resource.k8s.io/v1beta2=true");
        }
        _ => {}
    }
    processes.0.push(command.spawn().unwrap());

    let kubeconfig = path("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: envtest\n  cluster:\n    \
             server: https://127.0.0.1:{port}\n    insecure-skip-tls-verify: true\n\
             contexts:\n- name: envtest\n  context:\n    cluster: envtest\n    user: admin\n\
             current-context: envtest\nusers:\n- name: admin\n  user:\n    token: {TOKEN}\n"
        ),
    )
    .unwrap();

    let client = apiserver::client(Some(&kubeconfig)).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        // Ready for the scenarios: DRA discovered and the default namespace created.
        let namespace = kube::Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
            .get("default")
            .await;
        let served = apiserver::served_resource_version(&client).await;
        if namespace.is_ok() && served.is_ok() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "kube-apiserver not ready after 90 s; see {}",
            path("kube-apiserver.log").display()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Cluster {
        _processes: processes,
        _dir: dir,
        kubeconfig,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_and_prepare_against_a_real_api_server() {
    let assets = match assets() {
        Ok(a) => a,
        Err(why) => {
            eprintln!(
                "SKIPPED kubelet_envtest: {why}; point KUBEBUILDER_ASSETS at a directory with \
                 etcd and kube-apiserver (1.32 or later) to run it"
            );
            return;
        }
    };
    let cluster = start_cluster(&assets).await;
    let client = apiserver::client(Some(&cluster.kubeconfig)).await.unwrap();
    let version = apiserver::served_resource_version(&client).await.unwrap();
    scenarios::publish_and_check_shape(&client, version).await;
    scenarios::republish_after_inventory_change(&client, version).await;
    let work = tempfile::tempdir().unwrap();
    scenarios::prepare_through_kubelet(&client, version, work.path()).await;
}
