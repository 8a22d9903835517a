//! A reflector: lists a resource, then watches it from the list's resourceVersion, and hands
//! every change to the cluster view over a channel. When the watch ends it resumes from the
//! last resourceVersion seen; when the server says that version is gone (410) it lists again.
//! Errors never end it: it backs off and tries again until the receiver is gone.

use std::time::Duration;

use kube::api::{Api, DynamicObject, ListParams, WatchEvent, WatchParams};
use kube::core::ApiResource;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_stream::StreamExt as _;
use tracing::{debug, warn};

use super::Resource;

/// One change of one resource.
#[derive(Debug, Clone)]
pub enum Change {
    /// The complete current state (after a list): objects not in it are gone.
    Listed(Vec<Value>),
    /// One page of a list, handed on as it arrives so that a large list is never held whole:
    /// the first page starts the list, and after the last one objects not in any page are
    /// gone (the pages together mean what one [`Change::Listed`] means).
    Page {
        /// The page's objects.
        items: Vec<Value>,
        /// Whether this page starts a list (an earlier unfinished list is abandoned).
        first: bool,
        /// Whether this page ends the list.
        last: bool,
    },
    /// An object was added or modified.
    Applied(Value),
    /// An object was deleted.
    Deleted(Value),
}

/// Longest pause between failed attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// How long one watch request lasts before the server ends it (and it is resumed).
const WATCH_TIMEOUT_SECONDS: u32 = 290;

/// How many objects one list request asks for (the server hands out the rest page by page):
/// fewer for slices, each of which may hold up to 128 devices.
fn list_page(resource: Resource) -> u32 {
    match resource {
        Resource::Slices => 50,
        _ => 500,
    }
}

/// Reflects `resource` (served as `api`) into `tx` until `tx` is closed.
pub async fn run(
    client: kube::Client,
    resource: Resource,
    api: ApiResource,
    tx: mpsc::Sender<(Resource, Change)>,
) {
    let objects: Api<DynamicObject> = Api::all_with(client, &api);
    let mut backoff = Duration::from_millis(100);
    'list: loop {
        // Listed a page at a time, each page handed on as it comes, so a large list is never
        // in memory whole and undecoded.
        let mut continue_token: Option<String> = None;
        let mut version;
        let mut first = true;
        loop {
            let mut params = ListParams::default().limit(list_page(resource));
            if let Some(token) = &continue_token {
                params = params.continue_token(token);
            }
            let page = match objects.list(&params).await {
                Ok(page) => page,
                Err(e) => {
                    warn!(resource = resource.as_str(), error = %e, "listing failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    continue 'list;
                }
            };
            version = page.metadata.resource_version.clone().unwrap_or_default();
            continue_token = page.metadata.continue_.clone().filter(|c| !c.is_empty());
            let items = page
                .items
                .into_iter()
                .filter_map(|o| super::slim::object_value(o, &api))
                .collect();
            let last = continue_token.is_none();
            let change = Change::Page { items, first, last };
            if tx.send((resource, change)).await.is_err() {
                return;
            }
            first = false;
            if last {
                break;
            }
        }
        loop {
            let params = WatchParams::default().timeout(WATCH_TIMEOUT_SECONDS);
            let stream = match objects.watch(&params, &version).await {
                Ok(s) => s,
                Err(e) => {
                    warn!(resource = resource.as_str(), error = %e, "watching failed; listing again");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    continue 'list;
                }
            };
            backoff = Duration::from_millis(100);
            let mut stream = Box::pin(stream);
            while let Some(event) = stream.next().await {
                let change = match event {
                    Ok(WatchEvent::Added(o) | WatchEvent::Modified(o)) => {
                        if let Some(rv) = &o.metadata.resource_version {
                            version.clone_from(rv);
                        }
                        super::slim::object_value(o, &api).map(Change::Applied)
                    }
                    Ok(WatchEvent::Deleted(o)) => {
                        if let Some(rv) = &o.metadata.resource_version {
                            version.clone_from(rv);
                        }
                        super::slim::object_value(o, &api).map(Change::Deleted)
                    }
                    Ok(WatchEvent::Bookmark(b)) => {
                        version = b.metadata.resource_version;
                        None
                    }
                    Ok(WatchEvent::Error(e)) => {
                        debug!(resource = resource.as_str(), code = e.code, message = %e.message, "watch ended by the server");
                        if e.code == 410 {
                            continue 'list;
                        }
                        break;
                    }
                    Err(e) => {
                        debug!(resource = resource.as_str(), error = %e, "watch stream failed");
                        break;
                    }
                };
                if let Some(change) = change
                    && tx.send((resource, change)).await.is_err()
                {
                    return;
                }
            }
            if tx.is_closed() {
                return;
            }
        }
    }
}
