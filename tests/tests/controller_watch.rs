//! The controller's reflectors (kube-runtime's watcher behind `tessera_kubeapi::changes`)
//! against the fake API server doing what a real one does to watches: ending them, answering
//! 410 Gone after compaction, sending bookmarks, failing, and listing a page at a time. Each
//! test feeds a cluster view and checks it converges, and counts the requests and backoff
//! pauses that took.
#![allow(clippy::unwrap_used, missing_docs)]

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::core::ApiResource;
use serde_json::json;
use tessera_controller::cluster::{Change, ClusterView, Resource, reflector};
use tessera_kubeapi::Backoff;
use tessera_tests::fake_apiserver::{FakeApiServer, Verb};
use tokio::sync::mpsc;

/// How long a test waits for something that should happen at once before it fails.
const WAIT: Duration = Duration::from_secs(20);

/// Counts the pauses asked of it (each a few milliseconds, so tests stay quick).
#[derive(Clone, Default)]
struct CountingBackoff(Arc<AtomicUsize>);

impl CountingBackoff {
    fn pauses(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

impl Iterator for CountingBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Some(Duration::from_millis(5))
    }
}

impl Backoff for CountingBackoff {
    fn reset(&mut self) {}
}

struct Watched {
    server: FakeApiServer,
    changes: mpsc::Receiver<(Resource, Change)>,
    view: ClusterView,
    backoff: CountingBackoff,
    task: tokio::task::JoinHandle<()>,
    /// How many pages the last list came in.
    pages: usize,
}

impl Drop for Watched {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn node(name: &str) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
}

/// A fake server with `nodes`, after `prepare`, and a reflector of its Nodes.
async fn watch_nodes(nodes: &[&str], prepare: impl FnOnce(&FakeApiServer)) -> Watched {
    let server = FakeApiServer::start(&["v1"]).await.unwrap();
    for name in nodes {
        server.create("nodes", node(name)).unwrap();
    }
    prepare(&server);
    let client = kube::Client::try_from(kube::Config::new(server.url().parse().unwrap())).unwrap();
    let (tx, changes) = mpsc::channel(8);
    let backoff = CountingBackoff::default();
    let task = tokio::spawn(reflector::run(
        client,
        Resource::Nodes,
        ApiResource::erase::<Node>(&()),
        tx,
        backoff.clone(),
    ));
    Watched {
        server,
        changes,
        view: ClusterView::new("gpu.tessera.dev"),
        backoff,
        task,
        pages: 0,
    }
}

impl Watched {
    /// The next change, applied to the view; a list handed on in pages is applied page by
    /// page and answered as one `Change::Listed` of all its pages (their count in `pages`).
    async fn next(&mut self) -> Change {
        let mut listed: Option<Vec<serde_json::Value>> = None;
        self.pages = 0;
        loop {
            let (resource, change) = tokio::time::timeout(WAIT, self.changes.recv())
                .await
                .expect("no change came")
                .expect("the reflector ended");
            assert_eq!(resource, Resource::Nodes);
            self.view.apply(resource, change.clone());
            match change {
                Change::Page { items, first, last } => {
                    assert_eq!(first, listed.is_none(), "pages of one list in order");
                    self.pages += 1;
                    listed.get_or_insert_with(Vec::new).extend(items);
                    if last {
                        return Change::Listed(listed.unwrap_or_default());
                    }
                }
                other => {
                    assert!(listed.is_none(), "a list ended before its last page");
                    return other;
                }
            }
        }
    }

    /// Waits until `n` watches of Nodes have been opened.
    async fn watching(&self, n: usize) {
        let deadline = tokio::time::Instant::now() + WAIT;
        while self
            .server
            .requests()
            .iter()
            .filter(|r| r.verb == Verb::Watch && r.resource == "nodes" && r.code == 200)
            .count()
            < n
        {
            assert!(tokio::time::Instant::now() < deadline, "no watch {n} came");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    fn nodes(&self) -> BTreeSet<String> {
        self.view
            .nodes()
            .iter()
            .filter_map(|n| n.metadata.name.clone())
            .collect()
    }

    fn requests(&self, verb: Verb) -> usize {
        self.server
            .requests()
            .iter()
            .filter(|r| r.verb == verb && r.resource == "nodes")
            .count()
    }
}

fn names(of: &[&str]) -> BTreeSet<String> {
    of.iter().map(|n| (*n).to_owned()).collect()
}

fn listed_names(change: &Change) -> BTreeSet<String> {
    let Change::Listed(items) = change else {
        panic!("expected a list, got {change:?}");
    };
    items
        .iter()
        .map(|i| i["metadata"]["name"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_the_server_ends_is_resumed_without_listing_again() {
    let mut w = watch_nodes(&["n1"], |_| {}).await;
    assert_eq!(listed_names(&w.next().await), names(&["n1"]));
    w.watching(1).await;
    w.server.end_watches();
    w.server.create("nodes", node("n2")).unwrap();
    assert!(matches!(w.next().await, Change::Applied(_)));
    assert_eq!(w.nodes(), names(&["n1", "n2"]));
    assert_eq!(w.requests(Verb::List), 1, "a resumed watch needs no list");
    assert_eq!(w.backoff.pauses(), 0, "an ended watch is no error");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_answered_410_lists_again_and_the_view_converges() {
    let mut w = watch_nodes(&["n1", "n2"], |_| {}).await;
    assert_eq!(listed_names(&w.next().await), names(&["n1", "n2"]));
    w.watching(1).await;
    // The watch ends and, while it is away, n1 goes, n3 comes and the history is compacted.
    w.server.hold_watches(true);
    w.server.end_watches();
    w.server.delete("nodes", None, "n1").unwrap();
    w.server.create("nodes", node("n3")).unwrap();
    w.server.compact();
    w.server.hold_watches(false);
    // The resumed watch is answered 410: one pause, then a fresh list the view takes whole.
    assert_eq!(listed_names(&w.next().await), names(&["n2", "n3"]));
    assert_eq!(w.nodes(), names(&["n2", "n3"]));
    assert_eq!(w.requests(Verb::List), 2);
    assert_eq!(w.backoff.pauses(), 1);
    // And it watches on from the new list.
    w.server.create("nodes", node("n4")).unwrap();
    assert!(matches!(w.next().await, Change::Applied(_)));
    assert_eq!(w.nodes(), names(&["n2", "n3", "n4"]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bookmark_keeps_a_quiet_watch_resumable_after_compaction() {
    let mut w = watch_nodes(&["n1"], |_| {}).await;
    assert_eq!(listed_names(&w.next().await), names(&["n1"]));
    w.watching(1).await;
    // Other resources move the resourceVersion on; the Node watch hears of it only through a
    // bookmark.
    w.server
        .create(
            "pods",
            json!({"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": "p", "namespace": "default"}}),
        )
        .unwrap();
    w.server.send_bookmarks();
    let deadline = tokio::time::Instant::now() + WAIT;
    while w.server.bookmarks_sent() == 0 {
        assert!(tokio::time::Instant::now() < deadline, "no bookmark sent");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    w.server.compact();
    w.server.end_watches();
    w.server.create("nodes", node("n2")).unwrap();
    assert!(matches!(w.next().await, Change::Applied(_)));
    assert_eq!(w.nodes(), names(&["n1", "n2"]));
    assert_eq!(
        w.requests(Verb::List),
        1,
        "resumed from the bookmark, not listed again"
    );
    assert_eq!(w.backoff.pauses(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_failed_request_is_followed_by_one_pause_not_a_spin() {
    let mut w = watch_nodes(&["n1"], |server| {
        server.inject(Verb::List, "nodes", 500, 3);
        // 500, not 503: kube's client retries 503 itself.
        server.inject(Verb::Watch, "nodes", 500, 2);
    })
    .await;
    assert_eq!(listed_names(&w.next().await), names(&["n1"]));
    w.server.create("nodes", node("n2")).unwrap();
    assert!(matches!(w.next().await, Change::Applied(_)));
    assert_eq!(w.nodes(), names(&["n1", "n2"]));
    // Three failed lists and one that worked; two failed watch starts and one that worked
    // (resumed from the list, not listed again); one pause after each of the five failures.
    assert_eq!(w.requests(Verb::List), 4);
    assert_eq!(w.requests(Verb::Watch), 3);
    assert_eq!(w.backoff.pauses(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_list_comes_a_page_at_a_time_and_reaches_the_view_whole() {
    let many: Vec<String> = (0..1_100).map(|i| format!("n{i:04}")).collect();
    let refs: Vec<&str> = many.iter().map(String::as_str).collect();
    let mut w = watch_nodes(&refs, |_| {}).await;
    assert_eq!(listed_names(&w.next().await).len(), 1_100);
    assert_eq!(w.nodes().len(), 1_100);
    assert_eq!(w.requests(Verb::List), 3, "pages of 500");
    assert_eq!(w.pages, 3, "each page handed on as it came");
}
