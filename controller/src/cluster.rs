//! The controller's view of the cluster: ResourceSlices, DeviceClasses, ResourceClaims, Pods
//! and Nodes as the reflectors last saw them, and the allocator's snapshot fed from them.
//!
//! The view is updated by plain calls ([`ClusterView::apply`]) so tests need no client. Claims
//! feed the snapshot incrementally: every allocated claim counts as used, whoever allocated it,
//! and a claim's change replaces what it held. Slice and class changes mark the snapshot stale;
//! it is rebuilt from the view the next time it is needed. The controller's own writes are
//! applied as soon as the server answers them, and older watch events never overwrite newer
//! objects (resourceVersions compared as numbers), so a late event cannot make a device this
//! controller just allocated look free.

pub mod reflector;
mod slim;

pub(crate) use slim::claim as slim_claim;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, NodeSpec, NodeStatus, Pod, PodSpec, PodStatus};
use k8s_openapi::api::resource::v1 as res;
use serde_json::Value;
use tessera_driver::apiversion::{self, Object};
use tessera_driver::names;
use tessera_driver::placement::allocator::{Snapshot, claim_key};
use tessera_driver::placement::fast_path;
use tessera_driver::placement::fragmentation::{TaskShape, Workload};
use tessera_driver::placement::gate;
use tessera_driver::placement::nodefit::Resources;
use tessera_driver::rules::published::PublishedSlice;
use tracing::warn;

pub use reflector::Change;

use crate::error::Result;

/// The resources the controller reflects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Resource {
    /// resource.k8s.io ResourceSlices.
    Slices,
    /// resource.k8s.io DeviceClasses.
    Classes,
    /// resource.k8s.io ResourceClaims.
    Claims,
    /// core v1 Pods.
    Pods,
    /// core v1 Nodes.
    Nodes,
}

impl Resource {
    /// Every reflected resource.
    pub const ALL: [Self; 5] = [
        Self::Slices,
        Self::Classes,
        Self::Claims,
        Self::Pods,
        Self::Nodes,
    ];

    /// The plural resource name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Slices => names::RESOURCE_SLICE.plural,
            Self::Classes => names::DEVICE_CLASS.plural,
            Self::Claims => names::RESOURCE_CLAIM.plural,
            Self::Pods => names::POD.plural,
            Self::Nodes => names::NODE.plural,
        }
    }
}

/// `namespace/name` of a claim, the key the view keeps it under.
pub fn claim_path(claim: &res::ResourceClaim) -> String {
    format!(
        "{}/{}",
        claim.metadata.namespace.as_deref().unwrap_or("default"),
        claim.metadata.name.as_deref().unwrap_or_default()
    )
}

/// `namespace/name` of a pod, the key the view keeps it under (as [`json_key`]).
fn pod_path(pod: &Pod) -> String {
    with_pod_key(pod, str::to_owned)
}

/// Calls `f` with the key the view keeps `pod` under ([`pod_path`]), without making a string
/// for it (a pass looks up every pod's requests).
fn with_pod_key<R>(pod: &Pod, f: impl FnOnce(&str) -> R) -> R {
    let name = pod.metadata.name.as_deref().unwrap_or_default();
    match pod.metadata.namespace.as_deref() {
        Some(ns) => crate::object_key::with_key(ns, name, f),
        None => f(name),
    }
}

/// `namespace/name` (or `name` for cluster-scoped objects) of a JSON object.
fn json_key(value: &Value) -> String {
    let name = value
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or_default();
    match value.pointer("/metadata/namespace").and_then(Value::as_str) {
        Some(ns) => format!("{ns}/{name}"),
        None => name.to_owned(),
    }
}

fn version_of(value: &Value) -> Option<u64> {
    value
        .pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        .and_then(|v| v.parse().ok())
}

fn meta_version(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Option<u64> {
    meta.resource_version
        .as_deref()
        .and_then(|v| v.parse().ok())
}

/// Whether an object at `incoming` may replace one at `stored`: yes unless both are numbers
/// and the incoming one is older.
fn newer(incoming: Option<u64>, stored: Option<u64>) -> bool {
    match (incoming, stored) {
        (Some(i), Some(s)) => i >= s,
        _ => true,
    }
}

/// Keeps of a pod only what the controller's decisions and writes read: its identity and
/// version, creation and deletion times, gates, claims, node constraints, containers' names and
/// requests, overhead, what keeps it off the fast path (inter-pod affinity, spread
/// constraints, a scheduler name, volumes other than config and scratch ones, host ports,
/// pod-level resources: usually nothing), its controlling owner reference, and status phase, conditions (the condition patch rewrites the list) and
/// claim statuses, and the device-plugin request the pod webhook recorded (the templates the
/// pod needs are made from it). Everything else (`managedFields`, labels, other annotations,
/// images, env,
/// volumes, container statuses, ...) is dropped on the way in: at thousands of pods it is most
/// of their size.
pub(crate) fn slim_pod(pod: &mut Pod) {
    let meta = &mut pod.metadata;
    meta.managed_fields = None;
    meta.labels = None;
    meta.annotations = meta.annotations.take().and_then(|mut all| {
        let recorded = all.remove(names::ANNOTATION_DEVICE_PLUGIN_REQUEST)?;
        Some([(names::ANNOTATION_DEVICE_PLUGIN_REQUEST.to_owned(), recorded)].into())
    });
    // Defragmentation moves only pods a controller re-creates: the controlling reference is
    // kept (its kind and name), the others dropped.
    meta.owner_references = meta.owner_references.take().and_then(|all| {
        all.into_iter()
            .find(|o| o.controller == Some(true))
            .map(|o| vec![o])
    });
    meta.generate_name = None;
    if let Some(spec) = pod.spec.as_mut() {
        // What the node filter and the fast path's choice read (`fast_path::blocker`
        // answers the same for the slim pod as for the whole one).
        let slim = fast_path::decision_fields;
        *spec = PodSpec {
            containers: spec.containers.iter().map(slim).collect(),
            init_containers: spec
                .init_containers
                .as_ref()
                .map(|v| v.iter().map(slim).collect()),
            affinity: spec.affinity.take(),
            node_name: spec.node_name.take(),
            node_selector: spec.node_selector.take(),
            overhead: spec.overhead.take(),
            // Preemption evicts the lowest priorities first.
            priority: spec.priority.take(),
            resource_claims: spec.resource_claims.take(),
            scheduling_gates: spec.scheduling_gates.take(),
            tolerations: spec.tolerations.take(),
            scheduler_name: spec
                .scheduler_name
                .take()
                .filter(|n| n != fast_path::DEFAULT_SCHEDULER),
            topology_spread_constraints: spec.topology_spread_constraints.take(),
            volumes: spec
                .volumes
                .as_deref()
                .map(fast_path::blocking_volumes)
                .filter(|v| !v.is_empty()),
            resources: spec.resources.take(),
            ..PodSpec::default()
        };
    }
    if let Some(status) = pod.status.as_mut() {
        *status = PodStatus {
            phase: status.phase.take(),
            conditions: status.conditions.take(),
            resource_claim_statuses: status.resource_claim_statuses.take(),
            ..PodStatus::default()
        };
    }
}

/// What decisions read of a pod bound to a node (`spec.nodeName` set): who it is, its node,
/// phase, priority and claims, and its requests (kept beside it, worked out before this).
/// Its containers, scheduling constraints and conditions only mattered while it was
/// pending; at thousands of pods they are most of what a slim pod holds.
fn slim_bound_pod(pod: &mut Pod) {
    let Some(spec) = pod.spec.as_mut().filter(|s| s.node_name.is_some()) else {
        return;
    };
    *spec = PodSpec {
        node_name: spec.node_name.take(),
        priority: spec.priority.take(),
        resource_claims: spec.resource_claims.take(),
        scheduling_gates: spec.scheduling_gates.take(),
        scheduler_name: spec.scheduler_name.take(),
        ..PodSpec::default()
    };
    if let Some(status) = pod.status.as_mut() {
        status.conditions = None;
    }
}

/// Keeps of a node only what the node filter reads: name, labels, version, taints,
/// unschedulable and allocatable amounts; and defragmentation's record.
fn slim_node(node: &mut Node) {
    let meta = &mut node.metadata;
    meta.managed_fields = None;
    // Defragmentation's record is kept: its budget and holds are counted from it.
    meta.annotations = meta.annotations.take().and_then(|mut all| {
        let record = all.remove(names::ANNOTATION_DEFRAG)?;
        Some([(names::ANNOTATION_DEFRAG.to_owned(), record)].into())
    });
    meta.owner_references = None;
    if let Some(spec) = node.spec.as_mut() {
        *spec = NodeSpec {
            taints: spec.taints.take(),
            unschedulable: spec.unschedulable,
            ..NodeSpec::default()
        };
    }
    if let Some(status) = node.status.as_mut() {
        *status = NodeStatus {
            allocatable: status.allocatable.take(),
            ..NodeStatus::default()
        };
    }
}

/// The cluster as last seen; see the module docs.
#[derive(Debug)]
pub struct ClusterView {
    driver_name: String,
    /// In the allocator's compact form, shared with the snapshot, which refers to their
    /// devices instead of copying them.
    slices: BTreeMap<String, Arc<PublishedSlice>>,
    classes: BTreeMap<String, res::DeviceClass>,
    claims: BTreeMap<String, res::ResourceClaim>,
    /// Boxed: a `Pod` is 2.4 KB inline, and a B-tree node has room for eleven.
    pods: BTreeMap<String, Box<Pod>>,
    /// Every node in name order, held once: shared as it is with the allocator as the
    /// candidate list when every node fits a pod.
    nodes: Arc<Vec<Node>>,
    /// Each node's allocatable amounts, parsed when the node is stored (same order as `nodes`).
    allocatable: Vec<Resources>,
    snapshot: Option<Snapshot>,
    /// How many snapshots were built.
    builds: u64,
    synced: BTreeSet<Resource>,
    /// Per resource being listed page by page: the keys its pages had so far.
    listing: BTreeMap<Resource, BTreeSet<String>>,
    generation: u64,
    /// Grows whenever a claim becomes allocated (a share placed may make a fragment).
    allocations: u64,
    workload: Workload,
    learned: BTreeSet<String>,
    /// Each pod's requests (or why they do not parse), worked out when the pod is stored:
    /// a stored pod keeps no containers.
    requests: std::collections::HashMap<String, Result<Resources, String>>,
    /// Why a pod's containers keep it off the fast path, for the pods where they do
    /// (`fast_path::container_blocker`, worked out when the pod is stored).
    container_blockers: std::collections::HashMap<String, String>,
}

impl ClusterView {
    /// An empty view for Tessera's driver `driver_name`.
    pub fn new(driver_name: &str) -> Self {
        Self {
            driver_name: driver_name.to_owned(),
            slices: BTreeMap::new(),
            classes: BTreeMap::new(),
            claims: BTreeMap::new(),
            pods: BTreeMap::new(),
            nodes: Arc::new(Vec::new()),
            allocatable: Vec::new(),
            snapshot: None,
            builds: 0,
            synced: BTreeSet::new(),
            listing: BTreeMap::new(),
            generation: 0,
            allocations: 0,
            workload: Workload::new(),
            learned: BTreeSet::new(),
            requests: std::collections::HashMap::new(),
            container_blockers: std::collections::HashMap::new(),
        }
    }

    /// Whether every resource has been listed once.
    pub fn is_synced(&self) -> bool {
        Resource::ALL.iter().all(|r| self.synced.contains(r))
    }

    /// A counter that grows whenever something changed that could let a pod that did not
    /// fit before fit now (devices, classes, nodes, a claim released, a pod gone).
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// A counter that grows whenever a claim becomes allocated: a share placed anywhere may
    /// have made the fragment a delay-tolerant pod waits for.
    pub fn allocations(&self) -> u64 {
        self.allocations
    }

    /// Marks that something may have freed room (e.g. a periodic resync).
    pub fn bump(&mut self) {
        self.generation += 1;
    }

    /// Claims by `namespace/name`.
    pub fn claims(&self) -> &BTreeMap<String, res::ResourceClaim> {
        &self.claims
    }

    /// Pods by `namespace/name`.
    pub fn pods(&self) -> &BTreeMap<String, Box<Pod>> {
        &self.pods
    }

    /// Every pod, in `namespace/name` order.
    pub fn pod_objects(&self) -> impl Iterator<Item = &Pod> + Clone {
        self.pods.values().map(|p| &**p)
    }

    /// What a stored pod requests ([`tessera_driver::placement::nodefit::pod_requests`], kept from when the
    /// pod was stored); `None` when its requests do not parse.
    pub fn pod_requests(&self, pod: &Pod) -> Option<Resources> {
        self.checked_pod_requests(pod).ok()
    }

    /// What a pod requests, or why its requests do not parse: kept from when the pod was
    /// stored (a stored pod keeps no containers), worked out now for any other pod.
    pub fn checked_pod_requests(&self, pod: &Pod) -> Result<Resources, String> {
        match with_pod_key(pod, |key| self.requests.get(key).cloned()) {
            Some(r) => r,
            None => {
                tessera_driver::placement::nodefit::pod_requests(pod).map_err(|e| e.to_string())
            }
        }
    }

    /// Why `pod` must stay off the fast path ([`fast_path::blocker`]), its containers' part
    /// kept from when the pod was stored.
    pub fn fast_path_blocker(&self, pod: &Pod) -> Option<String> {
        fast_path::blocker(pod)
            .or_else(|| with_pod_key(pod, |key| self.container_blockers.get(key).cloned()))
    }

    /// Every node, in name order.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// The node named `name`.
    pub fn node(&self, name: &str) -> Option<&Node> {
        self.node_position(name).ok().map(|i| &self.nodes[i])
    }

    fn node_position(&self, name: &str) -> std::result::Result<usize, usize> {
        self.nodes
            .binary_search_by(|n| n.metadata.name.as_deref().unwrap_or_default().cmp(name))
    }

    /// Every node in name order, with its allocatable amounts
    /// ([`tessera_driver::placement::nodefit::node_allocatable`], worked out when the node was stored).
    pub fn nodes_allocatable(&self) -> impl Iterator<Item = (&str, &Node, Resources)> {
        self.nodes
            .iter()
            .zip(&self.allocatable)
            .map(|(node, a)| (node.metadata.name.as_deref().unwrap_or_default(), node, *a))
    }

    /// Every node, in name order, shared: the allocator's candidate list when all nodes fit a
    /// pod, without copying a thousand Node objects per pod.
    pub fn node_list(&self) -> Arc<Vec<Node>> {
        Arc::clone(&self.nodes)
    }

    /// The allocator's snapshot, rebuilt first when slices or classes changed.
    pub fn snapshot(&mut self) -> Result<&mut Snapshot> {
        let snapshot = if let Some(s) = self.snapshot.take() {
            s
        } else {
            let slices: Vec<Arc<PublishedSlice>> = self.slices.values().cloned().collect();
            let classes: Vec<res::DeviceClass> = self.classes.values().cloned().collect();
            let mut fresh = Snapshot::for_driver_shared(&self.driver_name, &slices, &classes, &[])?;
            for claim in self.claims.values() {
                if let Some(allocation) = claim.status.as_ref().and_then(|s| s.allocation.as_ref())
                {
                    fresh.commit(claim, allocation);
                }
            }
            fresh.set_workload(self.workload.clone());
            self.builds += 1;
            fresh
        };
        Ok(self.snapshot.insert(snapshot))
    }

    /// A stamp that changes whenever the use of some device may have changed (the snapshot
    /// was rebuilt, or an allocation was committed or released on it); `None` when the
    /// snapshot cannot be built.
    pub fn device_use_version(&mut self) -> Option<(u64, u64)> {
        let version = self.snapshot().ok()?.usage_version();
        Some((self.builds, version))
    }

    /// Records that the pod `pod` (its `namespace/name`) taught the snapshot `shape`
    /// ([`tessera_driver::placement::allocator::Allocator::place_pod`] did), so it is not taught twice
    /// and a rebuilt snapshot still knows it.
    pub fn learned(&mut self, pod: &str, shape: TaskShape) {
        if self.learned.insert(pod.to_owned()) {
            self.workload.observe(shape);
        }
    }

    /// Whether the pod `pod` (its `namespace/name`) has taught its shape already.
    pub fn has_learned(&self, pod: &str) -> bool {
        self.learned.contains(pod)
    }

    /// The task shapes learned so far.
    pub fn workload(&self) -> &Workload {
        &self.workload
    }

    /// Gives placement policies each node's CPU and memory: `status.allocatable` less
    /// `usage` (what the pods on it request, [`tessera_driver::placement::nodefit::node_usage`]).
    pub fn track_hosts(&mut self, usage: &BTreeMap<String, Resources>) -> Result<()> {
        self.snapshot()?;
        if let Some(snapshot) = self.snapshot.as_mut() {
            snapshot.track_hosts(self.nodes.iter(), usage);
        }
        Ok(())
    }

    /// Applies one change the reflector of `resource` saw (or the answer to one of the
    /// controller's own writes). Objects that do not decode are logged and skipped.
    pub fn apply(&mut self, resource: Resource, change: Change) {
        match change {
            Change::Listed(items) => self.list_page(resource, items, true, true),
            Change::Page { items, first, last } => self.list_page(resource, items, first, last),
            Change::Applied(value) => self.upsert(resource, value),
            Change::Deleted(value) => self.remove(resource, &json_key(&value)),
        }
    }

    /// One page of a list of `resource` (a whole list is one page that is first and last):
    /// its objects are stored at once, and after the last page what no page had is removed.
    fn list_page(&mut self, resource: Resource, items: Vec<Value>, first: bool, last: bool) {
        if first {
            self.listing.insert(resource, BTreeSet::new());
        }
        let keys: Vec<String> = items.iter().map(json_key).collect();
        self.listing.entry(resource).or_default().extend(keys);
        for item in items {
            self.upsert(resource, item);
        }
        if last {
            let seen = self.listing.remove(&resource).unwrap_or_default();
            let gone: Vec<String> = self
                .keys(resource)
                .into_iter()
                .filter(|k| !seen.contains(k))
                .collect();
            for key in gone {
                self.remove(resource, &key);
            }
            self.synced.insert(resource);
            self.generation += 1;
        }
    }

    fn keys(&self, resource: Resource) -> Vec<String> {
        match resource {
            Resource::Slices => self.slices.keys().cloned().collect(),
            Resource::Classes => self.classes.keys().cloned().collect(),
            Resource::Claims => self.claims.keys().cloned().collect(),
            Resource::Pods => self.pods.keys().cloned().collect(),
            Resource::Nodes => self
                .nodes
                .iter()
                .filter_map(|n| n.metadata.name.clone())
                .collect(),
        }
    }

    /// The resourceVersion of the object the view holds under `key`.
    fn stored_version(&self, resource: Resource, key: &str) -> Option<u64> {
        match resource {
            Resource::Slices => self
                .slices
                .get(key)
                .and_then(|o| o.resource_version())
                .and_then(|v| v.parse().ok()),
            Resource::Classes => self
                .classes
                .get(key)
                .and_then(|o| meta_version(&o.metadata)),
            Resource::Claims => self.claims.get(key).and_then(|o| meta_version(&o.metadata)),
            Resource::Pods => self.pods.get(key).and_then(|o| meta_version(&o.metadata)),
            Resource::Nodes => self.node(key).and_then(|o| meta_version(&o.metadata)),
        }
    }

    fn decode(resource: Resource, value: Value) -> Option<Object> {
        let key = json_key(&value);
        let decoded = match resource {
            Resource::Pods => serde_json::from_value(value)
                .map(Object::Pod)
                .map_err(|e| e.to_string()),
            Resource::Nodes => serde_json::from_value(value)
                .map(Object::Node)
                .map_err(|e| e.to_string()),
            _ => apiversion::decode_document(value, resource.as_str()).map_err(|e| e.to_string()),
        };
        match decoded {
            Ok(o) => Some(o),
            Err(e) => {
                warn!(resource = resource.as_str(), object = %key, error = %e, "skipping an object that does not decode");
                None
            }
        }
    }

    fn upsert(&mut self, resource: Resource, mut value: Value) {
        // managedFields are often the larger part of an object and nothing reads them.
        if let Some(meta) = value.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.remove("managedFields");
        }
        let key = json_key(&value);
        let version = version_of(&value);
        // An event no newer than what the view holds (an older one, the echo of the
        // controller's own write, an unchanged object in a relist) changes nothing: it is not
        // even decoded.
        if let (Some(incoming), Some(held)) = (version, self.stored_version(resource, &key))
            && incoming <= held
        {
            return;
        }
        let Some(mut object) = Self::decode(resource, value) else {
            return;
        };
        match &mut object {
            Object::Pod(p) => slim_pod(p),
            Object::Node(n) => slim_node(n),
            Object::DeviceClass(c) => c.metadata.managed_fields = None,
            Object::ResourceClaim(c) => slim::claim(c),
            // Slices are kept in the allocator's compact form (below): nothing to slim.
            Object::ResourceSlice(_) | Object::ResourceClaimTemplate(_) => {}
        }
        match object {
            Object::ResourceSlice(s) => {
                self.slices.insert(key, Arc::new(PublishedSlice::from(s)));
                self.snapshot = None;
                self.generation += 1;
            }
            Object::DeviceClass(c) => {
                self.classes.insert(key, c);
                self.snapshot = None;
                self.generation += 1;
            }
            Object::ResourceClaim(c) => self.put_claim(key, c, version),
            Object::Pod(p) => {
                if self
                    .pods
                    .get(&key)
                    .is_some_and(|o| !gate::is_done(o) && gate::is_done(&p))
                {
                    self.generation += 1;
                }
                self.store_pod(key, p);
            }
            Object::Node(n) => {
                let allocatable = tessera_driver::placement::nodefit::node_allocatable(&n);
                let at = self.node_position(&key);
                // In place unless an allocation in flight still holds the list.
                let nodes = Arc::make_mut(&mut self.nodes);
                match at {
                    Ok(i) => {
                        nodes[i] = n;
                        self.allocatable[i] = allocatable;
                    }
                    Err(i) => {
                        nodes.insert(i, n);
                        self.allocatable.insert(i, allocatable);
                    }
                }
                self.generation += 1;
            }
            Object::ResourceClaimTemplate(_) => {}
        }
    }

    fn put_claim(&mut self, key: String, claim: res::ResourceClaim, version: Option<u64>) {
        let old = self.claims.get(&key);
        if !newer(version, old.and_then(|o| meta_version(&o.metadata))) {
            return;
        }
        if old.is_some_and(gate::is_allocated) && !gate::is_allocated(&claim) {
            self.generation += 1;
        }
        // A claim that loses its last reservation while it stays allocated (kube-controller-
        // manager drops the reservation of a pod that is gone) may be an orphan now.
        if old.is_some_and(gate::is_reserved)
            && !gate::is_reserved(&claim)
            && gate::is_allocated(&claim)
        {
            self.generation += 1;
        }
        if !old.is_some_and(gate::is_allocated) && gate::is_allocated(&claim) {
            self.allocations += 1;
        }
        // A claim being deleted is given back (its finalizer removed) by the next pass.
        if old.is_some_and(|o| o.metadata.deletion_timestamp.is_none())
            && claim.metadata.deletion_timestamp.is_some()
        {
            self.generation += 1;
        }
        if let Some(snapshot) = self.snapshot.as_mut() {
            if let Some(old) = old
                && claim_key(old) != claim_key(&claim)
            {
                snapshot.release(&claim_key(old));
            }
            match claim.status.as_ref().and_then(|s| s.allocation.as_ref()) {
                Some(allocation) => snapshot.commit(&claim, allocation),
                None => snapshot.release(&claim_key(&claim)),
            }
        }
        self.claims.insert(key, claim);
    }

    /// Applies a claim the controller just wrote (the server's answer).
    pub fn put_written_claim(&mut self, mut claim: res::ResourceClaim) {
        slim::claim(&mut claim);
        let key = claim_path(&claim);
        let version = meta_version(&claim.metadata);
        self.put_claim(key, claim, version);
    }

    /// Applies a pod the controller just wrote (the server's answer).
    pub fn put_written_pod(&mut self, mut pod: Pod) {
        slim_pod(&mut pod);
        let key = pod_path(&pod);
        if newer(
            meta_version(&pod.metadata),
            self.pods.get(&key).and_then(|o| meta_version(&o.metadata)),
        ) {
            self.store_pod(key, pod);
        }
    }

    /// Stores a slim pod: what its containers decide (requests, the fast path) worked out
    /// first and kept beside it, then its containers dropped, and once it is bound, only what
    /// decisions read of a bound pod.
    fn store_pod(&mut self, key: String, mut pod: Pod) {
        self.requests.insert(
            key.clone(),
            tessera_driver::placement::nodefit::pod_requests(&pod).map_err(|e| e.to_string()),
        );
        match pod.spec.as_ref().and_then(fast_path::container_blocker) {
            Some(why) => self.container_blockers.insert(key.clone(), why),
            None => self.container_blockers.remove(&key),
        };
        if let Some(spec) = pod.spec.as_mut() {
            spec.containers = Vec::new();
            spec.init_containers = None;
        }
        slim_bound_pod(&mut pod);
        self.pods.insert(key, Box::new(pod));
    }

    fn remove(&mut self, resource: Resource, key: &str) {
        match resource {
            Resource::Slices => {
                if self.slices.remove(key).is_some() {
                    self.snapshot = None;
                }
            }
            Resource::Classes => {
                if self.classes.remove(key).is_some() {
                    self.snapshot = None;
                }
            }
            Resource::Claims => {
                if let Some(old) = self.claims.remove(key)
                    && let Some(snapshot) = self.snapshot.as_mut()
                {
                    snapshot.release(&claim_key(&old));
                }
            }
            Resource::Pods => {
                self.pods.remove(key);
                self.learned.remove(key);
                self.requests.remove(key);
                self.container_blockers.remove(key);
            }
            Resource::Nodes => {
                if let Ok(i) = self.node_position(key) {
                    Arc::make_mut(&mut self.nodes).remove(i);
                    self.allocatable.remove(i);
                }
            }
        }
        self.generation += 1;
    }

    /// Forgets a claim the controller saw deleted through a write (404).
    pub fn forget_claim(&mut self, key: &str) {
        self.remove(Resource::Claims, key);
    }

    /// Forgets a pod the controller saw deleted through a write (404).
    pub fn forget_pod(&mut self, key: &str) {
        self.remove(Resource::Pods, key);
    }
}

#[cfg(test)]
mod tests {

    use super::*;
    use serde_json::json;

    fn claim(rv: &str, node: Option<&str>) -> Value {
        let mut c = json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "c", "namespace": "ml", "uid": "u1", "resourceVersion": rv},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.tessera.dev"}}]}},
        });
        if let Some(n) = node {
            c["status"] = json!({"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": "gpu.tessera.dev", "pool": n, "device": "gpu-0"}]}}});
        }
        c
    }

    #[test]
    fn a_slim_pod_keeps_the_device_plugin_request_and_drops_other_annotations() {
        let mut pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ml", "annotations": {
                names::ANNOTATION_DEVICE_PLUGIN_REQUEST: "{\"containers\":[]}",
                "kubectl.kubernetes.io/last-applied-configuration": "{}",
            }},
        }))
        .unwrap();
        slim_pod(&mut pod);
        let kept = pod.metadata.annotations.unwrap();
        assert_eq!(kept.len(), 1);
        assert!(kept.contains_key(names::ANNOTATION_DEVICE_PLUGIN_REQUEST));
        let mut plain: Pod = serde_json::from_value(json!({
            "metadata": {"name": "q", "namespace": "ml", "annotations": {"a": "b"}},
        }))
        .unwrap();
        slim_pod(&mut plain);
        assert_eq!(plain.metadata.annotations, None);
    }

    #[test]
    fn a_slim_pod_still_says_why_it_is_off_the_fast_path() {
        let pod = |extra: Value| -> Pod {
            let mut spec = json!({"containers": [{"name": "c", "image": "x",
                "ports": [{"containerPort": 80}]}],
                "volumes": [{"name": "token", "projected": {"sources": []}}]});
            for (k, v) in extra.as_object().unwrap() {
                spec[k] = v.clone();
            }
            serde_json::from_value(json!({"metadata": {"name": "p"}, "spec": spec})).unwrap()
        };
        for extra in [
            json!({}),
            json!({"affinity": {"podAntiAffinity": {}}}),
            json!({"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone",
                "whenUnsatisfiable": "DoNotSchedule"}]}),
            json!({"volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "d"}}]}),
            json!({"containers": [{"name": "c", "image": "x",
                "ports": [{"containerPort": 80, "hostPort": 80}]}]}),
            json!({"containers": [{"name": "c", "image": "x",
                "resources": {"limits": {"example.com/fpga": "1"}}}]}),
            json!({"initContainers": [{"name": "i", "image": "x",
                "resources": {"requests": {"cpu": "lots"}}}]}),
            json!({"schedulerName": "other"}),
        ] {
            let full = pod(extra.clone());
            let mut slim = full.clone();
            slim_pod(&mut slim);
            assert_eq!(
                fast_path::blocker(&slim),
                fast_path::blocker(&full),
                "{extra}"
            );
            // The view keeps no containers, but what they decide.
            let mut view = ClusterView::new(names::DEFAULT_DRIVER_NAME);
            view.apply(
                Resource::Pods,
                Change::Applied(serde_json::to_value(&full).unwrap()),
            );
            let stored = &view.pods()["p"];
            assert!(stored.spec.as_ref().unwrap().containers.is_empty());
            assert_eq!(
                view.fast_path_blocker(stored),
                fast_path::blocker(&full),
                "{extra}"
            );
            assert_eq!(
                view.checked_pod_requests(stored),
                tessera_driver::placement::nodefit::pod_requests(&full).map_err(|e| e.to_string()),
                "{extra}"
            );
        }
        // What nothing decides on is dropped.
        let mut plain = pod(json!({}));
        slim_pod(&mut plain);
        let spec = plain.spec.unwrap();
        assert_eq!(
            (spec.volumes, spec.containers[0].ports.clone()),
            (None, None)
        );
    }

    #[test]
    fn an_event_for_the_version_held_changes_nothing() {
        let mut view = ClusterView::new("gpu.tessera.dev");
        let node = json!({"apiVersion": "v1", "kind": "Node",
                          "metadata": {"name": "n", "resourceVersion": "3"}});
        view.apply(Resource::Nodes, Change::Applied(node.clone()));
        let generation = view.generation();
        view.apply(Resource::Nodes, Change::Applied(node));
        assert_eq!(view.generation(), generation);
        // The echo of a claim the controller wrote is not decoded again: what the view holds
        // (the server's answer to the write) stays.
        let mut written: res::ResourceClaim =
            serde_json::from_value(claim("5", Some("n1"))).unwrap();
        view.put_written_claim(written.clone());
        written.status = None;
        view.apply(
            Resource::Claims,
            Change::Applied(serde_json::to_value(&written).unwrap()),
        );
        assert!(gate::is_allocated(&view.claims()["ml/c"]));
    }

    #[test]
    fn an_older_event_never_overwrites_a_newer_claim() {
        let mut view = ClusterView::new("gpu.tessera.dev");
        view.apply(Resource::Claims, Change::Applied(claim("5", Some("n1"))));
        view.apply(Resource::Claims, Change::Applied(claim("4", None)));
        assert!(gate::is_allocated(&view.claims()["ml/c"]));
        view.apply(Resource::Claims, Change::Applied(claim("6", None)));
        assert!(!gate::is_allocated(&view.claims()["ml/c"]));
    }

    #[test]
    fn a_list_replaces_what_was_seen_and_marks_the_resource_synced() {
        let mut view = ClusterView::new("gpu.tessera.dev");
        view.apply(Resource::Claims, Change::Applied(claim("5", None)));
        assert!(!view.is_synced());
        for r in Resource::ALL {
            view.apply(r, Change::Listed(vec![]));
        }
        assert!(view.is_synced());
        assert!(view.claims().is_empty());
    }

    #[test]
    fn a_list_in_pages_means_what_one_list_means() {
        let mut view = ClusterView::new("gpu.tessera.dev");
        let node = |name: &str| {
            json!({"apiVersion": "v1", "kind": "Node",
                                       "metadata": {"name": name, "resourceVersion": "1"}})
        };
        view.apply(Resource::Nodes, Change::Applied(node("old")));
        let page = |items, first, last| Change::Page { items, first, last };
        // A list abandoned after one page: its objects were stored, but what it did not
        // have is only removed by a list that ends.
        view.apply(Resource::Nodes, page(vec![node("x")], true, false));
        view.apply(Resource::Nodes, page(vec![node("a")], true, false));
        assert!(!view.is_synced() && view.node("old").is_some());
        view.apply(Resource::Nodes, page(vec![node("b")], false, true));
        let names = |view: &ClusterView| -> Vec<String> {
            view.nodes()
                .iter()
                .map(|n| n.metadata.name.clone().unwrap())
                .collect()
        };
        assert_eq!(names(&view), ["a", "b"]);
        // The next list in pages drops what none of its pages had.
        view.apply(Resource::Nodes, page(vec![node("b")], true, false));
        view.apply(Resource::Nodes, page(vec![], false, true));
        assert_eq!(names(&view), ["b"]);
        let allocatable: Vec<&str> = view.nodes_allocatable().map(|(n, _, _)| n).collect();
        assert_eq!(allocatable, ["b"]);
    }

    #[test]
    fn the_shared_node_list_follows_node_changes() {
        let mut view = ClusterView::new("gpu.tessera.dev");
        let node =
            |name: &str| json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}});
        view.apply(Resource::Nodes, Change::Applied(node("a")));
        assert_eq!(view.node_list().len(), 1);
        view.apply(Resource::Nodes, Change::Applied(node("b")));
        assert_eq!(view.node_list().len(), 2);
        view.apply(Resource::Nodes, Change::Deleted(node("a")));
        assert_eq!(view.node_list().len(), 1);
    }

    #[test]
    fn a_pod_teaches_its_shape_once_and_a_rebuilt_snapshot_keeps_what_was_learned() {
        let mut view = ClusterView::new("gpu.tessera.dev");
        let shape = TaskShape {
            host: tessera_driver::placement::fragmentation::HostResources::default(),
            gpus: 1,
            gpu_milli: 500,
            models: None,
        };
        view.learned("ml/p", shape.clone());
        view.learned("ml/p", shape.clone());
        assert!(view.has_learned("ml/p") && !view.has_learned("ml/q"));
        assert_eq!(view.workload().seen(), 1);
        assert_eq!(view.snapshot().unwrap().workload().seen(), 1);
        // A class change drops the snapshot; the rebuilt one still knows the shape.
        view.apply(
            Resource::Classes,
            Change::Applied(
                json!({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                "metadata": {"name": "x", "resourceVersion": "1"}, "spec": {}}),
            ),
        );
        assert_eq!(view.snapshot().unwrap().workload().seen(), 1);
        view.learned("ml/q", shape);
        assert_eq!(view.workload().seen(), 2);
    }

    #[test]
    fn pods_and_nodes_keep_only_what_decisions_read() {
        let mut view = ClusterView::new("gpu.tessera.dev");
        let managed = json!([{"manager": "kubectl", "operation": "Update", "fieldsType": "FieldsV1",
                              "fieldsV1": {"f:spec": {"f:containers": {}}}}]);
        view.apply(
            Resource::Pods,
            Change::Applied(json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "p", "namespace": "ml", "resourceVersion": "3",
                             "labels": {"app": "x"}, "managedFields": managed},
                "spec": {"schedulingGates": [{"name": "gpu.tessera.dev/allocation"}],
                         "resourceClaims": [{"name": "gpu", "resourceClaimName": "c"}],
                         "nodeSelector": {"zone": "a"},
                         "volumes": [{"name": "v", "emptyDir": {}}],
                         "containers": [{"name": "main", "image": "big/image:1",
                             "env": [{"name": "A", "value": "b"}],
                             "resources": {"requests": {"cpu": "2"}}}]},
                "status": {"phase": "Pending", "hostIP": "10.0.0.1",
                           "conditions": [{"type": "PodScheduled", "status": "False"}]}})),
        );
        let pod = serde_json::to_value(&view.pods()["ml/p"]).unwrap();
        assert_eq!(
            pod,
            json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "p", "namespace": "ml", "resourceVersion": "3"},
                "spec": {"schedulingGates": [{"name": "gpu.tessera.dev/allocation"}],
                         "resourceClaims": [{"name": "gpu", "resourceClaimName": "c"}],
                         "nodeSelector": {"zone": "a"},
                         "containers": []},
                "status": {"phase": "Pending",
                           "conditions": [{"type": "PodScheduled", "status": "False"}]}})
        );
        // What the containers decide is kept beside the pod.
        let stored = &view.pods()["ml/p"];
        assert_eq!(
            view.pod_requests(stored).map(|r| r.cpu_nanos),
            Some(2_000_000_000)
        );
        // Once bound, only what decisions read of a bound pod.
        view.apply(
            Resource::Pods,
            Change::Applied(json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "p", "namespace": "ml", "resourceVersion": "4"},
                "spec": {"nodeName": "n", "priority": 5,
                         "resourceClaims": [{"name": "gpu", "resourceClaimName": "c"}],
                         "nodeSelector": {"zone": "a"},
                         "tolerations": [{"operator": "Exists"}],
                         "containers": [{"name": "main", "image": "big/image:1",
                             "resources": {"requests": {"cpu": "2"}}}]},
                "status": {"phase": "Running",
                           "conditions": [{"type": "PodScheduled", "status": "True"}],
                           "resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "c"}]}})),
        );
        assert_eq!(
            serde_json::to_value(&view.pods()["ml/p"]).unwrap(),
            json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "p", "namespace": "ml", "resourceVersion": "4"},
                "spec": {"nodeName": "n", "priority": 5, "containers": [],
                         "resourceClaims": [{"name": "gpu", "resourceClaimName": "c"}]},
                "status": {"phase": "Running",
                           "resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "c"}]}})
        );
        assert_eq!(
            view.pod_requests(&view.pods()["ml/p"]).map(|r| r.cpu_nanos),
            Some(2_000_000_000)
        );
        view.apply(
            Resource::Nodes,
            Change::Applied(json!({"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": "n", "labels": {"zone": "a"}, "managedFields": managed},
                "spec": {"podCIDR": "10.1.0.0/24", "unschedulable": true},
                "status": {"allocatable": {"cpu": "8"}, "images": [{"names": ["a"], "sizeBytes": 1}]}})),
        );
        let node = serde_json::to_value(view.node("n").unwrap()).unwrap();
        assert_eq!(
            node,
            json!({"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": "n", "labels": {"zone": "a"}},
                "spec": {"unschedulable": true}, "status": {"allocatable": {"cpu": "8"}}})
        );
    }

    #[test]
    fn the_device_use_stamp_moves_with_allocations_only() {
        let mut view = ClusterView::new("gpu.tessera.dev");
        view.apply(
            Resource::Slices,
            Change::Applied(
                json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                "metadata": {"name": "n1-gpus", "resourceVersion": "1"},
                "spec": {"driver": "gpu.tessera.dev", "nodeName": "n1",
                         "pool": {"name": "n1", "generation": 1, "resourceSliceCount": 1},
                         "devices": [{"name": "gpu-0"}]}}),
            ),
        );
        let start = view.device_use_version().unwrap();
        assert_eq!(view.device_use_version(), Some(start));
        // A pod or an unallocated claim changes no device's use.
        view.apply(Resource::Claims, Change::Applied(claim("4", None)));
        view.apply(
            Resource::Pods,
            Change::Applied(json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "p", "namespace": "ml", "resourceVersion": "1"}})),
        );
        assert_eq!(view.device_use_version(), Some(start));
        view.apply(Resource::Claims, Change::Applied(claim("5", Some("n1"))));
        let allocated = view.device_use_version().unwrap();
        assert_ne!(allocated, start);
        view.apply(Resource::Claims, Change::Applied(claim("6", None)));
        assert_ne!(view.device_use_version().unwrap(), allocated);
    }

    #[test]
    fn a_claim_losing_its_last_reservation_bumps_the_generation() {
        let mut view = ClusterView::new("gpu.tessera.dev");
        let mut reserved = claim("5", Some("n1"));
        reserved["status"]["reservedFor"] =
            json!([{"resource": "pods", "name": "p", "uid": "pod-uid"}]);
        view.apply(Resource::Claims, Change::Applied(reserved));
        let before = view.generation();
        view.apply(Resource::Claims, Change::Applied(claim("6", Some("n1"))));
        assert!(view.generation() > before);
    }

    #[test]
    fn releasing_a_claim_bumps_the_generation() {
        let mut view = ClusterView::new("gpu.tessera.dev");
        view.apply(Resource::Claims, Change::Applied(claim("5", Some("n1"))));
        let before = view.generation();
        view.apply(Resource::Claims, Change::Applied(claim("6", None)));
        assert!(view.generation() > before);
    }
}
