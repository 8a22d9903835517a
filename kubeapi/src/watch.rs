//! Watches as a stream of [`Change`]s, with kube-runtime's watcher doing the protocol: a list
//! a page at a time, then a watch from the list's resourceVersion with bookmarks; a watch the
//! server ends is resumed from the last version seen (a bookmark's included), and one the
//! server answers with 410 Gone is listed again. Every error is handed on and followed by a
//! pause from the caller's backoff (kube-runtime's `DefaultBackoff` in the binaries), so a
//! failing server is never polled in a tight loop.
//!
//! kube-runtime announces a (re)list as `Init`, one `InitApply` per object, then `InitDone`;
//! the objects are gathered and handed on as one [`Change::Listed`], the complete current
//! state, so a consumer can drop whatever it holds that the list no longer has — or, with
//! [`WatchOptions::pages`], as [`Change::Page`]s of at most a page's objects each, handed on as
//! they come, so a large list is never held whole (the controller's view, at 1,000 nodes).

use std::time::Duration;

use kube::api::Api;
use kube::core::ApiResource;
use kube::runtime::utils::{Backoff, StreamBackoff};
use kube::runtime::watcher::{self, Event, ExponentialBackoff, watcher};
use serde_json::Value;
use tokio_stream::{Stream, StreamExt as _};

use crate::error::{Error, Result};
use crate::json_object::JsonObject;

/// One change of one watched resource.
#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    /// The complete current state (after a list): objects not in it are gone.
    Listed(Vec<Value>),
    /// One page of a list ([`WatchOptions::pages`]): the first page starts the list (an
    /// unfinished earlier one is abandoned), and after the last one objects not in any page
    /// are gone; together the pages mean what one [`Change::Listed`] means.
    Page {
        /// The page's objects.
        items: Vec<Value>,
        /// Whether this page starts a list.
        first: bool,
        /// Whether this page ends the list.
        last: bool,
    },
    /// An object was added or modified.
    Applied(Value),
    /// An object was deleted.
    Deleted(Value),
}

/// How a watch asks the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchOptions {
    /// Only objects matching this field selector (e.g. `spec.nodeName=n1`).
    pub field_selector: Option<String>,
    /// How many objects one list request asks for (the server hands out the rest page by page).
    pub page_size: u32,
    /// How long one watch request lasts before the server ends it (and it is resumed).
    pub timeout_seconds: u32,
    /// Hand a list on a page at a time ([`Change::Page`]) rather than whole ([`Change::Listed`]).
    pub pages: bool,
}

impl Default for WatchOptions {
    fn default() -> Self {
        Self {
            field_selector: None,
            page_size: 500,
            timeout_seconds: 290,
            pages: false,
        }
    }
}

impl WatchOptions {
    fn watcher_config(&self) -> watcher::Config {
        let config = watcher::Config::default()
            .page_size(self.page_size)
            .timeout(self.timeout_seconds);
        match &self.field_selector {
            Some(fields) => config.fields(fields),
            None => config,
        }
    }
}

/// What went wrong in one step of the watch, as an [`Error::Api`].
fn watch_error(api: &ApiResource, error: &watcher::Error) -> Error {
    let (action, code, message) = match error {
        watcher::Error::InitialListFailed(e) => ("listing", status_code(e), e.to_string()),
        watcher::Error::WatchStartFailed(e) => ("starting to watch", status_code(e), e.to_string()),
        watcher::Error::WatchFailed(e) => ("watching", status_code(e), e.to_string()),
        watcher::Error::WatchError(status) => {
            ("watching", Some(status.code), status.message.clone())
        }
        watcher::Error::NoResourceVersion => ("watching", None, error.to_string()),
    };
    Error::Api {
        action: format!("{action} {}", api.plural),
        code,
        message,
    }
}

fn status_code(error: &kube::Error) -> Option<u16> {
    match error {
        kube::Error::Api(status) => Some(status.code),
        _ => None,
    }
}

/// A backoff for [`changes`] whose pauses start at `initial` and double up to `max`, with
/// jitter (kube-runtime's exponential backoff; `DefaultBackoff` is the same from 0.8 s to
/// 30 s, reset after two quiet minutes).
pub fn backoff(initial: Duration, max: Duration) -> impl Backoff + use<> {
    ExponentialBackoff::from(
        backon::ExponentialBuilder::default()
            .with_min_delay(initial)
            .with_max_delay(max)
            .with_factor(2.0)
            .with_jitter()
            .without_max_times(),
    )
}

/// The changes of every object of `api` (cluster-wide) matching `options`, forever: the stream
/// never ends by itself. Errors are yielded (the caller logs them or acts on them) and each is
/// followed by a pause of `backoff`'s next delay; any other item resets `backoff`.
pub fn changes<B: Backoff + 'static>(
    client: kube::Client,
    api: &ApiResource,
    options: &WatchOptions,
    backoff: B,
) -> impl Stream<Item = Result<Change>> + Send + use<B> {
    let objects: Api<JsonObject> = Api::all_with(client, api);
    let events = StreamBackoff::new(watcher(objects, options.watcher_config()), backoff);
    let api = api.clone();
    let (pages, page_size) = (
        options.pages,
        usize::try_from(options.page_size)
            .unwrap_or(usize::MAX)
            .max(1),
    );
    // Objects of a list in progress: handed on whole at its end, or a page at a time.
    let mut listing: Vec<Value> = Vec::new();
    let mut first = true;
    let page = move |listing: &mut Vec<Value>, first: &mut bool, last: bool| {
        let items = std::mem::take(listing);
        let change = if pages {
            Change::Page {
                items,
                first: std::mem::replace(first, false),
                last,
            }
        } else {
            Change::Listed(items)
        };
        Some(Ok(change))
    };
    events.filter_map(move |event| match event {
        Ok(Event::Init) => {
            listing = Vec::new();
            first = true;
            None
        }
        Ok(Event::InitApply(object)) => {
            listing.push(object.into_value(&api));
            if pages && listing.len() >= page_size {
                page(&mut listing, &mut first, false)
            } else {
                None
            }
        }
        Ok(Event::InitDone) => page(&mut listing, &mut first, true),
        Ok(Event::Apply(object)) => Some(Ok(Change::Applied(object.into_value(&api)))),
        Ok(Event::Delete(object)) => Some(Ok(Change::Deleted(object.into_value(&api)))),
        Err(e) => Some(Err(watch_error(&api, &e))),
    })
}

#[cfg(test)]
mod tests {

    use super::*;

    #[test]
    fn the_backoff_grows_to_its_cap_and_resets() {
        let (initial, max) = (Duration::from_millis(10), Duration::from_millis(80));
        let mut pauses = backoff(initial, max);
        let first: Vec<Duration> = pauses.by_ref().take(8).collect();
        assert_eq!(first.len(), 8, "the backoff never gives up");
        // Jitter adds up to one more delay; the cap holds before it.
        assert!(
            first.iter().all(|d| *d >= initial && *d <= 2 * max),
            "{first:?}"
        );
        assert!(first[7] >= max, "{first:?}");
        pauses.reset();
        assert!(pauses.next().unwrap() < 2 * initial);
    }

    #[test]
    fn options_reach_the_watcher() {
        let options = WatchOptions {
            field_selector: Some("spec.nodeName=n1".to_owned()),
            page_size: 50,
            timeout_seconds: 60,
            pages: true,
        };
        let config = options.watcher_config();
        assert_eq!(config.field_selector.as_deref(), Some("spec.nodeName=n1"));
        assert_eq!(config.page_size, Some(50));
        assert_eq!(config.timeout, Some(60));
        assert!(config.bookmarks, "bookmarks are asked for");
    }
}
