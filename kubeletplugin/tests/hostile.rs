//! The binary against a tenant and a client that mean harm (issue 23): a 20,000-deep tree in a
//! claim's HAMi-core directory, input files that are devices or too large, claim names that
//! would forge log lines, a UID unprepared under another name, a prepare that fails half-way,
//! a record of another boot, calls of 10,000 claims (with small calls and `GetInfo` beside
//! them, and one given up), and an answer that would pass 4 MiB. Everything goes through the
//! real sockets, files and process, as in the other suites.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::io::Read as _;
use std::os::unix::fs::PermissionsExt as _;
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1 as res;
use tessera_driver::node::checkpoint::{Checkpoint, PrepareState};
use tessera_kubelet_plugin::claims::crash;
use tessera_proto::dra::v1;
use tessera_proto::pluginregistration::v1 as reg;
use tessera_tests::trees::deep_tree;
use tonic::transport::Channel;

mod support;
use support::{BOOT, DRIVER, NODE, NodeDir, Plugin, claim, claim_ref, share_claim, stop};

type Dra = v1::dra_plugin_client::DraPluginClient<Channel>;

/// A plugin that enforces nothing: `none` is never verified, so it offers shares only when it
/// accepts unverified isolation explicitly.
const NO_ENFORCEMENT: &[&str] = &[
    "--enforcement",
    "none",
    "--accept-unverified-isolation",
    "true",
];

/// A node's directories, on a tmpfs where there is one (as `/run` and the CDI directory are in
/// production; on a disk mounted with `discard` every `rmdir` waits for a TRIM).
struct Node {
    dir: NodeDir,
}

impl Node {
    fn new(claims: &[res::ResourceClaim]) -> Self {
        let dir = tempfile::tempdir_in("/dev/shm")
            .or_else(|_| tempfile::tempdir())
            .unwrap();
        Self {
            dir: NodeDir::new(dir, claims),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path(name)
    }

    /// The plugin's command: fake inventory and claims, every GPU shared, HAMi-core; a flag
    /// in `args` replaces the same flag's default.
    fn command(&self, args: &[&str]) -> Command {
        let hami = self.path("hami").display().to_string();
        let defaults = [
            ("--gpu-mode", "shared"),
            ("--enforcement", "hami-core"),
            ("--hami-cache-dir", hami.as_str()),
        ];
        self.dir.plugin_command(NODE, &defaults, args)
    }

    fn spawn(&self, args: &[&str]) -> Plugin {
        Plugin(self.command(args).spawn().unwrap())
    }

    async fn dial(&self, child: &mut Plugin, socket: &Path) -> Channel {
        support::dial_until_up(child, socket, Duration::from_secs(30)).await
    }

    async fn dra(&self, child: &mut Plugin) -> Dra {
        let socket = self.path("plugin").join("dra.sock");
        Dra::new(self.dial(child, &socket).await).max_decoding_message_size(4 << 20)
    }

    async fn registration(
        &self,
        child: &mut Plugin,
    ) -> reg::registration_client::RegistrationClient<Channel> {
        let socket = self.path("registry").join(format!("{DRIVER}-reg.sock"));
        reg::registration_client::RegistrationClient::new(self.dial(child, &socket).await)
    }

    fn checkpoint(&self) -> Checkpoint {
        self.dir.checkpoint()
    }

    fn spec(&self, i: usize) -> PathBuf {
        self.path("cdi")
            .join(format!("k8s.gpu.tessera.dev-claim_uid-{i}.json"))
    }

    fn specs(&self) -> usize {
        std::fs::read_dir(self.path("cdi")).map_or(0, |d| {
            d.filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .starts_with("k8s.gpu.tessera.dev-claim_")
            })
            .count()
        })
    }

    /// Waits until the plugin's background removal emptied the reap directory.
    async fn reaped(&self) {
        let reap = self.path("hami").join(".tessera-reap");
        let deadline = Instant::now() + Duration::from_mins(2);
        while std::fs::read_dir(&reap).is_ok_and(|mut d| d.next().is_some()) {
            assert!(Instant::now() < deadline, "the tree was not removed");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

async fn prepare(dra: &mut Dra, claims: Vec<v1::Claim>) -> v1::NodePrepareResourcesResponse {
    dra.node_prepare_resources(v1::NodePrepareResourcesRequest { claims })
        .await
        .unwrap()
        .into_inner()
}

async fn unprepare(dra: &mut Dra, claims: Vec<v1::Claim>) -> v1::NodeUnprepareResourcesResponse {
    dra.node_unprepare_resources(v1::NodeUnprepareResourcesRequest { claims })
        .await
        .unwrap()
        .into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_20000_deep_tree_in_a_hami_dir_neither_aborts_the_plugin_nor_fails_its_restart() {
    let node = Node::new(&[share_claim(0, 0, "10Gi")]);
    let hami = node.path("hami").join("uid-0");

    // Unprepare with the tree there: answered, the plugin lives on, the tree goes.
    let mut child = node.spawn(&[]);
    let mut dra = node.dra(&mut child).await;
    let answer = prepare(&mut dra, vec![claim_ref(0)]).await;
    assert!(answer.claims["uid-0"].error.is_empty(), "{answer:?}");
    // A non-root container's HAMi-core must be able to write its accounting there; the
    // claim's own directory that holds both is the node's.
    for dir in [hami.join("cache"), hami.join("vgpulock")] {
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode();
        assert_eq!(mode & 0o7777, 0o1777, "{}", dir.display());
    }
    let mode = std::fs::metadata(&hami).unwrap().permissions().mode();
    assert_eq!(mode & 0o7777, 0o755);
    // What the claim's containers write: its accounting directory.
    deep_tree(&hami.join("cache"), 20_000).unwrap();
    let answer = unprepare(&mut dra, vec![claim_ref(0)]).await;
    assert!(answer.claims["uid-0"].error.is_empty(), "{answer:?}");
    assert!(child.0.try_wait().unwrap().is_none(), "the plugin died");
    assert!(!hami.exists());
    node.reaped().await;
    assert!(node.checkpoint().get("uid-0").is_none());

    // The same with a crash after "unprepare started": the start-up cleanup meets the tree.
    let answer = prepare(&mut dra, vec![claim_ref(0)]).await;
    assert!(answer.claims["uid-0"].error.is_empty(), "{answer:?}");
    deep_tree(&hami.join("cache"), 20_000).unwrap();
    stop(child);
    let mut crashing = node.command(&[]);
    crashing.env(
        crash::CRASH_AT_ENV,
        crash::UNPREPARE_AFTER_CHECKPOINT_STARTED,
    );
    let mut child = Plugin(crashing.spawn().unwrap());
    let mut dra = node.dra(&mut child).await;
    let answered = dra
        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
            claims: vec![claim_ref(0)],
        })
        .await;
    assert!(answered.is_err());
    let status = child.0.wait().unwrap();
    assert_eq!(status.signal(), Some(6), "{status}");
    assert_eq!(
        node.checkpoint().get("uid-0").map(|e| e.state),
        Some(PrepareState::UnprepareStarted)
    );
    let mut child = node.spawn(&[]);
    let mut dra = node.dra(&mut child).await;
    node.reaped().await;
    assert!(!hami.exists());
    assert!(node.checkpoint().get("uid-0").is_none());
    assert!(!node.spec(0).exists());
    let answer = unprepare(&mut dra, vec![claim_ref(0)]).await;
    assert!(answer.claims["uid-0"].error.is_empty(), "{answer:?}");
    stop(child);
}

/// Runs the plugin until it exits (at most 60 s): its status and standard error.
fn run_to_exit(mut command: Command) -> (std::process::ExitStatus, String) {
    let mut child = command.stderr(Stdio::piped()).spawn().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let deadline = Instant::now() + Duration::from_mins(1);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the plugin did not stop");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (status, reader.join().unwrap())
}

#[test]
fn input_files_that_are_devices_or_too_large_stop_the_start_with_a_clear_error() {
    for flag in [
        "--boot-id-file",
        "--fake-claims",
        "--fake-inventory",
        "checkpoint",
    ] {
        let node = Node::new(&[claim(0)]);
        let zero = node.path("zero");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        let zero_arg = zero.display().to_string();
        let command = if flag == "checkpoint" {
            std::fs::create_dir_all(node.path("plugin")).unwrap();
            std::os::unix::fs::symlink("/dev/zero", node.path("plugin").join("checkpoint.json"))
                .unwrap();
            node.command(&[])
        } else {
            node.command(&[flag, &zero_arg])
        };
        let (status, stderr) = run_to_exit(command);
        assert!(!status.success(), "{flag}: {status}");
        assert!(
            stderr.contains("must be a regular file, and this is a device"),
            "{flag}: {stderr}"
        );
    }
    let node = Node::new(&[claim(0)]);
    let big = node.path("big.yaml");
    std::fs::File::create(&big)
        .unwrap()
        .set_len((64 << 20) + 1)
        .unwrap();
    let (status, stderr) = run_to_exit(node.command(&["--fake-claims", big.to_str().unwrap()]));
    assert!(!status.success());
    assert!(stderr.contains("larger than 64 MiB"), "{stderr}");
    assert!(stderr.contains(&big.display().to_string()), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_name_cannot_forge_a_plain_log_line() {
    let node = Node::new(&[claim(0)]);
    let mut command = node.command(&["--log-format", "plain"]);
    command.env("RUST_LOG", "info").stderr(Stdio::piped());
    let mut child = Plugin(command.spawn().unwrap());
    let mut stderr = child.0.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let mut dra = node.dra(&mut child).await;
    let forged = v1::Claim {
        namespace: "default".to_owned(),
        name: "x\n2026-11-27T00:00:00.000000Z  INFO FORGED: prepared\u{0}".to_owned(),
        uid: "uid-x\nFORGED-UID".to_owned(),
    };
    let answer = prepare(&mut dra, vec![forged]).await;
    assert_eq!(answer.claims.len(), 1);
    stop(child);
    let text = reader.join().unwrap();
    assert!(text.contains("claim failed"), "{text}");
    for line in text.lines() {
        assert!(
            !line.contains("FORGED") || line.contains("claim failed"),
            "forged: {line:?}"
        );
        assert!(!line.contains('\0'), "{line:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unprepare_refuses_a_uid_prepared_for_another_claim() {
    let node = Node::new(&[claim(0)]);
    let mut child = node.spawn(&[]);
    let mut dra = node.dra(&mut child).await;
    let answer = prepare(&mut dra, vec![claim_ref(0)]).await;
    assert!(answer.claims["uid-0"].error.is_empty(), "{answer:?}");
    let mut other = claim_ref(0);
    other.name = "someone-else".to_owned();
    let answer = unprepare(&mut dra, vec![other]).await;
    let error = &answer.claims["uid-0"].error;
    assert!(
        error.contains("is prepared for default/claim-0, not default/someone-else"),
        "{error}"
    );
    assert!(node.spec(0).exists());
    assert_eq!(
        node.checkpoint().get("uid-0").map(|e| e.state),
        Some(PrepareState::PrepareCompleted)
    );
    stop(child);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_prepare_and_a_record_of_another_boot_leave_no_cdi_spec() {
    // The MPS daemon cannot start: the claim's error, and nothing of it stays behind.
    let node = Node::new(&[share_claim(0, 0, "10Gi"), claim(1)]);
    let missing = node.path("no-such-mps-control");
    let mut child = node.spawn(&[
        "--enforcement",
        "mps",
        "--mps-shm-namespace=false",
        "--mps-control-binary",
        missing.to_str().unwrap(),
        "--mps-pipe-dir-root",
        node.path("mps").to_str().unwrap(),
        "--mps-log-dir-root",
        node.path("mps-log").to_str().unwrap(),
    ]);
    let mut dra = node.dra(&mut child).await;
    let answer = prepare(&mut dra, vec![claim_ref(0), claim_ref(1)]).await;
    assert!(!answer.claims["uid-0"].error.is_empty(), "{answer:?}");
    assert!(answer.claims["uid-1"].error.is_empty(), "{answer:?}");
    assert!(!node.spec(0).exists(), "the failed claim's spec stayed");
    assert!(node.checkpoint().get("uid-0").is_none());
    assert!(node.spec(1).exists());
    stop(child);

    // Another boot: the record is dropped, and so is every spec it held.
    std::fs::write(node.path("boot_id"), "boot-2\n").unwrap();
    let mut child = node.spawn(NO_ENFORCEMENT);
    let _dra = node.dra(&mut child).await;
    assert!(!node.spec(1).exists(), "another boot's spec stayed");
    stop(child);
}

/// The claims of the big calls: 1Gi shares spread over GPUs 0..7 (GPU 7 is left to the small
/// call); `TESSERA_BIG_CALL_CLAIMS` changes how many (for measuring).
fn big_call() -> (Vec<res::ResourceClaim>, Vec<v1::Claim>) {
    let n: usize = std::env::var("TESSERA_BIG_CALL_CLAIMS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let mut claims: Vec<res::ResourceClaim> =
        (0..n).map(|i| share_claim(i, i % 7, "1Gi")).collect();
    claims.push(share_claim(n, 7, "1Gi"));
    (claims, (0..n).map(claim_ref).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_call_of_10000_claims_is_prepared_while_small_calls_answer_beside_it() {
    let (claims, refs) = big_call();
    let n = refs.len();
    let node = Node::new(&claims);
    let mut child = node.spawn(NO_ENFORCEMENT);
    let mut dra = node.dra(&mut child).await;
    let mut registration = node.registration(&mut child).await;

    let started = Instant::now();
    let mut big_dra = dra.clone();
    let big_refs = refs.clone();
    let big = tokio::spawn(async move {
        let answer = prepare(&mut big_dra, big_refs).await;
        (answer, started.elapsed())
    });
    // The big call is under way once its claims are recorded as started.
    let deadline = Instant::now() + Duration::from_mins(4);
    while node.checkpoint().claims.is_empty() && !big.is_finished() {
        assert!(Instant::now() < deadline, "the big call never started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let t = Instant::now();
    let info = registration.get_info(reg::InfoRequest {}).await.unwrap();
    let get_info = t.elapsed();
    assert_eq!(info.into_inner().name, DRIVER);
    let t = Instant::now();
    let small = prepare(&mut dra, vec![claim_ref(n)]).await;
    let one_claim = t.elapsed();
    assert!(
        small.claims[&format!("uid-{n}")].error.is_empty(),
        "{small:?}"
    );
    let (answer, took) = big.await.unwrap();
    eprintln!(
        "one call of {n} claims: {took:?}; beside it GetInfo {get_info:?}, a one-claim prepare {one_claim:?}"
    );
    assert_eq!(answer.claims.len(), n);
    assert!(answer.claims.values().all(|c| c.error.is_empty()));
    assert_eq!(node.specs(), n + 1);

    let t = Instant::now();
    let answer = unprepare(&mut dra, refs).await;
    eprintln!("unpreparing them in one call: {:?}", t.elapsed());
    assert!(answer.claims.values().all(|c| c.error.is_empty()));
    assert_eq!(node.specs(), 1);
    stop(child);
}

/// A claim source whose one claim answers only once the test opens the gate: a call that
/// holds it cannot finish, whatever the machine's speed.
struct Gated {
    inner: tessera_kubelet_plugin::claims::FakeClaimSource,
    held: String,
    open: tokio::sync::watch::Receiver<bool>,
}

#[tonic::async_trait]
impl tessera_kubelet_plugin::claims::ClaimSource for Gated {
    async fn claim(
        &self,
        claim: &tessera_kubelet_plugin::claims::ClaimRef,
    ) -> tessera_kubelet_plugin::Result<res::ResourceClaim> {
        if claim.uid == self.held {
            let mut open = self.open.clone();
            let _ = open.wait_for(|open| *open).await;
        }
        self.inner.get(claim)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_info_and_a_one_claim_call_do_not_wait_for_a_big_call() {
    use tessera_driver::node::inventory::{GpuMode, Inventory};
    use tessera_kubelet_plugin::claims::FakeClaimSource;
    use tessera_kubelet_plugin::claims::preparer::{CdiPreparer, CdiPreparerConfig};
    use tessera_kubelet_plugin::kubelet::server::{self, PluginConfig};

    let (claims, refs) = big_call();
    let n = refs.len();
    let node = Node::new(&[]);
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/inventory/demo-cluster.yaml"),
    )
    .unwrap();
    let mut inventory = Inventory::from_yaml(&text)
        .unwrap()
        .node(NODE)
        .cloned()
        .unwrap();
    for gpu in &mut inventory.gpus {
        gpu.mode = GpuMode::Shared;
    }
    let mut inner = FakeClaimSource::new();
    for c in claims {
        inner.insert(c);
    }
    let (gate, open) = tokio::sync::watch::channel(false);
    let source = Gated {
        inner,
        held: format!("uid-{}", n - 1),
        open,
    };
    let preparer = CdiPreparer::new(
        CdiPreparerConfig {
            driver_name: DRIVER.to_owned(),
            cdi_dir: node.path("cdi"),
            state_dir: node.path("state"),
            enforcement: tessera_driver::node::cdi::Enforcement::None,
            boot_id: BOOT.to_owned(),
        },
        inventory,
        std::sync::Arc::new(source),
    )
    .unwrap();
    let plugin = server::start(
        PluginConfig {
            driver_name: DRIVER.to_owned(),
            registration_dir: node.path("registry"),
            plugin_dir: node.path("plugin"),
        },
        std::sync::Arc::new(preparer),
    )
    .unwrap();
    let mut dra = Dra::new(support::dial(&plugin.config().dra_socket()).await.unwrap());
    let mut registration = reg::registration_client::RegistrationClient::new(
        support::dial(&plugin.config().registration_socket())
            .await
            .unwrap(),
    );
    let mut big_dra = dra.clone();
    let big = tokio::spawn(async move { prepare(&mut big_dra, refs).await });
    // The big call cannot end before the gate opens; the small calls must end before that.
    let bound = Duration::from_mins(2);
    let info = tokio::time::timeout(bound, registration.get_info(reg::InfoRequest {}))
        .await
        .expect("GetInfo waited for the big call")
        .unwrap();
    assert_eq!(info.into_inner().name, DRIVER);
    let small = tokio::time::timeout(bound, prepare(&mut dra, vec![claim_ref(n)]))
        .await
        .expect("the one-claim call waited for the big call");
    assert!(
        small.claims[&format!("uid-{n}")].error.is_empty(),
        "{small:?}"
    );
    assert!(!big.is_finished());
    gate.send_replace(true);
    let answer = big.await.unwrap();
    assert_eq!(answer.claims.len(), n);
    assert!(answer.claims.values().all(|c| c.error.is_empty()));
    plugin.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_kubelet_gives_up_on_stops_its_work() {
    let (claims, refs) = big_call();
    let n = refs.len();
    let node = Node::new(&claims);
    let mut child = node.spawn(NO_ENFORCEMENT);
    let mut dra = node.dra(&mut child).await;
    let mut request = tonic::Request::new(v1::NodePrepareResourcesRequest {
        claims: refs.clone(),
    });
    request.set_timeout(Duration::from_millis(300));
    let given_up = dra.node_prepare_resources(request).await;
    assert!(given_up.is_err(), "the call was answered in time");
    // Settled: no claim half done, a spec per prepared claim, and no change for a while.
    let deadline = Instant::now() + Duration::from_mins(4);
    let mut last = None;
    let prepared = loop {
        let record = node.checkpoint();
        let started = record
            .claims
            .values()
            .filter(|e| e.state != PrepareState::PrepareCompleted)
            .count();
        let done = record.claims.len() - started;
        let now = (done, node.specs());
        if started == 0 && now.0 == now.1 && last == Some(now) {
            break done;
        }
        last = Some(now);
        assert!(Instant::now() < deadline, "the plugin never settled");
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    eprintln!("{prepared} of {n} claims prepared by the call given up");
    assert!(prepared < n, "the work went on after the call was given up");
    // Kubelet's retry prepares them all.
    let answer = prepare(&mut dra, refs).await;
    assert!(answer.claims.values().all(|c| c.error.is_empty()));
    assert_eq!(node.specs(), n);
    stop(child);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_that_would_pass_4_mib_is_cut_to_fit() {
    // Claims that do not exist, with the longest names: each error repeats the name, so the
    // answer is larger than the request, which is just under the 4 MiB limit.
    let node = Node::new(&[claim(0)]);
    let mut child = node.spawn(NO_ENFORCEMENT);
    let mut dra = node.dra(&mut child).await;
    let namespace = "n".repeat(63);
    let mut claims = Vec::new();
    let mut size = 0;
    loop {
        let i = claims.len();
        let c = v1::Claim {
            namespace: namespace.clone(),
            name: format!("{i:0>253}"),
            uid: format!("00000000-0000-4000-8000-{i:012}"),
        };
        let entry = prost::Message::encoded_len(&c) + 3;
        if size + entry > (4 << 20) - 1024 {
            break;
        }
        size += entry;
        claims.push(c);
    }
    let n = claims.len();
    let answer = prepare(&mut dra, claims).await;
    assert_eq!(answer.claims.len(), n);
    assert!(answer.claims.values().all(|c| !c.error.is_empty()));
    assert!(
        answer
            .claims
            .values()
            .all(|c| c.error.contains("not found") || c.error.contains("cut to fit")),
        "{:?}",
        answer.claims.values().next()
    );
    stop(child);
}
