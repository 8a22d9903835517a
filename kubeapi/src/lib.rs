//! Tessera's one way to reach the Kubernetes API server, shared by the controller and the
//! kubelet plugin: the client ([`client`]), the newest resource.k8s.io version the server
//! serves ([`served_resource_version`]) and the dynamic resource for a kind in it
//! ([`resource`]), and watches as a stream of [`Change`]s ([`changes`], kube-runtime's
//! watcher underneath: paged lists, bookmarks, resuming, relisting after 410, backoff).
//!
//! Objects of resource.k8s.io are read and written as JSON in the served version and converted
//! to and from the v1 model with `tessera_driver::apiversion`, so one code path covers
//! Kubernetes 1.32 (v1beta1), 1.33 (v1beta2) and 1.34+ (v1).
//!
//! ```no_run
//! # async fn sketch() -> Result<(), tessera_kubeapi::Error> {
//! use tessera_kubeapi::{Change, WatchOptions};
//! use tokio_stream::StreamExt as _;
//!
//! let client = tessera_kubeapi::client(None).await?;
//! let version = tessera_kubeapi::served_resource_version(&client).await?;
//! let slices = tessera_kubeapi::resource(version, tessera_driver::names::RESOURCE_SLICE);
//! let mut changes = std::pin::pin!(tessera_kubeapi::changes(
//!     client,
//!     &slices,
//!     &WatchOptions::default(),
//!     tessera_kubeapi::DefaultBackoff::default(),
//! ));
//! while let Some(change) = changes.next().await {
//!     match change {
//!         Ok(Change::Listed(all)) => { /* the complete current state */ }
//!         Ok(Change::Page { .. }) => { /* only with `WatchOptions::pages` */ }
//!         Ok(Change::Applied(one) | Change::Deleted(one)) => { /* one object */ }
//!         Err(e) => { /* logged; the stream backs off and goes on */ }
//!     }
//! }
//! # Ok(())
//! # }
//! ```

mod client;
mod discovery;
mod error;
pub mod events;
mod json_object;
pub mod logs;
pub mod probes;
pub mod signals;
pub mod text;
mod watch;

pub use client::client;
pub use discovery::{RESOURCE_GROUP, resource, served_resource_version, typed_json};
pub use error::{Error, Result};
pub use json_object::JsonObject;
pub use watch::{Change, WatchOptions, backoff, changes};

/// What [`changes`] pauses with after an error: kube-runtime's backoff trait, and its default
/// (0.8 s doubling to 30 s, with jitter, reset after two quiet minutes).
pub use kube::runtime::{utils::Backoff, watcher::DefaultBackoff};
