//! Watching the node's own ResourceSlices so that ones deleted or changed by someone else come
//! back within seconds.
//!
//! A list, then a watch from the list's `resourceVersion` (field selector `spec.nodeName`,
//! `spec.driver`), resumed from the last version seen when the server ends it, listed again
//! when the server says that version is gone (410). Each event is judged against what the
//! publisher last wrote (`tessera_driver::slices::drift::judge`); a drift notifies the
//! publisher, which lists and writes only what differs. Errors never end it: it backs off
//! (the publisher's retry delays) and tries again.

use std::sync::Arc;
use std::time::Duration;

use kube::api::{Api, DynamicObject, ListParams, WatchEvent, WatchParams};
use serde_json::Value;
use tessera_driver::slices::drift::{self, SliceEvent, Verdict};
use tokio::sync::Notify;
use tokio_stream::StreamExt as _;
use tracing::{debug, info, warn};

use crate::apiserver;
use crate::publisher::SlicePublisher;

/// How long one watch request lasts before the server ends it (and it is resumed).
const WATCH_TIMEOUT_SECONDS: u32 = 290;

/// Judges `event` and notifies `drifted` when the slices must be published again.
async fn judge(publisher: &SlicePublisher, event: SliceEvent<'_>, drifted: &Notify) {
    let record = publisher.record().await;
    if let Verdict::Drifted(reason) = drift::judge(record.as_ref(), event) {
        info!(%reason, "ResourceSlices drifted from what was published; publishing again");
        drifted.notify_one();
    }
}

/// Capped exponential delays between failed attempts.
struct Backoff {
    initial: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max,
            next: initial,
        }
    }

    /// Logs `error` of `what` and sleeps the current delay, doubling it for the next failure.
    async fn pause(&mut self, what: &str, error: &(dyn std::fmt::Display + Sync)) {
        warn!(error = %error, retry_in = ?self.next, "{what} the node's ResourceSlices failed");
        tokio::time::sleep(self.next).await;
        self.next = (self.next * 2).min(self.max);
    }

    fn reset(&mut self) {
        self.next = self.initial;
    }
}

fn to_value(object: &DynamicObject) -> Option<Value> {
    serde_json::to_value(object).ok()
}

/// Watches `publisher`'s slices until the future is dropped, notifying `drifted` whenever they
/// drift from what it wrote.
pub(crate) async fn run(publisher: Arc<SlicePublisher>, drifted: Arc<Notify>) {
    let mut backoff = Backoff::new(
        publisher.config().initial_backoff,
        publisher.config().max_backoff,
    );
    let fields = publisher.field_selector();
    'list: loop {
        let version = match publisher.served_version().await {
            Ok(v) => v,
            Err(e) => {
                backoff.pause("watching", &e).await;
                continue;
            }
        };
        let api: Api<DynamicObject> = Api::all_with(
            publisher.client().clone(),
            &apiserver::resource(version, "ResourceSlice", "resourceslices"),
        );
        let list = match api.list(&ListParams::default().fields(&fields)).await {
            Ok(list) => list,
            Err(e) => {
                if matches!(&e, kube::Error::Api(s) if s.code == 404) {
                    publisher.forget().await;
                }
                backoff.pause("listing", &e).await;
                continue;
            }
        };
        let mut version_seen = list.metadata.resource_version.clone().unwrap_or_default();
        let items: Vec<Value> = list.items.iter().filter_map(to_value).collect();
        judge(&publisher, SliceEvent::Listed(&items), &drifted).await;
        loop {
            let params = WatchParams::default()
                .fields(&fields)
                .timeout(WATCH_TIMEOUT_SECONDS);
            let stream = match api.watch(&params, &version_seen).await {
                Ok(s) => s,
                Err(e) => {
                    backoff.pause("watching", &e).await;
                    continue 'list;
                }
            };
            let mut stream = Box::pin(stream);
            let mut failed = None;
            while let Some(event) = stream.next().await {
                if matches!(event, Ok(ref e) if !matches!(e, WatchEvent::Error(_))) {
                    backoff.reset();
                }
                match event {
                    Ok(WatchEvent::Added(o) | WatchEvent::Modified(o)) => {
                        if let Some(rv) = &o.metadata.resource_version {
                            version_seen.clone_from(rv);
                        }
                        if let Some(v) = to_value(&o) {
                            judge(&publisher, SliceEvent::Applied(&v), &drifted).await;
                        }
                    }
                    Ok(WatchEvent::Deleted(o)) => {
                        if let Some(rv) = &o.metadata.resource_version {
                            version_seen.clone_from(rv);
                        }
                        if let Some(v) = to_value(&o) {
                            judge(&publisher, SliceEvent::Deleted(&v), &drifted).await;
                        }
                    }
                    Ok(WatchEvent::Bookmark(b)) => version_seen = b.metadata.resource_version,
                    Ok(WatchEvent::Error(e)) => {
                        debug!(code = e.code, message = %e.message, "watch of ResourceSlices ended by the server");
                        if e.code == 410 {
                            continue 'list;
                        }
                        failed = Some(format!("{} ({})", e.message, e.code));
                        break;
                    }
                    Err(e) => {
                        failed = Some(e.to_string());
                        break;
                    }
                }
            }
            if let Some(error) = failed {
                backoff.pause("watching", &error).await;
            }
        }
    }
}
