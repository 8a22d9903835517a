//! An in-process fake of the Kubernetes API server at the HTTP level, for tests of anything
//! that talks to a cluster through a real client (kube-rs).
//!
//! Plain HTTP on 127.0.0.1 with an ephemeral port. It serves discovery (`/api`, `/api/v1`,
//! `/apis`, `/apis/resource.k8s.io[/<version>]`, with the resource.k8s.io versions a test
//! chooses), and for Nodes, Pods, Events (core v1 and events.k8s.io/v1), DeviceClasses,
//! ResourceSlices, ResourceClaims, ResourceClaimTemplates and (coordination.k8s.io/v1) Leases:
//! get, list (label and field
//! selectors, pages with `limit` and `continue`), watch (`?watch=true`,
//! resourceVersion-based, newline-delimited JSON events; `sendInitialEvents=true` streams the
//! current state and an initial-events-end bookmark first; `allowWatchBookmarks=true` gets
//! bookmarks when a test sends them; a watch from before the compacted history gets 410 Gone;
//! lists come a page at a time with `limit` and `continue`; see `watches`), create, update (PUT, with a
//! resourceVersion precondition), the `status` subresource, `pods/binding` (POST: sets
//! `spec.nodeName`; 409 for a pod already bound or still gated, as a real server answers, and
//! for a UID that does not match), JSON merge patch, JSON patch,
//! delete and deleteCollection; `PodDisruptionBudgets` (policy/v1) and the `pods/eviction`
//! subresource with budget checks (see `eviction`); Events in core v1 and in events.k8s.io/v1,
//! one set of objects converted and checked as the real server does (see `events`); Tessera's
//! `GpuProfileSchedules` (gpu.tessera.dev/v1alpha1, cluster-scoped, no status subresource), as a
//! server with the chart's CRD installed serves them. As on a real server, deleting an object that carries finalizers
//! only sets `metadata.deletionTimestamp`; the object goes when an update removes its last
//! finalizer. Strategic merge patch and server-side apply are approximated
//! by a merge patch (apply creates an absent object); `managedFields` are recorded only when a
//! test asks ([`FakeApiServer::set_managed_fields`]), and a fixed per-request latency can be
//! set ([`FakeApiServer::set_request_delay`]). Objects are
//! kept as JSON exactly as written, in whatever version they were written: the fake does not
//! convert between API versions, so a test serves one resource.k8s.io version at a time.
//! Errors come back as `metav1.Status`. A test can queue error answers per verb and resource.

mod events;
mod eviction;
mod patch;
mod store;
mod watches;

pub use events::GROUP as EVENTS_GROUP;
pub use store::fields_v1;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use http_body_util::{BodyExt as _, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Bytes, Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use store::Store;
pub use store::{RecordedRequest, StatusError};
use watches::WatchControl;

/// The resource.k8s.io group.
pub const RESOURCE_GROUP: &str = "resource.k8s.io";
/// The coordination.k8s.io group (Leases), served in v1 only.
pub const COORDINATION_GROUP: &str = "coordination.k8s.io";
/// The only version of [`COORDINATION_GROUP`] the fake serves.
const COORDINATION_VERSION: &str = "v1";
/// The policy group (`PodDisruptionBudgets`), served in v1 only.
pub const POLICY_GROUP: &str = "policy";
/// The only version of [`POLICY_GROUP`] the fake serves.
const POLICY_VERSION: &str = "v1";
/// Tessera's own group (`GpuProfileSchedules`, a CRD on a real server), served in v1alpha1,
/// as a server with the chart's CRD installed serves it.
pub const TESSERA_GROUP: &str = "gpu.tessera.dev";
/// The only version of [`TESSERA_GROUP`] the fake serves.
const TESSERA_VERSION: &str = "v1alpha1";

/// What a request does, for fault injection and the request log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Verb {
    /// GET of one object.
    Get,
    /// GET of a collection.
    List,
    /// GET of a collection with `watch=true`.
    Watch,
    /// POST to a collection.
    Create,
    /// PUT of one object.
    Update,
    /// PATCH of one object.
    Patch,
    /// DELETE of one object.
    Delete,
    /// DELETE of a collection.
    DeleteCollection,
}

/// A resource the fake serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kind {
    /// The plural resource name, e.g. `resourceslices`.
    pub resource: &'static str,
    /// The kind, e.g. `ResourceSlice`.
    pub kind: &'static str,
    /// The API group (`""` for core).
    pub group: &'static str,
    /// Whether objects live in a namespace.
    pub namespaced: bool,
    /// Whether it has a `status` subresource (status is then written only through it).
    pub has_status: bool,
}

const KINDS: [Kind; 11] = [
    Kind {
        resource: "nodes",
        kind: "Node",
        group: "",
        namespaced: false,
        has_status: true,
    },
    Kind {
        resource: "pods",
        kind: "Pod",
        group: "",
        namespaced: true,
        has_status: true,
    },
    Kind {
        resource: "deviceclasses",
        kind: "DeviceClass",
        group: RESOURCE_GROUP,
        namespaced: false,
        has_status: false,
    },
    Kind {
        resource: "resourceslices",
        kind: "ResourceSlice",
        group: RESOURCE_GROUP,
        namespaced: false,
        has_status: false,
    },
    Kind {
        resource: "resourceclaims",
        kind: "ResourceClaim",
        group: RESOURCE_GROUP,
        namespaced: true,
        has_status: true,
    },
    Kind {
        resource: "resourceclaimtemplates",
        kind: "ResourceClaimTemplate",
        group: RESOURCE_GROUP,
        namespaced: true,
        has_status: false,
    },
    Kind {
        resource: "events",
        kind: "Event",
        group: "",
        namespaced: true,
        has_status: false,
    },
    // The same Events as the core ones above, served in their events.k8s.io/v1 shape (see
    // `events`); the store keys both by the plural, so they are one set of objects.
    Kind {
        resource: "events",
        kind: "Event",
        group: events::GROUP,
        namespaced: true,
        has_status: false,
    },
    Kind {
        resource: "leases",
        kind: "Lease",
        group: COORDINATION_GROUP,
        namespaced: true,
        has_status: false,
    },
    Kind {
        resource: "poddisruptionbudgets",
        kind: "PodDisruptionBudget",
        group: POLICY_GROUP,
        namespaced: true,
        has_status: true,
    },
    Kind {
        resource: "gpuprofileschedules",
        kind: "GpuProfileSchedule",
        group: TESSERA_GROUP,
        namespaced: false,
        has_status: false,
    },
];

/// Looks up a resource by plural name (`/status` suffix ignored).
pub fn kind(resource: &str) -> Option<Kind> {
    let plural = resource.strip_suffix("/status").unwrap_or(resource);
    KINDS.iter().copied().find(|k| k.resource == plural)
}

struct Shared {
    store: Mutex<Store>,
    /// How long every write waits before it is carried out (a slow server).
    write_delay: Mutex<std::time::Duration>,
    /// How long every request but a watch waits before it is answered (a real server's
    /// round trip: authentication, admission, etcd).
    request_delay: Mutex<std::time::Duration>,
    versions: Mutex<Vec<String>>,
    changed: watch::Sender<u64>,
    /// Ending watches, bookmarks, compaction ([`FakeApiServer::end_watches`] and beside it).
    watches: WatchControl,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Store> {
        // A test that panicked while holding the lock has failed already; keep serving.
        self.store
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn versions(&self) -> Vec<String> {
        self.versions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// A running fake API server; stops when dropped.
pub struct FakeApiServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
    stop: watch::Sender<bool>,
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.stop.send_replace(true);
        self.accept.abort();
    }
}

impl FakeApiServer {
    /// Starts serving resource.k8s.io in `versions` (e.g. `["v1"]`, `["v1beta1"]`), preferred
    /// first. Must be called inside a tokio runtime.
    pub async fn start(versions: &[&str]) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let (changed, _) = watch::channel(0);
        let shared = Arc::new(Shared {
            store: Mutex::new(Store::default()),
            write_delay: Mutex::new(std::time::Duration::ZERO),
            request_delay: Mutex::new(std::time::Duration::ZERO),
            versions: Mutex::new(versions.iter().map(|v| (*v).to_owned()).collect()),
            changed,
            watches: WatchControl::new(),
        });
        let (stop, stopped) = watch::channel(false);
        let accept_shared = Arc::clone(&shared);
        let accept = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let shared = Arc::clone(&accept_shared);
                let stopped = stopped.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let shared = Arc::clone(&shared);
                        let stopped = stopped.clone();
                        async move { Ok::<_, Infallible>(handle(&shared, req, stopped).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(Self {
            addr,
            shared,
            accept,
            stop,
        })
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kubeconfig (YAML) pointing at this server, for clients that read one.
    pub fn kubeconfig(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n\
             current-context: fake\nusers:\n- name: fake\n  user: {{}}\n",
            self.url()
        )
    }

    /// Changes the served resource.k8s.io versions.
    pub fn set_versions(&self, versions: &[&str]) {
        *self
            .shared
            .versions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            versions.iter().map(|v| (*v).to_owned()).collect();
    }

    /// Queues `count` answers of `code` (e.g. 409, 500) for the next `verb` requests on
    /// `resource` (plural name, `resourceclaims/status` for the subresource). The request is
    /// not carried out. Code 0 lets a request through, to fail a later one.
    pub fn inject(&self, verb: Verb, resource: &str, code: u16, count: usize) {
        let mut store = self.shared.lock();
        let queue = store.faults.entry((verb, resource.to_owned())).or_default();
        queue.extend(std::iter::repeat_n(code, count));
    }

    /// Makes every later create, update, patch and delete wait `delay` first, as a slow or
    /// distant API server would.
    pub fn set_write_delay(&self, delay: std::time::Duration) {
        *self
            .shared
            .write_delay
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = delay;
    }

    /// Makes every later request but a watch wait `delay` before it is answered, as a real
    /// API server's round trip does.
    pub fn set_request_delay(&self, delay: std::time::Duration) {
        *self
            .shared
            .request_delay
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = delay;
    }

    /// Makes every later write record `metadata.managedFields` (who wrote which fields, with
    /// the writer's `User-Agent` as manager), so objects are served about as large as a real
    /// API server serves them.
    pub fn set_managed_fields(&self, on: bool) {
        self.shared.lock().managed_fields = on;
    }

    /// Makes later creation and deletion timestamps the wall clock's (whole seconds) instead
    /// of the fixed time, for tests whose subject counts time from them (a delay-tolerant
    /// pod's patience runs from its creation).
    pub fn use_wall_clock(&self, on: bool) {
        self.shared.lock().wall_clock = on;
    }

    /// The names of the stored objects of `resource` that satisfy `predicate` (without
    /// copying the objects).
    pub fn names_where(&self, resource: &str, predicate: impl Fn(&Value) -> bool) -> Vec<String> {
        let Some(kind) = kind(resource) else {
            return Vec::new();
        };
        self.shared.lock().names_where(&kind, predicate)
    }

    /// Forgets the request log (long benchmarks would otherwise keep every request).
    pub fn clear_requests(&self) {
        self.shared.lock().requests.clear();
    }

    /// Every request on a served resource answered so far (discovery and unknown paths
    /// excluded).
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.shared.lock().requests.clone()
    }

    /// Creates an object directly (as a POST would), e.g. to seed Nodes and claims.
    pub fn create(&self, resource: &str, object: Value) -> Result<Value, StatusError> {
        let kind = kind(resource)
            .ok_or_else(|| StatusError::bad_request(format!("unknown resource {resource}")))?;
        let namespace = kind.namespaced.then(|| {
            object
                .pointer("/metadata/namespace")
                .and_then(Value::as_str)
                .unwrap_or("default")
                .to_owned()
        });
        let result = {
            let mut store = self.shared.lock();
            "kubectl-create".clone_into(&mut store.manager);
            store.create(&kind, namespace.as_ref(), object)
        };
        self.notify();
        result
    }

    /// Writes an object's status directly (as a PUT to `/status` without precondition).
    pub fn set_status(
        &self,
        resource: &str,
        namespace: Option<&str>,
        name: &str,
        status: &Value,
    ) -> Result<Value, StatusError> {
        let kind = kind(resource)
            .ok_or_else(|| StatusError::bad_request(format!("unknown resource {resource}")))?;
        let namespace = namespace.map(str::to_owned);
        let result = {
            let mut store = self.shared.lock();
            "status-writer".clone_into(&mut store.manager);
            store.update(
                &kind,
                namespace.as_ref(),
                name,
                json!({ "status": status.clone() }),
                true,
            )
        };
        self.notify();
        result
    }

    /// Binds a pod to `node` as a POST to `pods/<name>/binding` does (kube-scheduler's write).
    pub fn bind(&self, namespace: &str, name: &str, node: &str) -> Result<(), StatusError> {
        let kind = kind("pods").ok_or_else(|| StatusError::bad_request("no pods".to_owned()))?;
        let result = {
            let mut store = self.shared.lock();
            "kube-scheduler".clone_into(&mut store.manager);
            store.bind(
                &kind,
                Some(&namespace.to_owned()),
                name,
                &json!({"target": {"kind": "Node", "name": node}}),
            )
        };
        self.notify();
        result
    }

    /// One stored object.
    pub fn get(&self, resource: &str, namespace: Option<&str>, name: &str) -> Option<Value> {
        let kind = kind(resource)?;
        self.shared
            .lock()
            .get(&kind, namespace.map(str::to_owned).as_ref(), name)
            .ok()
    }

    /// Every stored object of `resource`, in name order.
    pub fn objects(&self, resource: &str) -> Vec<Value> {
        kind(resource).map_or_else(Vec::new, |k| self.shared.lock().list(&k, None))
    }

    /// Every Event, as events.k8s.io/v1 serves it (`regarding`, `note`, `reportingController`,
    /// …: what kube-runtime's `Recorder` writes), whichever API wrote it; in name order.
    pub fn events(&self) -> Vec<Value> {
        self.objects("events")
            .into_iter()
            .map(events::from_core)
            .collect()
    }

    /// Deletes an object directly.
    pub fn delete(
        &self,
        resource: &str,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Value, StatusError> {
        let kind = kind(resource)
            .ok_or_else(|| StatusError::bad_request(format!("unknown resource {resource}")))?;
        let result = self
            .shared
            .lock()
            .delete(&kind, namespace.map(str::to_owned).as_ref(), name);
        self.notify();
        result
    }

    /// The current global resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.lock().rv
    }

    fn notify(&self) {
        let rv = self.shared.lock().rv;
        self.shared.changed.send_replace(rv);
    }
}

type Body = BoxBody<Bytes, Infallible>;

fn json_response(code: u16, value: &Value) -> Response<Body> {
    let mut response = Response::new(Full::new(Bytes::from(value.to_string())).boxed());
    *response.status_mut() =
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    response
}

fn error_response(error: &StatusError) -> Response<Body> {
    json_response(error.code, &error.to_status())
}

fn query_params(req: &Request<Incoming>) -> Vec<(String, String)> {
    req.uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..=i + 2]).unwrap_or("");
                if let Ok(b) = u8::from_str_radix(hex, 16) {
                    out.push(b);
                    i += 3;
                    continue;
                }
                out.push(b'%');
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// What a path names once the group prefix is parsed.
struct Target {
    kind: Kind,
    version: String,
    namespace: Option<String>,
    name: Option<String>,
    status: bool,
    /// `pods/<name>/binding`.
    binding: bool,
    /// The `pods/eviction` subresource.
    eviction: bool,
}

impl Target {
    fn api_version(&self) -> String {
        if self.kind.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.kind.group, self.version)
        }
    }

    fn resource_label(&self) -> String {
        if self.eviction {
            return format!("{}/eviction", self.kind.resource);
        }
        if self.status {
            format!("{}/status", self.kind.resource)
        } else if self.binding {
            format!("{}/binding", self.kind.resource)
        } else {
            self.kind.resource.to_owned()
        }
    }
}

fn parse_target(segments: &[&str], versions: &[String]) -> Option<Target> {
    let (group, version, rest) = match segments {
        ["api", "v1", rest @ ..] => ("", "v1", rest),
        ["apis", group, version, rest @ ..] if *group == RESOURCE_GROUP => {
            if !versions.iter().any(|v| v == version) {
                return None;
            }
            (RESOURCE_GROUP, *version, rest)
        }
        ["apis", group, version, rest @ ..]
            if *group == COORDINATION_GROUP && *version == COORDINATION_VERSION =>
        {
            (COORDINATION_GROUP, *version, rest)
        }
        ["apis", group, version, rest @ ..]
            if *group == POLICY_GROUP && *version == POLICY_VERSION =>
        {
            (POLICY_GROUP, *version, rest)
        }
        ["apis", group, version, rest @ ..]
            if *group == events::GROUP && *version == events::VERSION =>
        {
            (events::GROUP, *version, rest)
        }
        ["apis", group, version, rest @ ..]
            if *group == TESSERA_GROUP && *version == TESSERA_VERSION =>
        {
            (TESSERA_GROUP, *version, rest)
        }
        _ => return None,
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some((*ns).to_owned()), rest),
        _ => (None, rest),
    };
    let (resource, name, status, binding, eviction) = match rest {
        [resource] => (*resource, None, false, false, false),
        [resource, name] => (*resource, Some((*name).to_owned()), false, false, false),
        [resource, name, "status"] => (*resource, Some((*name).to_owned()), true, false, false),
        ["pods", name, "binding"] if group.is_empty() => {
            ("pods", Some((*name).to_owned()), false, true, false)
        }
        ["pods", name, "eviction"] if group.is_empty() => {
            ("pods", Some((*name).to_owned()), false, false, true)
        }
        _ => return None,
    };
    let kind = KINDS
        .iter()
        .copied()
        .find(|k| k.resource == resource && k.group == group)?;
    if kind.namespaced && name.is_some() && namespace.is_none() {
        return None;
    }
    if !kind.namespaced && namespace.is_some() {
        return None;
    }
    if status && !kind.has_status {
        return None;
    }
    Some(Target {
        kind,
        version: version.to_owned(),
        namespace,
        name,
        status,
        binding,
        eviction,
    })
}

/// An `APIGroup`'s name and versions, for a group served in one version.
fn one_version_group(group: &str, version: &str) -> Value {
    let v = json!({"groupVersion": format!("{group}/{version}"), "version": version});
    json!({"name": group, "versions": [v.clone()], "preferredVersion": v})
}

/// The `APIResourceList` of one group version.
fn resource_list(group: &str, version: &str) -> Value {
    let list: Vec<Value> = KINDS
        .iter()
        .filter(|k| k.group == group)
        .flat_map(|k| {
            let verbs = json!([
                "create",
                "delete",
                "deletecollection",
                "get",
                "list",
                "patch",
                "update",
                "watch"
            ]);
            let mut out = vec![json!({
                "name": k.resource,
                "singularName": k.kind.to_lowercase(),
                "namespaced": k.namespaced,
                "kind": k.kind,
                "verbs": verbs,
            })];
            if k.has_status {
                out.push(json!({
                    "name": format!("{}/status", k.resource),
                    "singularName": "",
                    "namespaced": k.namespaced,
                    "kind": k.kind,
                    "verbs": ["get", "patch", "update"],
                }));
            }
            out
        })
        .collect();
    let group_version = if group.is_empty() {
        version.to_owned()
    } else {
        format!("{group}/{version}")
    };
    json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": list})
}

fn discovery(segments: &[&str], versions: &[String]) -> Option<Value> {
    let group_versions = || {
        versions
            .iter()
            .map(|v| json!({"groupVersion": format!("{RESOURCE_GROUP}/{v}"), "version": v}))
            .collect::<Vec<_>>()
    };
    let group = || {
        json!({
            "name": RESOURCE_GROUP,
            "versions": group_versions(),
            "preferredVersion": group_versions().first().cloned().unwrap_or(Value::Null),
        })
    };
    let coordination = || one_version_group(COORDINATION_GROUP, COORDINATION_VERSION);
    let policy = || one_version_group(POLICY_GROUP, POLICY_VERSION);
    let events_group = || one_version_group(events::GROUP, events::VERSION);
    let tessera = || one_version_group(TESSERA_GROUP, TESSERA_VERSION);
    let resources = resource_list;
    match segments {
        ["api"] => Some(json!({
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}],
        })),
        ["api", "v1"] => Some(resources("", "v1")),
        ["apis"] => {
            let mut groups = if versions.is_empty() {
                vec![]
            } else {
                vec![group()]
            };
            groups.push(coordination());
            groups.push(policy());
            groups.push(events_group());
            groups.push(tessera());
            Some(json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}))
        }
        ["apis", g] if *g == RESOURCE_GROUP && !versions.is_empty() => {
            let mut g = group();
            g["kind"] = json!("APIGroup");
            g["apiVersion"] = json!("v1");
            Some(g)
        }
        ["apis", g, v] if *g == RESOURCE_GROUP && versions.iter().any(|x| x == v) => {
            Some(resources(RESOURCE_GROUP, v))
        }
        ["apis", g] if *g == COORDINATION_GROUP => {
            let mut g = coordination();
            g["kind"] = json!("APIGroup");
            g["apiVersion"] = json!("v1");
            Some(g)
        }
        ["apis", g, v]
            if (*g == COORDINATION_GROUP && *v == COORDINATION_VERSION)
                || (*g == POLICY_GROUP && *v == POLICY_VERSION)
                || (*g == TESSERA_GROUP && *v == TESSERA_VERSION) =>
        {
            Some(resources(g, v))
        }
        ["apis", g] if *g == TESSERA_GROUP => {
            let mut g = tessera();
            g["kind"] = json!("APIGroup");
            g["apiVersion"] = json!("v1");
            Some(g)
        }
        ["apis", g] if *g == POLICY_GROUP => {
            let mut g = policy();
            g["kind"] = json!("APIGroup");
            g["apiVersion"] = json!("v1");
            Some(g)
        }
        ["apis", g] if *g == events::GROUP => {
            let mut g = events_group();
            g["kind"] = json!("APIGroup");
            g["apiVersion"] = json!("v1");
            Some(g)
        }
        ["apis", g, v] if *g == events::GROUP && *v == events::VERSION => Some(resources(g, v)),
        ["version"] => Some(json!({"major": "1", "minor": "36", "gitVersion": "v1.36.0-fake"})),
        _ => None,
    }
}

fn select(objects: Vec<Value>, params: &[(String, String)]) -> Result<Vec<Value>, StatusError> {
    let param = |k: &str| {
        params
            .iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.as_str())
    };
    let labels = param("labelSelector").filter(|s| !s.is_empty());
    let fields = param("fieldSelector").filter(|s| !s.is_empty());
    let mut out = Vec::new();
    for o in objects {
        if let Some(l) = labels
            && !patch::matches_labels(&o, l).map_err(StatusError::bad_request)?
        {
            continue;
        }
        if let Some(f) = fields
            && !patch::matches_fields(&o, f).map_err(StatusError::bad_request)?
        {
            continue;
        }
        out.push(o);
    }
    Ok(out)
}

/// Waits the configured request latency (every request but a watch) and write delay.
async fn wait_latency(shared: &Shared, verb: Verb) {
    let get = |d: &Mutex<std::time::Duration>| {
        *d.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    };
    let mut delay = std::time::Duration::ZERO;
    if verb != Verb::Watch {
        delay += get(&shared.request_delay);
    }
    if !matches!(verb, Verb::Get | Verb::List | Verb::Watch) {
        delay += get(&shared.write_delay);
    }
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
}

#[allow(
    clippy::too_many_lines,
    reason = "one request's route, from path to answer, reads best top to bottom"
)]
async fn handle(
    shared: &Arc<Shared>,
    req: Request<Incoming>,
    stopped: watch::Receiver<bool>,
) -> Response<Body> {
    let path = req.uri().path().to_owned();
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let versions = shared.versions();
    if req.method() == Method::GET
        && let Some(doc) = discovery(&segments, &versions)
    {
        return json_response(200, &doc);
    }
    let Some(target) = parse_target(&segments, &versions) else {
        return error_response(&StatusError::new(
            404,
            "NotFound",
            format!("the server could not find the requested resource ({path})"),
        ));
    };
    let params = query_params(&req);
    let is_watch = params
        .iter()
        .any(|(k, v)| k == "watch" && (v == "true" || v == "1"));
    let verb = match (req.method().clone(), target.name.is_some()) {
        (Method::POST, true) if target.eviction => Verb::Create,
        _ if target.eviction => {
            return error_response(&StatusError::new(
                405,
                "MethodNotAllowed",
                format!("{} is not allowed on {path}", req.method()),
            ));
        }
        (Method::GET, true) => Verb::Get,
        (Method::GET, false) if is_watch => Verb::Watch,
        (Method::GET, false) => Verb::List,
        (Method::POST, false) => Verb::Create,
        (Method::POST, true) if target.binding => Verb::Create,
        (Method::PUT, true) => Verb::Update,
        (Method::PATCH, true) => Verb::Patch,
        (Method::DELETE, true) => Verb::Delete,
        (Method::DELETE, false) => Verb::DeleteCollection,
        _ => {
            return error_response(&StatusError::new(
                405,
                "MethodNotAllowed",
                format!("{} is not allowed on {path}", req.method()),
            ));
        }
    };
    let manager = req
        .headers()
        .get(hyper::header::USER_AGENT)
        .and_then(|v| v.to_str().ok())
        .map(|a| a.split('/').next().unwrap_or(a).to_owned())
        .unwrap_or_default();
    let content_type = req
        .headers()
        .get(hyper::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return error_response(&StatusError::bad_request(format!("reading body: {e}"))),
    };
    let resource = target.resource_label();
    wait_latency(shared, verb).await;
    let fault = shared
        .lock()
        .take_fault(verb, &resource)
        .filter(|code| *code != 0);
    let outcome = match fault {
        Some(code) => Err(StatusError::new(
            code,
            match code {
                409 => "Conflict",
                500 => "InternalError",
                503 => "ServiceUnavailable",
                429 => "TooManyRequests",
                _ => "Unknown",
            },
            format!("injected {code} for {verb:?} {resource}"),
        )),
        None if verb == Verb::Watch => {
            shared.watches.wait_until_let_through().await;
            return watch_response(shared, &target, &params, stopped);
        }
        None if target.eviction => {
            let dry_run = params.iter().any(|(k, v)| k == "dryRun" && v == "All");
            let namespace = target.namespace.clone().unwrap_or_default();
            let name = target.name.clone().unwrap_or_default();
            parse_body(&body)
                .and_then(|b| eviction::evict(&mut shared.lock(), &namespace, &name, &b, dry_run))
        }
        None => {
            shared.lock().manager = manager;
            serve(shared, &target, verb, &params, &content_type, &body)
        }
    };
    let (code, response) = match outcome {
        Ok((code, value)) => (code, json_response(code, &value)),
        Err(e) => (e.code, error_response(&e)),
    };
    let rv = {
        let mut store = shared.lock();
        store.requests.push(RecordedRequest {
            verb,
            resource,
            name: target.name.clone(),
            code,
        });
        store.rv
    };
    shared.changed.send_replace(rv);
    response
}

fn parse_body(body: &Bytes) -> Result<Value, StatusError> {
    serde_json::from_slice(body).map_err(|e| StatusError::bad_request(format!("body: {e}")))
}

fn serve(
    shared: &Arc<Shared>,
    target: &Target,
    verb: Verb,
    params: &[(String, String)],
    content_type: &str,
    body: &Bytes,
) -> Result<(u16, Value), StatusError> {
    let events_api = target.kind.group == events::GROUP;
    let answer = serve_stored(shared, target, verb, params, content_type, body, events_api)?;
    Ok(if events_api {
        (answer.0, events::from_core(answer.1))
    } else {
        answer
    })
}

/// Serves a request on the stored objects; `events_api`: the request came through
/// events.k8s.io/v1, whose bodies are converted to the stored core v1 shape and checked as
/// the API server checks them (see `events`).
#[allow(
    clippy::too_many_lines,
    reason = "one verb per arm, each short, read best side by side"
)]
fn serve_stored(
    shared: &Arc<Shared>,
    target: &Target,
    verb: Verb,
    params: &[(String, String)],
    content_type: &str,
    body: &Bytes,
    events_api: bool,
) -> Result<(u16, Value), StatusError> {
    let parse_body =
        |body: &Bytes| parse_body(body).map(|b| if events_api { events::to_core(b) } else { b });
    let ns = target.namespace.as_ref();
    let name = target.name.as_deref().unwrap_or("");
    let kind = &target.kind;
    let mut store = shared.lock();
    match verb {
        Verb::Get => store.get(kind, ns, name).map(|o| (200, o)),
        Verb::List | Verb::DeleteCollection => {
            let selected = select(store.list(kind, ns), params)?;
            if verb == Verb::DeleteCollection {
                for o in &selected {
                    let ns = o
                        .pointer("/metadata/namespace")
                        .and_then(Value::as_str)
                        .map(str::to_owned);
                    let n = o
                        .pointer("/metadata/name")
                        .and_then(Value::as_str)
                        .unwrap_or("");
                    store.delete(kind, ns.as_ref(), n)?;
                }
            }
            let (items, next, rv) = watches::page(selected, params, store.rv)?;
            let mut metadata = json!({"resourceVersion": rv.to_string()});
            if let Some(token) = next {
                metadata["continue"] = Value::String(token);
            }
            Ok((
                200,
                json!({
                    "kind": format!("{}List", kind.kind),
                    "apiVersion": target.api_version(),
                    "metadata": metadata,
                    "items": items,
                }),
            ))
        }
        Verb::Create if target.binding => {
            let binding = parse_body(body)?;
            store.bind(kind, ns, name, &binding).map(|()| {
                (
                    201,
                    json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201}),
                )
            })
        }
        Verb::Create => {
            let object = parse_body(body)?;
            if events_api {
                let mut named = object.clone();
                if let Some(ns) = ns {
                    named["metadata"]["namespace"] = json!(ns);
                }
                events::check_create(&named)?;
            }
            if params.iter().any(|(k, v)| k == "dryRun" && v == "All") {
                return Ok((201, object));
            }
            store.create(kind, ns, object).map(|o| (201, o))
        }
        Verb::Update => {
            let object = parse_body(body)?;
            if events_api {
                let old = store.get(kind, ns, name)?;
                let mut new = object.clone();
                new["metadata"]["namespace"] = old["metadata"]["namespace"].clone();
                events::check_update(&new, &old)?;
            }
            store
                .update(kind, ns, name, object, target.status)
                .map(|o| (200, o))
        }
        Verb::Patch => {
            let patch_doc = parse_body(body)?;
            let apply = content_type.starts_with("application/apply-patch");
            if apply && !target.status && store.get(kind, ns, name).is_err() {
                // Server-side apply of an absent object creates it.
                return store.create(kind, ns, patch_doc).map(|o| (201, o));
            }
            let mut object = store.get(kind, ns, name)?;
            let old = events_api.then(|| object.clone());
            let old_rv = object.pointer("/metadata/resourceVersion").cloned();
            if content_type.starts_with("application/json-patch+json") {
                // `parse_body` renamed the keys of an object; a JSON patch names fields in
                // its paths.
                let patch_doc = if events_api {
                    events::json_patch_to_core(patch_doc)
                } else {
                    patch_doc
                };
                patch::json_patch(&mut object, &patch_doc)
                    .map_err(|m| StatusError::new(422, "Invalid", format!("JSON patch: {m}")))?;
            } else if content_type.starts_with("application/merge-patch+json")
                || content_type.starts_with("application/strategic-merge-patch+json")
                || apply
            {
                patch::merge_patch(&mut object, &patch_doc);
            } else {
                return Err(StatusError::new(
                    415,
                    "UnsupportedMediaType",
                    format!("the fake API server does not support patch type {content_type:?}"),
                ));
            }
            // A patch carrying a resourceVersion is a precondition; without one it applies to
            // whatever is stored.
            if object.pointer("/metadata/resourceVersion").is_none()
                && let Some(rv) = old_rv
                && let Some(Value::Object(meta)) = object.get_mut("metadata")
            {
                meta.insert("resourceVersion".to_owned(), rv);
            }
            if let Some(old) = &old {
                events::check_update(&object, old)?;
            }
            store
                .update(kind, ns, name, object, target.status)
                .map(|o| (200, o))
        }
        Verb::Delete => store.delete(kind, ns, name).map(|o| (200, o)),
        Verb::Watch => Err(StatusError::bad_request("watch is served elsewhere")),
    }
}

#[allow(
    clippy::too_many_lines,
    reason = "one streaming loop reads best in one place"
)]
fn watch_response(
    shared: &Arc<Shared>,
    target: &Target,
    params: &[(String, String)],
    mut stopped: watch::Receiver<bool>,
) -> Response<Body> {
    let param = |k: &str| {
        params
            .iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.clone())
    };
    let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, Infallible>>(64);
    let shared = Arc::clone(shared);
    let kind = target.kind;
    let namespace = target.namespace.clone();
    let start = param("resourceVersion").filter(|v| !v.is_empty() && v != "0");
    // A streaming list: the current state, then a bookmark marking its end, then changes.
    let initial_events = param("sendInitialEvents").is_some_and(|v| v == "true");
    let allow_bookmarks = param("allowWatchBookmarks").is_some_and(|v| v == "true");
    let api_version = target.api_version();
    let timeout = param("timeoutSeconds")
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(1800);
    let labels = param("labelSelector");
    let fields = param("fieldSelector");
    let mut selector_params = Vec::new();
    if let Some(l) = labels {
        selector_params.push(("labelSelector".to_owned(), l));
    }
    if let Some(f) = fields {
        selector_params.push(("fieldSelector".to_owned(), f));
    }
    // Validate the selectors once before streaming.
    if let Err(e) = select(Vec::new(), &selector_params) {
        return error_response(&e);
    }
    let start_rv = match &start {
        Some(v) => match v.parse::<u64>() {
            Ok(rv) => Some(rv),
            Err(_) => {
                return error_response(&StatusError::bad_request(format!(
                    "resourceVersion {v:?} is not a number"
                )));
            }
        },
        None => None,
    };
    // Listening before the request is logged: a test that saw it logged may end it.
    let mut changed = shared.changed.subscribe();
    let mut ended = shared.watches.ended.subscribe();
    let mut bookmarks = shared.watches.bookmarks.subscribe();
    let compacted = shared.watches.compacted();
    {
        let mut store = shared.lock();
        store.requests.push(RecordedRequest {
            verb: Verb::Watch,
            resource: kind.resource.to_owned(),
            name: None,
            code: 200,
        });
    }
    tokio::spawn(async move {
        let deadline = tokio::time::sleep(std::time::Duration::from_secs(timeout));
        tokio::pin!(deadline);
        let events_api = kind.group == events::GROUP;
        let line = |kind: &str, object: &Value| {
            let object = if events_api && kind != "BOOKMARK" {
                events::from_core(object.clone())
            } else {
                object.clone()
            };
            let mut text = json!({"type": kind, "object": object}).to_string();
            text.push('\n');
            Ok(Frame::data(Bytes::from(text)))
        };
        let mut sent_up_to = if let Some(rv) = start_rv.filter(|_| !initial_events) {
            if rv < compacted {
                let mut text = watches::expired(rv, compacted).to_string();
                text.push('\n');
                let _ = tx.send(Ok(Frame::data(Bytes::from(text)))).await;
                return;
            }
            rv
        } else {
            // No resourceVersion: the current state first, as synthetic ADDED events.
            let (objects, rv) = {
                let store = shared.lock();
                (store.list(&kind, namespace.as_ref()), store.rv)
            };
            for o in select(objects, &selector_params).unwrap_or_default() {
                if tx.send(line("ADDED", &o)).await.is_err() {
                    return;
                }
            }
            if initial_events {
                let bookmark = json!({
                    "kind": kind.kind,
                    "apiVersion": api_version,
                    "metadata": {
                        "resourceVersion": rv.to_string(),
                        "annotations": {"k8s.io/initial-events-end": "true"},
                    },
                });
                if tx.send(line("BOOKMARK", &bookmark)).await.is_err() {
                    return;
                }
            }
            rv
        };
        let mut bookmark_due = false;
        loop {
            if ended.has_changed().unwrap_or(true) {
                return;
            }
            let events: Vec<(&'static str, Value)> = {
                let store = shared.lock();
                let events = store
                    .events
                    .iter()
                    .filter(|e| {
                        e.rv > sent_up_to
                            && e.resource == kind.resource
                            && (namespace.is_none() || e.namespace == namespace)
                    })
                    .map(|e| (e.kind, e.object.clone()))
                    .collect();
                sent_up_to = store.rv;
                events
            };
            for (event, object) in events {
                if select(vec![object.clone()], &selector_params).is_ok_and(|s| !s.is_empty())
                    && tx.send(line(event, &object)).await.is_err()
                {
                    return;
                }
            }
            if std::mem::take(&mut bookmark_due) && allow_bookmarks {
                let mark = watches::bookmark(kind.kind, &api_version, sent_up_to);
                if tx.send(line("BOOKMARK", &mark)).await.is_err() {
                    return;
                }
                shared
                    .watches
                    .bookmarks_sent
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            tokio::select! {
                r = changed.changed() => if r.is_err() { return },
                r = bookmarks.changed() => {
                    if r.is_err() {
                        return;
                    }
                    bookmark_due = true;
                }
                _ = ended.changed() => return,
                () = &mut deadline => return,
                _ = stopped.wait_for(|s| *s) => return,
                () = tx.closed() => return,
            }
        }
    });
    let body = StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    let mut response = Response::new(body.boxed());
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    response
}
