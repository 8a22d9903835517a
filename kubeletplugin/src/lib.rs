//! The Tessera kubelet plugin: the node agent that prepares claims for kubelet.
//!
//! * [`server`]: the registration and DRA sockets (`start`, `RunningPlugin`); [`authority`]:
//!   the layer under them that accepts the `:authority` kubelet sends on a unix socket.
//! * [`registration`], [`dra`]: the gRPC services, thin layers over the seams below.
//! * [`preparer`]: `ClaimPreparer`, and `CdiPreparer`, which writes CDI specs under a
//!   crash-safe checkpoint (the checkpoint's rules live in `tessera_driver::node::checkpoint`).
//! * [`mps`]: `MpsSupervisor`, the MPS control daemons of shared GPUs, run by the node's
//!   `tessera-mps host` ([`mps_cli`]) or by the plugin; [`driver_files`]: the driver's files
//!   under the mounted driver root.
//! * [`accounting`]: `Accountant`, which holds each claim's processes together to its GPU
//!   memory booking (NVML's processes, `/proc`, MPS `terminate_client`, Events).
//! * [`claims`]: `ClaimSource`, where allocations come from.
//! * [`apiserver`]: `ApiClaimSource` (the client itself is `tessera_kubeapi`'s);
//!   [`publisher`]: `SlicePublisher`, and the watch of the published slices that keeps them so.
//! * [`health_stream`]: the DRA health API, following the inventory's health.
//! * [`discovery`]: `GpuDiscovery`, which GPUs the node has; [`nvml`]: its NVML backend.
//! * [`args`]: the command line and the process around the library.

pub mod accounting;
pub mod apiserver;
pub mod args;
pub mod atomic_file;
pub mod authority;
pub mod cancel;
pub mod claims;
pub mod crash;
pub mod discovery;
pub mod dra;
pub mod driver_files;
pub mod error;
pub mod health_http;
pub mod health_stream;
pub mod input_file;
pub mod isolation;
pub mod metrics;
pub mod mps;
pub mod mps_cli;
pub mod node_labels;
pub mod nvml;
pub mod ops;
pub mod preparer;
pub mod publisher;
pub mod reaper;
pub mod registration;
pub mod server;
pub mod watch;

pub use error::{Error, Result};
