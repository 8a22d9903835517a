//! A reflector: hands every change of one resource to the cluster view over a channel, until
//! the receiver is gone. The watching itself is kube-runtime's watcher behind
//! [`tessera_kubeapi::changes`]: lists a page at a time, watches with bookmarks from the
//! list's resourceVersion, resumes a watch the server ended from the last version seen, lists
//! again when the server says that version is gone (410), and pauses after every error with
//! the backoff it is given (kube-runtime's `DefaultBackoff` in the service: 0.8 s doubling to
//! 30 s, with jitter). A (re)list reaches the view a page at a time ([`Change::Page`], handed
//! on as the pages come, so a large list is never held whole); its last page is also what
//! marks the resource synced for the controller's first pass.

use kube::core::ApiResource;
use tessera_kubeapi::Backoff;
use tessera_kubeapi::WatchOptions;
use tokio::sync::mpsc;
use tokio_stream::StreamExt as _;
use tracing::warn;

pub use tessera_kubeapi::Change;

use super::Resource;

/// How many objects one list request asks for (the server hands out the rest page by page):
/// fewer for slices, each of which may hold up to 128 devices.
fn list_page(resource: Resource) -> u32 {
    match resource {
        Resource::Slices => 50,
        _ => 500,
    }
}

/// Reflects `resource` (served as `api`) into `tx` until `tx` is closed, pausing after each
/// error for `backoff`'s next delay.
pub async fn run(
    client: kube::Client,
    resource: Resource,
    api: ApiResource,
    tx: mpsc::Sender<(Resource, Change)>,
    backoff: impl Backoff + 'static,
) {
    let options = WatchOptions {
        page_size: list_page(resource),
        pages: true,
        ..WatchOptions::default()
    };
    let changes = tessera_kubeapi::changes(client, &api, &options, backoff);
    let mut changes = std::pin::pin!(changes);
    loop {
        let next = tokio::select! {
            next = changes.next() => next,
            () = tx.closed() => return,
        };
        match next {
            Some(Ok(change)) => {
                if tx.send((resource, change)).await.is_err() {
                    return;
                }
            }
            Some(Err(e)) => {
                warn!(resource = resource.as_str(), error = %e, "watch failed; backing off and going on");
            }
            None => return,
        }
    }
}
