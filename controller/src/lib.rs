//! Tessera's control-plane side: the `tessera` CLI (offline demo, allocate, validate; live
//! inspect) and the admission webhook, thin adapters around the pure core in `tessera-driver`.

pub mod apiserver;
pub mod cli;
pub mod error;
pub mod webhook;

pub use error::{Error, Result};
