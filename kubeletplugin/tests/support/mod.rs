//! What the binary's test suites share: the node they pretend to be, a claim allocated on it,
//! the node's directories and the plugin's command on them, and dialling the plugin's socket
//! the way kubelet does (HTTP/2 over a unix socket).
#![allow(dead_code, unreachable_pub)] // Reason: each suite uses a different part.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1 as res;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use tessera_driver::node::checkpoint::Checkpoint;
use tessera_kubelet_plugin::claims::crash;
use tessera_proto::dra::v1;
use tonic::transport::Channel;

pub mod mps;

pub const DRIVER: &str = "gpu.tessera.dev";
pub const NODE: &str = "a100-node";
/// The boot id of the suites' nodes.
pub const BOOT: &str = "boot-1";

/// Claim `claim-<i>` (UID `uid-<i>`), allocated the whole GPU `gpu-<i>` of [`NODE`].
pub fn claim(i: usize) -> res::ResourceClaim {
    allocated_claim(
        &format!("claim-{i}"),
        &format!("uid-{i}"),
        NODE,
        &format!("gpu-{i}"),
    )
}

/// Claim `name` (UID `uid`) in `default`, allocated the whole device `device` of node `pool`
/// for its request `gpu`.
pub fn allocated_claim(name: &str, uid: &str, pool: &str, device: &str) -> res::ResourceClaim {
    res::ResourceClaim {
        metadata: ObjectMeta {
            namespace: Some("default".to_owned()),
            name: Some(name.to_owned()),
            uid: Some(uid.to_owned()),
            ..ObjectMeta::default()
        },
        spec: res::ResourceClaimSpec::default(),
        status: Some(res::ResourceClaimStatus {
            allocation: Some(res::AllocationResult {
                devices: Some(res::DeviceAllocationResult {
                    results: Some(vec![res::DeviceRequestAllocationResult {
                        request: "gpu".to_owned(),
                        driver: DRIVER.to_owned(),
                        pool: pool.to_owned(),
                        device: device.to_owned(),
                        ..res::DeviceRequestAllocationResult::default()
                    }]),
                    ..res::DeviceAllocationResult::default()
                }),
                ..res::AllocationResult::default()
            }),
            ..res::ResourceClaimStatus::default()
        }),
    }
}

/// Kubelet's reference to [`claim`]`(i)` in a prepare or unprepare call.
pub fn claim_ref(i: usize) -> v1::Claim {
    v1::Claim {
        namespace: "default".to_owned(),
        name: format!("claim-{i}"),
        uid: format!("uid-{i}"),
    }
}

/// Claim `claim-<i>` (UID `uid-<i>`), allocated a share of `gpu-<gpu>` of [`NODE`] booked as
/// `memory` of it (kube-scheduler's `consumedCapacity`, no Tessera record): the node must run
/// that GPU shared (`--gpu-mode shared`).
pub fn share_claim(i: usize, gpu: usize, memory: &str) -> res::ResourceClaim {
    let mut claim = claim(i);
    let result = first_result(&mut claim);
    result.device = format!("gpu-{gpu}");
    result.share_id = Some(format!("00000000-0000-4000-8000-{i:012}"));
    result.consumed_capacity = Some(
        [(
            "memory".to_owned(),
            k8s_openapi::apimachinery::pkg::api::resource::Quantity(memory.to_owned()),
        )]
        .into(),
    );
    claim
}

/// The first device result of `claim`'s allocation.
pub fn first_result(claim: &mut res::ResourceClaim) -> &mut res::DeviceRequestAllocationResult {
    &mut claim
        .status
        .as_mut()
        .unwrap()
        .allocation
        .as_mut()
        .unwrap()
        .devices
        .as_mut()
        .unwrap()
        .results
        .as_mut()
        .unwrap()[0]
}

/// One attempt to dial the plugin's unix socket at `socket`.
pub use tessera_tests::plugin_socket::dial;

/// A channel to the plugin's unix socket at `socket`, dialled until the plugin serves it (a
/// socket an earlier process left refuses) for at most `timeout`; the plugin exiting first
/// fails the test.
pub async fn dial_until_up(plugin: &mut Plugin, socket: &Path, timeout: Duration) -> Channel {
    let deadline = Instant::now() + timeout;
    loop {
        assert!(plugin.0.try_wait().unwrap().is_none(), "the plugin exited");
        if let Ok(channel) = dial(socket).await {
            return channel;
        }
        assert!(Instant::now() < deadline, "the plugin did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A node's directories, under one temporary directory: the claims file (`claims.yaml`), the
/// boot id ([`BOOT`], in `boot_id`), and what the plugin writes there (`registry`, `plugin`
/// with the checkpoint, `cdi`).
pub struct NodeDir {
    dir: tempfile::TempDir,
}

impl NodeDir {
    /// `dir` with `claims` (one YAML document each) and the boot id written.
    pub fn new(dir: tempfile::TempDir, claims: &[res::ResourceClaim]) -> Self {
        let mut yaml = String::new();
        for c in claims {
            yaml.push_str("---\n");
            yaml.push_str(&serde_json::to_string(c).unwrap());
            yaml.push('\n');
        }
        std::fs::write(dir.path().join("claims.yaml"), yaml).unwrap();
        std::fs::write(dir.path().join("boot_id"), format!("{BOOT}\n")).unwrap();
        Self { dir }
    }

    /// `name` in the node's directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The plugin's command on this node as `node`: the fake backend on the demo inventory,
    /// this node's claims, directories and boot id, and `defaults`, each flag unless `args`
    /// names it; then `args`. Logs at `warn` go to the test's stderr; no crash point is set.
    pub fn plugin_command(&self, node: &str, defaults: &[(&str, &str)], args: &[&str]) -> Command {
        let inventory =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/inventory/demo-cluster.yaml");
        let path = |name: &str| self.path(name).display().to_string();
        let common = [
            ("--gpu-backend", "fake".to_owned()),
            ("--fake-inventory", inventory.display().to_string()),
            ("--fake-claims", path("claims.yaml")),
            ("--registration-dir", path("registry")),
            ("--plugin-dir", path("plugin")),
            ("--cdi-dir", path("cdi")),
            ("--boot-id-file", path("boot_id")),
        ];
        let mut command = Command::new(env!("CARGO_BIN_EXE_tessera-kubelet-plugin"));
        command
            .env("NODE_NAME", node)
            .env_remove(crash::CRASH_AT_ENV)
            .env_remove(crash::CRASH_SKIP_ENV)
            .env("RUST_LOG", "warn");
        let defaults = defaults
            .iter()
            .map(|(flag, value)| (*flag, (*value).to_owned()));
        for (flag, value) in common.into_iter().chain(defaults) {
            if !args.contains(&flag) {
                command.arg(flag).arg(value);
            }
        }
        command
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        command
    }

    /// The checkpoint the plugin keeps (an empty one before it wrote any).
    pub fn checkpoint(&self) -> Checkpoint {
        match std::fs::read(self.path("plugin").join("checkpoint.json")) {
            Ok(bytes) => Checkpoint::decode(&bytes, BOOT).unwrap(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Checkpoint::new(BOOT),
            Err(e) => panic!("{e}"),
        }
    }
}

/// The plugin's process, killed and reaped when the test lets go of it.
pub struct Plugin(pub Child);

/// Stops the plugin as a pod's shutdown does (`SIGTERM`); it must exit cleanly.
pub fn stop(mut plugin: Plugin) {
    let killed = Command::new("kill")
        .args(["-TERM", &plugin.0.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    assert!(plugin.0.wait().unwrap().success());
}

impl Drop for Plugin {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
