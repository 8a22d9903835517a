//! The tools wing: the offline tools built on placement.
//!
//! It holds batch allocation (`tessera allocate`), replaying a GPU cluster trace through the
//! allocator (`tessera simulate`), and the operator's view of a cluster (`tessera inspect`).
//!
//! May import: `placement`, `node` (to render the nodes of a simulated cluster), `rules` and the
//! shared top-level modules. Nothing in another wing imports `tools`.

pub mod batch;
pub mod defrag;
pub mod inspect;
pub mod simulate;
