//! Cross-crate integration tests for Tessera live in this crate's `tests/` folder; fixtures sit
//! beside them. The library holds what several of those tests share: the fake API server, and
//! what the scale benchmarks share.

pub mod fake_apiserver;
pub mod scale;
