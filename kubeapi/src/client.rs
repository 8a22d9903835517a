//! The API client, from a kubeconfig or the pod's service account.

use std::path::Path;

use crate::error::{Error, Result};

/// A client from `kubeconfig`, or from the pod's service account when `None`.
///
/// The client does not retry by itself: kube's default retries 429s (and 503s, 504s) up to 15
/// times with exponential backoff, and a 429 from the eviction subresource is a
/// budget's (`PodDisruptionBudget`) "not now" that the controller must see at once, not minutes later.
/// Both binaries already treat a failed request as "try again soon" with their own backoff
/// (the watcher's, the controller's pass, kubelet's retry of a failed prepare).
pub async fn client(kubeconfig: Option<&Path>) -> Result<kube::Client> {
    let config_error =
        |what: &str, e: &dyn std::fmt::Display| Error::Config(format!("{what}: {e}"));
    let config = match kubeconfig {
        Some(path) => {
            let file = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| config_error(&format!("reading kubeconfig {}", path.display()), &e))?;
            kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| config_error(&format!("kubeconfig {}", path.display()), &e))?
        }
        None => kube::Config::incluster().map_err(|e| {
            config_error(
                "in-cluster configuration (use --kubeconfig outside a pod)",
                &e,
            )
        })?,
    };
    let mut config = config;
    config.default_retry = false;
    kube::Client::try_from(config).map_err(|e| Error::api("building the API client", &e))
}

#[cfg(test)]
mod tests {

    use super::*;

    /// The TLS stack (rustls with ring) builds a client for an HTTPS server; nothing panics
    /// choosing a crypto provider.
    #[tokio::test]
    async fn https_kubeconfig_builds_a_client() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubeconfig");
        std::fs::write(
            &path,
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    \
             server: https://127.0.0.1:1\n    insecure-skip-tls-verify: true\n\
             contexts:\n- name: c\n  context:\n    cluster: c\n    user: u\n\
             current-context: c\nusers:\n- name: u\n  user:\n    token: t\n",
        )
        .unwrap();
        let client = client(Some(&path)).await.unwrap();
        // Nothing listens there: an error, not a panic.
        let err = crate::served_resource_version(&client).await.unwrap_err();
        assert!(matches!(err, Error::Api { code: None, .. }), "{err}");
    }

    #[tokio::test]
    async fn a_missing_kubeconfig_is_a_config_error() {
        let Err(err) = client(Some(Path::new("/nonexistent/kubeconfig"))).await else {
            panic!("a missing kubeconfig built a client");
        };
        assert!(matches!(err, Error::Config(_)), "{err}");
    }
}
