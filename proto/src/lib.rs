//! The kubelet gRPC APIs that the Tessera kubelet plugin speaks.
//!
//! The `.proto` files and their generated code arrive with the kubelet-plugin work; until then
//! this crate is an empty library so the workspace layout matches DESIGN.md.
