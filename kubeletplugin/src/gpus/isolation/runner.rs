//! [`ChildProbe`]: the real probe. It renders the claim of a 1 GiB share of the GPU
//! (`isolation::probe_claim`) exactly as a claim is rendered (`cdi::render`), makes what the
//! backend needs (MPS: the GPU's control daemon, through the plugin's supervisor, released
//! after; HAMi-core: the claim's host directories, removed after), runs the probe child with
//! the spec's mounts and environment (`isolation::probe_command`: the plugin's own binary
//! applies the mounts in a mount namespace of its own, then runs the probe), kills it after the
//! timeout, and judges its report.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, PoisonError, mpsc};
use std::time::{Duration, Instant};

use tessera_driver::node::cdi::{self, ContainerEdits, Enforcement};
use tessera_driver::node::inventory::{Gpu, NodeInventory};
use tessera_driver::node::isolation::{
    self, ProbeOutcome, ProbeReport, REASON_DID_NOT_RUN, REASON_TIMED_OUT,
};
use tracing::warn;

use super::IsolationProbe;
use crate::mps::DaemonKeeper;

/// Runs the probe child for real.
pub struct ChildProbe {
    /// The program run as the child (the plugin's own binary).
    pub program: PathBuf,
    /// Its arguments (`isolation-probe`).
    pub args: Vec<String>,
    /// The node's backend, with its host paths.
    pub enforcement: Enforcement,
    /// What starts and stops the probe's MPS daemons, under `mps`.
    pub mps: Option<Arc<dyn DaemonKeeper>>,
    /// How long the child may take before it is killed (and the GPU stays unverified).
    pub timeout: Duration,
    /// The binary whose `isolation-probe` subcommand applies the spec's mounts in a mount
    /// namespace of its own before it runs `program`, as a container gets them (the plugin's
    /// own); `None` leaves the mounts out (tests only).
    pub launcher: Option<PathBuf>,
}

impl std::fmt::Debug for ChildProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChildProbe")
            .field("program", &self.program)
            .field("enforcement", &self.enforcement)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl ChildProbe {
    /// The plugin's own binary in probe mode, under `enforcement`, killed after `timeout`.
    pub fn of_this_binary(
        enforcement: Enforcement,
        mps: Option<Arc<dyn DaemonKeeper>>,
        timeout: Duration,
    ) -> std::io::Result<Self> {
        let program = std::env::current_exe()?;
        Ok(Self {
            launcher: Some(program.clone()),
            program,
            args: vec![super::SUBCOMMAND.to_owned()],
            enforcement,
            mps,
            timeout,
        })
    }

    fn did_not_run(message: impl Into<String>) -> ProbeOutcome {
        ProbeOutcome::failed(REASON_DID_NOT_RUN, message)
    }

    /// Runs the child with `edits` (a spec's container edits: its mounts and environment) and
    /// judges what it reports.
    pub fn run(&self, edits: &ContainerEdits) -> ProbeOutcome {
        // Only what an image would carry; `env::vars` would panic on a value that is not UTF-8.
        let inherited: Vec<(String, String)> = ["PATH", "LD_LIBRARY_PATH"]
            .iter()
            .filter_map(|k| Some(((*k).to_owned(), std::env::var(k).ok()?)))
            .collect();
        let launcher = self.launcher.as_ref().map(|l| l.display().to_string());
        let command = isolation::probe_command(
            edits,
            &self.program.display().to_string(),
            &self.args,
            &inherited,
            launcher.as_deref(),
        );
        let child = Command::new(&command.program)
            .args(&command.args)
            .env_clear()
            .envs(command.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match child {
            Ok(child) => child,
            Err(e) => {
                return Self::did_not_run(format!("cannot start {}: {e}", command.program));
            }
        };
        // Read while the child runs: a child that writes more than a pipe holds (a chatty
        // preloaded library) would otherwise block until it is killed as timed out.
        let stdout = child.stdout.take().map(drain);
        let stderr = child.stderr.take().map(drain);
        let deadline = Instant::now() + self.timeout;
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) if Instant::now() >= deadline => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return ProbeOutcome::failed(
                        REASON_TIMED_OUT,
                        format!(
                            "the probe did not finish within {:?} and was killed",
                            self.timeout
                        ),
                    );
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                Err(e) => return Self::did_not_run(format!("waiting for the probe: {e}")),
            }
        };
        // What the child wrote is in the pipes now; only a process it left behind (a daemon a
        // preloaded library forked) can hold them open, and discovery does not wait for it.
        let until = Instant::now() + OUTPUT_AFTER_EXIT;
        let stdout = stdout.map(|o| o.collect(until)).unwrap_or_default();
        let stderr = stderr.map(|o| o.collect(until)).unwrap_or_default();
        if !status.success() {
            return Self::did_not_run(format!("the probe exited with {status}: {}", tail(&stderr)));
        }
        match serde_json::from_str::<ProbeReport>(stdout.trim()) {
            Ok(report) => isolation::judge(&report),
            Err(e) => Self::did_not_run(format!(
                "the probe's report does not read ({e}): {}",
                tail(&stdout)
            )),
        }
    }
}

/// The most of a child's output kept (the report is one short line; the rest is for the tail
/// of an error): what comes after is read and dropped.
const OUTPUT_KEPT: usize = 1 << 20;

/// How long the child's output may still take to be read to its end once the child exited.
const OUTPUT_AFTER_EXIT: Duration = Duration::from_secs(1);

/// One of the child's output pipes, read to its end on a thread of its own.
struct Drained {
    /// The first [`OUTPUT_KEPT`] bytes read so far.
    kept: Arc<Mutex<Vec<u8>>>,
    /// Says the pipe reached its end (every writer closed it).
    ended: mpsc::Receiver<()>,
}

/// Starts reading `pipe` to its end, keeping its first [`OUTPUT_KEPT`] bytes.
fn drain(mut pipe: impl Read + Send + 'static) -> Drained {
    let kept = Arc::new(Mutex::new(Vec::new()));
    let (end, ended) = mpsc::channel();
    let into = Arc::clone(&kept);
    std::thread::spawn(move || {
        let mut chunk = [0u8; 8192];
        loop {
            match pipe.read(&mut chunk) {
                Ok(0) => break,
                Ok(n) => {
                    let mut kept = into.lock().unwrap_or_else(PoisonError::into_inner);
                    let room = OUTPUT_KEPT.saturating_sub(kept.len());
                    kept.extend_from_slice(&chunk[..n.min(room)]);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        let _ = end.send(());
    });
    Drained { kept, ended }
}

impl Drained {
    /// What was read: all of it when the pipe ends by `until`; else what came by then (the
    /// thread goes on reading, and ends with the pipe).
    fn collect(self, until: Instant) -> String {
        let _ = self
            .ended
            .recv_timeout(until.saturating_duration_since(Instant::now()));
        let kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        String::from_utf8_lossy(&kept).into_owned()
    }
}

/// The last line of `text`, at most 300 characters, for a reason.
fn tail(text: &str) -> String {
    let line = text.trim().lines().last().unwrap_or("(nothing)");
    line.chars().take(300).collect()
}

impl IsolationProbe for ChildProbe {
    fn probe(&self, node: &NodeInventory, gpu: &Gpu) -> ProbeOutcome {
        let claim = isolation::probe_claim(&node.name, gpu);
        let rendered = match cdi::render(&claim, &self.enforcement) {
            Ok(rendered) => rendered,
            Err(e) => return Self::did_not_run(e.to_string()),
        };
        for dir in &rendered.host_dirs {
            if let Err(e) = crate::mps::host_dirs::create(dir) {
                return Self::did_not_run(format!("creating the probe's directory: {e}"));
            }
        }
        let daemon = match (&rendered.mps_daemon, &self.mps) {
            (Some(daemon), Some(mps)) => {
                if let Err(e) = mps.ensure(&claim.uid, daemon) {
                    return Self::did_not_run(format!("the MPS daemon did not start: {e}"));
                }
                Some(mps)
            }
            (Some(_), None) => {
                return Self::did_not_run("the node enforces with MPS but runs no supervisor");
            }
            _ => None,
        };
        let outcome = self.run(&rendered.spec.container_edits.clone().unwrap_or_default());
        if let Some(mps) = daemon
            && let Err(e) = mps.release(&claim.uid)
        {
            warn!(gpu = %gpu.device_name(), error = %e, "releasing the probe's MPS daemon failed");
        }
        // The host dirs hold only the probe's accounting; the deepest first.
        for dir in rendered.host_dirs.iter().rev() {
            let _ = std::fs::remove_dir_all(Path::new(&dir.path));
        }
        outcome
    }
}

#[cfg(test)]
mod tests {
    use tessera_driver::node::inventory::Inventory;

    use super::*;

    fn node() -> NodeInventory {
        Inventory::from_yaml("nodes:\n- name: n\n  mode: shared\n  gpus:\n  - model: t4-16g\n")
            .unwrap()
            .nodes
            .remove(0)
    }

    fn probe(program: &str, args: &[&str], timeout: Duration) -> ChildProbe {
        ChildProbe {
            program: PathBuf::from(program),
            args: args.iter().map(|a| (*a).to_owned()).collect(),
            enforcement: Enforcement::None,
            mps: None,
            timeout,
            launcher: None,
        }
    }

    fn code(outcome: &ProbeOutcome) -> &'static str {
        match outcome {
            ProbeOutcome::Held => isolation::REASON_PROBE_HELD,
            ProbeOutcome::Failed { code, .. } => code,
        }
    }

    #[test]
    fn a_probe_that_hangs_is_killed_at_its_timeout_and_fails() {
        let node = node();
        let started = Instant::now();
        let outcome =
            probe("/bin/sleep", &["30"], Duration::from_millis(200)).probe(&node, &node.gpus[0]);
        assert_eq!(code(&outcome), REASON_TIMED_OUT, "{outcome:?}");
        assert!(
            started.elapsed() < Duration::from_secs(25),
            "the child was killed"
        );
    }

    #[test]
    fn a_child_that_writes_more_than_a_pipe_holds_is_read_while_it_runs() {
        let node = node();
        // 256 KiB on stderr, then a failure: read only after the exit, the child would block
        // on the full pipe and be killed as timed out.
        let script =
            "head -c 262144 /dev/zero | tr '\\0' x >&2; echo >&2; echo last words >&2; exit 3";
        let outcome =
            probe("/bin/sh", &["-c", script], Duration::from_mins(1)).probe(&node, &node.gpus[0]);
        let ProbeOutcome::Failed { code, message } = outcome else {
            panic!("a failing child cannot hold");
        };
        assert_eq!(code, isolation::REASON_DID_NOT_RUN, "{message}");
        assert!(message.contains("last words"), "{message}");
    }

    #[test]
    fn a_process_the_child_leaves_holding_its_output_does_not_hold_up_the_verdict() {
        let node = node();
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("grandchild.pid");
        // The child forks a sleeper that inherits its stdout and stderr, reports, and exits.
        let script = format!(
            "sleep 300 & echo $! > {}; echo '{{\"limitBytes\":1073741824,\"pastBytes\":1610612736,\"past\":{{\"result\":\"served\"}},\"underBytes\":536870912,\"under\":{{\"result\":\"served\"}}}}'",
            pid_file.display()
        );
        let (verdict, judged) = mpsc::channel();
        let gpu = node.gpus[0].clone();
        std::thread::spawn(move || {
            let child = probe("/bin/sh", &["-c", &script], Duration::from_mins(1));
            let _ = verdict.send(child.probe(&node, &gpu));
        });
        // Far longer than reading what the child wrote takes, far shorter than the sleeper.
        let outcome = judged.recv_timeout(Duration::from_mins(2));
        if let Ok(pid) = std::fs::read_to_string(&pid_file) {
            let pid = nix::unistd::Pid::from_raw(pid.trim().parse().unwrap());
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        }
        let outcome = outcome.expect("the verdict does not wait for the sleeper");
        assert_eq!(
            code(&outcome),
            isolation::REASON_LIMIT_NOT_ENFORCED,
            "the child's report is judged: {outcome:?}"
        );
    }

    #[test]
    fn the_child_gets_the_claims_limit_and_its_report_is_judged() {
        let node = node();
        // A stand-in child that reports what HAMi-core did on driver 580: served past the limit.
        let script = r#"echo "{\"limitBytes\":$TESSERA_GPU_MEMORY_LIMIT_BYTES,\"pastBytes\":1610612736,\"past\":{\"result\":\"served\"},\"underBytes\":536870912,\"under\":{\"result\":\"served\"}}""#;
        let outcome =
            probe("/bin/sh", &["-c", script], Duration::from_secs(20)).probe(&node, &node.gpus[0]);
        let ProbeOutcome::Failed { code, message } = outcome else {
            panic!("a served allocation past the limit must fail");
        };
        assert_eq!(code, isolation::REASON_LIMIT_NOT_ENFORCED);
        assert!(
            message.contains("past the 1024 MiB limit was served"),
            "{message}"
        );
    }
}
