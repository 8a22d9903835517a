//! Tessera's control-plane side. For now: the offline `tessera` CLI (demo, allocate, validate),
//! a thin adapter around the pure core in `tessera-driver`.

pub mod apiserver;
pub mod cli;
pub mod error;

pub use error::{Error, Result};
