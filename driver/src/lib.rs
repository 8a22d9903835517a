//! Tessera's domain core: every decision of the driver, as pure functions of plain data.
//!
//! No I/O lives here (no Kubernetes client, no async runtime, no NVML, no filesystem): the
//! kubelet plugin and the controller fetch, call into this crate, and write.
//!
//! * [`inventory`]: the GPU inventory model and the fake-inventory file format.
//! * [`slices`]: rendering an inventory into the `ResourceSlices` of one pool.
//! * [`apiversion`]: reading and writing resource.k8s.io v1, v1beta2 and v1beta1 objects.
//! * [`config`], [`share`], [`tier`], [`patience`]: Tessera's opaque config API, the share
//!   rules, tiers and delay tolerance.
//! * [`config`], [`share`]: Tessera's opaque config API and the share rules.
//! * [`tier`], [`overcommit`]: a share's tier, and how batch shares over-commit a GPU.
//! * [`cel`]: the Kubernetes DRA CEL environment.
//! * [`allocator`]: structured allocation with Tessera's shares and placement policies.
//! * [`fragmentation`]: idle GPU capacity that typical task shapes cannot use.
//! * [`simulate`]: replaying a GPU cluster trace through the allocator.
//! * [`cdi`]: the CDI spec of a prepared claim.
//! * [`checkpoint`]: the node's record of prepared claims and its exclusivity rule.
//! * [`admission`]: the admission webhook's decisions (scheduling gate, claim checks).
//! * [`gate`], [`nodefit`]: the controller's gate protocol and kube-scheduler's node filters;
//!   [`fast_path`]: which gated pods the controller may bind itself.
//! * [`gpu_mode`]: the admin's choice of GPU modes (flags, node labels) applied to an inventory.
//! * [`health`]: which GPU events make a GPU unhealthy; the health of published devices.
//! * [`inspect`]: the operator's view of a cluster and why a gated pod is pending.
//! * [`lease`]: leader election on a Lease.
//! * [`mps`]: the MPS control daemons the recorded claims need, and their restart backoff.
//! * [`reconfigure`]: taking a re-discovered inventory without touching held GPUs.

pub mod admission;
pub mod allocator;
pub mod apiversion;
pub mod batch;
pub mod cdi;
pub mod cel;
pub mod checkpoint;
pub mod config;
pub mod error;
pub mod fast_path;
pub mod fragmentation;
pub mod gate;
pub mod gpu_mode;
pub mod health;
pub mod inspect;
pub mod inventory;
pub mod lease;
pub mod mps;
pub mod names;
pub mod nodefit;
pub mod overcommit;
pub mod packing;
pub mod patience;
pub mod prepare;
pub mod quantity;
pub mod reconfigure;
pub mod share;
pub mod simulate;
pub mod slices;
pub mod tier;
pub mod validation;

pub use error::{Error, Result};
pub use quantity::Quantity;
