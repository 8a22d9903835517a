//! Per-claim GPU memory accounting: a share is a share, however many processes use it.
//!
//! MPS limits memory per client *process* (measured on an H200, driver 580, CUDA 13.0: three
//! processes started with one 10 GiB share's environment held 9.5 GiB each), and HAMi-core's
//! limits are per process too. So the node counts per claim: every process NVML lists on a GPU
//! is mapped to the claims booking that GPU, and a claim whose processes together use more than
//! its booking is brought back under it by stopping processes.
//!
//! The rule, as one pure function ([`judge`]):
//!
//! * **Bookings** come from the checkpoint alone (what the allocator wrote, recorded at
//!   prepare): per claim and GPU, the sum of its shares' memory there. Whole devices have no
//!   booking below the GPU and are not accounted.
//! * **Who a process is**: its pod, from its cgroup ([`proc::attribute`]: every line that names
//!   a pod must name the same one, else the process is left out of the pass); a container's
//!   processes cannot leave their pod's cgroup, and the pod's UID is in that cgroup's path under
//!   every kubelet cgroup driver. A pod's claims are the claims whose `status.reservedFor`
//!   names the pod ([`Consumers`]). A process's *candidates* are the claims its pod uses that
//!   book memory on the process's GPU. Environment variables are not used to tell claims apart:
//!   a process can rewrite its own environment and blame another pod's claim.
//! * **Units**: usually one claim on one GPU. When a pod uses two claims that both book the
//!   same GPU, its processes cannot be told apart between them, so those claims are accounted
//!   together (claims linked through any process's candidates form one unit, booking the sum of
//!   their bookings). Each process is counted once; each booking is counted once.
//! * **Over its booking**: a unit whose processes use more than it booked stops processes,
//!   newest first (the one that started last crossed the line; larger first among processes
//!   started in the same tick, then the higher pid), until what is left fits.
//! * **Means**: on a GPU the claim's MPS daemon serves, `terminate_client` through that daemon
//!   (ends only that client's GPU work and frees its memory); where there is no daemon
//!   (HAMi-core, time-slicing), or a process was already asked to terminate and still holds
//!   memory, or the daemon does not know it, the process is killed. The node acts the same way
//!   under every backend: the accounting never depends on a backend's own limit.
//! * Processes outside any pod (the MPS server, host tools, the isolation probe) and processes
//!   of pods that booked nothing on the GPU are left alone and reported as unattributed.

use std::collections::{BTreeMap, BTreeSet};

use crate::node::checkpoint::{Checkpoint, ClaimEntry};
use crate::node::mps::MpsDaemon;

pub mod proc;
mod usage;

pub use usage::{GpuUse, Usage, usage};

/// A process NVML lists on a GPU, with what the node read about it in `/proc`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuProcess {
    /// Its id in the host's PID namespace (the one NVML reports).
    pub pid: u32,
    /// The GPU it uses.
    pub gpu_uuid: String,
    /// GPU memory it holds, in bytes (NVML's `usedGpuMemory`).
    pub used_bytes: u64,
    /// When it started, in clock ticks since boot (`/proc/<pid>/stat`, field 22): orders
    /// processes by age, and tells a reused pid from the process that was judged.
    pub start_ticks: u64,
    /// The UID of the pod whose cgroup it runs in; `None` outside any pod.
    pub pod_uid: Option<String>,
}

/// A pod a claim is reserved for (`status.reservedFor`, resource `pods`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Consumer {
    /// The pod's UID.
    pub uid: String,
    /// The pod's name (its namespace is the claim's).
    pub name: String,
}

/// The pods each claim is reserved for, by claim UID.
pub type Consumers = BTreeMap<String, Vec<Consumer>>;

/// A process the node has already acted on: its pid and start time.
pub type ProcessKey = (u32, u64);

/// How a process is stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Means {
    /// `terminate_client <server> <pid>` through one of these daemons (the one whose server
    /// lists the process as a client); killed when none does.
    MpsTerminate(Vec<MpsDaemon>),
    /// `SIGKILL`.
    Kill,
}

/// A process to stop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stop {
    /// Its pid.
    pub pid: u32,
    /// Its start time, checked again right before it is stopped (a reused pid is spared).
    pub start_ticks: u64,
    /// The GPU it uses.
    pub gpu_uuid: String,
    /// Memory it held.
    pub used_bytes: u64,
    /// How.
    pub means: Means,
}

/// A claim as the Event names it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ClaimName {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// UID.
    pub uid: String,
}

/// One pod's part in a unit over its booking: what its Event says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverBooking {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub pod_name: String,
    /// The pod's UID.
    pub pod_uid: String,
    /// The claims of the unit (one, unless the pod's claims share the GPU).
    pub claims: Vec<ClaimName>,
    /// The GPU.
    pub gpu_uuid: String,
    /// What the unit booked on the GPU, in bytes.
    pub booked_bytes: u64,
    /// What all of the unit's processes used, in bytes.
    pub used_bytes: u64,
    /// This pod's processes that are stopped, with the memory each held.
    pub stopped: Vec<(u32, u64)>,
}

impl OverBooking {
    /// The Event message: the claims, the booking, the use and what was stopped.
    pub fn message(&self) -> String {
        let claims: Vec<String> = self
            .claims
            .iter()
            .map(|c| format!("ResourceClaim {}/{}", c.namespace, c.name))
            .collect();
        let stopped: Vec<String> = self
            .stopped
            .iter()
            .map(|(pid, bytes)| format!("{pid} ({})", mib(*bytes)))
            .collect();
        format!(
            "{} booked {} of GPU {} but its processes used {}; stopped process {} to bring it \
             back under its booking (memory limits hold per process, a claim's booking holds \
             for all of its processes together)",
            claims.join(" + "),
            mib(self.booked_bytes),
            self.gpu_uuid,
            mib(self.used_bytes),
            stopped.join(", "),
        )
    }
}

fn mib(bytes: u64) -> String {
    format!("{} MiB", bytes / (1 << 20))
}

/// What one accounting pass decided.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Verdict {
    /// Processes to stop, in order.
    pub stops: Vec<Stop>,
    /// One entry per pod whose processes are stopped.
    pub over: Vec<OverBooking>,
    /// Pids on accounted GPUs that belong to no claim booking that GPU.
    pub unattributed: Vec<u32>,
}

/// One claim's booking on one GPU.
#[derive(Debug, Clone)]
struct Booking {
    claim: ClaimName,
    bytes: u64,
    daemon: Option<MpsDaemon>,
}

/// The devices of `entry` the accounting books, as (GPU UUID, bytes): the shares with a memory
/// size on a whole GPU. A whole device has no booking below the GPU, and a MIG device's memory
/// is its own hardware partition; neither is accounted. The one statement of the rule: the
/// plugin asks it which GPUs to list and whose consumers to read.
pub fn booked(entry: &ClaimEntry) -> impl Iterator<Item = (&str, u64)> {
    entry
        .devices
        .iter()
        .filter_map(|d| match (d.share_memory_bytes, d.mig) {
            (Some(bytes), false) => Some((d.gpu_uuid.as_str(), bytes)),
            _ => None,
        })
}

/// The GPUs any claim of `record` books memory on ([`booked`]): the GPUs a pass lists.
pub fn booked_gpus(record: &Checkpoint) -> BTreeSet<String> {
    record
        .claims
        .values()
        .flat_map(booked)
        .map(|(gpu, _)| gpu.to_owned())
        .collect()
}

/// Bookings by GPU, then by claim UID: the sum of each claim's shares on each GPU.
fn bookings(record: &Checkpoint) -> BTreeMap<&str, BTreeMap<&str, Booking>> {
    let mut out: BTreeMap<&str, BTreeMap<&str, Booking>> = BTreeMap::new();
    for (uid, entry) in &record.claims {
        for (gpu, bytes) in booked(entry) {
            let daemon = entry
                .mps_daemon
                .as_ref()
                .filter(|d| d.devices.iter().any(|g| g == gpu))
                .cloned();
            let booking = out
                .entry(gpu)
                .or_default()
                .entry(uid.as_str())
                .or_insert_with(|| Booking {
                    claim: ClaimName {
                        namespace: entry.namespace.clone(),
                        name: entry.name.clone(),
                        uid: uid.clone(),
                    },
                    bytes: 0,
                    daemon,
                });
            booking.bytes = booking.bytes.saturating_add(bytes);
        }
    }
    out
}

/// One entry per (GPU, pid), at its larger reading: NVML's two lists may both name an MPS
/// client, and counting the smaller would let an over-booked claim go unstopped.
fn one_per_process(processes: &[GpuProcess]) -> BTreeMap<(&str, u32), &GpuProcess> {
    let mut seen: BTreeMap<(&str, u32), &GpuProcess> = BTreeMap::new();
    for p in processes {
        seen.entry((p.gpu_uuid.as_str(), p.pid))
            .and_modify(|q| {
                if p.used_bytes > q.used_bytes {
                    *q = p;
                }
            })
            .or_insert(p);
    }
    seen
}

/// The claims booking a GPU (`claims`) that a process of `pod` counts for: those the pod uses.
/// None when the process names no pod.
fn claims_of_pod<'a>(
    claims: &BTreeMap<&'a str, Booking>,
    consumers: &Consumers,
    pod: Option<&str>,
) -> BTreeSet<&'a str> {
    let Some(pod) = pod else {
        return BTreeSet::new();
    };
    claims
        .keys()
        .copied()
        .filter(|uid| {
            consumers
                .get(*uid)
                .is_some_and(|c| c.iter().any(|c| c.uid == pod))
        })
        .collect()
}

/// Merges sets of claim UIDs that share a member: the units of one GPU.
fn units<'a>(
    candidate_sets: impl Iterator<Item = &'a BTreeSet<&'a str>>,
) -> Vec<BTreeSet<&'a str>> {
    let mut out: Vec<BTreeSet<&str>> = Vec::new();
    for set in candidate_sets {
        let mut merged = set.clone();
        out.retain(|unit| {
            if unit.is_disjoint(&merged) {
                true
            } else {
                merged.extend(unit.iter().copied());
                false
            }
        });
        out.push(merged);
    }
    out
}

/// Decides which processes to stop so that every claim's processes together stay within the
/// claim's booking on each GPU (see the module's rule). `asked` holds the processes an earlier
/// pass already asked MPS to terminate: one still listed is killed.
pub fn judge(
    record: &Checkpoint,
    consumers: &Consumers,
    processes: &[GpuProcess],
    asked: &BTreeSet<ProcessKey>,
) -> Verdict {
    let booked = bookings(record);
    let seen = one_per_process(processes);
    let mut verdict = Verdict::default();
    let mut by_gpu: BTreeMap<&str, Vec<(&GpuProcess, BTreeSet<&str>)>> = BTreeMap::new();
    for ((gpu, pid), p) in seen {
        let Some(claims) = booked.get(gpu) else {
            continue;
        };
        let candidates = claims_of_pod(claims, consumers, p.pod_uid.as_deref());
        if candidates.is_empty() {
            verdict.unattributed.push(pid);
        } else {
            by_gpu.entry(gpu).or_default().push((p, candidates));
        }
    }
    for (gpu, attributed) in &by_gpu {
        let claims = &booked[gpu];
        for unit in units(attributed.iter().map(|(_, c)| c)) {
            let members: Vec<&GpuProcess> = attributed
                .iter()
                .filter(|(_, c)| c.is_subset(&unit))
                .map(|(p, _)| *p)
                .collect();
            judge_unit(gpu, &unit, claims, &members, consumers, asked, &mut verdict);
        }
    }
    verdict
}

fn judge_unit(
    gpu: &str,
    unit: &BTreeSet<&str>,
    claims: &BTreeMap<&str, Booking>,
    members: &[&GpuProcess],
    consumers: &Consumers,
    asked: &BTreeSet<ProcessKey>,
    verdict: &mut Verdict,
) {
    let bookings: Vec<&Booking> = unit.iter().filter_map(|uid| claims.get(uid)).collect();
    let booked_bytes = bookings
        .iter()
        .fold(0u64, |sum, b| sum.saturating_add(b.bytes));
    let used_bytes = members
        .iter()
        .fold(0u64, |sum, p| sum.saturating_add(p.used_bytes));
    if used_bytes <= booked_bytes {
        return;
    }
    let daemons: Vec<MpsDaemon> = {
        let mut ds: Vec<MpsDaemon> = bookings.iter().filter_map(|b| b.daemon.clone()).collect();
        ds.sort_by(|a, b| a.id.cmp(&b.id));
        ds.dedup_by(|a, b| a.id == b.id);
        ds
    };
    let mut order = members.to_vec();
    order.sort_by(|a, b| {
        b.start_ticks
            .cmp(&a.start_ticks)
            .then(b.used_bytes.cmp(&a.used_bytes))
            .then(b.pid.cmp(&a.pid))
    });
    let mut left = used_bytes;
    let mut stopped_by_pod: BTreeMap<&str, Vec<(u32, u64)>> = BTreeMap::new();
    for p in order {
        if left <= booked_bytes {
            break;
        }
        left = left.saturating_sub(p.used_bytes);
        let means = if daemons.is_empty() || asked.contains(&(p.pid, p.start_ticks)) {
            Means::Kill
        } else {
            Means::MpsTerminate(daemons.clone())
        };
        verdict.stops.push(Stop {
            pid: p.pid,
            start_ticks: p.start_ticks,
            gpu_uuid: gpu.to_owned(),
            used_bytes: p.used_bytes,
            means,
        });
        if let Some(pod) = p.pod_uid.as_deref() {
            stopped_by_pod
                .entry(pod)
                .or_default()
                .push((p.pid, p.used_bytes));
        }
    }
    let claim_names: Vec<ClaimName> = bookings.iter().map(|b| b.claim.clone()).collect();
    for (pod, stopped) in stopped_by_pod {
        let Some((namespace, consumer)) = bookings.iter().find_map(|b| {
            consumers
                .get(&b.claim.uid)?
                .iter()
                .find(|c| c.uid == pod)
                .map(|c| (b.claim.namespace.clone(), c))
        }) else {
            continue;
        };
        verdict.over.push(OverBooking {
            namespace,
            pod_name: consumer.name.clone(),
            pod_uid: pod.to_owned(),
            claims: claim_names.clone(),
            gpu_uuid: gpu.to_owned(),
            booked_bytes,
            used_bytes,
            stopped,
        });
    }
}

/// The pods `claim` is reserved for (`status.reservedFor` entries of the core group's `pods`):
/// the only consumers whose processes can use a prepared claim's devices.
pub fn pod_consumers(claim: &k8s_openapi::api::resource::v1::ResourceClaim) -> Vec<Consumer> {
    let mut out: Vec<Consumer> = claim
        .status
        .iter()
        .flat_map(|s| s.reserved_for.iter().flatten())
        .filter(|r| {
            r.resource == crate::names::POD.plural
                && r.api_group.as_deref().unwrap_or_default().is_empty()
        })
        .map(|r| Consumer {
            uid: r.uid.clone(),
            name: r.name.clone(),
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests;
