//! What the binary's test suites share: the node they pretend to be, a claim allocated on it,
//! and dialling the plugin's socket the way kubelet does (HTTP/2 over a unix socket).
#![allow(dead_code, unreachable_pub)] // Reason: each suite uses a different part.

use std::path::Path;
use std::process::Child;

use hyper_util::rt::TokioIo;
use k8s_openapi::api::resource::v1 as res;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use tonic::transport::{Channel, Endpoint};

pub const DRIVER: &str = "gpu.tessera.dev";
pub const NODE: &str = "a100-node";

/// Claim `claim-<i>` (UID `uid-<i>`), allocated the whole GPU `gpu-<i>` of [`NODE`].
pub fn claim(i: usize) -> res::ResourceClaim {
    res::ResourceClaim {
        metadata: ObjectMeta {
            namespace: Some("default".to_owned()),
            name: Some(format!("claim-{i}")),
            uid: Some(format!("uid-{i}")),
            ..ObjectMeta::default()
        },
        spec: res::ResourceClaimSpec::default(),
        status: Some(res::ResourceClaimStatus {
            allocation: Some(res::AllocationResult {
                devices: Some(res::DeviceAllocationResult {
                    results: Some(vec![res::DeviceRequestAllocationResult {
                        request: "gpu".to_owned(),
                        driver: DRIVER.to_owned(),
                        pool: NODE.to_owned(),
                        device: format!("gpu-{i}"),
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

/// Claim `claim-<i>` (UID `uid-<i>`), allocated a share of `gpu-<gpu>` of [`NODE`] booked as
/// `memory` of it (kube-scheduler's `consumedCapacity`, no Tessera record): the node must run
/// that GPU shared (`--gpu-mode shared`).
pub fn share_claim(i: usize, gpu: usize, memory: &str) -> res::ResourceClaim {
    let mut claim = claim(i);
    let result = &mut claim
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
        .unwrap()[0];
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

/// One attempt to dial the plugin's unix socket at `socket`.
pub async fn dial(socket: &Path) -> Result<Channel, tonic::transport::Error> {
    let socket = socket.to_owned();
    Endpoint::try_from("http://[::]:50051")?
        .connect_with_connector(tower::service_fn(move |_| {
            let socket = socket.clone();
            async move {
                Ok::<_, std::io::Error>(TokioIo::new(
                    tokio::net::UnixStream::connect(socket).await?,
                ))
            }
        }))
        .await
}

/// The plugin's process, killed and reaped when the test lets go of it.
pub struct Plugin(pub Child);

impl Drop for Plugin {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
