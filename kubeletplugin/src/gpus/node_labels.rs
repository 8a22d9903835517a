//! The GPU mode an admin chooses with node labels (`gpu.tessera.dev/mode`,
//! `gpu.tessera.dev/mode.gpu-<index>`), read from the Node at start and again at every poll,
//! layered over the plugin's flags (`tessera_driver::node::gpu_mode`).

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use tessera_driver::node::gpu_mode::ModeChoice;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::error::{Error, Result};

/// The mode choice of the node's labels (bad labels are logged and left out).
pub async fn read(client: &kube::Client, node_name: &str) -> Result<ModeChoice> {
    let node = Api::<Node>::all(client.clone())
        .get(node_name)
        .await
        .map_err(|e| Error::api(format!("getting Node {node_name}"), &e))?;
    let labels: BTreeMap<String, String> = node.metadata.labels.unwrap_or_default();
    let (choice, problems) = ModeChoice::from_labels(&labels);
    for problem in problems {
        warn!(node = node_name, %problem, "GPU mode label ignored");
    }
    Ok(choice)
}

/// Stores `labels` over `flags` into `current`; returns whether the effective choice changed.
pub fn take(current: &RwLock<ModeChoice>, flags: &ModeChoice, labels: &ModeChoice) -> bool {
    let effective = labels.over(flags);
    match current.write() {
        Ok(mut c) if *c != effective => {
            info!(?effective, "GPU mode choice changed");
            *c = effective;
            true
        }
        _ => false,
    }
}

/// Reads the labels every `interval` and, when the choice changed, stores it and wakes the
/// inventory watcher. A failed read keeps the last choice.
pub fn spawn_watcher(
    client: kube::Client,
    node_name: String,
    flags: ModeChoice,
    current: Arc<RwLock<ModeChoice>>,
    wake: Arc<Notify>,
    interval: Duration,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticker.tick().await;
        loop {
            ticker.tick().await;
            match read(&client, &node_name).await {
                Ok(labels) => {
                    if take(&current, &flags, &labels) {
                        wake.notify_one();
                    }
                }
                Err(e) => {
                    warn!(error = %e, "reading the node's GPU mode labels failed; keeping the last choice");
                }
            }
        }
    })
}
