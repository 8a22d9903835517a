//! The accounting's MPS commands through a control binary, as on a node: `BinaryMpsControl`
//! runs the fake backend's `nvidia-cuda-mps-control` (a real `SOCK_SEQPACKET` control socket)
//! with two fake CUDA clients attached, finds them with `get_server_list` and
//! `get_client_list`, and `terminate_client` ends one while the other stays.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tessera_driver::node::mps::MpsDaemon;
use tessera_kubelet_plugin::accounting::{BinaryMpsControl, MpsControl};
use tessera_kubelet_plugin::mps::fake_control::TERMINATED_EXIT;
use tessera_kubelet_plugin::mps::record;

const FAKE_MPS: &str = env!("CARGO_BIN_EXE_tessera-fake-mps-control");

/// Children killed and reaped when the test lets go of them.
struct Reaped(Vec<Child>);

impl Drop for Reaped {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn fake(args: &[&str], pipe: &Path) -> Child {
    Command::new(FAKE_MPS)
        .args(args)
        .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
        .stdin(Stdio::null())
        .spawn()
        .unwrap()
}

/// Polls `f` every 20 ms for up to 20 s.
fn eventually<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn exited(child: &mut Child) -> Option<ExitStatus> {
    child.try_wait().unwrap()
}

#[test]
fn terminate_client_through_the_control_binary_ends_one_client_and_leaves_the_other() {
    let dir = tempfile::tempdir().unwrap();
    let pipe = dir.path().join("pipe");
    std::fs::create_dir_all(&pipe).unwrap();
    let daemon = MpsDaemon {
        id: "mps-test".to_owned(),
        devices: vec!["GPU-1".to_owned()],
        pipe_dir: pipe.display().to_string(),
        shm_dir: dir.path().join("shm").display().to_string(),
        log_dir: dir.path().join("log").display().to_string(),
        user: None,
    };
    let mut children = Reaped(vec![fake(&["-f"], &pipe)]);
    let server = children.0[0].id();
    // As a supervisor records the daemon it starts: commands go only to the recorded daemon.
    record::write(&daemon, &record::of_child(&daemon, server).unwrap()).unwrap();
    eventually("the control socket", || {
        pipe.join("control").exists().then_some(())
    });
    children.0.push(fake(&["client"], &pipe));
    children.0.push(fake(&["client"], &pipe));
    let (first, second) = (children.0[1].id(), children.0[2].id());

    let control = BinaryMpsControl::new(FAKE_MPS, Duration::from_secs(10));
    let mut both = vec![first, second];
    both.sort_unstable();
    eventually("both clients listed", || {
        (control.servers(&daemon).ok()? == [server]
            && control.clients(&daemon, server).ok()? == both)
            .then_some(())
    });

    control.terminate(&daemon, server, second).unwrap();
    let status = eventually("the terminated client exits", || exited(&mut children.0[2]));
    assert_eq!(status.code(), Some(TERMINATED_EXIT));
    assert!(
        exited(&mut children.0[1]).is_none(),
        "the other client runs on"
    );
    assert_eq!(control.clients(&daemon, server).unwrap(), [first]);
    assert!(
        control.clients(&daemon, server + 1_000_000).is_err(),
        "an unknown server is an error, not an empty list"
    );
}
