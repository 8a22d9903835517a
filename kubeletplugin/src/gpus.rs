//! The GPUs wing: which GPUs the node has and what they can prove.
//!
//! * [`discovery`]: `GpuDiscovery`, the seam the rest of the plugin reads GPUs through, and its
//!   inventory-file backend (`--gpu-backend fake`); [`nvml`]: the NVML backend and its health
//!   events.
//! * [`inventory_poller`]: re-discovers the GPUs on a period (and re-reads an inventory file when
//!   it changes), hands each new inventory to the preparer and the slice publisher.
//! * [`isolation`]: the probe that proves a GPU's isolation, run as a child of the plugin's own
//!   binary in a claim's environment.
//! * [`node_labels`]: the labels the plugin reads off its Node; [`driver_files`]: the driver's
//!   files under the mounted driver root; [`mig_minors`]: the driver's MIG capability table.
//!
//! May import: `claims` (the preparer the poller feeds, bounded input files, `Cancel`), `mps`
//! (the probe runs under an MPS daemon), `accounting` (NVML is its `GpuProcesses`), `ops` (the
//! metrics the passes count) and `error`. Nothing here imports `kubelet`, `publisher` or `cli`.

pub mod discovery;
pub mod driver_files;
pub mod inventory_poller;
pub mod isolation;
pub mod mig_minors;
pub mod node_labels;
pub mod nvml;
