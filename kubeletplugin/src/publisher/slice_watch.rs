//! Watching the node's own ResourceSlices so that ones deleted or changed by someone else come
//! back within seconds.
//!
//! kube-runtime's watcher, through [`tessera_kubeapi::changes`] (field selector
//! `spec.nodeName`, `spec.driver`): a list, then a watch from its `resourceVersion` with
//! bookmarks, resumed from the last version seen when the server ends it, listed again when
//! the server says that version is gone (410). Each change is judged against what the
//! publisher last wrote (`tessera_driver::node::slices::drift::judge`); a drift notifies the
//! publisher, which lists and writes only what differs. Errors never end it: each is followed
//! by a pause that starts at the publisher's first retry delay and doubles up to its longest.
//! A 404 (the served resource.k8s.io version is gone: the cluster was upgraded) makes it
//! discover the version again.

use std::sync::Arc;

use tessera_driver::node::slices::drift::{self, SliceEvent, Verdict};
use tessera_kubeapi::Backoff as _;
use tessera_kubeapi::{Change, WatchOptions};
use tokio::sync::Notify;
use tokio_stream::StreamExt as _;
use tracing::{info, warn};

use super::SlicePublisher;

/// Judges `event` and notifies `drifted` when the slices must be published again.
async fn judge(publisher: &SlicePublisher, event: SliceEvent<'_>, drifted: &Notify) {
    let record = publisher.record().await;
    if let Verdict::Drifted(reason) = drift::judge(record.as_ref(), event) {
        info!(%reason, "ResourceSlices drifted from what was published; publishing again");
        drifted.notify_one();
    }
}

/// Watches `publisher`'s slices until the future is dropped, notifying `drifted` whenever they
/// drift from what it wrote.
pub(crate) async fn run(publisher: Arc<SlicePublisher>, drifted: Arc<Notify>) {
    let (initial, max) = (
        publisher.config().initial_backoff,
        publisher.config().max_backoff,
    );
    let options = WatchOptions {
        field_selector: Some(publisher.field_selector()),
        ..WatchOptions::default()
    };
    // Pauses between attempts to discover the served version (the watch has its own).
    let mut pauses = tessera_kubeapi::backoff(initial, max);
    loop {
        match publisher.served_version().await {
            Ok(version) => {
                let api = tessera_kubeapi::resource(version, tessera_driver::names::RESOURCE_SLICE);
                let changes = tessera_kubeapi::changes(
                    publisher.client().clone(),
                    &api,
                    &options,
                    tessera_kubeapi::backoff(initial, max),
                );
                let mut changes = std::pin::pin!(changes);
                // A list handed on in pages (not asked for here: one node's slices are few)
                // is judged once whole.
                let mut listing: Vec<serde_json::Value> = Vec::new();
                while let Some(change) = changes.next().await {
                    match change {
                        Ok(Change::Listed(items)) => {
                            pauses.reset();
                            judge(&publisher, SliceEvent::Listed(&items), &drifted).await;
                        }
                        Ok(Change::Page { items, first, last }) => {
                            if first {
                                listing.clear();
                            }
                            listing.extend(items);
                            if last {
                                pauses.reset();
                                let items = std::mem::take(&mut listing);
                                judge(&publisher, SliceEvent::Listed(&items), &drifted).await;
                            }
                        }
                        Ok(Change::Applied(v)) => {
                            judge(&publisher, SliceEvent::Applied(&v), &drifted).await;
                        }
                        Ok(Change::Deleted(v)) => {
                            judge(&publisher, SliceEvent::Deleted(&v), &drifted).await;
                        }
                        Err(e) if e.api_code() == Some(404) => {
                            warn!(error = %e, "the node's ResourceSlices are not served in {version}; discovering the version again");
                            publisher.forget().await;
                            break;
                        }
                        Err(e) => {
                            warn!(error = %e, "watching the node's ResourceSlices failed; backing off");
                        }
                    }
                }
            }
            Err(e) => {
                warn!(error = %e, "discovering the served resource.k8s.io version failed");
            }
        }
        tokio::time::sleep(pauses.next().unwrap_or(max)).await;
    }
}
