//! Tessera's domain core: every decision of the driver, as pure functions of plain data.
//!
//! No I/O lives here (no Kubernetes client, no async runtime, no NVML, no filesystem): the
//! kubelet plugin and the controller fetch, call into this crate, and write.
//!
//! The crate is four wings and a few shared modules; docs/architecture.md draws them. Imports run
//! one way: `tools` → `placement` → `rules`, `node` → `rules`, and every wing may use the shared
//! modules at the top.
//!
//! * [`rules`]: the policy vocabulary every other wing reads: quantities, shares, Tessera's
//!   opaque config (`GpuShare`, `TierPolicy`, `AllocatedShares`), tiers, patience, over-commit, static
//!   validation, the CEL environment and the published-device view.
//! * [`node`]: what a node decides: its inventory and GPU modes, the ResourceSlices it
//!   publishes, health, preparing claims into CDI specs, the checkpoint, MPS daemons and
//!   reconfiguration.
//! * [`placement`]: where claims go: the allocator, kube-scheduler's node filters, the fast
//!   path, fragmentation and packing, leader election and the gate protocol.
//! * [`tools`]: the offline tools built on placement: batch allocation, trace replay and the
//!   operator's view.
//! * [`admission`]: the admission webhook's decisions (scheduling gate, claim checks, pods
//!   written for device plugins).
//! * [`apiversion`]: reading and writing resource.k8s.io v1, v1beta2 and v1beta1 objects.
//! * [`names`]: the names Tessera and Kubernetes give things (driver, groups, kinds, labels).
//! * [`error`]: the crate's one error type.

pub mod admission;
pub mod apiversion;
pub mod error;
pub mod names;
pub mod node;
pub mod placement;
pub mod rules;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod tools;

pub use error::{Error, Result};
pub use rules::quantity::Quantity;
