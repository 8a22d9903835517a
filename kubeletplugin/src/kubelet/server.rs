//! The plugin's two unix sockets and their gRPC servers.
//!
//! The DRA socket (`<plugin-dir>/dra.sock`) serves the DRA API v1 and v1beta1 (and the health
//! API v1alpha1 when the plugin reports health); the
//! registration socket (`<registration-dir>/<driver>-reg.sock`) is what kubelet's plugin
//! watcher finds. The DRA socket is bound first, so when kubelet sees the registration socket
//! and connects to the endpoint it is told, the endpoint already answers.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tessera_driver::names;
use tessera_proto::dra::{v1, v1beta1};
use tessera_proto::health::v1alpha1 as health;
use tessera_proto::pluginregistration::v1 as reg;
use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::UnixListenerStream;
use tracing::info;

use crate::claims::preparer::ClaimPreparer;
use crate::error::{Error, Result};
use crate::kubelet::authority::AuthorityShim;
use crate::kubelet::dra::DraService;
use crate::kubelet::health_stream::HealthService;
use crate::kubelet::registration::{KubeletVerdict, RegistrationService};

/// Where the plugin listens.
#[derive(Debug, Clone)]
pub struct PluginConfig {
    /// The driver name (registration name, socket name).
    pub driver_name: String,
    /// Kubelet's plugin registry directory.
    pub registration_dir: PathBuf,
    /// The plugin's own directory, holding the DRA socket.
    pub plugin_dir: PathBuf,
}

impl PluginConfig {
    /// `<registration-dir>/<driver>-reg.sock`.
    pub fn registration_socket(&self) -> PathBuf {
        self.registration_dir.join(format!(
            "{}{}",
            self.driver_name,
            names::REGISTRATION_SOCKET_SUFFIX
        ))
    }

    /// `<plugin-dir>/dra.sock`.
    pub fn dra_socket(&self) -> PathBuf {
        self.plugin_dir.join(names::DRA_SOCKET_NAME)
    }
}

/// Binds `path` after removing a socket a previous run left, with owner-only permissions.
fn bind(path: &Path) -> Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| Error::io("creating", dir, e))?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => info!(path = %path.display(), "removed stale socket"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io("removing stale socket", path, e)),
    }
    let listener = UnixListener::bind(path).map_err(|e| Error::io("binding", path, e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| Error::io("restricting permissions of", path, e))?;
    Ok(listener)
}

/// The listener's connections, each under an [`AuthorityShim`] so that the `:authority` kubelet
/// sends (the socket path) does not make the HTTP/2 layer reset its calls.
fn accepted(
    listener: UnixListener,
) -> impl tokio_stream::Stream<Item = std::io::Result<AuthorityShim<tokio::net::UnixStream>>> {
    UnixListenerStream::new(listener).map(|conn| conn.map(AuthorityShim::new))
}

type ServerTask = JoinHandle<std::result::Result<(), tonic::transport::Error>>;

/// A plugin serving on its sockets; dropping it without [`RunningPlugin::shutdown`] stops the
/// servers too, but leaves the socket files behind.
pub struct RunningPlugin {
    config: PluginConfig,
    stop: watch::Sender<bool>,
    tasks: Vec<ServerTask>,
    verdict: watch::Receiver<Option<KubeletVerdict>>,
}

/// Binds both sockets and starts serving the DRA API without the health API; returns once
/// kubelet can connect.
pub fn start(config: PluginConfig, preparer: Arc<dyn ClaimPreparer>) -> Result<RunningPlugin> {
    start_with_health(config, preparer, None)
}

/// Binds both sockets and starts serving; with `health`, the DRA socket also serves
/// `v1alpha1.DRAResourceHealth` and registration advertises it. Returns once kubelet can
/// connect.
pub fn start_with_health(
    config: PluginConfig,
    preparer: Arc<dyn ClaimPreparer>,
    health: Option<HealthService>,
) -> Result<RunningPlugin> {
    let (stop, stopped) = watch::channel(false);
    let until_stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let dra = DraService::new(preparer);
    let dra_socket = config.dra_socket();
    let dra_listener = bind(&dra_socket)?;
    let serves_health = health.is_some();
    let dra_task = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(v1::dra_plugin_server::DraPluginServer::new(dra.clone()))
            .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(dra))
            .add_optional_service(
                health.map(health::dra_resource_health_server::DraResourceHealthServer::new),
            )
            .serve_with_incoming_shutdown(accepted(dra_listener), until_stopped(stopped.clone())),
    );

    let (verdict_tx, verdict) = watch::channel(None);
    let registration = RegistrationService::new(
        config.driver_name.clone(),
        dra_socket.display().to_string(),
        verdict_tx,
    )
    .serving_health(serves_health);
    let reg_socket = config.registration_socket();
    let reg_listener = bind(&reg_socket)?;
    let reg_task = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(reg::registration_server::RegistrationServer::new(
                registration,
            ))
            .serve_with_incoming_shutdown(accepted(reg_listener), until_stopped(stopped)),
    );
    info!(
        registration = %reg_socket.display(),
        dra = %dra_socket.display(),
        "serving"
    );
    Ok(RunningPlugin {
        config,
        stop,
        tasks: vec![reg_task, dra_task],
        verdict,
    })
}

impl RunningPlugin {
    /// Kubelet's last verdict on the registration (`None` until kubelet sent one); the
    /// readiness signal.
    pub fn registration(&self) -> watch::Receiver<Option<KubeletVerdict>> {
        self.verdict.clone()
    }

    /// Whether kubelet has registered the plugin.
    pub fn is_registered(&self) -> bool {
        self.verdict.borrow().as_ref().is_some_and(|v| v.registered)
    }

    /// The sockets' paths.
    pub fn config(&self) -> &PluginConfig {
        &self.config
    }

    /// Stops serving (in-flight calls finish first) and removes the socket files, the
    /// registration socket first so kubelet stops routing claims to us.
    pub async fn shutdown(self) -> Result<()> {
        self.stop.send_replace(true);
        let mut first_error = None;
        for task in self.tasks {
            let outcome = match task.await {
                Ok(served) => served.map_err(Error::from),
                Err(e) => Err(Error::Task(e.to_string())),
            };
            if let Err(e) = outcome {
                first_error.get_or_insert(e);
            }
        }
        for socket in [self.config.registration_socket(), self.config.dra_socket()] {
            match std::fs::remove_file(&socket) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    first_error.get_or_insert(Error::io("removing", socket, e));
                }
            }
        }
        info!("stopped");
        first_error.map_or(Ok(()), Err)
    }
}
