//! Tessera's domain core: every decision of the driver, as pure functions of plain data.
//!
//! No I/O lives here (no Kubernetes client, no async runtime, no NVML, no filesystem): the
//! kubelet plugin and the controller fetch, call into this crate, and write.
//!
//! * [`inventory`]: the GPU inventory model and the fake-inventory file format.
//! * [`slices`]: rendering an inventory into the `ResourceSlices` of one pool.
//! * [`apiversion`]: reading and writing resource.k8s.io v1, v1beta2 and v1beta1 objects.
//! * [`config`], [`share`]: Tessera's opaque config API and the share rules.
//! * [`cel`]: the Kubernetes DRA CEL environment.
//! * [`allocator`]: structured allocation with Tessera's shares and placement policies.
//! * [`fragmentation`]: idle GPU capacity that typical task shapes cannot use.
//! * [`simulate`]: replaying a GPU cluster trace through the allocator.
//! * [`cdi`]: the CDI spec of a prepared claim.
//! * [`checkpoint`]: the node's record of prepared claims and its exclusivity rule.
//! * [`reconfigure`]: taking a re-discovered inventory without touching held GPUs.

pub mod allocator;
pub mod apiversion;
pub mod batch;
pub mod cdi;
pub mod cel;
pub mod checkpoint;
pub mod config;
pub mod error;
pub mod fragmentation;
pub mod inventory;
pub mod names;
pub mod prepare;
pub mod quantity;
pub mod reconfigure;
pub mod share;
pub mod simulate;
pub mod slices;
pub mod validation;

pub use error::{Error, Result};
pub use quantity::Quantity;
