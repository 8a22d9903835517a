//! The node wing: what a GPU node decides.
//!
//! It holds the GPU inventory model (discovered or from a fake-inventory file), the admin's GPU
//! modes, rendering an inventory into the ResourceSlices of one pool and their drift, health,
//! preparing a claim into a CDI spec with its isolation limits, the checkpoint of prepared claims,
//! the MPS control daemons the claims need (and the mounts and driver files they run with),
//! taking a re-discovered inventory, and holding each claim's processes together to its GPU
//! memory booking (`accounting`).
//!
//! May import: `rules` and the shared top-level modules `names` and `error`. Nothing here
//! imports `placement`, `tools`, `admission` or `apiversion`.

pub mod accounting;
pub mod cdi;
pub mod checkpoint;
pub mod driver_root;
pub mod gpu_mode;
pub mod health;
pub mod inventory;
pub mod isolation;
pub mod mps;
pub mod mps_exec;
pub mod prepare;
pub mod reconfigure;
pub mod slices;
