//! The Alibaba "openb" trace CSV format: node lists and pod (task) lists.
//!
//! Columns are found by their header names, so the 5-column variants (`multigpu*`) and the
//! 11-column ones read alike. Every bad value is an error naming the file, the line, the
//! column and the rule. GPU models are mapped to Tessera's model ids through the inventory's
//! model table (`G1`/`G2`/`G3` are aliases of stand-in models, docs/inventory.md).

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::node::inventory::models;
use crate::placement::fragmentation::{HostResources, TaskShape, WHOLE_GPU};

/// Bytes in one MiB, the trace's memory unit.
pub const MIB: u64 = 1 << 20;
/// The `qos` of best-effort tasks (the others: `LS`, `Burstable`, `Guaranteed`).
pub const QOS_BEST_EFFORT: &str = "BE";

/// One node of a node list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceNode {
    /// Node name (`sn`).
    pub name: String,
    /// CPU and memory.
    pub host: HostResources,
    /// Number of GPUs.
    pub gpus: u32,
    /// Tessera model id of its GPUs (empty when it has none).
    pub model: String,
}

/// One task of a pod list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TracePod {
    /// Task name.
    pub name: String,
    /// CPU and memory requested.
    pub host: HostResources,
    /// GPUs requested.
    pub num_gpu: u32,
    /// Milli-GPU on each GPU (1..=1000; 0 for CPU-only tasks).
    pub gpu_milli: u32,
    /// Tessera model ids the task accepts; empty accepts any.
    pub gpu_spec: Vec<String>,
    /// Whether the task is best-effort (`qos` `BE`: batch when mixing tiers); `None` when the
    /// list has no `qos` column.
    pub best_effort: Option<bool>,
}

impl TracePod {
    /// GPU demand in milli-GPU.
    pub fn gpu_demand(&self) -> u64 {
        u64::from(self.num_gpu) * u64::from(self.gpu_milli)
    }

    /// The task's shape, as fragmentation measures see it.
    pub fn shape(&self) -> TaskShape {
        TaskShape {
            host: self.host,
            gpus: self.num_gpu,
            gpu_milli: self.gpu_milli,
            models: (!self.gpu_spec.is_empty()).then(|| Arc::from(self.gpu_spec.clone())),
        }
    }
}

/// A CSV table with named columns.
struct Table<'a> {
    file: &'a str,
    header: Vec<&'a str>,
    rows: Vec<(usize, Vec<&'a str>)>,
}

impl<'a> Table<'a> {
    fn parse(file: &'a str, text: &'a str) -> Result<Self> {
        // Spreadsheets often save CSV with a UTF-8 byte-order mark.
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        let mut lines = text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty());
        let Some((_, header)) = lines.next() else {
            return Err(Error::invalid(file, "header", "the file is empty"));
        };
        let header: Vec<&str> = header.split(',').map(str::trim).collect();
        let rows = lines
            .map(|(i, l)| (i + 1, l.split(',').map(str::trim).collect()))
            .collect();
        Ok(Self { file, header, rows })
    }

    fn column(&self, name: &str) -> Result<usize> {
        self.header
            .iter()
            .position(|h| *h == name)
            .ok_or_else(|| Error::invalid(self.file, name, "the header has no such column"))
    }

    /// The positions of the columns `names`, in their order; `Err` names the first missing.
    fn columns<const N: usize>(&self, names: [&str; N]) -> Result<[usize; N]> {
        let mut out = [0; N];
        for (slot, name) in out.iter_mut().zip(names) {
            *slot = self.column(name)?;
        }
        Ok(out)
    }

    fn cell<'r>(&self, row: &'r (usize, Vec<&'a str>), col: usize, name: &str) -> Result<&'r str> {
        row.1.get(col).copied().ok_or_else(|| {
            Error::invalid(
                format!("{} line {}", self.file, row.0),
                name,
                format!(
                    "the row has {} columns, the header {}",
                    row.1.len(),
                    self.header.len()
                ),
            )
        })
    }

    fn number(&self, row: &(usize, Vec<&'a str>), col: usize, name: &str) -> Result<u64> {
        let text = self.cell(row, col, name)?;
        text.parse::<u64>().map_err(|_| {
            Error::invalid(
                format!("{} line {}", self.file, row.0),
                name,
                format!("{text:?} is not a whole non-negative number"),
            )
        })
    }

    /// The row's `cpu_milli` and `memory_mib` (columns `cpu` and `mem`) as host resources.
    fn host(&self, row: &(usize, Vec<&'a str>), cpu: usize, mem: usize) -> Result<HostResources> {
        Ok(HostResources {
            cpu_milli: self.number(row, cpu, "cpu_milli")?,
            memory_bytes: self.number(row, mem, "memory_mib")?.saturating_mul(MIB),
        })
    }
}

fn model_id(code: &str, object: &str, field: &str) -> Result<String> {
    models::lookup(code)
        .map(|m| m.id.to_owned())
        .ok_or_else(|| Error::invalid(object, field, format!("unknown GPU model {code:?}")))
}

fn small(value: u64, object: &str, field: &str) -> Result<u32> {
    u32::try_from(value)
        .map_err(|_| Error::invalid(object, field, format!("{value} is out of range")))
}

/// Reads a node list (`sn,cpu_milli,memory_mib,gpu,model`); `file` names it in errors.
pub fn parse_nodes(file: &str, text: &str) -> Result<Vec<TraceNode>> {
    let t = Table::parse(file, text)?;
    let [sn, cpu, mem, gpu, model] =
        t.columns(["sn", "cpu_milli", "memory_mib", "gpu", "model"])?;
    let mut nodes = Vec::with_capacity(t.rows.len());
    for row in &t.rows {
        let object = format!("{file} line {}", row.0);
        let gpus = small(t.number(row, gpu, "gpu")?, &object, "gpu")?;
        let code = t.cell(row, model, "model")?;
        let model = match (gpus, code.is_empty()) {
            (0, _) => String::new(),
            (_, true) => {
                return Err(Error::invalid(
                    &object,
                    "model",
                    "a node with GPUs needs a model",
                ));
            }
            (_, false) => model_id(code, &object, "model")?,
        };
        nodes.push(TraceNode {
            name: t.cell(row, sn, "sn")?.to_owned(),
            host: t.host(row, cpu, mem)?,
            gpus,
            model,
        });
    }
    Ok(nodes)
}

/// Reads a pod list (`name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec,...]`).
pub fn parse_pods(file: &str, text: &str) -> Result<Vec<TracePod>> {
    let t = Table::parse(file, text)?;
    let [name, cpu, mem, num, milli] =
        t.columns(["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli"])?;
    let spec = t.column("gpu_spec").ok();
    let qos = t.column("qos").ok();
    if t.rows.is_empty() {
        return Err(Error::invalid(
            file,
            "rows",
            "the pod list has a header but no tasks",
        ));
    }
    let mut pods = Vec::with_capacity(t.rows.len());
    for row in &t.rows {
        let object = format!("{file} line {}", row.0);
        let num_gpu = small(t.number(row, num, "num_gpu")?, &object, "num_gpu")?;
        let gpu_milli = small(t.number(row, milli, "gpu_milli")?, &object, "gpu_milli")?;
        if num_gpu > 0 && !(1..=WHOLE_GPU).contains(&gpu_milli) {
            return Err(Error::invalid(
                &object,
                "gpu_milli",
                format!("{gpu_milli} is outside 1..1000 for a task with GPUs"),
            ));
        }
        if num_gpu == 0 && gpu_milli != 0 {
            return Err(Error::invalid(
                &object,
                "gpu_milli",
                format!("{gpu_milli} milli-GPU on a task with num_gpu 0"),
            ));
        }
        let gpu_spec = match spec {
            Some(col) => t
                .cell(row, col, "gpu_spec")?
                .split('|')
                .filter(|s| !s.is_empty())
                .map(|code| model_id(code, &object, "gpu_spec"))
                .collect::<Result<Vec<_>>>()?,
            None => Vec::new(),
        };
        pods.push(TracePod {
            name: t.cell(row, name, "name")?.to_owned(),
            host: t.host(row, cpu, mem)?,
            num_gpu,
            gpu_milli,
            gpu_spec,
            best_effort: qos
                .map(|col| t.cell(row, col, "qos").map(|q| q == QOS_BEST_EFFORT))
                .transpose()?,
        });
    }
    Ok(pods)
}

/// A task's `qos` in the trace, and the tier a time replay gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub enum Qos {
    /// `LS`, latency-sensitive: online.
    LatencySensitive,
    /// `BE`, best-effort: batch.
    BestEffort,
    /// `Guaranteed` (the Kubernetes `QoS` class: requests equal limits): online.
    Guaranteed,
    /// `Burstable` (the Kubernetes `QoS` class: may use more than it requests): batch.
    Burstable,
}

impl Qos {
    /// The `qos` values of the trace, in the order of [`Qos`].
    pub const ALL: [Self; 4] = [
        Self::LatencySensitive,
        Self::BestEffort,
        Self::Guaranteed,
        Self::Burstable,
    ];

    /// The value as the trace writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::LatencySensitive => "LS",
            Self::BestEffort => QOS_BEST_EFFORT,
            Self::Guaranteed => "Guaranteed",
            Self::Burstable => "Burstable",
        }
    }

    /// Whether a time replay runs it as batch work (`BE` and `Burstable`); the others are
    /// online.
    pub fn is_batch(self) -> bool {
        matches!(self, Self::BestEffort | Self::Burstable)
    }

    fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|q| q.as_str() == text)
    }
}

/// A task of a pod list with its lifetime, for a time replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimedPod {
    /// The task.
    pub pod: TracePod,
    /// Its `qos`.
    pub qos: Qos,
    /// `creation_time`, seconds from the trace's start.
    pub created: u64,
    /// `deletion_time`, seconds from the trace's start (at or after `created`).
    pub deleted: u64,
}

impl TimedPod {
    /// Seconds it runs once placed.
    pub fn runtime(&self) -> u64 {
        self.deleted - self.created
    }
}

/// The columns a time replay needs beyond [`parse_pods`]'s.
pub const TIME_COLUMNS: [&str; 3] = ["qos", "creation_time", "deletion_time"];

/// Reads a pod list with time columns (`qos`, `creation_time`, `deletion_time`) for a time
/// replay: every rule of [`parse_pods`], and a list without one of those columns, an unknown
/// `qos`, or a task deleted before it was created is an error naming the file, the line, the
/// column and the rule.
pub fn parse_timed_pods(file: &str, text: &str) -> Result<Vec<TimedPod>> {
    let t = Table::parse(file, text)?;
    let mut cols = [0; 3];
    for (slot, name) in cols.iter_mut().zip(TIME_COLUMNS) {
        *slot = t.column(name).map_err(|_| {
            Error::invalid(
                file,
                name,
                format!(
                    "a time replay needs the columns {}; this pod list has no {name} column \
                     (the multigpu lists have no time columns)",
                    TIME_COLUMNS.join(", ")
                ),
            )
        })?;
    }
    let [qos, created, deleted] = cols;
    let pods = parse_pods(file, text)?;
    let mut out = Vec::with_capacity(pods.len());
    for (row, pod) in t.rows.iter().zip(pods) {
        let object = format!("{file} line {}", row.0);
        let text = t.cell(row, qos, "qos")?;
        let qos = Qos::parse(text).ok_or_else(|| {
            Error::invalid(
                &object,
                "qos",
                format!(
                    "{text:?} is not a qos of the trace; expected LS, BE, Guaranteed or Burstable"
                ),
            )
        })?;
        let created = t.number(row, created, "creation_time")?;
        let deleted = t.number(row, deleted, "deletion_time")?;
        if deleted < created {
            return Err(Error::invalid(
                &object,
                "deletion_time",
                format!("{deleted} is before creation_time {created}: a task ends after it starts"),
            ));
        }
        out.push(TimedPod {
            pod,
            qos,
            created,
            deleted,
        });
    }
    Ok(out)
}
