//! The Tessera kubelet plugin: the node agent that prepares claims for kubelet.
//!
//! Nine wings, each a folder whose module doc says what it owns and what it may import; the
//! arrows point one way, down this list:
//!
//! * [`cli`]: the binaries' flags and the wiring of the process around the library.
//! * [`publisher`]: `SlicePublisher`, the node's pool as ResourceSlices, kept so.
//! * [`gpus`]: which GPUs the node has (NVML or an inventory file), the inventory poller, the
//!   isolation probe runner, the Node's mode labels, the driver's files.
//! * [`accounting`]: `Accountant`, which holds each claim's processes together to its GPU
//!   memory booking (NVML's processes, `/proc`, MPS `terminate_client`, Events).
//! * [`ops`]: logs, Prometheus metrics and the `/metrics`, `/healthz`, `/readyz` endpoint.
//! * [`kubelet`]: the registration and DRA sockets kubelet calls, and the DRA health stream.
//! * [`claims`]: a claim's life on the node: where its allocation comes from, preparing and
//!   unpreparing it under the crash-safe checkpoint, removing what a tenant left behind.
//! * [`mps`]: `MpsSupervisor`, the MPS control daemons of shared GPUs.
//! * [`error`]: the crate's one error type.

pub mod accounting;
pub mod claims;
pub mod cli;
pub mod error;
pub mod gpus;
pub mod kubelet;
pub mod mps;
pub mod ops;
pub mod publisher;

pub use error::{Error, Result};
