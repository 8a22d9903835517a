//! Kubelet plugin registration: who we are, and what kubelet thought of it.

use tessera_driver::names;
use tessera_proto::pluginregistration::v1 as pb;
use tokio::sync::watch;
use tonic::{Request, Response, Status};
use tracing::{error, info};

/// Kubelet's last verdict on our registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeletVerdict {
    /// Whether kubelet registered the plugin.
    pub registered: bool,
    /// Kubelet's reason when it did not.
    pub error: String,
}

/// The `pluginregistration.Registration` service.
#[derive(Debug)]
pub struct RegistrationService {
    driver_name: String,
    endpoint: String,
    health: bool,
    verdict: watch::Sender<Option<KubeletVerdict>>,
}

impl RegistrationService {
    /// Registration of `driver_name` with its DRA socket at `endpoint`; kubelet's verdicts go
    /// to `verdict`.
    pub fn new(
        driver_name: impl Into<String>,
        endpoint: impl Into<String>,
        verdict: watch::Sender<Option<KubeletVerdict>>,
    ) -> Self {
        Self {
            driver_name: driver_name.into(),
            endpoint: endpoint.into(),
            health: false,
            verdict,
        }
    }

    /// Whether the DRA socket also serves the health API (it is then advertised).
    #[must_use]
    pub fn serving_health(mut self, health: bool) -> Self {
        self.health = health;
        self
    }

    /// What `GetInfo` answers. v1 comes first: kubelet takes the first version it knows. The
    /// health service is listed when the plugin serves it.
    pub fn info(&self) -> pb::PluginInfo {
        let mut supported_versions = vec![
            names::DRA_SERVICE_V1.to_owned(),
            names::DRA_SERVICE_V1BETA1.to_owned(),
        ];
        if self.health {
            supported_versions.push(names::DRA_HEALTH_SERVICE_V1ALPHA1.to_owned());
        }
        pb::PluginInfo {
            r#type: names::PLUGIN_TYPE_DRA.to_owned(),
            name: self.driver_name.clone(),
            endpoint: self.endpoint.clone(),
            supported_versions,
        }
    }
}

#[tonic::async_trait]
impl pb::registration_server::Registration for RegistrationService {
    async fn get_info(
        &self,
        _request: Request<pb::InfoRequest>,
    ) -> Result<Response<pb::PluginInfo>, Status> {
        Ok(Response::new(self.info()))
    }

    async fn notify_registration_status(
        &self,
        request: Request<pb::RegistrationStatus>,
    ) -> Result<Response<pb::RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            info!(driver = %self.driver_name, "kubelet registered the plugin");
        } else {
            error!(driver = %self.driver_name, reason = %status.error, "kubelet refused the plugin");
        }
        self.verdict.send_replace(Some(KubeletVerdict {
            registered: status.plugin_registered,
            error: status.error,
        }));
        Ok(Response::new(pb::RegistrationStatusResponse {}))
    }
}
