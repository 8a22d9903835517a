//! Replaying a trace in time (`tessera simulate --time`): tasks arrive at their
//! `creation_time`, run for `deletion_time - creation_time` once placed, and a day/night
//! `GpuProfileSchedule` moves part of the cluster between online and batch work.
//!
//! # The model
//!
//! * **Tiers.** A task's `qos` gives its tier ([`super::trace::Qos::is_batch`]): `LS` and `Guaranteed` are
//!   online, `BE` and `Burstable` batch. Online tasks claim Tessera's share class, batch tasks
//!   the batch class (its `TierPolicy` records their shares as batch), so whom a switch or a
//!   defragmentation may evict is decided from the allocation as the controller decides it.
//! * **Pools.** Every node is labelled [`POOL_LABEL`] with [`POOL_BATCH`], [`POOL_TIDAL`] or
//!   [`POOL_ONLINE`] ([`pool_labels`]). Batch nodes are in `exclusive` mode all the time and
//!   online nodes in `shared` mode; tidal nodes follow the schedule whose node selector picks
//!   them ([`crate::node::schedule::assign`]), or stay `shared` when none does (the static
//!   split).
//! * **Mode to tier.** A node serves batch work while its GPUs are `exclusive` (the night
//!   profile: GPUs given to training) and online work while they are `shared` (the day
//!   profile: many small inference shares). Inside a node the allocator places shares as in
//!   the paper's replay: every GPU is published as shares, so batch shares still pack onto one
//!   GPU; the mode only says which tier the node takes.
//! * **Switches.** At each window start, and again when a holder leaves or the drain deadline
//!   passes, each node of the schedule goes through [`switch::decide`] with its GPUs and their
//!   holders: a GPU without holders switches at once, one with holders drains; past the
//!   profile's `drainDeadline` the batch holders it names are evicted, online holders never
//!   are (the GPU waits for them). A node takes new tasks only once its switch has finished
//!   (the plugin drains GPU by GPU; the replay holds the whole node, which understates what a
//!   switch gives).
//! * **Pending.** A task that fits nowhere waits in a FIFO queue, retried in order whenever
//!   room of its tier was freed (a departure, an eviction, a finished switch). A pass tries
//!   each task shape at most once: a task whose GPU ask, models and tier failed in this pass,
//!   with no less CPU and memory, is skipped.
//! * **Evictions.** An evicted task goes back to the end of the queue with the runtime it had
//!   left; its claim is placed again from scratch.
//! * **Defragmentation.** Every [`DEFRAG_PASS_SECS`], pending whole-GPU tasks (in queue order)
//!   get a [`defrag::plan`] over the nodes of their tier, whose movable pods are found by
//!   [`defrag::movable`] (batch pods owned by a `Job`; the replay has no
//!   `PodDisruptionBudgets`), within the evictions-per-hour budget ([`defrag::budget_left`]).
//!   The moved tasks are evicted and the pending task placed where room was made.
//! * **Time.** The trace's second `t` is the instant `origin + t`; the replay ends at the
//!   latest `deletion_time` (tasks still running are cut there, tasks still waiting that were
//!   never placed are counted).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap, VecDeque};

use jiff::Timestamp;
use k8s_openapi::Resource as _;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Node, Pod, PodResourceClaim, PodSpec};
use k8s_openapi::api::resource::v1 as res;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use serde::Serialize;

use super::cluster::{Cluster, claim_in};
use super::trace::TimedPod;
use crate::error::{Error, Result};
use crate::names;
use crate::node::inventory::GpuMode;
use crate::node::schedule::switch::{
    self, DeviceGpus, Disruption, GpuState, GpuStep, Holder, SwitchRecord,
};
use crate::node::schedule::{self, Assignment, Schedule};
use crate::placement::allocator::{
    Allocator, AllocatorOptions, DEFAULT_MAX_STEPS, Learn, Policy, Snapshot, claim_key,
};
use crate::placement::defrag;
use crate::placement::fragmentation::{HostResources, WHOLE_GPU};

/// The node label that puts a node in a pool.
pub const POOL_LABEL: &str = "simulate.tessera.dev/pool";
/// Nodes that serve batch work all the time.
pub const POOL_BATCH: &str = "batch";
/// Nodes that a schedule may move between online and batch work.
pub const POOL_TIDAL: &str = "tidal";
/// Nodes that serve online work all the time.
pub const POOL_ONLINE: &str = "online";
/// How often defragmentation looks at the pending whole-GPU tasks, in seconds.
pub const DEFRAG_PASS_SECS: u64 = 600;
/// The namespace of the replay's pods and claims.
const NAMESPACE: &str = "simulate";

/// How a time replay runs.
#[derive(Debug, Clone)]
pub struct TimeOptions {
    /// The placement policy.
    pub policy: Policy,
    /// The batch DeviceClass (a `TierPolicy` that says batch) that batch tasks claim.
    pub batch_class: String,
    /// Each node's labels, in cluster order ([`pool_labels`]).
    pub labels: Vec<BTreeMap<String, String>>,
    /// The schedule tidal nodes follow; `None`: the static split.
    pub schedule: Option<Schedule>,
    /// Defragmentation's evictions per hour; 0 turns it off.
    pub defrag_evictions_per_hour: u32,
    /// The instant of the trace's second 0.
    pub origin: Timestamp,
}

/// Pending time of one kind of task, in seconds from creation to first placement.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Waits {
    /// Tasks of the kind.
    pub tasks: usize,
    /// Of them, placed at some time.
    pub placed: usize,
    /// Median wait of the placed ones.
    pub p50_secs: u64,
    /// 95th percentile.
    pub p95_secs: u64,
    /// Longest.
    pub max_secs: u64,
}

impl Waits {
    fn of(tasks: usize, mut waits: Vec<u64>) -> Self {
        waits.sort_unstable();
        let at = |q: usize| {
            if waits.is_empty() {
                0
            } else {
                waits[((waits.len() - 1) * q).div_ceil(100)]
            }
        };
        Self {
            tasks,
            placed: waits.len(),
            p50_secs: at(50),
            p95_secs: at(95),
            max_secs: waits.last().copied().unwrap_or(0),
        }
    }
}

/// What one time replay measured.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TimeResult {
    /// Seconds replayed (the latest `deletion_time`).
    pub duration_secs: u64,
    /// GPUs of the cluster.
    pub gpus: u64,
    /// Tasks by `qos` as the trace writes it.
    pub tasks_by_qos: BTreeMap<&'static str, usize>,
    /// GPU-hours held by online tasks.
    pub online_gpu_hours: f64,
    /// GPU-hours held by batch tasks.
    pub batch_gpu_hours: f64,
    /// Pending time of tasks asking for one whole GPU.
    pub whole_gpu_wait: Waits,
    /// Pending time of tasks asking for two or more whole GPUs.
    pub multi_gpu_wait: Waits,
    /// Pending time of the batch tasks among both (whole GPUs, one or more): the ones the
    /// night profile and defragmentation are for.
    pub batch_large_wait: Waits,
    /// Tasks never placed before the end.
    pub never_placed: usize,
    /// Of them, online.
    pub online_never_placed: usize,
    /// Evictions by switches past their drain deadline.
    pub schedule_evictions: usize,
    /// Evictions by defragmentation.
    pub defrag_evictions: usize,
    /// Pending tasks defragmentation made room for.
    pub defrag_plans: usize,
    /// Online tasks evicted (the rules allow none).
    pub online_evicted: usize,
    /// Profile switches started (per node).
    pub switches: usize,
}

/// Labels every node with its pool: of each 100 consecutive nodes, `batch_percent` are batch
/// and the next `tidal_percent` tidal, spread evenly (node `i` has slot `37 i mod 100`).
pub fn pool_labels(
    nodes: usize,
    batch_percent: u32,
    tidal_percent: u32,
) -> Result<Vec<BTreeMap<String, String>>> {
    if batch_percent.saturating_add(tidal_percent) > 100 {
        return Err(Error::invalid(
            "simulation",
            "pools",
            format!(
                "batch {batch_percent}% and tidal {tidal_percent}% of the nodes add up to more \
                 than 100%"
            ),
        ));
    }
    Ok((0..nodes)
        .map(|i| {
            let slot = u32::try_from(i % 100 * 37 % 100).unwrap_or(0);
            let pool = if slot < batch_percent {
                POOL_BATCH
            } else if slot < batch_percent + tidal_percent {
                POOL_TIDAL
            } else {
                POOL_ONLINE
            };
            BTreeMap::from([(POOL_LABEL.to_owned(), pool.to_owned())])
        })
        .collect())
}

/// An instant (the trace's second 0 is one), as [`parse_trace_start`] reads it.
pub type Origin = Timestamp;

/// Reads the instant of the trace's second 0 (RFC 3339, e.g. `2023-01-02T15:00:00Z`).
pub fn parse_trace_start(text: &str) -> Result<Timestamp> {
    text.parse().map_err(|e| {
        Error::invalid(
            "--trace-start",
            "value",
            format!("{text:?} is not an RFC 3339 instant (e.g. 2023-01-02T15:00:00Z): {e}"),
        )
    })
}

/// A placed task.
#[derive(Debug, Clone)]
struct Running {
    node: usize,
    since: u64,
    gpus: BTreeSet<u32>,
    /// Its claim with the allocation (none for a CPU-only task).
    claim: Option<res::ResourceClaim>,
}

#[derive(Debug)]
struct Task {
    claim: Option<res::ResourceClaim>,
    batch: bool,
    remaining: u64,
    running: Option<Running>,
    /// Bumped at each eviction: an older departure event is stale.
    epoch: u32,
    first_placed: Option<u64>,
}

#[derive(Debug)]
struct NodeRun {
    modes: Vec<GpuMode>,
    scheduled: bool,
    labels: BTreeMap<String, String>,
    record: Option<SwitchRecord>,
    accepting: bool,
    /// Task indices holding each GPU.
    holders: Vec<BTreeSet<usize>>,
    /// Tasks placed on it (CPU-only ones too).
    tasks: BTreeSet<usize>,
}

impl NodeRun {
    /// The tier the node takes new tasks of, if any.
    fn serves(&self) -> Option<bool> {
        if !self.accepting {
            return None;
        }
        if self.modes.iter().all(|m| *m == GpuMode::Exclusive) {
            Some(true)
        } else if self.modes.iter().all(|m| *m == GpuMode::Shared) {
            Some(false)
        } else {
            None
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// A task's runtime ends (with the epoch it was placed in).
    Departure(usize, u32),
    /// A window of the schedule starts.
    Window,
    /// A node's drain deadline passes.
    Deadline(usize),
    /// A task is created.
    Arrival(usize),
    /// Defragmentation looks at the pending tasks.
    Defrag,
}

struct Replay<'a> {
    cluster: &'a Cluster,
    pods: &'a [TimedPod],
    opts: &'a TimeOptions,
    allocator: Allocator,
    snap: Snapshot,
    tasks: Vec<Task>,
    nodes: Vec<NodeRun>,
    node_index: HashMap<String, usize>,
    task_index: HashMap<String, usize>,
    device_gpus: DeviceGpus,
    events: BinaryHeap<Reverse<(u64, Event)>>,
    pending: VecDeque<usize>,
    /// Tiers (batch?) with room freed since the last retry pass.
    dirty: [bool; 2],
    /// Candidate nodes of each tier (online, batch), rebuilt when a node changes tier.
    candidates: [Vec<Node>; 2],
    candidates_stale: bool,
    defrag_done: Vec<Timestamp>,
    online_milli_secs: u128,
    batch_milli_secs: u128,
    result: TimeResult,
}

fn task_key(claim_name: &str) -> String {
    format!("{NAMESPACE}/{claim_name}")
}

impl Replay<'_> {
    fn at(&self, t: u64) -> Timestamp {
        let secs = i64::try_from(t).unwrap_or(i64::MAX);
        self.opts
            .origin
            .checked_add(jiff::SignedDuration::from_secs(secs))
            .unwrap_or(Timestamp::MAX)
    }

    fn secs(&self, at: Timestamp) -> u64 {
        u64::try_from(at.as_second().saturating_sub(self.opts.origin.as_second())).unwrap_or(0)
    }

    fn push(&mut self, t: u64, e: Event) {
        self.events.push(Reverse((t, e)));
    }

    fn tier(batch: bool) -> usize {
        usize::from(batch)
    }

    fn refresh_candidates(&mut self) {
        if !self.candidates_stale {
            return;
        }
        for batch in [false, true] {
            self.candidates[Self::tier(batch)] = self
                .nodes
                .iter()
                .zip(&self.cluster.candidates)
                .filter(|(n, _)| n.serves() == Some(batch))
                .map(|(_, c)| c.clone())
                .collect();
        }
        self.candidates_stale = false;
    }

    /// Tries to place task `i` now on a node of its tier.
    fn try_place(&mut self, i: usize, now: u64, learn: bool) -> bool {
        self.refresh_candidates();
        let task = &self.tasks[i];
        let pod = &self.pods[i].pod;
        let claims: Vec<&res::ResourceClaim> = task.claim.iter().collect();
        let learn = if learn {
            Learn::Shape(pod.shape())
        } else {
            Learn::Known
        };
        let placed = self.allocator.place_pod(
            &mut self.snap,
            &claims,
            &self.candidates[Self::tier(task.batch)],
            &pod.host,
            learn,
        );
        let Ok(placement) = placed.result else {
            return false;
        };
        let Some(&node) = self.node_index.get(&placement.node) else {
            return false;
        };
        let mut gpus = BTreeSet::new();
        let claim = task
            .claim
            .clone()
            .zip(placement.allocations.first())
            .map(|(mut c, a)| {
                for r in a.devices.iter().flat_map(|d| d.results.iter().flatten()) {
                    if let Some(g) = self.device_gpus.get(&(r.pool.clone(), r.device.clone())) {
                        gpus.insert(*g);
                    }
                }
                c.status = Some(res::ResourceClaimStatus {
                    allocation: Some(a.clone()),
                    ..res::ResourceClaimStatus::default()
                });
                c
            });
        for g in &gpus {
            if let Some(h) = self.nodes[node]
                .holders
                .get_mut(usize::try_from(*g).unwrap_or(usize::MAX))
            {
                h.insert(i);
            }
        }
        self.nodes[node].tasks.insert(i);
        let task = &mut self.tasks[i];
        task.first_placed.get_or_insert(now);
        task.running = Some(Running {
            node,
            since: now,
            gpus,
            claim,
        });
        let (epoch, end) = (task.epoch, now.saturating_add(task.remaining));
        self.push(end, Event::Departure(i, epoch));
        true
    }

    /// Ends task `i`'s run at `now`: its GPU time is counted and its room freed.
    fn stop(&mut self, i: usize, now: u64) -> Option<usize> {
        let run = self.tasks[i].running.take()?;
        let pod = &self.pods[i].pod;
        if let Some(c) = &run.claim {
            self.snap.release(&claim_key(c));
        }
        self.snap
            .remove_host_use(&self.cluster.nodes[run.node].name, &pod.host);
        let held = u128::from(pod.gpu_demand()) * u128::from(now.saturating_sub(run.since));
        if self.tasks[i].batch {
            self.batch_milli_secs += held;
        } else {
            self.online_milli_secs += held;
        }
        let node = &mut self.nodes[run.node];
        node.tasks.remove(&i);
        for g in &run.gpus {
            if let Some(h) = node
                .holders
                .get_mut(usize::try_from(*g).unwrap_or(usize::MAX))
            {
                h.remove(&i);
            }
        }
        let task = &mut self.tasks[i];
        task.remaining = task.remaining.saturating_sub(now.saturating_sub(run.since));
        self.dirty[Self::tier(task.batch)] = true;
        Some(run.node)
    }

    /// Evicts task `i` at `now`: it waits again with the runtime it had left.
    fn evict(&mut self, i: usize, now: u64) -> Option<usize> {
        let node = self.stop(i, now)?;
        let task = &mut self.tasks[i];
        task.epoch += 1;
        if !task.batch {
            self.result.online_evicted += 1;
        }
        self.pending.push_back(i);
        Some(node)
    }

    fn holder(&self, i: usize, preemptible: &BTreeSet<String>) -> Holder {
        let claim = self.tasks[i]
            .running
            .as_ref()
            .and_then(|r| r.claim.as_ref());
        Holder {
            pod: claim.map_or_else(
                || task_key(&self.pods[i].pod.name),
                |c| task_key(c.metadata.name.as_deref().unwrap_or_default()),
            ),
            uid: claim.and_then(|c| c.metadata.uid.clone()),
            disruption: claim.map_or(Disruption::Online, |c| {
                switch::claim_disruption(c, &self.cluster.driver_name, preemptible)
            }),
            terminating: false,
        }
    }

    /// One pass of the switch of node `n` at `now` (see the module docs).
    fn step_node(&mut self, n: usize, now: u64, preemptible: &BTreeSet<String>) {
        let Some(schedule) = self.opts.schedule.as_ref() else {
            return;
        };
        if !self.nodes[n].scheduled {
            return;
        }
        let Some(active) = schedule.active_at(self.at(now)) else {
            return;
        };
        // Each round either switches GPUs, evicts, or stops; three suffice (switch, evict,
        // switch what the evictions freed), one more to see the switch finished.
        for _ in 0..4 {
            let gpus: Vec<GpuState> = self.nodes[n]
                .modes
                .iter()
                .zip(&self.nodes[n].holders)
                .enumerate()
                .map(|(index, (mode, holders))| GpuState {
                    index: u32::try_from(index).unwrap_or(u32::MAX),
                    mode: *mode,
                    draining: !holders.is_empty(),
                    holders: holders
                        .iter()
                        .map(|&i| self.holder(i, preemptible))
                        .collect(),
                })
                .collect();
            let node = &self.nodes[n];
            let Some(d) = switch::decide(
                schedule,
                active,
                &node.labels,
                &gpus,
                node.record.as_ref(),
                self.at(now),
            ) else {
                return;
            };
            if d.starts {
                self.result.switches += 1;
                if let Some(deadline) = d.deadline.filter(|_| !d.finished) {
                    let t = self.secs(deadline);
                    self.push(t.max(now), Event::Deadline(n));
                }
            }
            let by_key: HashMap<String, usize> = self.nodes[n]
                .tasks
                .iter()
                .map(|&i| (self.holder_key(i), i))
                .collect();
            let mut changed = false;
            let node = &mut self.nodes[n];
            for (key, value) in &d.labels {
                match value {
                    Some(v) => node.labels.insert(key.clone(), v.clone()),
                    None => node.labels.remove(key),
                };
            }
            for plan in &d.gpus {
                if let (GpuStep::SwitchesNow, Some(w)) = (&plan.step, plan.wanted)
                    && let Some(m) = node
                        .modes
                        .get_mut(usize::try_from(plan.index).unwrap_or(usize::MAX))
                {
                    *m = w;
                    changed = true;
                }
            }
            if node.accepting != d.finished {
                node.accepting = d.finished;
                self.candidates_stale = true;
                if d.finished {
                    self.dirty = [true, true];
                }
            }
            let mut record = d.record;
            for h in &d.evict {
                if let Some(&i) = by_key.get(&h.pod)
                    && self.evict(i, now).is_some()
                {
                    self.result.schedule_evictions += 1;
                    record.evicted.push(h.pod.clone());
                    changed = true;
                }
            }
            self.nodes[n].record = Some(record);
            if !changed {
                return;
            }
        }
    }

    fn holder_key(&self, i: usize) -> String {
        self.tasks[i]
            .running
            .as_ref()
            .and_then(|r| r.claim.as_ref())
            .and_then(|c| c.metadata.name.as_deref())
            .map_or_else(|| task_key(&self.pods[i].pod.name), task_key)
    }

    /// Retries the pending tasks of the tiers with room freed, in queue order.
    fn retry(&mut self, now: u64) {
        if !self.dirty.iter().any(|d| *d) || self.pending.is_empty() {
            return;
        }
        let dirty = std::mem::take(&mut self.dirty);
        // (tier, gpus, milli, models) -> the least CPU and memory that failed this pass.
        let mut failed: HashMap<(bool, u32, u32, Vec<String>), Vec<HostResources>> = HashMap::new();
        let queue = std::mem::take(&mut self.pending);
        for i in queue {
            let batch = self.tasks[i].batch;
            if self.tasks[i].running.is_some() {
                continue;
            }
            let pod = &self.pods[i].pod;
            let key = (batch, pod.num_gpu, pod.gpu_milli, pod.gpu_spec.clone());
            let dominated = failed.get(&key).is_some_and(|hs| {
                hs.iter().any(|h| {
                    h.cpu_milli <= pod.host.cpu_milli && h.memory_bytes <= pod.host.memory_bytes
                })
            });
            if !dirty[Self::tier(batch)] || dominated || !self.try_place(i, now, false) {
                if !dominated && dirty[Self::tier(batch)] {
                    failed.entry(key).or_default().push(pod.host);
                }
                self.pending.push_back(i);
            }
        }
    }

    /// The batch pods on the nodes of `candidates` as Kubernetes objects, for
    /// [`defrag::movable`]: each owned by a `Job`, its claim allocated.
    fn movable(&self, candidates: &[Node]) -> Vec<defrag::Evictable> {
        let mut pods = Vec::new();
        let mut claims = BTreeMap::new();
        for node in candidates {
            let Some(&n) = node
                .metadata
                .name
                .as_ref()
                .and_then(|m| self.node_index.get(m))
            else {
                continue;
            };
            for &i in &self.nodes[n].tasks {
                let Some(claim) = self.tasks[i].running.as_ref().and_then(|r| r.claim.clone())
                else {
                    continue;
                };
                let name = claim.metadata.name.clone().unwrap_or_default();
                pods.push(Pod {
                    metadata: ObjectMeta {
                        name: Some(name.clone()),
                        namespace: Some(NAMESPACE.to_owned()),
                        uid: claim.metadata.uid.clone(),
                        owner_references: Some(vec![OwnerReference {
                            api_version: Job::API_VERSION.to_owned(),
                            kind: Job::KIND.to_owned(),
                            name: name.clone(),
                            uid: format!("job-{name}"),
                            controller: Some(true),
                            ..OwnerReference::default()
                        }]),
                        ..ObjectMeta::default()
                    },
                    spec: Some(PodSpec {
                        node_name: node.metadata.name.clone(),
                        resource_claims: Some(vec![PodResourceClaim {
                            name: "gpu".to_owned(),
                            resource_claim_name: Some(name.clone()),
                            ..PodResourceClaim::default()
                        }]),
                        ..PodSpec::default()
                    }),
                    status: None,
                });
                claims.insert(task_key(&name), claim);
            }
        }
        defrag::movable(&self.cluster.driver_name, &pods, &claims, &[])
    }

    /// Defragmentation's pass at `now` (see the module docs).
    fn defrag(&mut self, now: u64) {
        let per_hour = self.opts.defrag_evictions_per_hour;
        let large: Vec<usize> = self
            .pending
            .iter()
            .copied()
            .filter(|&i| {
                let p = &self.pods[i].pod;
                p.num_gpu > 0 && p.gpu_milli == WHOLE_GPU && self.tasks[i].running.is_none()
            })
            .collect();
        // Shapes no plan was found for in this pass (as in `retry`).
        let mut failed: HashMap<(bool, u32, Vec<String>), Vec<HostResources>> = HashMap::new();
        for i in large {
            let budget = defrag::budget_left(per_hour, &self.defrag_done, self.at(now));
            if budget == 0 {
                return;
            }
            self.refresh_candidates();
            let batch = self.tasks[i].batch;
            let pod = &self.pods[i].pod;
            let key = (batch, pod.num_gpu, pod.gpu_spec.clone());
            let host = pod.host;
            if failed.get(&key).is_some_and(|hs| {
                hs.iter()
                    .any(|h| h.cpu_milli <= host.cpu_milli && h.memory_bytes <= host.memory_bytes)
            }) {
                continue;
            }
            let candidates = self.candidates[Self::tier(batch)].clone();
            let movable = self.movable(&candidates);
            let claims: Vec<&res::ResourceClaim> = self.tasks[i].claim.iter().collect();
            let plan = if movable.is_empty() {
                None
            } else {
                defrag::plan(
                    &self.allocator,
                    &mut self.snap,
                    &claims,
                    &host,
                    &candidates,
                    &movable,
                    budget,
                )
            };
            let Some(plan) = plan else {
                failed.entry(key).or_default().push(host);
                continue;
            };
            let keys: HashMap<String, usize> = movable
                .iter()
                .filter_map(|e| self.task_index.get(&e.pod).map(|&t| (e.pod.clone(), t)))
                .collect();
            for m in &plan.moves {
                if let Some(&t) = keys.get(&m.pod)
                    && self.evict(t, now).is_some()
                {
                    self.result.defrag_evictions += 1;
                    self.defrag_done.push(self.at(now));
                }
            }
            let Some(target) = candidates
                .iter()
                .find(|c| c.metadata.name.as_deref() == Some(plan.node.as_str()))
                .cloned()
            else {
                continue;
            };
            self.pending.retain(|&p| p != i);
            if self.try_place_on(i, now, target) {
                self.result.defrag_plans += 1;
            } else {
                self.pending.push_front(i);
            }
        }
    }

    fn try_place_on(&mut self, i: usize, now: u64, node: Node) -> bool {
        let saved = std::mem::take(&mut self.candidates);
        let tier = Self::tier(self.tasks[i].batch);
        self.candidates[tier] = vec![node];
        let stale = std::mem::replace(&mut self.candidates_stale, false);
        let ok = self.try_place(i, now, false);
        self.candidates = saved;
        self.candidates_stale = stale;
        ok
    }
}

/// Replays `pods` in time on `cluster` (see the module docs). `classes` are the cluster's
/// DeviceClasses (to know which ones make their pods preemptible).
#[allow(clippy::too_many_lines)] // Reason: the event loop, read top to bottom.
pub fn replay_time(
    cluster: &Cluster,
    classes: &[res::DeviceClass],
    pods: &[TimedPod],
    opts: &TimeOptions,
) -> Result<TimeResult> {
    if opts.labels.len() != cluster.nodes.len() {
        return Err(Error::invalid(
            "simulation",
            "labels",
            format!(
                "{} label sets for {} nodes",
                opts.labels.len(),
                cluster.nodes.len()
            ),
        ));
    }
    let horizon = pods.iter().map(|p| p.deleted).max().unwrap_or(0);
    let driver = cluster.driver_name.clone();
    let preemptible = switch::preemptible_classes(classes, &driver);
    let slices: Vec<&res::ResourceSlice> = cluster.slices().iter().collect();
    let (_, device_gpus) = switch::published_gpus(&slices, &driver);
    let followed: Vec<Schedule> = opts.schedule.iter().cloned().collect();
    let nodes: Vec<NodeRun> = cluster
        .nodes
        .iter()
        .zip(&opts.labels)
        .map(|(n, labels)| {
            let pool = labels.get(POOL_LABEL).map(String::as_str);
            let scheduled = pool != Some(POOL_BATCH)
                && matches!(schedule::assign(&followed, labels), Assignment::One(_));
            let mode = if pool == Some(POOL_BATCH) {
                GpuMode::Exclusive
            } else {
                GpuMode::Shared
            };
            let count = usize::try_from(n.gpus).unwrap_or(0);
            NodeRun {
                modes: vec![mode; count],
                scheduled,
                labels: labels.clone(),
                record: None,
                accepting: true,
                holders: vec![BTreeSet::new(); count],
                tasks: BTreeSet::new(),
            }
        })
        .collect();
    let mut tasks = Vec::with_capacity(pods.len());
    let mut task_index = HashMap::with_capacity(pods.len());
    let mut tasks_by_qos: BTreeMap<&'static str, usize> = BTreeMap::new();
    for (seq, p) in pods.iter().enumerate() {
        let batch = p.qos.is_batch();
        *tasks_by_qos.entry(p.qos.as_str()).or_default() += 1;
        let class = if batch {
            opts.batch_class.as_str()
        } else {
            names::CLASS_SHARED_GPU
        };
        let claim = claim_in(&p.pod, seq, &driver, class).map(|(c, _)| c);
        let key = claim.as_ref().map_or_else(
            || task_key(&p.pod.name),
            |c| task_key(c.metadata.name.as_deref().unwrap_or_default()),
        );
        task_index.insert(key, seq);
        tasks.push(Task {
            claim,
            batch,
            remaining: p.runtime(),
            running: None,
            epoch: 0,
            first_placed: None,
        });
    }
    let mut run = Replay {
        cluster,
        pods,
        opts,
        allocator: Allocator::new(AllocatorOptions {
            driver_name: driver.clone(),
            policy: opts.policy,
            max_steps: DEFAULT_MAX_STEPS,
        })
        .without_explanations(),
        snap: cluster.snapshot()?,
        tasks,
        node_index: cluster
            .nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (n.name.clone(), i))
            .collect(),
        nodes,
        task_index,
        device_gpus,
        events: BinaryHeap::new(),
        pending: VecDeque::new(),
        dirty: [false, false],
        candidates: [Vec::new(), Vec::new()],
        candidates_stale: true,
        defrag_done: Vec::new(),
        online_milli_secs: 0,
        batch_milli_secs: 0,
        result: TimeResult {
            duration_secs: horizon,
            gpus: cluster.capacity_milli() / u64::from(WHOLE_GPU),
            tasks_by_qos,
            ..TimeResult::default()
        },
    };
    for (i, p) in pods.iter().enumerate() {
        run.push(p.created, Event::Arrival(i));
    }
    if opts.schedule.is_some() {
        run.push(0, Event::Window);
    }
    if opts.defrag_evictions_per_hour > 0 {
        run.push(DEFRAG_PASS_SECS, Event::Defrag);
    }
    while let Some(Reverse((now, event))) = run.events.pop() {
        if now > horizon {
            break;
        }
        match event {
            Event::Arrival(i) => {
                if !run.try_place(i, now, true) {
                    run.pending.push_back(i);
                }
            }
            Event::Departure(i, epoch) => {
                if run.tasks[i].epoch != epoch {
                    continue;
                }
                if let Some(n) = run.stop(i, now) {
                    run.step_node(n, now, &preemptible);
                }
            }
            Event::Window => {
                for n in 0..run.nodes.len() {
                    run.step_node(n, now, &preemptible);
                }
                if let Some(next) = opts
                    .schedule
                    .as_ref()
                    .and_then(|s| s.next_switch(run.at(now)))
                {
                    let t = run.secs(next.since);
                    if t > now {
                        run.push(t, Event::Window);
                    }
                }
            }
            Event::Deadline(n) => run.step_node(n, now, &preemptible),
            Event::Defrag => {
                run.defrag(now);
                run.push(now + DEFRAG_PASS_SECS, Event::Defrag);
            }
        }
        run.retry(now);
    }
    for i in 0..run.tasks.len() {
        run.stop(i, horizon);
    }
    let mut whole = (0, Vec::new());
    let mut multi = (0, Vec::new());
    let mut batch_large = (0, Vec::new());
    for (t, p) in run.tasks.iter().zip(pods) {
        if t.first_placed.is_none() {
            run.result.never_placed += 1;
            if !t.batch {
                run.result.online_never_placed += 1;
            }
        }
        if p.pod.num_gpu == 0 || p.pod.gpu_milli != WHOLE_GPU {
            continue;
        }
        let slot = if p.pod.num_gpu == 1 {
            &mut whole
        } else {
            &mut multi
        };
        slot.0 += 1;
        if let Some(at) = t.first_placed {
            slot.1.push(at - p.created);
        }
        if t.batch {
            batch_large.0 += 1;
            if let Some(at) = t.first_placed {
                batch_large.1.push(at - p.created);
            }
        }
    }
    let r = &mut run.result;
    r.whole_gpu_wait = Waits::of(whole.0, whole.1);
    r.multi_gpu_wait = Waits::of(multi.0, multi.1);
    r.batch_large_wait = Waits::of(batch_large.0, batch_large.1);
    r.online_gpu_hours = gpu_hours(run.online_milli_secs);
    r.batch_gpu_hours = gpu_hours(run.batch_milli_secs);
    Ok(run.result)
}

#[allow(clippy::cast_precision_loss)] // Reason: milli-GPU seconds of a trace, far below 2^52 after dividing.
fn gpu_hours(milli_secs: u128) -> f64 {
    milli_secs as f64 / 1000.0 / 3600.0
}

#[cfg(test)]
mod tests;
