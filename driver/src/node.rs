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
//!
//! Inside the wing the arrows run one way, from the modules that decide to the values they
//! share (no two files import each other):
//!
//! * leaves, importing nothing of the wing: `prepared` (a prepared claim, its devices and
//!   shares), `inventory` (the GPUs, with the isolation verdict each one stores and publishes),
//!   `mps` (the MPS daemon a claim needs, and how daemons are run), `mps_exec`, `driver_root`;
//! * `cdi` renders a prepared claim (`prepared`, `mps`, and `inventory` for the device-plugin
//!   variables); `checkpoint` records it (`prepared`, `cdi`, `mps`);
//! * `prepare` builds the prepared claim and has it rendered (`prepared`, `inventory`, `cdi`);
//!   `isolation` judges probes and runs its probe's claim through a container's CDI edits
//!   (`prepared`, `inventory`, `cdi`, `mps_exec`), and writes its verdicts into the inventory;
//! * `claim_status` decides the entries of `ResourceClaim.status.devices` the node writes
//!   (`checkpoint`, `inventory`, `cdi`, `accounting`);
//! * `accounting` (`checkpoint`, `mps`), `reconfigure` (`checkpoint`, `inventory`), `gpu_mode`,
//!   `health` and `slices` (`inventory`);
//! * `mps_peer` (whether a control socket's peer is the recorded daemon: `mps`) and `mps_user`
//!   (which Unix user a share claim's daemon serves, and its directories' access: `mps`,
//!   `accounting`).

pub mod accounting;
pub mod cdi;
pub mod checkpoint;
pub mod claim_status;
pub mod driver_root;
pub mod gpu_mode;
pub mod health;
pub mod host_dir;
pub mod inventory;
pub mod isolation;
pub mod mps;
pub mod mps_exec;
pub mod mps_peer;
pub mod mps_user;
pub mod prepare;
pub mod prepared;
pub mod reconfigure;
pub mod schedule;
pub mod slices;
