//! The rules wing: the policy vocabulary every other wing reads.
//!
//! It holds what a request, a share and an admin's policy mean, independent of where they are
//! placed or prepared: Kubernetes quantities, the API limits, Tessera's opaque config API (and
//! the values inside it: over-commit factors, patience), shares, tiers, delay tolerance,
//! over-commit, the static checks of classes and claims, the CEL environment, and the view of a
//! published device that CEL selectors and the allocator both read.
//!
//! May import: the shared top-level modules `names` and `error` only. Nothing here imports
//! `node`, `placement`, `tools`, `admission` or `apiversion`.

pub mod cel;
pub mod config;
pub mod labelselect;
pub mod limits;
pub(crate) mod nodeselect;
pub mod overcommit;
pub mod patience;
pub mod published;
pub mod quantity;
pub mod share;
pub mod tier;
pub mod validation;
