//! The real `tessera-controller` binary's log, written to a pipe as a container runtime takes
//! it, against the in-process fake API server: plain lines (the chart's default) escape what
//! objects name and carry no colour codes.
#![allow(clippy::unwrap_used, missing_docs)]

use std::io::BufRead as _;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;
use tessera_driver::names;
use tessera_tests::fake_apiserver::FakeApiServer;

/// A pod name with what would end a log line and forge the next, drive a terminal (colour),
/// and reverse the text after it; the fake API server keeps names as they are given.
const CRAFTED: &str = "web\n1999-01-01T00:00:00Z  INFO forged: placed\u{1b}[31m\u{202e}\u{2028}x";

/// How long the controller may take to list the pod and log that it waits; the test bound.
const LOGGED_BOUND: Duration = Duration::from_mins(1);

/// Stops the controller when the test ends, however it ends.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plain_log_on_a_pipe_escapes_a_crafted_pod_name_and_has_no_colour_codes() {
    let server = FakeApiServer::start(&["v1"]).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, server.kubeconfig()).unwrap();
    // A gated pod whose claim does not exist yet: the controller logs (at debug) that it waits.
    server
        .create(
            "pods",
            json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": CRAFTED, "namespace": "default"},
                "spec": {
                    "schedulingGates": [{"name": names::SCHEDULING_GATE}],
                    "resourceClaims": [{"name": "gpu", "resourceClaimName": CRAFTED}],
                    "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}],
                },
            }),
        )
        .unwrap();
    let mut controller = Killed(
        Command::new(env!("CARGO_BIN_EXE_tessera-controller"))
            .args(["--leader-elect", "false", "--metrics-addr", "127.0.0.1:0"])
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .env("RUST_LOG", "info,tessera_controller::reconcile=debug")
            .env_remove("NO_COLOR")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let stdout = controller.0.stdout.take().unwrap();
    // Read on a thread of its own: the lines come while the fake API server runs here.
    let (lines_tx, lines) = std::sync::mpsc::channel::<Vec<u8>>();
    std::thread::spawn(move || {
        let mut reader = std::io::BufReader::new(stdout);
        let mut line = Vec::new();
        while reader.read_until(b'\n', &mut line).is_ok_and(|n| n > 0) {
            if lines_tx.send(std::mem::take(&mut line)).is_err() {
                break;
            }
        }
    });
    let started = Instant::now();
    let mut log = Vec::new();
    let waits = loop {
        let left = LOGGED_BOUND.saturating_sub(started.elapsed());
        let line = tokio::task::block_in_place(|| lines.recv_timeout(left)).unwrap_or_else(|_| {
            panic!(
                "no line about the pod within {LOGGED_BOUND:?}:\n{}",
                String::from_utf8_lossy(&log)
            )
        });
        log.extend_from_slice(&line);
        if String::from_utf8_lossy(&line).contains(" waiting ") {
            break String::from_utf8(line).unwrap();
        }
    };
    let text = String::from_utf8_lossy(&log);
    assert!(!log.contains(&0x1b), "a colour code or escape: {text:?}");
    assert!(
        !text.contains(['\u{202e}', '\u{2028}']),
        "a raw format character or separator: {text:?}"
    );
    assert!(
        waits.contains(
            "web\\n1999-01-01T00:00:00Z  INFO forged: placed\\u{1b}[31m\\u{202e}\\u{2028}x"
        ),
        "the pod's name, escaped: {waits}"
    );
    assert!(!text.lines().any(|l| l.starts_with("1999-01-01")), "{text}");
}
