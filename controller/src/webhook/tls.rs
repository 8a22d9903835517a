//! The webhook's serving certificate: `tls.crt` and `tls.key` from a mounted Secret, reloaded
//! when they change (cert-manager rotates them in place).
//!
//! The files are looked at (not read) before each new connection; when their size, mtime or
//! inode changed they are read again. A pair that does not load (a half-written rotation, a key
//! that does not match the certificate) keeps the previous certificate in service and is tried
//! again after the next change.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::SystemTime;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

use crate::error::{Error, Result};

/// File name of the certificate chain (PEM) in the certificate directory.
pub const CERT_FILE: &str = "tls.crt";
/// File name of the private key (PEM) in the certificate directory.
pub const KEY_FILE: &str = "tls.key";

/// What identifies one version of a file without reading it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stamp {
    modified: Option<SystemTime>,
    len: u64,
    inode: u64,
}

fn stamp(path: &Path) -> Option<Stamp> {
    use std::os::unix::fs::MetadataExt as _;
    let meta = fs::metadata(path).ok()?;
    Some(Stamp {
        modified: meta.modified().ok(),
        len: meta.len(),
        inode: meta.ino(),
    })
}

#[derive(Debug)]
struct Loaded {
    stamps: (Option<Stamp>, Option<Stamp>),
    key: Arc<CertifiedKey>,
}

/// The current certificate, reloaded on change; the TLS server asks it on every handshake.
#[derive(Debug)]
pub struct CertStore {
    cert: PathBuf,
    key: PathBuf,
    provider: Arc<CryptoProvider>,
    loaded: Mutex<Loaded>,
}

impl CertStore {
    /// Loads `dir/tls.crt` and `dir/tls.key`; an error names the file and what is wrong.
    pub fn load(dir: &Path, provider: Arc<CryptoProvider>) -> Result<Self> {
        let cert = dir.join(CERT_FILE);
        let key = dir.join(KEY_FILE);
        let stamps = (stamp(&cert), stamp(&key));
        let certified = load_pair(&cert, &key, &provider)?;
        Ok(Self {
            cert,
            key,
            provider,
            loaded: Mutex::new(Loaded {
                stamps,
                key: Arc::new(certified),
            }),
        })
    }

    /// Reloads the pair if either file changed since it was last looked at; returns whether a
    /// new certificate is now in service.
    pub fn refresh(&self) -> bool {
        let stamps = (stamp(&self.cert), stamp(&self.key));
        let mut loaded = self.loaded.lock().unwrap_or_else(PoisonError::into_inner);
        if loaded.stamps == stamps {
            return false;
        }
        loaded.stamps = stamps;
        match load_pair(&self.cert, &self.key, &self.provider) {
            Ok(key) => {
                loaded.key = Arc::new(key);
                tracing::info!(cert = %self.cert.display(), "serving certificate reloaded");
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "serving certificate changed but does not load; keeping the previous one");
                false
            }
        }
    }

    /// The certificate in service.
    pub fn current(&self) -> Arc<CertifiedKey> {
        Arc::clone(
            &self
                .loaded
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .key,
        )
    }
}

impl ResolvesServerCert for CertStore {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

fn load_pair(cert: &Path, key: &Path, provider: &CryptoProvider) -> Result<CertifiedKey> {
    let bad = |path: &Path, what: String| Error::Config(format!("{}: {what}", path.display()));
    let chain = CertificateDer::pem_file_iter(cert)
        .map_err(|e| bad(cert, format!("cannot read the certificate: {e}")))?
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| bad(cert, format!("not a PEM certificate chain: {e}")))?;
    if chain.is_empty() {
        return Err(bad(cert, "holds no CERTIFICATE block".to_owned()));
    }
    let private = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| bad(key, format!("not a PEM private key: {e}")))?;
    CertifiedKey::from_der(chain, private, provider)
        .map_err(|e| bad(key, format!("does not go with {}: {e}", cert.display())))
}
