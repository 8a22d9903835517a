//! Cross-crate integration tests for Tessera live in this crate's `tests/` folder; fixtures sit
//! beside them. The library holds what several of those tests share: the fake API server,
//! dialling a plugin's socket (for these tests, the node agent's and the acceptance suite's
//! fake kubelet), the deep directory trees a tenant could build, what the host lets a test
//! mount and run, and what the scale benchmarks share.

pub mod fake_apiserver;
pub mod host;
pub mod plugin_socket;
pub mod scale;
pub mod trees;
