//! The Tessera kubelet plugin: discovers GPUs, publishes ResourceSlices and prepares claims.
//!
//! The node agent arrives with the kubelet-plugin work; until then this crate is an empty
//! library so the workspace layout matches DESIGN.md.
