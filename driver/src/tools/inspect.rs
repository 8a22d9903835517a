//! The operator's view of a live cluster (`tessera inspect`), computed from plain objects.
//!
//! * [`gpus`]: per node and GPU, the mode, memory and compute allocated and free, and the
//!   claims and pods holding it (the allocator's own accounting, not a recount).
//! * [`claim`]: one claim: its booking, what the node says it got and uses, and the node's
//!   Events about it.
//! * [`pending`]: why a pod that carries Tessera's scheduling gate is still pending.
//! * [`profiles`]: each scheduled node's GPU profile, next switch, and what holds its draining
//!   GPUs.

pub mod claim;
pub mod gpus;
pub mod pending;
pub mod profiles;

pub use claim::{ClaimView, explain_claim};
pub use gpus::{ClaimHold, ClusterView, GpuRow, NodeGpus, cluster_view};
pub use pending::{ClaimState, ClusterObjects, PodExplanation, Verdict, explain_pod};
