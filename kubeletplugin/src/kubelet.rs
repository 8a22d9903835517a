//! The kubelet wing: everything kubelet talks to over the plugin's two unix sockets.
//!
//! * [`server`]: starts the registration and DRA sockets (`start`, `RunningPlugin`);
//!   [`authority`]: the layer under them that accepts the `:authority` kubelet sends on a unix
//!   socket.
//! * [`registration`]: the plugin-registration service and kubelet's verdict on it.
//! * [`dra`]: the DRA node service (v1 and v1beta1), a thin layer over `claims::preparer`.
//! * [`health_stream`]: the DRA health API, following the inventory's health.
//!
//! May import: `claims` (the preparer and the claim names it answers for) and `error`. Nothing
//! here imports `gpus`, `ops`, `accounting`, `publisher` or `cli`.

pub mod authority;
pub mod dra;
pub mod health_stream;
pub mod registration;
pub mod server;
