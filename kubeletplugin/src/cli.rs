//! The command-line wing: the two binaries' flags and the process around the library.
//!
//! * [`args`]: the kubelet plugin's flags, and nothing else; [`wiring`]: the process they
//!   start (logs, runtime, every wing put together, signals).
//! * [`ops_tasks`]: the metrics endpoint and the inventory watcher, run next to the sockets.
//! * [`mps_cli`]: `tessera-mps`, the MPS daemons' node host and mount-namespace wrapper.
//!
//! May import: every other wing (it only wires them together). Nothing imports `cli` but the
//! binaries and the tests that parse a command line.

pub mod args;
pub mod mps_cli;
pub mod ops_tasks;
pub mod wiring;
