//! What a real API server does to watches and lists that the fake imitates on a test's word:
//! ending every open watch (as a server does at its timeout or on restart), sending bookmarks
//! to watches that allow them, compacting its history so a watch resumed from an older
//! resourceVersion is answered `410 Gone`, holding new watch requests back for a while, and
//! handing out lists a page at a time (`limit`, `continue`).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{Value, json};
use tokio::sync::watch;

use super::{FakeApiServer, StatusError};

/// The fake's switches for watches.
pub(super) struct WatchControl {
    /// Bumped to end every open watch.
    pub(super) ended: watch::Sender<u64>,
    /// Bumped to have every watch that allows bookmarks send one.
    pub(super) bookmarks: watch::Sender<u64>,
    /// While `true`, a new watch request waits before it is answered.
    held: watch::Sender<bool>,
    /// Watches from a resourceVersion older than this are answered 410 Gone.
    compacted: Mutex<u64>,
    /// How many bookmarks watches have sent.
    pub(super) bookmarks_sent: AtomicU64,
}

impl WatchControl {
    pub(super) fn new() -> Self {
        Self {
            ended: watch::channel(0).0,
            bookmarks: watch::channel(0).0,
            held: watch::channel(false).0,
            compacted: Mutex::new(0),
            bookmarks_sent: AtomicU64::new(0),
        }
    }

    /// Waits while new watches are held back.
    pub(super) async fn wait_until_let_through(&self) {
        let mut held = self.held.subscribe();
        let _ = held.wait_for(|h| !*h).await;
    }

    /// The oldest resourceVersion a watch may start from.
    pub(super) fn compacted(&self) -> u64 {
        *self
            .compacted
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The one event of a watch that starts before the compacted history, as a real server sends
/// it (HTTP 200, then an `ERROR` event carrying a 410 Status).
pub(super) fn expired(start: u64, compacted: u64) -> Value {
    json!({"type": "ERROR", "object": StatusError::new(
        410,
        "Expired",
        format!("too old resource version: {start} ({compacted})"),
    ).to_status()})
}

/// The object of a `BOOKMARK` event at `rv` for objects of `kind` in `api_version`.
pub(super) fn bookmark(kind: &str, api_version: &str, rv: u64) -> Value {
    json!({
        "kind": kind, "apiVersion": api_version,
        "metadata": {"resourceVersion": rv.to_string()},
    })
}

/// The page of `items` a list with `limit` and `continue` asks for: the items, the continue
/// token of the next page (if any), and the resourceVersion the list reports (the first
/// page's, carried in the token, as a real server keeps one snapshot across pages). Items come
/// in key order (namespace, name) and a token names the last key handed out, as a real
/// server's does: an object created meanwhile before the cursor is in no page, one after it
/// may be, and no object comes twice.
pub(super) fn page(
    mut items: Vec<Value>,
    params: &[(String, String)],
    rv: u64,
) -> Result<(Vec<Value>, Option<String>, u64), StatusError> {
    let param = |k: &str| params.iter().find(|(key, _)| key == k).map(|(_, v)| v);
    let limit = match param("limit") {
        Some(l) => l
            .parse::<usize>()
            .map_err(|_| StatusError::bad_request(format!("limit {l:?} is not a number")))?,
        None => 0,
    };
    let key = |o: &Value| {
        let text = |p: &str| {
            o.pointer(p)
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_owned()
        };
        (text("/metadata/namespace"), text("/metadata/name"))
    };
    let (list_rv, after) = match param("continue").filter(|c| !c.is_empty()) {
        Some(token) => {
            let mut parts = token.splitn(3, '/');
            let parsed = (|| {
                let r = parts.next()?.parse::<u64>().ok()?;
                Some((r, (parts.next()?.to_owned(), parts.next()?.to_owned())))
            })();
            let (r, k) = parsed
                .ok_or_else(|| StatusError::bad_request(format!("continue token {token:?}")))?;
            (r, Some(k))
        }
        None => (rv, None),
    };
    items.sort_by_key(key);
    let mut rest: Vec<Value> = items
        .into_iter()
        .filter(|o| after.as_ref().is_none_or(|a| key(o) > *a))
        .collect();
    if limit == 0 || rest.len() <= limit {
        return Ok((rest, None, list_rv));
    }
    rest.truncate(limit);
    let next = rest.last().map(|o| {
        let (ns, name) = key(o);
        format!("{list_rv}/{ns}/{name}")
    });
    Ok((rest, next, list_rv))
}

impl FakeApiServer {
    /// Ends every open watch, as a server does at a watch's timeout or when it restarts.
    pub fn end_watches(&self) {
        self.shared.watches.ended.send_modify(|n| *n += 1);
    }

    /// Has every open watch that asked for bookmarks (`allowWatchBookmarks=true`) send one at
    /// the current resourceVersion, once it has sent every change before it.
    pub fn send_bookmarks(&self) {
        self.shared.watches.bookmarks.send_modify(|n| *n += 1);
    }

    /// How many bookmarks watches have sent so far.
    pub fn bookmarks_sent(&self) -> u64 {
        self.shared.watches.bookmarks_sent.load(Ordering::SeqCst)
    }

    /// Forgets the history before the current resourceVersion, as etcd's compaction does: a
    /// watch started (or resumed) from an older version gets an `ERROR` event with 410 Gone
    /// and ends. Open watches go on.
    pub fn compact(&self) {
        let rv = self.resource_version();
        *self
            .shared
            .watches
            .compacted
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = rv;
    }

    /// Holds new watch requests back (`true`) until called with `false`; other requests are
    /// answered as usual.
    pub fn hold_watches(&self, held: bool) {
        self.shared.watches.held.send_replace(held);
    }
}

#[cfg(test)]
mod tests {

    use super::*;

    fn items(n: usize) -> Vec<Value> {
        (0..n)
            .map(|i| json!({"metadata": {"namespace": "ns", "name": format!("o{i}")}}))
            .collect()
    }

    fn params(limit: &str, token: Option<&str>) -> Vec<(String, String)> {
        let mut p = vec![("limit".to_owned(), limit.to_owned())];
        if let Some(t) = token {
            p.push(("continue".to_owned(), t.to_owned()));
        }
        p
    }

    #[test]
    fn lists_come_a_page_at_a_time_at_the_first_pages_version() {
        let (first, token, rv) = page(items(5), &params("2", None), 9).unwrap();
        assert_eq!((first.len(), token.as_deref(), rv), (2, Some("9/ns/o1"), 9));
        // An object created meanwhile before the cursor is in no page; none comes twice.
        let mut more = items(5);
        more.push(json!({"metadata": {"namespace": "ns", "name": "o0a"}}));
        let (second, token, rv) = page(more, &params("2", Some("9/ns/o1")), 12).unwrap();
        assert_eq!(second[0]["metadata"]["name"], "o2");
        assert_eq!((token.as_deref(), rv), (Some("9/ns/o3"), 9));
        let (last, token, _) = page(items(5), &params("2", Some("9/ns/o3")), 12).unwrap();
        assert_eq!((last.len(), token), (1, None));
        let (all, token, _) = page(items(5), &[], 3).unwrap();
        assert_eq!((all.len(), token), (5, None));
        assert!(page(items(1), &params("x", None), 1).is_err());
        assert!(page(items(1), &params("1", Some("junk")), 1).is_err());
    }
}
