//! `tessera-fake-kubelet`: kubelet's side of the DRA gRPC API, for the GPU acceptance suite
//! (`tests/gpu/run.sh`): prepares or unprepares claims through the plugin's `dra.sock` exactly
//! as kubelet does (v1 `DRAPlugin` over HTTP/2 on the unix socket) and prints the answer as JSON:
//! `{"<claim uid>": {"error": "...", "devices": [{"pool", "device", "cdiDeviceIds", "shareId"}]}}`.
//!
//! `tessera-fake-kubelet prepare|unprepare --socket PATH NAMESPACE/NAME/UID...`

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use serde_json::{Value, json};
use tessera_proto::dra::v1;
use tessera_tests::plugin_socket::dial;

fn usage() -> anyhow::Error {
    anyhow::anyhow!(
        "usage: tessera-fake-kubelet prepare|unprepare --socket PATH NAMESPACE/NAME/UID..."
    )
}

fn claim(arg: &str) -> anyhow::Result<v1::Claim> {
    let mut parts = arg.splitn(3, '/');
    match (parts.next(), parts.next(), parts.next()) {
        (Some(namespace), Some(name), Some(uid))
            if !namespace.is_empty() && !name.is_empty() && !uid.is_empty() =>
        {
            Ok(v1::Claim {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
                uid: uid.to_owned(),
            })
        }
        _ => Err(anyhow::anyhow!("{arg:?} is not NAMESPACE/NAME/UID")),
    }
}

async fn run(verb: &str, socket: PathBuf, claims: Vec<v1::Claim>) -> anyhow::Result<Value> {
    let channel = tokio::time::timeout(Duration::from_secs(10), dial(&socket))
        .await
        .context("dialling the plugin's DRA socket: no answer in 10 s")?
        .context("dialling the plugin's DRA socket")?;
    let mut client = v1::dra_plugin_client::DraPluginClient::new(channel);
    let mut out = BTreeMap::new();
    if verb == "prepare" {
        let answer = client
            .node_prepare_resources(v1::NodePrepareResourcesRequest { claims })
            .await
            .context("NodePrepareResources")?
            .into_inner();
        for (uid, claim) in answer.claims {
            let devices: Vec<Value> = claim
                .devices
                .iter()
                .map(|d| {
                    json!({
                        "pool": d.pool_name,
                        "device": d.device_name,
                        "cdiDeviceIds": d.cdi_device_ids,
                        "shareId": d.share_id,
                    })
                })
                .collect();
            out.insert(uid, json!({"error": claim.error, "devices": devices}));
        }
    } else {
        let answer = client
            .node_unprepare_resources(v1::NodeUnprepareResourcesRequest { claims })
            .await
            .context("NodeUnprepareResources")?
            .into_inner();
        for (uid, claim) in answer.claims {
            out.insert(uid, json!({"error": claim.error}));
        }
    }
    Ok(json!(out))
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let verb = args.next().ok_or_else(usage)?;
    if verb != "prepare" && verb != "unprepare" {
        return Err(usage());
    }
    if args.next().as_deref() != Some("--socket") {
        return Err(usage());
    }
    let socket: PathBuf = args.next().ok_or_else(usage)?.into();
    let claims = args
        .map(|a| claim(&a))
        .collect::<anyhow::Result<Vec<_>>>()?;
    if claims.is_empty() {
        return Err(usage());
    }
    let answer = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(run(&verb, socket, claims))?;
    let mut stdout = std::io::stdout().lock();
    std::io::Write::write_all(&mut stdout, format!("{answer}\n").as_bytes())?;
    Ok(())
}
