//! The admission webhook, served over HTTPS by the controller.
//!
//! ```text
//! let lookup = Arc::new(ApiAdmissionLookup::new(client).await?);
//! webhook::serve(WebhookConfig::new(addr, cert_dir), lookup, shutdown_signal).await?;
//! ```
//!
//! Three hooks (see [`hooks`]): `/mutate-pods` (device-plugin names rewritten into claims, and
//! the scheduling gate; the chart registers it with `failurePolicy: Ignore`), `/mutate-claims` (canonical opaque parameters; `Ignore`) and
//! `/validate-claims` (share rules; `failurePolicy: Fail`). `/healthz` answers `ok`. The
//! decisions are the pure functions of `tessera_driver::admission`.

pub mod hooks;
pub mod lookup;
pub mod review;
pub mod server;
mod stage;
pub mod tls;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tessera_driver::names;

pub use hooks::{Admission, Hook};
pub use lookup::{AdmissionLookup, ApiAdmissionLookup, FakeAdmissionLookup, FakeBehaviour};
pub use server::BoundWebhook;

use crate::error::{Error, Result};

/// The default time all lookups of one review may take together; the chart gives the API
/// server's call a longer timeout so a slow lookup still ends in an answer.
pub const DEFAULT_LOOKUP_TIMEOUT: Duration = Duration::from_secs(4);

/// Where and how the webhook serves.
#[derive(Debug, Clone)]
pub struct WebhookConfig {
    /// The address to listen on, e.g. `0.0.0.0:9443`.
    pub addr: SocketAddr,
    /// The directory holding `tls.crt` and `tls.key` (a mounted Secret).
    pub cert_dir: PathBuf,
    /// Tessera's DRA driver name.
    pub driver_name: String,
    /// How long all cluster lookups of one review may take together.
    pub lookup_timeout: Duration,
    /// Time-sliced replicas per GPU: one `nvidia.com/gpu.shared` is 1/R of a card.
    pub shared_replicas: u32,
    /// How many connections are served and in their TLS handshake at once.
    pub capacity: server::Capacity,
}

impl WebhookConfig {
    /// A configuration with the default driver name and lookup timeout.
    pub fn new(addr: SocketAddr, cert_dir: impl Into<PathBuf>) -> Self {
        Self {
            addr,
            cert_dir: cert_dir.into(),
            driver_name: names::DEFAULT_DRIVER_NAME.to_owned(),
            lookup_timeout: DEFAULT_LOOKUP_TIMEOUT,
            shared_replicas:
                tessera_driver::admission::device_plugin_names::DEFAULT_SHARED_REPLICAS,
            capacity: server::Capacity::default(),
        }
    }
}

/// Loads the certificate and binds the listener; an error names what is missing or wrong.
pub async fn bind(config: WebhookConfig, lookup: Arc<dyn AdmissionLookup>) -> Result<BoundWebhook> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let certs = Arc::new(tls::CertStore::load(
        &config.cert_dir,
        Arc::clone(&provider),
    )?);
    let tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Config(format!("TLS configuration: {e}")))?
        .with_no_client_auth()
        .with_cert_resolver(Arc::clone(&certs) as Arc<dyn rustls::server::ResolvesServerCert>);
    let listener = tokio::net::TcpListener::bind(config.addr)
        .await
        .map_err(|e| Error::Config(format!("webhook address {}: {e}", config.addr)))?;
    let admission = Admission::new(lookup, &config.driver_name, config.lookup_timeout)
        .with_shared_replicas(config.shared_replicas);
    Ok(BoundWebhook::new(
        listener,
        certs,
        Arc::new(tls),
        admission,
        config.capacity,
    ))
}

/// Serves the webhook until `shutdown` completes.
pub async fn serve(
    config: WebhookConfig,
    lookup: Arc<dyn AdmissionLookup>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<()> {
    bind(config, lookup).await?.run(shutdown).await
}
