//! Dialling a plugin's unix socket the way kubelet does: gRPC over HTTP/2 on the socket (the
//! URI is a placeholder; the connector ignores it); and kubelet's calls on the registration
//! and DRA sockets.

use std::collections::HashMap;
use std::path::Path;

use anyhow::Context as _;
use hyper_util::rt::TokioIo;
use tessera_proto::dra::v1;
use tessera_proto::pluginregistration::v1 as reg;
use tonic::transport::{Channel, Endpoint};

/// A registration client on `channel` (the plugin's registration socket).
pub type Registration = reg::registration_client::RegistrationClient<Channel>;

/// A DRA client (v1) on the plugin's DRA socket.
pub type Dra = v1::dra_plugin_client::DraPluginClient<Channel>;

/// One attempt to open a gRPC channel to the plugin's unix socket at `socket`; a socket that is
/// missing or that nothing serves is an error.
///
/// # Errors
/// The transport's error when the socket cannot be connected or HTTP/2 cannot be set up on it.
pub async fn dial(socket: &Path) -> Result<Channel, tonic::transport::Error> {
    let socket = socket.to_owned();
    Endpoint::try_from("http://[::]:50051")?
        .connect_with_connector(tower::service_fn(move |_| {
            let socket = socket.clone();
            async move {
                Ok::<_, std::io::Error>(TokioIo::new(
                    tokio::net::UnixStream::connect(socket).await?,
                ))
            }
        }))
        .await
}

/// Kubelet's first call on the plugin's registration socket, on `channel`: `GetInfo`. Returns
/// the client, for the status that follows, and the plugin's answer.
///
/// # Errors
/// The status the plugin answered with.
pub async fn get_info(channel: Channel) -> Result<(Registration, reg::PluginInfo), tonic::Status> {
    let mut registration = Registration::new(channel);
    let info = registration
        .get_info(reg::InfoRequest {})
        .await?
        .into_inner();
    Ok((registration, info))
}

/// Kubelet's registration status, as it reports it after `GetInfo`: registered, or (`error`)
/// not registered for that reason.
///
/// # Errors
/// The status the plugin answered with.
pub async fn notify_registration(
    registration: &mut Registration,
    error: Option<&str>,
) -> Result<(), tonic::Status> {
    registration
        .notify_registration_status(reg::RegistrationStatus {
            plugin_registered: error.is_none(),
            error: error.unwrap_or_default().to_owned(),
        })
        .await?;
    Ok(())
}

/// Kubelet's `NodePrepareResources` of `claim` alone: the CDI device ids of its devices, in the
/// plugin's order.
///
/// # Errors
/// The call's status, or the error the plugin answered for the claim (or that it answered
/// nothing for it).
pub async fn prepare_one(dra: &mut Dra, claim: v1::Claim) -> anyhow::Result<Vec<String>> {
    let uid = claim.uid.clone();
    let answer = dra
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![claim],
        })
        .await?
        .into_inner();
    let one = answer_for(&answer.claims, &uid, |a| &a.error)?;
    Ok(one
        .devices
        .iter()
        .flat_map(|d| d.cdi_device_ids.clone())
        .collect())
}

/// Kubelet's `NodeUnprepareResources` of `claim` alone.
///
/// # Errors
/// The call's status, or the error the plugin answered for the claim (or that it answered
/// nothing for it).
pub async fn unprepare_one(dra: &mut Dra, claim: v1::Claim) -> anyhow::Result<()> {
    let uid = claim.uid.clone();
    let answer = dra
        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
            claims: vec![claim],
        })
        .await?
        .into_inner();
    answer_for(&answer.claims, &uid, |a| &a.error)?;
    Ok(())
}

/// The plugin's answer for claim `uid` among `answers`, where it gave one and its error
/// (`error` reads it) is empty.
fn answer_for<'a, T>(
    answers: &'a HashMap<String, T>,
    uid: &str,
    error: impl Fn(&T) -> &String,
) -> anyhow::Result<&'a T> {
    let one = answers
        .get(uid)
        .with_context(|| format!("no answer for claim {uid}"))?;
    let error = error(one);
    anyhow::ensure!(error.is_empty(), "{error}");
    Ok(one)
}
