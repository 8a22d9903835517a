//! Whether a node's share isolation holds, GPU by GPU (shared/DESIGN.md §5).
//!
//! A limit that was never seen to hold is not a limit: HAMi-core was measured limiting nothing
//! on driver 580 / CUDA 13 while its NVML view showed the limit. So before a node offers
//! shares of a GPU, the kubelet plugin runs a **probe** there: a child process in exactly the
//! environment a container gets from the CDI spec of a 1 GiB share ([`probe_claim`], rendered
//! by `cdi::render` like any claim), which allocates past the limit (must be refused) and under
//! it (must be served) through the CUDA driver API and reports both answers ([`ProbeReport`]).
//!
//! This module decides, purely:
//!
//! * what a report means ([`judge`]);
//! * when a GPU must be probed ([`probe_due`]): a shared GPU under a backend that limits
//!   something (`mps`, `hami-core`), when no probe of that backend on that driver version
//!   holds for it — at start, and whenever the driver version or the backend changes; and
//!   again after a probe that could not run or timed out ([`ProbeRecord::retry_at`]: 1 minute
//!   after the first such failure, doubling to at most an hour), since what stopped it (a
//!   driver still loading, a busy GPU) may pass, where a probe that ran and saw the limit
//!   fail is repeated only when the driver or the backend changes;
//! * what each GPU publishes ([`verdict`], [`apply`]): `isolation: verified` when its last
//!   probe under the node's backend and driver held; otherwise `unverified`, with the reason —
//!   or `unverified-accepted` when the admin accepted unverified isolation explicitly
//!   (`--accept-unverified-isolation`, never the default). Under `none` nothing is limited, so
//!   its GPUs are never verified.
//!
//! The shipped share classes select `verified` and `unverified-accepted` GPUs only, and the
//! node refuses to prepare a share on an `unverified` GPU (fail closed even for a class that
//! does not look). Only whole GPUs and MIG instances, isolated by the hardware, need no probe;
//! they publish no `isolation` attribute.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::names;
use crate::node::cdi::ContainerEdits;
use crate::node::inventory::{Gpu, GpuMode, Isolation, NodeInventory, REASON_NOT_PROBED};
use crate::node::prepared::{GpuNode, PreparedClaim, PreparedDevice};
use crate::rules::config::Tier;
use crate::rules::share::PerDeviceShare;

pub mod namespace;

/// The memory limit the probe runs under: 1 GiB.
pub const PROBE_LIMIT_BYTES: u64 = 1 << 30;
/// The UID prefix of a probe's claim (the rest is the GPU's index); names its CDI environment.
pub const PROBE_CLAIM_PREFIX: &str = "isolation-probe-gpu-";

/// Reason code: the probe held.
pub const REASON_PROBE_HELD: &str = "probe-held";
/// Reason code: an allocation past the limit was served.
pub const REASON_LIMIT_NOT_ENFORCED: &str = "limit-not-enforced";
/// Reason code: an allocation under the limit was refused.
pub const REASON_UNDER_LIMIT_REFUSED: &str = "under-limit-refused";
/// Reason code: the probe did not finish in time and was killed.
pub const REASON_TIMED_OUT: &str = "probe-timed-out";
/// Reason code: the probe could not run or report (its daemon, its child, its CUDA).
pub const REASON_DID_NOT_RUN: &str = "probe-did-not-run";
/// The plugin binary's subcommand that runs the probe (and, with arguments, first applies the
/// claim's mounts: [`namespace`]).
pub const PROBE_SUBCOMMAND: &str = "isolation-probe";
/// Where the launcher of a contained probe finds the spec's `LD_PRELOAD`: it sets
/// `LD_PRELOAD` from it only for the probe it execs after the mounts, since before them the
/// library is not at its path (the loader would complain, or load what happens to be there).
pub const PRELOAD_HANDOFF_ENV: &str = "TESSERA_PROBE_LD_PRELOAD";

/// Reason code: the node enforces nothing (`none`).
pub const REASON_NO_ENFORCEMENT: &str = "no-enforcement";

/// One allocation the probe made: served, or refused with the CUDA error's name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "result", content = "error")]
pub enum Allocation {
    /// The allocation succeeded.
    Served,
    /// The allocation failed, e.g. `CUDA_ERROR_OUT_OF_MEMORY`.
    Refused(String),
}

/// What the probe child prints on stdout, one JSON object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProbeReport {
    /// The limit it ran under, bytes.
    pub limit_bytes: u64,
    /// How much it asked for past the limit, in one allocation.
    pub past_bytes: u64,
    /// The answer to that.
    pub past: Allocation,
    /// How much it asked for under the limit, in one allocation.
    pub under_bytes: u64,
    /// The answer to that.
    pub under: Allocation,
}

impl ProbeReport {
    /// The sizes the probe asks for under `limit`: one and a half times the limit (past),
    /// half of it (under; leaves room for what a backend keeps for the context).
    pub fn sizes(limit: u64) -> (u64, u64) {
        (limit.saturating_add(limit / 2), limit / 2)
    }
}

/// What one probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeOutcome {
    /// Refused past the limit and served under it.
    Held,
    /// Anything else (including a probe that could not run or timed out).
    Failed {
        /// A `REASON_*` code, published as `isolationReason`.
        code: &'static str,
        /// What happened, for the log and the metric.
        message: String,
    },
}

impl ProbeOutcome {
    /// Whether the probe could not run or did not finish (no verdict on the limits), as
    /// opposed to one that ran and held or saw them fail.
    pub fn did_not_run(&self) -> bool {
        matches!(self, Self::Failed { code, .. } if *code == REASON_DID_NOT_RUN || *code == REASON_TIMED_OUT)
    }

    /// A failure with `code` and `message`.
    pub fn failed(code: &'static str, message: impl Into<String>) -> Self {
        Self::Failed {
            code,
            message: message.into(),
        }
    }
}

/// Judges a probe's report.
pub fn judge(report: &ProbeReport) -> ProbeOutcome {
    if let Allocation::Refused(error) = &report.under {
        return ProbeOutcome::failed(
            REASON_UNDER_LIMIT_REFUSED,
            format!(
                "an allocation of {} under the {} limit was refused ({error}): shares would not \
             get what they booked",
                mib(report.under_bytes),
                mib(report.limit_bytes)
            ),
        );
    }
    if report.past == Allocation::Served {
        return ProbeOutcome::failed(
            REASON_LIMIT_NOT_ENFORCED,
            format!(
                "an allocation of {} past the {} limit was served: the backend does not limit \
             memory here",
                mib(report.past_bytes),
                mib(report.limit_bytes)
            ),
        );
    }
    ProbeOutcome::Held
}

fn mib(bytes: u64) -> String {
    format!("{} MiB", bytes >> 20)
}

/// How long after the first probe in a row that could not run or timed out the GPU is probed
/// again; each further such failure doubles the wait, up to [`RETRY_MAX`].
pub const RETRY_FIRST: Duration = Duration::from_mins(1);
/// The longest wait before a probe that could not run or timed out is tried again.
pub const RETRY_MAX: Duration = Duration::from_hours(1);

/// The last probe of one GPU: under which backend and driver version, and what it found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeRecord {
    /// The enforcement backend probed (`mps`, `hami-core`).
    pub backend: String,
    /// The GPU's driver version then.
    pub driver_version: String,
    /// What it found.
    pub outcome: ProbeOutcome,
    /// When it was taken, on the caller's monotonic clock.
    pub at: Duration,
    /// How many probes in a row under this backend and driver, this one included, could not
    /// run or timed out; 0 when this one ran.
    pub failed_runs: u32,
}

impl ProbeRecord {
    /// The record of a probe of `gpu` under `backend` taken `at`, which found `outcome`;
    /// `previous` is the GPU's record before it (its run of failures goes on only under the
    /// same backend and driver).
    pub fn new(
        gpu: &Gpu,
        backend: &str,
        outcome: ProbeOutcome,
        at: Duration,
        previous: Option<&ProbeRecord>,
    ) -> Self {
        let failed_runs = if outcome.did_not_run() {
            previous
                .filter(|p| current(gpu, backend, p))
                .map_or(0, |p| p.failed_runs)
                .saturating_add(1)
        } else {
            0
        };
        Self {
            backend: backend.to_owned(),
            driver_version: gpu.driver_version.clone(),
            outcome,
            at,
            failed_runs,
        }
    }

    /// When the GPU is probed again though neither its driver nor the backend changed: only
    /// after a probe that could not run or timed out, [`RETRY_FIRST`] doubling with each such
    /// failure in a row, at most [`RETRY_MAX`]; `None` after a probe that ran.
    pub fn retry_at(&self) -> Option<Duration> {
        if self.failed_runs == 0 {
            return None;
        }
        let doublings = self.failed_runs.saturating_sub(1).min(16);
        let wait = RETRY_FIRST.saturating_mul(1 << doublings).min(RETRY_MAX);
        Some(self.at.saturating_add(wait))
    }
}

/// Whether `backend` limits anything a probe can test (`none` limits nothing).
pub fn backend_limits(backend: &str) -> bool {
    backend == names::ENFORCEMENT_MPS || backend == names::ENFORCEMENT_HAMI_CORE
}

/// Whether `record` was taken under `backend` on `gpu`'s current driver.
fn current(gpu: &Gpu, backend: &str, record: &ProbeRecord) -> bool {
    record.backend == backend && record.driver_version == gpu.driver_version
}

/// Whether `gpu` must be probed at `now` (the records' clock): a shared GPU under a backend
/// that limits something, with no probe of that backend on its current driver version, or
/// whose last such probe could not run and is due again ([`ProbeRecord::retry_at`]); `last` is
/// its last probe.
pub fn probe_due(gpu: &Gpu, backend: &str, last: Option<&ProbeRecord>, now: Duration) -> bool {
    gpu.mode == GpuMode::Shared
        && backend_limits(backend)
        && match last.filter(|r| current(gpu, backend, r)) {
            None => true,
            Some(r) => r.retry_at().is_some_and(|at| now >= at),
        }
}

/// What a GPU publishes, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// The published value.
    pub isolation: Isolation,
    /// A `REASON_*` code, published as `isolationReason`.
    pub code: &'static str,
    /// Why, for the log line, the metric's reason and `tessera inspect`.
    pub reason: String,
}

/// The verdict for `gpu` under the node's `backend`, given its `last` probe and whether the
/// admin accepts unverified isolation; `None` for a GPU that is not shared (whole GPUs and MIG
/// instances are isolated by the hardware).
pub fn verdict(
    gpu: &Gpu,
    backend: &str,
    last: Option<&ProbeRecord>,
    accept_unverified: bool,
) -> Option<Verdict> {
    if gpu.mode != GpuMode::Shared {
        return None;
    }
    let (code, unverified) = if backend_limits(backend) {
        match last.filter(|r| current(gpu, backend, r)) {
            None => (
                REASON_NOT_PROBED,
                format!(
                    "not probed yet with {backend} on driver {}",
                    gpu.driver_version
                ),
            ),
            Some(ProbeRecord {
                outcome: ProbeOutcome::Failed { code, message },
                ..
            }) => (
                *code,
                format!(
                    "the {backend} probe on driver {} failed: {message}",
                    gpu.driver_version
                ),
            ),
            Some(ProbeRecord {
                outcome: ProbeOutcome::Held,
                ..
            }) => {
                return Some(Verdict {
                    isolation: Isolation::Verified,
                    code: REASON_PROBE_HELD,
                    reason: format!(
                        "the {backend} probe on driver {} was refused past a {} limit and \
                         served under it",
                        gpu.driver_version,
                        mib(PROBE_LIMIT_BYTES)
                    ),
                });
            }
        }
    } else {
        (
            REASON_NO_ENFORCEMENT,
            format!(
                "enforcement {backend:?} limits nothing in the container (time-slicing): \
                 shares are bookkeeping only"
            ),
        )
    };
    Some(if accept_unverified {
        Verdict {
            isolation: Isolation::Accepted,
            code,
            reason: format!("{unverified}; accepted by the admin (--accept-unverified-isolation)"),
        }
    } else {
        Verdict {
            isolation: Isolation::Unverified,
            code,
            reason: format!("{unverified}; no shares are offered"),
        }
    })
}

/// Sets every shared GPU's `isolation` in `node` from `records` (last probe by GPU UUID),
/// and returns each shared GPU's verdict by device name.
pub fn apply(
    node: &mut NodeInventory,
    backend: &str,
    records: &BTreeMap<String, ProbeRecord>,
    accept_unverified: bool,
) -> BTreeMap<String, Verdict> {
    let mut out = BTreeMap::new();
    for gpu in &mut node.gpus {
        if let Some(v) = verdict(gpu, backend, records.get(&gpu.uuid), accept_unverified) {
            gpu.isolation = v.isolation;
            v.code.clone_into(&mut gpu.isolation_reason);
            out.insert(gpu.device_name(), v);
        }
    }
    out
}

/// The GPUs of `node` that must be probed at `now`, given the last probes by GPU UUID.
pub fn due<'a>(
    node: &'a NodeInventory,
    backend: &str,
    records: &BTreeMap<String, ProbeRecord>,
    now: Duration,
) -> Vec<&'a Gpu> {
    node.gpus
        .iter()
        .filter(|g| probe_due(g, backend, records.get(&g.uuid), now))
        .collect()
}

/// The claim a probe of `gpu` runs as: one online share of [`PROBE_LIMIT_BYTES`] and no
/// compute limit, rendered by `cdi::render` exactly as a container's claim is.
pub fn probe_claim(node: &str, gpu: &Gpu) -> PreparedClaim {
    PreparedClaim {
        uid: format!("{PROBE_CLAIM_PREFIX}{}", gpu.index),
        namespace: "tessera-probe".to_owned(),
        name: format!("isolation-probe-{}", gpu.device_name()),
        devices: vec![PreparedDevice {
            request: "probe".to_owned(),
            pool: node.to_owned(),
            device: gpu.device_name(),
            gpu: GpuNode {
                index: gpu.index,
                uuid: gpu.uuid.clone(),
                minor: gpu.minor,
            },
            mig: None,
            share: Some(PerDeviceShare {
                memory_bytes: PROBE_LIMIT_BYTES,
                compute_percent: 0,
            }),
            tier: Tier::Online,
            memory_overcommitted: false,
            share_id: None,
        }],
    }
}

/// How the probe child is started: program, arguments, and its whole environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeCommand {
    /// The program.
    pub program: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// Its environment, nothing inherited beyond it.
    pub env: Vec<(String, String)>,
}

/// The command that runs `program args` the way a container gets `edits` (a claim's CDI
/// container edits): exactly the spec's environment, plus `PATH` and `LD_LIBRARY_PATH` of
/// `inherited` (what an image would carry), the spec's values winning; and every bind mount
/// applied in a mount namespace of its own by `launcher`, the plugin's own binary, as
/// `launcher isolation-probe --bind SOURCE TARGET OPTIONS ... -- program args`
/// ([`namespace`]; it needs `CAP_SYS_ADMIN`, and no shell, `unshare` or `mount`), which
/// hands the spec's `LD_PRELOAD` on to the probe in [`PRELOAD_HANDOFF_ENV`]. Without a
/// `launcher` the mounts are left out (tests; a backend that needs them then fails its probe,
/// which fails closed).
pub fn probe_command(
    edits: &ContainerEdits,
    program: &str,
    args: &[String],
    inherited: &[(String, String)],
    launcher: Option<&str>,
) -> ProbeCommand {
    let mut env: Vec<(String, String)> = inherited
        .iter()
        .filter(|(k, _)| k == "PATH" || k == "LD_LIBRARY_PATH")
        .cloned()
        .collect();
    for line in &edits.env {
        if let Some((k, v)) = line.split_once('=') {
            env.retain(|(have, _)| have != k);
            env.push((k.to_owned(), v.to_owned()));
        }
    }
    match launcher {
        Some(launcher) if !edits.mounts.is_empty() => {
            let mut out = vec![PROBE_SUBCOMMAND.to_owned()];
            out.extend(namespace::arguments(&edits.mounts, program, args));
            ProbeCommand {
                program: launcher.to_owned(),
                args: out,
                env: env
                    .into_iter()
                    .map(|(k, v)| match k.as_str() {
                        "LD_PRELOAD" => (PRELOAD_HANDOFF_ENV.to_owned(), v),
                        _ => (k, v),
                    })
                    .collect(),
            }
        }
        _ => ProbeCommand {
            program: program.to_owned(),
            args: args.to_vec(),
            env,
        },
    }
}

#[cfg(test)]
mod tests;
