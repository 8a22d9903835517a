//! The placement wing: where claims go.
//!
//! It holds the allocator (structured allocation with Tessera's shares and placement policies),
//! kube-scheduler's node filters, the fast path by which the controller binds pods itself,
//! fragmentation and packing, leader election on a Lease, and the gate protocol between the
//! admission webhook, the controller and kube-scheduler.
//!
//! May import: `rules` and the shared top-level modules `names` and `error`. Nothing here
//! imports `node`, `tools`, `admission` or `apiversion`.

pub mod allocator;
pub mod defrag;
pub mod fast_path;
pub mod fragmentation;
pub mod gate;
pub mod lease;
pub mod nodefit;
pub mod packing;
