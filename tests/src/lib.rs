//! Cross-crate integration tests for Tessera live in this crate's `tests/` folder; fixtures sit
//! beside them.
