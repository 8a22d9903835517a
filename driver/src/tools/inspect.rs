//! The operator's view of a live cluster (`tessera inspect`), computed from plain objects.
//!
//! * [`gpus`]: per node and GPU, the mode, memory and compute allocated and free, and the
//!   claims and pods holding it (the allocator's own accounting, not a recount).
//! * [`pending`]: why a pod that carries Tessera's scheduling gate is still pending.

pub mod gpus;
pub mod pending;

pub use gpus::{ClaimHold, ClusterView, GpuRow, NodeGpus, cluster_view};
pub use pending::{ClaimState, ClusterObjects, PodExplanation, Verdict, explain_pod};
