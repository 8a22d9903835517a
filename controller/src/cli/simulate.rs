//! `tessera simulate`: replays a GPU cluster trace (Alibaba "openb" CSVs) through the
//! allocator, by the method of the trace's paper, and reports how much GPU stays unallocated.
//!
//! The replay itself is pure (`tessera_driver::tools::simulate`); this adapter reads the files, runs
//! the seeds on all cores, draws a progress bar when standard error is a terminal, and prints
//! a table or JSON.

use std::fmt::Write as _;
use std::io::{IsTerminal as _, Write as _};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use k8s_openapi::api::resource::v1 as res;
use serde::Serialize;
use tessera_driver::names;
use tessera_driver::placement::allocator::Policy;
use tessera_driver::rules::config::Factor;
use tessera_driver::tools::simulate::{
    self, Cluster, Mixing, ReplayOptions, SeedResult, Summary, parse_nodes, parse_pods,
};

use crate::error::{Error, Result};

/// Tessera's share class, as shipped in `deviceclasses/`.
const SHARED_CLASS: &str = include_str!("../../../deviceclasses/shared-gpu.yaml");
/// Tessera's batch class, as shipped in `deviceclasses/` (mixing adds its factors).
const BATCH_CLASS: &str = include_str!("../../../deviceclasses/batch-gpu.yaml");

/// Reads an over-commit factor flag (`2`, `1.5`).
pub fn parse_factor(s: &str) -> std::result::Result<Factor, String> {
    let value: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number, e.g. 2 or 1.5"))?;
    Factor::from_f64(value)
}

/// How a mixing replay's batch class over-commits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MixingArgs {
    /// Batch compute factor.
    pub compute: Factor,
    /// Batch memory factor (the simulated GPUs then back it with `hami-core`).
    pub memory: Factor,
}

/// An inclusive range of seeds, written `A..B` (the paper's seeds are `42..51`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeedRange {
    /// First seed.
    pub first: u64,
    /// Last seed, included.
    pub last: u64,
}

impl FromStr for SeedRange {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let bad = || format!("seeds {s:?}: expected A..B with A <= B, e.g. 42..51");
        let (a, b) = s.split_once("..").ok_or_else(bad)?;
        let first = a.trim().parse::<u64>().map_err(|_| bad())?;
        let last = b.trim().parse::<u64>().map_err(|_| bad())?;
        if first > last {
            return Err(bad());
        }
        Ok(Self { first, last })
    }
}

/// What to simulate.
#[derive(Debug, Clone)]
pub struct SimulateArgs {
    /// The node list.
    pub nodes: PathBuf,
    /// The pod list.
    pub pods: PathBuf,
    /// The placement policy.
    pub policy: Policy,
    /// The seeds to run.
    pub seeds: Vec<u64>,
    /// A pod list whose task shapes the policy knows before the first arrival.
    pub history: Option<PathBuf>,
    /// JSON instead of a table.
    pub json: bool,
    /// Draw a progress bar on standard error when it is a terminal.
    pub progress: bool,
    /// Mix tiers (best-effort tasks batch), with these factors.
    pub mixing: Option<MixingArgs>,
}

/// The JSON report.
#[derive(Debug, Serialize)]
struct Report<'a> {
    nodes: String,
    pods: String,
    history: Option<String>,
    gpus: u64,
    #[serde(flatten)]
    summary: &'a Summary,
}

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| Error::Read {
        path: path.to_owned(),
        source,
    })
}

fn malformed(e: &tessera_driver::Error) -> Error {
    Error::Malformed(e.to_string())
}

/// Draws `[####....] 40% (4/10 seeds)` on standard error, in place.
struct Progress {
    enabled: bool,
    done: Vec<AtomicUsize>,
    total: Vec<AtomicUsize>,
    last: Mutex<usize>,
}

impl Progress {
    fn new(seeds: usize, enabled: bool) -> Self {
        Self {
            enabled,
            done: (0..seeds).map(|_| AtomicUsize::new(0)).collect(),
            total: (0..seeds).map(|_| AtomicUsize::new(1)).collect(),
            last: Mutex::new(usize::MAX),
        }
    }

    fn report(&self, seed: usize, done: usize, total: usize) {
        if !self.enabled {
            return;
        }
        self.done[seed].store(done, Ordering::Relaxed);
        self.total[seed].store(total.max(1), Ordering::Relaxed);
        let permille: usize = self
            .done
            .iter()
            .zip(&self.total)
            .map(|(d, t)| d.load(Ordering::Relaxed) * 1000 / t.load(Ordering::Relaxed))
            .sum::<usize>()
            / self.done.len().max(1);
        let mut last = self
            .last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if *last == permille / 10 {
            return;
        }
        *last = permille / 10;
        let filled = permille * 30 / 1000;
        let bar = format!(
            "\r[{}{}] {:>3}% ",
            "#".repeat(filled),
            ".".repeat(30 - filled),
            permille / 10
        );
        let _ = std::io::stderr().write_all(bar.as_bytes());
    }

    fn finish(&self) {
        if self.enabled {
            let _ = std::io::stderr().write_all(b"\r\x1b[K");
        }
    }
}

/// Reads the pod list, refusing one the replay cannot use.
fn read_pods(args: &SimulateArgs, pods_name: &str) -> Result<Vec<simulate::TracePod>> {
    let pods = parse_pods(pods_name, &read(&args.pods)?).map_err(|e| malformed(&e))?;
    if pods.iter().all(|p| p.gpu_demand() == 0) {
        return Err(Error::Malformed(format!(
            "{pods_name}: none of the {} tasks asks for a GPU (num_gpu is 0 on every line); \
             the replay measures GPU allocation and has nothing to place",
            pods.len()
        )));
    }
    if args.mixing.is_some() && pods.iter().any(|p| p.best_effort.is_none()) {
        return Err(Error::Malformed(format!(
            "{pods_name}: --mixing needs each task's qos (BE is batch, anything else online), \
             and this pod list has no qos column"
        )));
    }
    Ok(pods)
}

/// Runs the simulation and appends the report to `out`.
pub fn run(args: &SimulateArgs, driver: &str, out: &mut String) -> Result<()> {
    let nodes_name = args.nodes.display().to_string();
    let pods_name = args.pods.display().to_string();
    let nodes = parse_nodes(&nodes_name, &read(&args.nodes)?).map_err(|e| malformed(&e))?;
    let pods = read_pods(args, &pods_name)?;
    let history = match &args.history {
        Some(path) => {
            let name = path.display().to_string();
            let list = parse_pods(&name, &read(path)?).map_err(|e| malformed(&e))?;
            Some(simulate::workload_of(&list))
        }
        None => None,
    };
    let (classes, mixing, enforcement) = classes(args.mixing)?;
    let cluster = Cluster::with_enforcement(nodes, classes, driver, enforcement)
        .map_err(|e| malformed(&e))?;
    // The report's fragmentation uses the whole trace's shapes, as the paper's measure does;
    // the policy never sees them unless given as --history.
    let measure = simulate::workload_of(&pods);
    let progress = Progress::new(
        args.seeds.len(),
        args.progress && std::io::stderr().is_terminal(),
    );
    let results: Mutex<Vec<Option<(SeedResult, f64)>>> = Mutex::new(vec![None; args.seeds.len()]);
    let next = AtomicUsize::new(0);
    let failure: Mutex<Option<tessera_driver::Error>> = Mutex::new(None);
    let workers = std::thread::available_parallelism()
        .map_or(1, std::num::NonZero::get)
        .min(args.seeds.len().max(1));
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| {
                loop {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&seed) = args.seeds.get(k) else {
                        break;
                    };
                    let opts = ReplayOptions {
                        policy: args.policy,
                        seed,
                        history: history.clone(),
                        mixing: mixing.clone(),
                    };
                    let started = Instant::now();
                    let outcome =
                        simulate::replay(&cluster, &pods, &measure, &opts, &mut |d, t| {
                            progress.report(k, d, t);
                        });
                    let seconds = started.elapsed().as_secs_f64();
                    match outcome {
                        Ok(r) => {
                            results
                                .lock()
                                .unwrap_or_else(std::sync::PoisonError::into_inner)[k] =
                                Some((r, seconds));
                        }
                        Err(e) => {
                            *failure
                                .lock()
                                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(e);
                        }
                    }
                }
            });
        }
    });
    progress.finish();
    if let Some(e) = failure
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
    {
        return Err(e.into());
    }
    let (seeds, seconds): (Vec<SeedResult>, Vec<f64>) = results
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .into_iter()
        .flatten()
        .unzip();
    let summary = Summary::new(&args.policy.to_string(), seeds);
    if args.json {
        let report = Report {
            nodes: nodes_name,
            pods: pods_name,
            history: args.history.as_ref().map(|p| p.display().to_string()),
            gpus: cluster.capacity_milli() / 1000,
            summary: &summary,
        };
        let text =
            serde_json::to_string_pretty(&report).map_err(|e| Error::Output(e.to_string()))?;
        out.push_str(&text);
        out.push('\n');
        return Ok(());
    }
    table(&summary, &seconds, &pods_name, out);
    Ok(())
}

/// The classes of the replay, how it mixes tiers, and the GPUs' enforcement backend.
fn classes(
    mixing: Option<MixingArgs>,
) -> Result<(Vec<res::DeviceClass>, Option<Mixing>, Option<&'static str>)> {
    let class: res::DeviceClass = serde_yaml::from_str(SHARED_CLASS)
        .map_err(|e| Error::Malformed(format!("deviceclasses/shared-gpu.yaml: {e}")))?;
    let Some(m) = mixing else {
        return Ok((vec![class], None, None));
    };
    let batch = batch_class(m)?;
    let mixing = Mixing {
        batch_class: batch.metadata.name.clone().unwrap_or_default(),
    };
    // Memory over-commit needs GPUs that can back it.
    let enforcement = m
        .memory
        .overcommits()
        .then_some(names::ENFORCEMENT_HAMI_CORE);
    Ok((vec![class, batch], Some(mixing), enforcement))
}

/// The shipped batch class with the factors of `m` in its `TierPolicy`.
fn batch_class(m: MixingArgs) -> Result<res::DeviceClass> {
    let mut class: res::DeviceClass = serde_yaml::from_str(BATCH_CLASS)
        .map_err(|e| Error::Malformed(format!("deviceclasses/batch-gpu.yaml: {e}")))?;
    let policy = class
        .spec
        .config
        .iter_mut()
        .flatten()
        .filter_map(|c| c.opaque.as_mut())
        .find(|o| o.parameters.0["kind"] == names::TIER_POLICY_KIND)
        .ok_or_else(|| {
            Error::Malformed("deviceclasses/batch-gpu.yaml: no TierPolicy config".to_owned())
        })?;
    let set = |v: Factor| serde_json::to_value(v).unwrap_or(serde_json::Value::Null);
    policy.parameters.0["batchComputeOvercommit"] = set(m.compute);
    policy.parameters.0["batchMemoryOvercommit"] = set(m.memory);
    Ok(class)
}

fn mixing_table(summary: &Summary, out: &mut String) {
    let Some(mean) = &summary.mixing else {
        return;
    };
    let _ = writeln!(
        out,
        "mixing (BE tasks batch): {:>6} {:>13} {:>13} {:>14} {:>15} {:>18} {:>14}",
        "SEED",
        "ONLINE@100",
        "BATCH@100",
        "PLACED/CAP@100",
        "BATCH-OVER@100",
        "PREEMPT<100",
        "PREEMPT-ALL"
    );
    for s in &summary.seeds {
        let Some(m) = &s.mixing else { continue };
        let _ = writeln!(
            out,
            "{:>31} {:>12.2}% {:>12.2}% {:>13.2}% {:>14.2}% {:>10}/{:<7} {:>6}/{:<7}",
            s.seed,
            m.online_placed_pct_at_100,
            m.batch_placed_pct_at_100,
            m.placed_pct_of_capacity_at_100,
            m.batch_overcommitted_pct_at_100,
            m.online_would_preempt_before_100,
            m.online_gpu_tasks_before_100,
            m.online_would_preempt,
            m.online_gpu_tasks
        );
    }
    let _ = writeln!(
        out,
        "{:>31} {:>12.2}% {:>12.2}% {:>13.2}% {:>14.2}% {:>17.2}% {:>13.2}%",
        "mean",
        mean.online_placed_pct_at_100,
        mean.batch_placed_pct_at_100,
        mean.placed_pct_of_capacity_at_100,
        mean.batch_overcommitted_pct_at_100,
        mean.online_preempt_pct_before_100,
        mean.online_preempt_pct
    );
}

fn table(summary: &Summary, seconds: &[f64], pods: &str, out: &mut String) {
    let pods = crate::cli::output::printable(pods, false);
    let _ = writeln!(out, "trace {pods}, policy {}", summary.policy);
    let _ = writeln!(
        out,
        "{:>6} {:>7} {:>7} {:>12} {:>10} {:>9}  {:<28}  IDLE@100 PARTLY-USED/UNTOUCHED/STRANDED",
        "SEED",
        "PODS",
        "FAILED",
        "UNALLOC@100",
        "FRAG@100",
        "SECONDS",
        "FAILED<100 SHARE/WHOLE/MULTI"
    );
    for (s, secs) in summary.seeds.iter().zip(seconds) {
        let failed = format!(
            "{}/{}/{}",
            s.failed_before_100.shares, s.failed_before_100.whole, s.failed_before_100.multi
        );
        let _ = writeln!(
            out,
            "{:>6} {:>7} {:>7} {:>11.2}% {:>9.2}% {:>9.2}  {failed:<28}  {}/{}/{}",
            s.seed,
            s.pods,
            s.failed_pods,
            s.unallocated_pct_at_100,
            s.fragmentation_pct_at_100,
            secs,
            s.idle_at_100.partly_used,
            s.idle_at_100.untouched,
            s.idle_at_100.stranded
        );
    }
    let _ = writeln!(
        out,
        "{:>6} {:>7} {:>7.1} {:>11.2}% {:>9.2}%",
        "mean",
        "",
        summary.failed_pods,
        summary.unallocated_pct_at_100,
        summary.fragmentation_pct_at_100
    );
    mixing_table(summary, out);
    if summary.seeds.iter().any(|s| s.rounded_pods > 0) {
        let _ = writeln!(
            out,
            "note: some tasks' milli-GPU was not a multiple of 10 and was rounded up to a whole percent (rounded_pods in -o json)"
        );
    }
}

/// The instant a time replay takes the trace's second 0 to be, unless told otherwise: 15:00
/// UTC. The openb traces carry no wall clock; at this phase the 12 hours with the fewest
/// online (`LS`) arrivals are 20:00 to 08:00 on the default, gpushare40 and gpuspec20 lists
/// (docs/placement.md).
pub const DEFAULT_TRACE_START: &str = "2023-01-02T15:00:00Z";

/// What a time replay (`--time`) runs.
#[derive(Debug, Clone)]
pub struct TimeArgs {
    /// The node list.
    pub nodes: PathBuf,
    /// The pod list (with `qos`, `creation_time` and `deletion_time`).
    pub pods: PathBuf,
    /// The placement policy.
    pub policy: Policy,
    /// A `GpuProfileSchedule` for the tidal nodes; without it only the static split runs.
    pub schedule: Option<PathBuf>,
    /// Defragmentation's evictions per hour (0: only scenarios without it).
    pub defrag_evictions_per_hour: u32,
    /// Percent of the nodes that serve batch all the time.
    pub batch_nodes_percent: u32,
    /// Percent of the nodes the schedule moves (online all the time in the static split).
    pub tidal_nodes_percent: u32,
    /// The instant of the trace's second 0 (RFC 3339).
    pub trace_start: String,
    /// Keep every `node_stride`-th node of the node list (1: all), to scale the cluster to
    /// the trace's demand.
    pub node_stride: usize,
    /// JSON instead of a table.
    pub json: bool,
}

/// One scenario's result.
#[derive(Debug, Serialize)]
struct ScenarioReport {
    scenario: String,
    seconds: f64,
    #[serde(flatten)]
    result: simulate::TimeResult,
}

/// The JSON report of a time replay.
#[derive(Debug, Serialize)]
struct TimeReport<'a> {
    nodes: String,
    pods: String,
    schedule: Option<String>,
    trace_start: &'a str,
    batch_nodes_percent: u32,
    tidal_nodes_percent: u32,
    node_stride: usize,
    defrag_evictions_per_hour: u32,
    scenarios: &'a [ScenarioReport],
}

/// Reads a `GpuProfileSchedule` file with the parser the webhook validates with.
pub fn read_schedule(path: &Path) -> Result<tessera_driver::node::schedule::Schedule> {
    let name = path.display().to_string();
    let value: serde_json::Value =
        serde_yaml::from_str(&read(path)?).map_err(|e| Error::Malformed(format!("{name}: {e}")))?;
    tessera_driver::node::schedule::parse(&value)
        .map_err(|e| Error::Malformed(format!("{name}: {e}")))
}

/// Runs a time replay's scenarios (static split, with the schedule, each with and without
/// defragmentation) and appends the report to `out`.
pub fn run_time(args: &TimeArgs, driver: &str, out: &mut String) -> Result<()> {
    let nodes_name = args.nodes.display().to_string();
    let pods_name = args.pods.display().to_string();
    let nodes: Vec<simulate::TraceNode> = parse_nodes(&nodes_name, &read(&args.nodes)?)
        .map_err(|e| malformed(&e))?
        .into_iter()
        .step_by(args.node_stride.max(1))
        .collect();
    let pods =
        simulate::parse_timed_pods(&pods_name, &read(&args.pods)?).map_err(|e| malformed(&e))?;
    let origin =
        simulate::tidal::parse_trace_start(&args.trace_start).map_err(|e| malformed(&e))?;
    let schedule = args.schedule.as_deref().map(read_schedule).transpose()?;
    let batch = batch_class(MixingArgs {
        compute: Factor::ONE,
        memory: Factor::ONE,
    })?;
    let shared: res::DeviceClass = serde_yaml::from_str(SHARED_CLASS)
        .map_err(|e| Error::Malformed(format!("deviceclasses/shared-gpu.yaml: {e}")))?;
    let batch_name = batch.metadata.name.clone().unwrap_or_default();
    let classes = vec![shared, batch];
    let cluster = Cluster::new(nodes, classes.clone(), driver).map_err(|e| malformed(&e))?;
    let labels = simulate::tidal::pool_labels(
        cluster.nodes.len(),
        args.batch_nodes_percent,
        args.tidal_nodes_percent,
    )
    .map_err(|e| malformed(&e))?;
    let scenarios = scenarios(args, batch_name, labels, origin, schedule.as_ref());
    let results: Mutex<Vec<Option<ScenarioReport>>> =
        Mutex::new((0..scenarios.len()).map(|_| None).collect());
    let failure: Mutex<Option<tessera_driver::Error>> = Mutex::new(None);
    let next = AtomicUsize::new(0);
    let workers = std::thread::available_parallelism()
        .map_or(1, std::num::NonZero::get)
        .min(scenarios.len());
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| {
                loop {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    let Some((name, opts)) = scenarios.get(k) else {
                        break;
                    };
                    let started = Instant::now();
                    match simulate::replay_time(&cluster, &classes, &pods, opts) {
                        Ok(result) => {
                            results
                                .lock()
                                .unwrap_or_else(std::sync::PoisonError::into_inner)[k] =
                                Some(ScenarioReport {
                                    scenario: name.clone(),
                                    seconds: started.elapsed().as_secs_f64(),
                                    result,
                                });
                        }
                        Err(e) => {
                            *failure
                                .lock()
                                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(e);
                        }
                    }
                }
            });
        }
    });
    if let Some(e) = failure
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
    {
        return Err(e.into());
    }
    let reports: Vec<ScenarioReport> = results
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .into_iter()
        .flatten()
        .collect();
    if args.json {
        let report = TimeReport {
            nodes: nodes_name,
            pods: pods_name,
            schedule: args.schedule.as_ref().map(|p| p.display().to_string()),
            trace_start: &args.trace_start,
            batch_nodes_percent: args.batch_nodes_percent,
            tidal_nodes_percent: args.tidal_nodes_percent,
            node_stride: args.node_stride,
            defrag_evictions_per_hour: args.defrag_evictions_per_hour,
            scenarios: &reports,
        };
        let text =
            serde_json::to_string_pretty(&report).map_err(|e| Error::Output(e.to_string()))?;
        out.push_str(&text);
        out.push('\n');
        return Ok(());
    }
    time_table(args, &pods_name, &reports, out);
    Ok(())
}

/// The scenarios of a time replay: the static split, and with a schedule the tidal one, each
/// also with defragmentation when it has a budget.
fn scenarios(
    args: &TimeArgs,
    batch_name: String,
    labels: Vec<std::collections::BTreeMap<String, String>>,
    origin: simulate::tidal::Origin,
    schedule: Option<&tessera_driver::node::schedule::Schedule>,
) -> Vec<(String, simulate::TimeOptions)> {
    let mut scenarios: Vec<(String, simulate::TimeOptions)> = Vec::new();
    let per_hour = args.defrag_evictions_per_hour;
    let base = simulate::TimeOptions {
        policy: args.policy,
        batch_class: batch_name,
        labels,
        schedule: None,
        defrag_evictions_per_hour: 0,
        origin,
    };
    scenarios.push(("static".to_owned(), base.clone()));
    if per_hour > 0 {
        scenarios.push((
            "static+defrag".to_owned(),
            simulate::TimeOptions {
                defrag_evictions_per_hour: per_hour,
                ..base.clone()
            },
        ));
    }
    if let Some(s) = schedule {
        let tidal = simulate::TimeOptions {
            schedule: Some(s.clone()),
            ..base.clone()
        };
        scenarios.push(("tidal".to_owned(), tidal.clone()));
        if per_hour > 0 {
            scenarios.push((
                "tidal+defrag".to_owned(),
                simulate::TimeOptions {
                    defrag_evictions_per_hour: per_hour,
                    ..tidal
                },
            ));
        }
    }
    scenarios
}

fn waits(w: &simulate::tidal::Waits) -> String {
    format!(
        "{}/{}/{}",
        hours(w.p50_secs),
        hours(w.p95_secs),
        hours(w.max_secs)
    )
}

#[allow(clippy::cast_precision_loss)] // Reason: seconds of a trace, far below 2^52.
fn days(secs: u64) -> f64 {
    secs as f64 / 86400.0
}

#[allow(clippy::cast_precision_loss)] // Reason: seconds of a trace, far below 2^52.
fn hours(secs: u64) -> String {
    format!("{:.1}h", secs as f64 / 3600.0)
}

fn time_table(args: &TimeArgs, pods: &str, reports: &[ScenarioReport], out: &mut String) {
    let pods = crate::cli::output::printable(pods, false);
    let Some(first) = reports.first() else {
        return;
    };
    let r = &first.result;
    let qos = r
        .tasks_by_qos
        .iter()
        .map(|(q, n)| format!("{q} {n}"))
        .collect::<Vec<_>>()
        .join(", ");
    let _ = writeln!(
        out,
        "trace {pods}, policy {}, {} GPUs, {:.1} days from {}; tasks: {qos} (LS, Guaranteed online; BE, Burstable batch)",
        args.policy,
        r.gpus,
        days(r.duration_secs),
        args.trace_start
    );
    let _ = writeln!(
        out,
        "nodes: every {}. of the list, {}% batch, {}% tidal (online in the static split), the rest online; defrag budget {}/h",
        args.node_stride.max(1),
        args.batch_nodes_percent,
        args.tidal_nodes_percent,
        args.defrag_evictions_per_hour
    );
    let _ = writeln!(
        out,
        "{:<14} {:>12} {:>12} {:>22} {:>22} {:>28} {:>6} {:>8} {:>8} {:>8} {:>9} {:>8}",
        "SCENARIO",
        "ONLINE-GPUh",
        "BATCH-GPUh",
        "WAIT-1GPU p50/p95/max",
        "WAIT-MULTI p50/p95/max",
        "WAIT-BATCH-LARGE p50/p95/max",
        "NEVER",
        "SWITCHES",
        "EVICT-SW",
        "EVICT-DF",
        "ONLINE-EV",
        "SECONDS"
    );
    for s in reports {
        let r = &s.result;
        let _ = writeln!(
            out,
            "{:<14} {:>12.0} {:>12.0} {:>22} {:>22} {:>28} {:>6} {:>8} {:>8} {:>8} {:>9} {:>8.1}",
            s.scenario,
            r.online_gpu_hours,
            r.batch_gpu_hours,
            waits(&r.whole_gpu_wait),
            waits(&r.multi_gpu_wait),
            waits(&r.batch_large_wait),
            r.never_placed,
            r.switches,
            r.schedule_evictions,
            r.defrag_evictions,
            r.online_evicted,
            s.seconds
        );
    }
}
