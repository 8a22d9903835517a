//! Tessera's control-plane side: the `tessera-controller` service (cluster view, gate
//! protocol, leader election, admission webhook, metrics) and the `tessera` CLI (offline demo,
//! allocate, validate; live inspect), thin adapters around the pure core in `tessera-driver`.

pub mod args;
pub mod cli;
pub mod cluster;
pub mod device_plugin_templates;
pub mod error;
pub mod health_http;
pub mod leader;
pub mod metrics;
mod object_key;
pub mod reconcile;
pub mod service;
pub mod tidal;
pub mod webhook;
pub mod writer;

pub use error::{Error, Result};
