//! Crash safety of the real binary: the plugin aborts at every crash point of prepare and
//! unprepare (`TESSERA_CRASH_AT`, see `src/crash.rs`), is restarted on the same directories,
//! and then every claim must be fully prepared (checkpoint "completed" and its CDI spec as a
//! clean run writes it) or cleanly absent (no spec, no entry), no temp file may be left, and
//! kubelet's repeated call must finish the job. A second test SIGKILLs the binary at random
//! moments while it prepares and unprepares claims, with the same checks.
#![allow(clippy::unwrap_used, missing_docs)]

use std::os::unix::process::ExitStatusExt as _;
use std::path::PathBuf;
use std::time::Duration;

use tessera_driver::node::checkpoint::PrepareState;
use tessera_kubelet_plugin::claims::crash;
use tessera_proto::dra::v1;
use tessera_tests::plugin_socket::{Dra, prepare_one, unprepare_one};

mod support;
use support::{NODE, NodeDir, Plugin, claim, claim_ref, stop};
/// The claim the crash hits.
const VICTIM: usize = 0;
/// A claim prepared before the crash, which must come through untouched.
const BYSTANDER: usize = 1;

/// A node's directories: claims file, boot id, sockets, CDI and state.
struct Node {
    dir: NodeDir,
}

impl Node {
    fn new(claims: usize) -> Self {
        let claims: Vec<_> = (0..claims).map(claim).collect();
        Self {
            dir: NodeDir::new(tempfile::tempdir().unwrap(), &claims),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path(name)
    }

    fn spawn(&self, crash_at: Option<(&str, u64)>) -> Plugin {
        let mut command = self
            .dir
            .plugin_command(NODE, &[("--enforcement", "none")], &[]);
        if let Some((point, skip)) = crash_at {
            command
                .env(crash::CRASH_AT_ENV, point)
                .env(crash::CRASH_SKIP_ENV, skip.to_string());
        }
        Plugin(command.spawn().unwrap())
    }

    /// Connects to the DRA socket of the plugin that serves now (a stale socket refuses).
    async fn connect(&self, child: &mut Plugin) -> Dra {
        let socket = self.path("plugin").join("dra.sock");
        let channel = support::dial_until_up(child, &socket, Duration::from_secs(20)).await;
        Dra::new(channel)
    }

    fn spec(&self, i: usize) -> Option<serde_json::Value> {
        let path = self
            .path("cdi")
            .join(format!("k8s.gpu.tessera.dev-claim_uid-{i}.json"));
        std::fs::read(path)
            .ok()
            .map(|b| serde_json::from_slice(&b).expect("a CDI spec is never torn"))
    }

    /// Whether claim `i` is fully prepared (true) or cleanly absent (false); panics on any
    /// state in between, and on leftover temp files.
    fn settled(&self, i: usize, reference: &[serde_json::Value], context: &str) -> bool {
        for dir in ["cdi", "plugin"] {
            let temps: Vec<_> = std::fs::read_dir(self.path(dir))
                .into_iter()
                .flatten()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| n.contains(".tmp-"))
                .collect();
            assert!(
                temps.is_empty(),
                "{context}: temp files left in {dir}: {temps:?}"
            );
        }
        let record = self.dir.checkpoint();
        let uid = format!("uid-{i}");
        match (record.get(&uid), self.spec(i)) {
            (Some(entry), Some(spec)) => {
                assert_eq!(
                    entry.state,
                    PrepareState::PrepareCompleted,
                    "{context}: {uid} is half done"
                );
                assert_eq!(spec, reference[i], "{context}: {uid}'s CDI spec");
                true
            }
            (None, None) => false,
            (entry, spec) => panic!(
                "{context}: {uid} is neither prepared nor absent: entry {entry:?}, spec present: {}",
                spec.is_some()
            ),
        }
    }
}

async fn prepare(dra: &mut Dra, i: usize) -> Vec<String> {
    prepare_one(dra, claim_ref(i)).await.unwrap()
}

async fn unprepare(dra: &mut Dra, i: usize) {
    unprepare_one(dra, claim_ref(i)).await.unwrap();
}

/// The CDI specs of claims `0..n` as a run without crashes writes them.
async fn reference_specs(n: usize) -> Vec<serde_json::Value> {
    let node = Node::new(n);
    let mut child = node.spawn(None);
    let mut dra = node.connect(&mut child).await;
    for i in 0..n {
        prepare(&mut dra, i).await;
    }
    stop(child);
    (0..n).map(|i| node.spec(i).unwrap()).collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    Prepare,
    Unprepare,
}

async fn crash_once(call: Call, point: &str, skip: u64, reference: &[serde_json::Value]) {
    let context = format!("{call:?} crashing at {point} (skip {skip})");
    let node = Node::new(2);
    // Before: the bystander is prepared, and for unprepare the victim too.
    let mut child = node.spawn(None);
    let mut dra = node.connect(&mut child).await;
    prepare(&mut dra, BYSTANDER).await;
    if call == Call::Unprepare {
        prepare(&mut dra, VICTIM).await;
    }
    stop(child);

    let mut child = node.spawn(Some((point, skip)));
    let mut dra = node.connect(&mut child).await;
    let request = v1::NodePrepareResourcesRequest {
        claims: vec![claim_ref(VICTIM)],
    };
    let answered = match call {
        Call::Prepare => dra.node_prepare_resources(request).await.is_ok(),
        Call::Unprepare => dra
            .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
                claims: request.claims,
            })
            .await
            .is_ok(),
    };
    let status = tokio::task::spawn_blocking(move || child.0.wait().unwrap())
        .await
        .unwrap();
    assert!(!answered, "{context}: the call was answered");
    assert_eq!(status.signal(), Some(6), "{context}: {status}");

    let mut child = node.spawn(None);
    let mut dra = node.connect(&mut child).await;
    assert!(
        node.settled(BYSTANDER, reference, &context),
        "{context}: bystander lost"
    );
    node.settled(VICTIM, reference, &context);
    match call {
        Call::Prepare => {
            let ids = prepare(&mut dra, VICTIM).await;
            assert_eq!(
                ids,
                vec!["k8s.gpu.tessera.dev/claim=uid-0-gpu-0".to_owned()]
            );
            assert!(
                node.settled(VICTIM, reference, &context),
                "{context}: not prepared"
            );
        }
        Call::Unprepare => {
            unprepare(&mut dra, VICTIM).await;
            assert!(
                !node.settled(VICTIM, reference, &context),
                "{context}: still prepared"
            );
        }
    }
    assert!(node.settled(BYSTANDER, reference, &context));
    stop(child);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_crash_point_leaves_claims_prepared_or_absent() {
    let reference = reference_specs(2).await;
    // Prepare writes the checkpoint, the CDI spec, the checkpoint; unprepare (after the
    // victim's prepare in the same process) writes the checkpoint twice.
    let mut cases = vec![
        (Call::Prepare, crash::PREPARE_AFTER_CHECKPOINT_STARTED, 0),
        (Call::Prepare, crash::PREPARE_AFTER_HOST_DIRS, 0),
        (Call::Prepare, crash::PREPARE_AFTER_CDI_WRITTEN, 0),
        (Call::Prepare, crash::PREPARE_AFTER_CHECKPOINT_COMPLETED, 0),
        (
            Call::Unprepare,
            crash::UNPREPARE_AFTER_CHECKPOINT_STARTED,
            0,
        ),
        (Call::Unprepare, crash::UNPREPARE_AFTER_HOST_DIRS_REMOVED, 0),
        (Call::Unprepare, crash::UNPREPARE_AFTER_CDI_REMOVED, 0),
        (
            Call::Unprepare,
            crash::UNPREPARE_AFTER_CHECKPOINT_REMOVED,
            0,
        ),
    ];
    for point in [crash::ATOMIC_WRITE_TEMP_SYNCED, crash::ATOMIC_WRITE_RENAMED] {
        for skip in 0..3 {
            cases.push((Call::Prepare, point, skip));
        }
        for skip in 0..2 {
            cases.push((Call::Unprepare, point, skip));
        }
    }
    let covered: std::collections::BTreeSet<&str> = cases.iter().map(|c| c.1).collect();
    assert_eq!(
        covered.len(),
        crash::POINTS.len(),
        "a crash point is not tested"
    );
    for (call, point, skip) in cases {
        crash_once(call, point, skip, &reference).await;
    }
}

/// A small deterministic generator (xorshift64): random enough to spread the kills, and a
/// failure replays with the same seed.
struct Xorshift(u64);

impl Xorshift {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_under_load_leaves_claims_prepared_or_absent() {
    const CLAIMS: usize = 4;
    const ROUNDS: u64 = 12;
    let reference = reference_specs(CLAIMS).await;
    let node = Node::new(CLAIMS);
    let mut random = Xorshift(0x5eed_7e55_e2a0_0001);
    let all: Vec<v1::Claim> = (0..CLAIMS).map(claim_ref).collect();
    for round in 0..ROUNDS {
        let context = format!("round {round}");
        let mut child = node.spawn(None);
        let dra = node.connect(&mut child).await;
        // Load: prepare and unprepare all claims (one concurrent batch each) until the kill.
        let claims = all.clone();
        let load = tokio::spawn(async move {
            let mut dra = dra;
            loop {
                let prepared = dra
                    .node_prepare_resources(v1::NodePrepareResourcesRequest {
                        claims: claims.clone(),
                    })
                    .await;
                let unprepared = dra
                    .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
                        claims: claims.clone(),
                    })
                    .await;
                if prepared.is_err() || unprepared.is_err() {
                    return;
                }
            }
        });
        tokio::time::sleep(Duration::from_millis(2 + random.below(40))).await;
        child.0.kill().unwrap();
        let status = child.0.wait().unwrap();
        assert_eq!(status.signal(), Some(9), "{context}: {status}");
        load.await.unwrap();

        let mut child = node.spawn(None);
        let mut dra = node.connect(&mut child).await;
        let prepared = (0..CLAIMS)
            .filter(|i| node.settled(*i, &reference, &context))
            .count();
        eprintln!("{context}: {prepared} of {CLAIMS} claims prepared after the kill");
        // Kubelet's retries finish the job, whichever way the claim was left.
        for i in 0..CLAIMS {
            prepare(&mut dra, i).await;
            assert!(node.settled(i, &reference, &context));
        }
        if round % 2 == 0 {
            for i in 0..CLAIMS {
                unprepare(&mut dra, i).await;
                assert!(!node.settled(i, &reference, &context));
            }
        }
        stop(child);
    }
}
