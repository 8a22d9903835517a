//! The DRA resource health API (`v1alpha1.DRAResourceHealth`): kubelet keeps one
//! `NodeWatchResources` stream open and shows each device's health in the pod status of the
//! pods that use it.
//!
//! The health follows the inventory the preparer works with (the same channel the slice
//! publisher follows): [`HealthReporter`] keeps one [`HealthBoard`] for the node, and each
//! stream sends the whole board first, then, whenever the board changes, the devices whose
//! health changed (a device that is no longer published is reported once as `UNKNOWN`), and
//! the whole board again every refresh interval: kubelet takes a device whose health was not
//! reported for a while as `UNKNOWN`, so silence must not mean "nothing changed".

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tessera_driver::node::health::{Health, HealthBoard, HealthChange, HealthEntry};
use tessera_driver::node::inventory::NodeInventory;
use tessera_proto::health::v1alpha1 as pb;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use tracing::{debug, info};

/// Seconds since the Unix epoch, now (0 if the clock is before 1970).
pub fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// Keeps the node's health board in step with the inventory.
#[derive(Debug)]
pub struct HealthReporter {
    board: watch::Receiver<Arc<HealthBoard>>,
    task: JoinHandle<()>,
}

impl HealthReporter {
    /// Follows `inventory` until its sender is dropped.
    pub fn spawn(mut inventory: watch::Receiver<NodeInventory>) -> Self {
        let mut board = HealthBoard::of(&inventory.borrow_and_update(), unix_now());
        let (tx, rx) = watch::channel(Arc::new(board.clone()));
        let task = tokio::spawn(async move {
            while inventory.changed().await.is_ok() {
                let node = inventory.borrow_and_update().clone();
                let change = board.update(&node, unix_now());
                if change.is_empty() {
                    continue;
                }
                for (device, entry) in &change.changed {
                    info!(device = %device, health = ?entry.health, "device health changed");
                }
                tx.send_replace(Arc::new(board.clone()));
            }
            // The inventory no longer changes (nothing follows it, e.g. with polling off): the
            // board stays as it is, and the streams stay open and keep refreshing it.
            tx.closed().await;
        });
        Self { board: rx, task }
    }

    /// The gRPC service that streams the board, sending all of it again every `refresh`.
    pub fn service(&self, refresh: Duration) -> HealthService {
        HealthService {
            board: self.board.clone(),
            refresh,
        }
    }

    /// The board as it is now.
    pub fn board(&self) -> Arc<HealthBoard> {
        Arc::clone(&self.board.borrow())
    }
}

impl Drop for HealthReporter {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The `DRAResourceHealth` service over a health board.
#[derive(Debug, Clone)]
pub struct HealthService {
    board: watch::Receiver<Arc<HealthBoard>>,
    refresh: Duration,
}

/// How often a stream sends the whole board again when nothing changed.
pub const DEFAULT_REFRESH: Duration = Duration::from_secs(10);

fn status(health: Health) -> pb::HealthStatus {
    match health {
        Health::Healthy => pb::HealthStatus::Healthy,
        Health::Unhealthy => pb::HealthStatus::Unhealthy,
        Health::Unknown => pb::HealthStatus::Unknown,
    }
}

fn device(pool: &str, name: &str, entry: HealthEntry) -> pb::DeviceHealth {
    pb::DeviceHealth {
        device: Some(pb::DeviceIdentifier {
            pool_name: pool.to_owned(),
            device_name: name.to_owned(),
        }),
        health: status(entry.health).into(),
        last_updated_time: entry.updated_unix,
    }
}

/// The message that tells a reader of `before` what `board` says.
fn message(board: &HealthBoard, change: &HealthChange, now: i64) -> pb::NodeWatchResourcesResponse {
    let gone = HealthEntry {
        health: Health::Unknown,
        updated_unix: now,
    };
    pb::NodeWatchResourcesResponse {
        devices: change
            .changed
            .iter()
            .map(|(d, e)| device(&board.pool, d, *e))
            .chain(change.removed.iter().map(|d| device(&board.pool, d, gone)))
            .collect(),
    }
}

type WatchStream =
    Pin<Box<dyn Stream<Item = Result<pb::NodeWatchResourcesResponse, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl pb::dra_resource_health_server::DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = WatchStream;

    async fn node_watch_resources(
        &self,
        _request: Request<pb::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        let mut board = self.board.clone();
        let (tx, rx) = mpsc::channel(4);
        let mut ticker = tokio::time::interval(self.refresh);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::spawn(async move {
            let mut seen = HealthBoard::default();
            // The first message is the whole board (sent even for a node without devices, so
            // kubelet knows the stream is live); so is every refresh.
            let mut whole = true;
            loop {
                let now = Arc::clone(&board.borrow_and_update());
                let change = if whole {
                    let checked = unix_now();
                    HealthChange {
                        changed: now
                            .devices
                            .iter()
                            .map(|(d, e)| {
                                let fresh = HealthEntry {
                                    health: e.health,
                                    updated_unix: checked,
                                };
                                (d.clone(), fresh)
                            })
                            .collect(),
                        removed: seen.changes_to(&now).removed,
                    }
                } else {
                    seen.changes_to(&now)
                };
                if whole || !change.is_empty() {
                    if tx
                        .send(Ok(message(&now, &change, unix_now())))
                        .await
                        .is_err()
                    {
                        break;
                    }
                    ticker.reset();
                }
                seen = (*now).clone();
                whole = tokio::select! {
                    changed = board.changed() => if changed.is_err() { break } else { false },
                    _ = ticker.tick() => true,
                    () = tx.closed() => break,
                };
            }
            debug!("health stream closed");
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

#[cfg(test)]
mod tests {

    use tessera_driver::node::inventory::Inventory;
    use tokio_stream::StreamExt as _;

    use super::pb::dra_resource_health_server::DraResourceHealth as _;
    use super::*;

    /// Node `n` with `count` T4 GPUs.
    fn one_node(count: u32) -> NodeInventory {
        Inventory::from_yaml(&format!(
            "nodes:\n- name: n\n  gpus:\n  - model: t4-16g\n    count: {count}\n"
        ))
        .unwrap()
        .nodes
        .remove(0)
    }

    /// Asserts that `message` reports `count` devices, all healthy.
    fn assert_all_healthy(message: &pb::NodeWatchResourcesResponse, count: usize) {
        assert_eq!(message.devices.len(), count);
        assert!(
            message
                .devices
                .iter()
                .all(|d| d.health() == pb::HealthStatus::Healthy)
        );
    }

    /// A kubelet's health stream from `reporter`, repeated every `refresh`.
    async fn open_stream(reporter: &HealthReporter, refresh: Duration) -> WatchStream {
        reporter
            .service(refresh)
            .node_watch_resources(Request::new(pb::NodeWatchResourcesRequest {}))
            .await
            .unwrap()
            .into_inner()
    }

    #[tokio::test]
    async fn a_stream_reports_everything_then_each_change() {
        let mut node = one_node(2);
        let (tx, rx) = watch::channel(node.clone());
        let reporter = HealthReporter::spawn(rx);
        let mut stream = open_stream(&reporter, Duration::from_hours(1)).await;
        let first = stream.next().await.unwrap().unwrap();
        assert_all_healthy(&first, 2);

        node.gpus[1].healthy = false;
        tx.send_replace(node.clone());
        let next = stream.next().await.unwrap().unwrap();
        assert_eq!(next.devices.len(), 1);
        assert_eq!(
            next.devices[0].device.as_ref().unwrap().device_name,
            "gpu-1"
        );
        assert_eq!(next.devices[0].device.as_ref().unwrap().pool_name, "n");
        assert_eq!(next.devices[0].health(), pb::HealthStatus::Unhealthy);
        assert!(next.devices[0].last_updated_time > 0);

        node.gpus.pop();
        tx.send_replace(node);
        let gone = stream.next().await.unwrap().unwrap();
        assert_eq!(gone.devices[0].health(), pb::HealthStatus::Unknown);
    }

    #[tokio::test]
    async fn streams_stay_open_when_nothing_follows_the_inventory_any_more() {
        let node = one_node(1);
        let (tx, rx) = watch::channel(node);
        let reporter = HealthReporter::spawn(rx);
        drop(tx);
        let mut stream = open_stream(&reporter, Duration::from_millis(20)).await;
        for _ in 0..3 {
            assert_eq!(stream.next().await.unwrap().unwrap().devices.len(), 1);
        }
    }

    #[tokio::test]
    async fn a_quiet_stream_repeats_the_whole_board_every_refresh() {
        let node = one_node(2);
        let (_tx, rx) = watch::channel(node);
        let reporter = HealthReporter::spawn(rx);
        let mut stream = open_stream(&reporter, Duration::from_millis(20)).await;
        for _ in 0..3 {
            assert_all_healthy(&stream.next().await.unwrap().unwrap(), 2);
        }
    }
}
