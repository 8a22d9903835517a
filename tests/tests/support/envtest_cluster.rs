//! Starting a real kube-apiserver and etcd (and kube-scheduler when present) on loopback from
//! the binaries in `KUBEBUILDER_ASSETS`, for the envtest-style runs of the kubelet plugin and
//! the controller. Nothing is ever downloaded.
#![allow(dead_code, reason = "each test file uses a subset")]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tessera_tests::host::free_port;

const TOKEN: &str = "tessera-envtest-token";

/// Children killed when dropped, so a failed assertion leaves no server behind.
pub(crate) struct Processes(pub(crate) Vec<Child>);

impl Drop for Processes {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

pub(crate) fn assets() -> Result<PathBuf, String> {
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
pub(crate) fn server_version(bin: &Path) -> (u32, u32) {
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

pub(crate) struct Cluster {
    pub(crate) processes: Processes,
    pub(crate) dir: tempfile::TempDir,
    pub(crate) kubeconfig: PathBuf,
    pub(crate) minor: u32,
}

/// A real cluster started from `KUBEBUILDER_ASSETS`, with a client and the resource.k8s.io
/// version it serves.
pub(crate) struct Connected {
    pub(crate) assets: PathBuf,
    pub(crate) cluster: Cluster,
    pub(crate) client: kube::Client,
    pub(crate) version: tessera_driver::apiversion::ApiVersion,
}

/// Starts a real cluster for `test` and connects to it, or says why `test` is skipped (no
/// binaries at hand) and answers `None`.
pub(crate) async fn connect(test: &str) -> Option<Connected> {
    let assets = match assets() {
        Ok(a) => a,
        Err(why) => {
            eprintln!(
                "SKIPPED {test}: {why}; point KUBEBUILDER_ASSETS at a directory with etcd and \
                 kube-apiserver (1.32 or later) to run it"
            );
            return None;
        }
    };
    Some(start_connected(assets).await)
}

/// Runs `scenario` with a client of a real cluster started for `test` and the resource.k8s.io
/// version it serves (the cluster stays up until the scenario ends), or says why `test` is
/// skipped.
pub(crate) async fn run<F, Fut>(test: &str, scenario: F)
where
    F: FnOnce(kube::Client, tessera_driver::apiversion::ApiVersion) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let Some(Connected {
        cluster: _cluster,
        client,
        version,
        ..
    }) = connect(test).await
    else {
        return;
    };
    scenario(client, version).await;
}

/// Starts a real cluster from the binaries in `assets` and connects to it.
pub(crate) async fn start_connected(assets: PathBuf) -> Connected {
    let cluster = start_cluster(&assets).await;
    let client = tessera_kubeapi::client(Some(&cluster.kubeconfig))
        .await
        .unwrap();
    let version = tessera_kubeapi::served_resource_version(&client)
        .await
        .unwrap();
    Connected {
        assets,
        cluster,
        client,
        version,
    }
}

#[allow(
    clippy::too_many_lines,
    reason = "the start-up sequence reads best in order"
)]
pub(crate) async fn start_cluster(assets: &Path) -> Cluster {
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
        // TaintNodesByCondition gives every new Node the `node.kubernetes.io/not-ready`
        // NoSchedule taint, which only kube-controller-manager's node lifecycle controller
        // removes once the Node is Ready. The suite runs no controller-manager and creates its
        // Ready Nodes itself, so with the plugin on every Node would stay tainted and nothing
        // could be placed (the controller rightly honours the taint).
        .args([
            "--disable-admission-plugins",
            "ServiceAccount,TaintNodesByCondition",
        ])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(path("kube-apiserver.log")).unwrap());
    // TESSERA_ENVTEST_AUDIT_LOG=path: every write request (verb, resource, user agent) logged
    // to `path-<port>`, for counting what each component writes per pod.
    if let Some(log) = std::env::var_os("TESSERA_ENVTEST_AUDIT_LOG") {
        std::fs::write(
            path("audit-policy.yaml"),
            "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n\
             - level: Metadata\n  verbs: [create, update, patch, delete]\n- level: None\n",
        )
        .unwrap();
        command
            .arg(format!(
                "--audit-policy-file={}",
                path("audit-policy.yaml").display()
            ))
            .arg(format!("--audit-log-path={}-{port}", log.to_string_lossy()));
    }
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

    let client = tessera_kubeapi::client(Some(&kubeconfig)).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        // Ready for the scenarios: DRA discovered and the default namespace created.
        let namespace = kube::Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
            .get("default")
            .await;
        let served = tessera_kubeapi::served_resource_version(&client).await;
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
        processes,
        dir,
        kubeconfig,
        minor,
    }
}

impl Cluster {
    /// Starts kube-scheduler from `assets` against this cluster, if the binary is there;
    /// returns whether it runs.
    pub(crate) fn start_scheduler(&mut self, assets: &Path) -> bool {
        let bin = assets.join("kube-scheduler");
        if !bin.is_file() {
            return false;
        }
        let log = std::fs::File::create(self.dir.path().join("kube-scheduler.log")).unwrap();
        let mut command = Command::new(bin);
        command
            .args(["--kubeconfig", self.kubeconfig.to_str().unwrap()])
            .args([
                "--authentication-kubeconfig",
                self.kubeconfig.to_str().unwrap(),
            ])
            .args([
                "--authorization-kubeconfig",
                self.kubeconfig.to_str().unwrap(),
            ])
            .args(["--leader-elect=false"])
            .args(["--bind-address", "127.0.0.1"])
            .args(["--secure-port", &free_port().to_string()])
            .stdout(Stdio::null())
            .stderr(log);
        if self.minor < 34 {
            command.arg("--feature-gates=DynamicResourceAllocation=true");
        }
        self.processes.0.push(command.spawn().unwrap());
        true
    }
}
