//! Fragmentation of idle GPU capacity, measured against a workload's typical task shapes.
//!
//! The measure is the one of Weng et al., "Beware of Fragmentation" (USENIX ATC '23): for a node
//! and a task shape, idle GPU capacity is *fragmented* when that shape cannot use it. A shape
//! that cannot run on the node at all (too little CPU or memory left, a GPU model it does not
//! accept, too few free GPUs) sees every idle GPU of the node as fragmented; a shape that can
//! run sees only the GPUs whose free fraction is below its per-GPU request. A node's
//! fragmentation is the expectation over the workload's typical shapes.
//!
//! Everything is in milli-GPU (1000 = one whole GPU), the unit of the published results.
//! [`Workload`] learns the shapes from tasks it is shown (never from tasks still to come).

use std::collections::HashMap;
use std::sync::Arc;

/// One whole GPU in milli-GPU.
pub const WHOLE_GPU: u32 = 1000;
/// The typical shapes are the most frequent ones that together cover this share of tasks.
pub const TYPICAL_COVERAGE: f64 = 0.95;
/// Free milli-GPU that fewer than this share of the shares seen could fill counts as waste to
/// Sum-of-Squares packing (see [`Workload::smallest_share`]).
pub const FILLABLE_SHARE_QUANTILE: f64 = 0.005;
/// The typical shapes are recomputed when the tasks seen grow by this factor, so scores can be
/// cached between refreshes; early on (fewer than [`REFRESH_EVERY_BELOW`] tasks) on every task.
pub const REFRESH_GROWTH: f64 = 1.05;
/// Below this many tasks seen, every new task refreshes the typical shapes.
pub const REFRESH_EVERY_BELOW: u64 = 64;

/// CPU and memory of a node (free or total) or of a pod's request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct HostResources {
    /// CPU in milli-cores.
    pub cpu_milli: u64,
    /// Memory in bytes.
    pub memory_bytes: u64,
}

impl HostResources {
    /// Whether `ask` fits into `self`.
    pub fn holds(&self, ask: &Self) -> bool {
        ask.cpu_milli <= self.cpu_milli && ask.memory_bytes <= self.memory_bytes
    }

    /// `self - ask`, saturating at zero.
    #[must_use]
    pub fn minus(&self, ask: &Self) -> Self {
        Self {
            cpu_milli: self.cpu_milli.saturating_sub(ask.cpu_milli),
            memory_bytes: self.memory_bytes.saturating_sub(ask.memory_bytes),
        }
    }

    /// `self + other`, saturating.
    #[must_use]
    pub fn plus(&self, other: &Self) -> Self {
        Self {
            cpu_milli: self.cpu_milli.saturating_add(other.cpu_milli),
            memory_bytes: self.memory_bytes.saturating_add(other.memory_bytes),
        }
    }
}

/// What one task asks for: host resources and `gpus` GPUs of `gpu_milli` each.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TaskShape {
    /// CPU and memory.
    pub host: HostResources,
    /// Number of GPUs (0 for a CPU-only task).
    pub gpus: u32,
    /// Milli-GPU on each GPU: below 1000 for a share of one GPU, 1000 for whole GPUs.
    pub gpu_milli: u32,
    /// GPU models (`model` attribute values) the task accepts; `None` accepts any.
    pub models: Option<Arc<[String]>>,
}

impl TaskShape {
    /// GPU demand in milli-GPU.
    pub fn gpu_demand(&self) -> u64 {
        u64::from(self.gpus) * u64::from(self.gpu_milli)
    }

    /// Whether the task accepts GPUs of `model` (`None`: the node's model is unknown).
    pub fn accepts(&self, model: Option<&str>) -> bool {
        match (&self.models, model) {
            (None, _) => true,
            (Some(list), Some(m)) => list.iter().any(|x| x == m),
            (Some(_), None) => false,
        }
    }
}

/// What fragmentation looks at on one node.
#[derive(Debug, Clone, Copy)]
pub struct NodeState<'a> {
    /// The model of the node's GPUs, if known.
    pub model: Option<&'a str>,
    /// Free CPU and memory; `None` when the node's host resources are not tracked.
    pub host_free: Option<HostResources>,
    /// Free milli-GPU of each GPU.
    pub gpu_free: &'a [u32],
}

impl NodeState<'_> {
    /// Idle milli-GPU on the node.
    pub fn idle(&self) -> u64 {
        self.gpu_free.iter().map(|&f| u64::from(f)).sum()
    }

    /// Whether a task of `shape` can run on the node as it is.
    pub fn can_run(&self, shape: &TaskShape) -> bool {
        if let Some(free) = self.host_free
            && !free.holds(&shape.host)
        {
            return false;
        }
        if shape.gpus == 0 {
            return true;
        }
        if !shape.accepts(self.model) {
            return false;
        }
        let fitting = self
            .gpu_free
            .iter()
            .filter(|&&f| f >= shape.gpu_milli)
            .count();
        fitting >= shape.gpus as usize
    }
}

/// Milli-GPU of `node` that a task of `shape` cannot use.
pub fn shape_fragmentation(node: &NodeState<'_>, shape: &TaskShape) -> u64 {
    if !node.can_run(shape) {
        return node.idle();
    }
    if shape.gpus == 0 {
        return 0;
    }
    node.gpu_free
        .iter()
        .filter(|&&f| f < shape.gpu_milli)
        .map(|&f| u64::from(f))
        .sum()
}

/// One typical shape and its weight (the weights of a workload sum to 1).
#[derive(Debug, Clone, PartialEq)]
pub struct Typical {
    /// The shape.
    pub shape: TaskShape,
    /// Its popularity among the typical shapes.
    pub weight: f64,
}

/// Expected fragmented milli-GPU of `node` for a task drawn from `typical`.
pub fn node_fragmentation(node: &NodeState<'_>, typical: &[Typical]) -> f64 {
    let idle = node.idle();
    if idle == 0 {
        return 0.0;
    }
    typical
        .iter()
        .map(|t| {
            #[allow(clippy::cast_precision_loss)] // Reason: milli-GPU of one node, far below 2^52.
            let f = shape_fragmentation(node, &t.shape) as f64;
            t.weight * f
        })
        .sum()
}

/// CPU and memory the typical GPU task brings per milli-GPU (demand-weighted means).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct HostPerGpu {
    /// Milli-cores per milli-GPU.
    pub cpu: f64,
    /// Bytes per milli-GPU.
    pub memory: f64,
}

/// Idle milli-GPU of `node` that its free CPU or memory cannot back, if the GPU were filled
/// by typical tasks (`per_gpu`): what stays idle however the GPUs are shared out. Single-task
/// fragmentation misses this: a node may fit the next typical task and still run out of CPU
/// long before its GPUs are full.
pub fn stranded(node: &NodeState<'_>, per_gpu: &HostPerGpu) -> f64 {
    let Some(free) = node.host_free else {
        return 0.0;
    };
    #[allow(clippy::cast_precision_loss)] // Reason: node-sized amounts, far below 2^52.
    let (idle, cpu, memory) = (
        node.idle() as f64,
        free.cpu_milli as f64,
        free.memory_bytes as f64,
    );
    let backed = |have: f64, per: f64| if per > 0.0 { have / per } else { f64::INFINITY };
    let usable = backed(cpu, per_gpu.cpu).min(backed(memory, per_gpu.memory));
    (idle - usable).max(0.0)
}

/// The task shapes seen so far, and the typical ones among them.
#[derive(Debug, Clone, Default)]
pub struct Workload {
    counts: HashMap<TaskShape, u64>,
    seen: u64,
    typical: Vec<Typical>,
    by_demand: Vec<Typical>,
    per_gpu: HostPerGpu,
    pressure: Vec<(String, f64)>,
    smallest: u32,
    refreshed_at: u64,
    version: u64,
}

impl Workload {
    /// An empty workload (no typical shapes: nothing counts as fragmented).
    pub fn new() -> Self {
        Self::default()
    }

    /// A workload that has seen `shapes`, with its typical shapes computed.
    pub fn from_shapes<I: IntoIterator<Item = TaskShape>>(shapes: I) -> Self {
        let mut w = Self::new();
        for s in shapes {
            *w.counts.entry(s).or_default() += 1;
            w.seen += 1;
        }
        w.refresh();
        w
    }

    /// Records one more task; refreshes the typical shapes when enough new tasks were seen.
    pub fn observe(&mut self, shape: TaskShape) {
        *self.counts.entry(shape).or_default() += 1;
        self.seen += 1;
        #[allow(clippy::cast_precision_loss)] // Reason: task counts, far below 2^52.
        let grown = self.seen as f64 >= self.refreshed_at as f64 * REFRESH_GROWTH;
        if self.seen < REFRESH_EVERY_BELOW || grown {
            self.refresh();
        }
    }

    /// Tasks seen.
    pub fn seen(&self) -> u64 {
        self.seen
    }

    /// Bumped whenever the typical shapes change, so cached scores can be dropped.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The most frequent shapes covering [`TYPICAL_COVERAGE`] of the tasks seen, most frequent
    /// first, weighted by frequency.
    pub fn typical(&self) -> &[Typical] {
        &self.typical
    }

    /// The same shapes weighted by what their failure would leave unallocated: frequency
    /// times GPU demand (CPU-only shapes count as one milli-GPU, so their CPU and memory still
    /// matter).
    pub fn typical_by_demand(&self) -> &[Typical] {
        &self.by_demand
    }

    /// The share of typical GPU demand (demand-weighted) that accepts only some models,
    /// split evenly over the models each shape accepts: how much the workload needs GPUs of
    /// `model` that other tasks could do without.
    pub fn model_pressure(&self, model: Option<&str>) -> f64 {
        model.map_or(0.0, |m| {
            self.pressure
                .iter()
                .find(|(name, _)| name == m)
                .map_or(0.0, |(_, p)| *p)
        })
    }

    /// CPU and memory per milli-GPU of the typical GPU tasks, weighted by demand.
    pub fn host_per_gpu(&self) -> HostPerGpu {
        self.per_gpu
    }

    /// The share size below which free milli-GPU is expected to stay idle: the smallest size
    /// such that shares up to it are at least [`FILLABLE_SHARE_QUANTILE`] of the shares seen
    /// (1000 when no share was seen). A gap that only a handful of rare tiny shares could fill
    /// is, for packing, as good as full.
    pub fn smallest_share(&self) -> u32 {
        self.smallest
    }

    /// The smallest share size (milli-GPU) such that shares up to that size make up at least
    /// `quantile` of the shares seen, by count; 1000 when none was seen.
    fn share_quantile(&self, quantile: f64) -> u32 {
        let mut sizes: Vec<(u32, u64)> = self
            .counts
            .iter()
            .filter(|(s, _)| s.gpus == 1 && s.gpu_milli < WHOLE_GPU)
            .map(|(s, &c)| (s.gpu_milli, c))
            .collect();
        sizes.sort_unstable();
        let total: u64 = sizes.iter().map(|(_, c)| c).sum();
        let mut acc = 0u64;
        for (milli, count) in sizes {
            acc += count;
            #[allow(clippy::cast_precision_loss)] // Reason: task counts, far below 2^52.
            if acc as f64 >= quantile * total as f64 {
                return milli;
            }
        }
        WHOLE_GPU
    }

    fn refresh(&mut self) {
        let mut shapes: Vec<(&TaskShape, u64)> = self.counts.iter().map(|(s, &c)| (s, c)).collect();
        // Ties are broken by the shape itself, so the result never depends on hash order.
        shapes.sort_unstable_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(b.0)));
        #[allow(
            clippy::cast_precision_loss,
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss
        )] // Reason: task counts, far below 2^52, and the product is positive.
        let goal = (self.seen as f64 * TYPICAL_COVERAGE).ceil() as u64;
        let mut covered = 0u64;
        let mut chosen = Vec::new();
        for (shape, count) in shapes {
            if covered >= goal {
                break;
            }
            covered += count;
            chosen.push((shape.clone(), count));
        }
        self.typical = chosen
            .into_iter()
            .map(|(shape, count)| {
                #[allow(clippy::cast_precision_loss)] // Reason: task counts, far below 2^52.
                let weight = count as f64 / covered.max(1) as f64;
                Typical { shape, weight }
            })
            .collect();
        let raw: Vec<f64> = self
            .typical
            .iter()
            .map(|t| {
                #[allow(clippy::cast_precision_loss)] // Reason: milli-GPU of one task.
                let d = t.shape.gpu_demand().max(1) as f64;
                t.weight * d
            })
            .collect();
        let total: f64 = raw.iter().sum();
        self.by_demand = self
            .typical
            .iter()
            .zip(raw)
            .map(|(t, w)| Typical {
                shape: t.shape.clone(),
                weight: if total > 0.0 { w / total } else { 0.0 },
            })
            .collect();
        let (mut cpu, mut memory, mut milli) = (0.0, 0.0, 0.0);
        for t in self.typical.iter().filter(|t| t.shape.gpus > 0) {
            #[allow(clippy::cast_precision_loss)] // Reason: one task's amounts.
            let (c, m, d) = (
                t.shape.host.cpu_milli as f64,
                t.shape.host.memory_bytes as f64,
                t.shape.gpu_demand() as f64,
            );
            cpu += t.weight * c;
            memory += t.weight * m;
            milli += t.weight * d;
        }
        self.per_gpu = if milli > 0.0 {
            HostPerGpu {
                cpu: cpu / milli,
                memory: memory / milli,
            }
        } else {
            HostPerGpu::default()
        };
        // Every task seen counts here, not only the typical shapes: model-restricted tasks
        // come in many rare shapes that the typical ones leave out.
        let all_demand: u64 = self.counts.iter().map(|(s, &c)| c * s.gpu_demand()).sum();
        let mut restricted: Vec<(&TaskShape, u64)> = self
            .counts
            .iter()
            .filter(|(s, _)| s.models.is_some() && s.gpus > 0)
            .map(|(s, &c)| (s, c))
            .collect();
        // Sums in a fixed order: hash order must not change the result's last bits.
        restricted.sort_unstable();
        let mut pressure: Vec<(String, f64)> = Vec::new();
        for (shape, count) in restricted {
            let Some(models) = shape.models.as_ref() else {
                continue;
            };
            #[allow(clippy::cast_precision_loss)] // Reason: milli-GPU totals, far below 2^52.
            let each = (count * shape.gpu_demand()) as f64
                / all_demand.max(1) as f64
                / models.len() as f64;
            for m in models.iter() {
                match pressure.iter_mut().find(|(name, _)| name == m) {
                    Some((_, p)) => *p += each,
                    None => pressure.push((m.clone(), each)),
                }
            }
        }
        self.pressure = pressure;
        self.smallest = self.share_quantile(FILLABLE_SHARE_QUANTILE);
        self.refreshed_at = self.seen;
        self.version += 1;
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A task of `gpus` GPUs at `milli` each, with 1 CPU and 1 GiB of host memory, on any model
    /// (the policy tests' typical tasks too).
    pub(crate) fn shape(gpus: u32, milli: u32) -> TaskShape {
        TaskShape {
            host: HostResources {
                cpu_milli: 1000,
                memory_bytes: 1 << 30,
            },
            gpus,
            gpu_milli: milli,
            models: None,
        }
    }

    fn node(free: &[u32], cpu: u64) -> NodeState<'_> {
        NodeState {
            model: Some("a100-40g"),
            host_free: Some(HostResources {
                cpu_milli: cpu,
                memory_bytes: 64 << 30,
            }),
            gpu_free: free,
        }
    }

    #[test]
    fn a_share_sees_only_gpus_with_less_free_than_it_asks_as_fragmented() {
        let n = node(&[1000, 300, 600], 8000);
        assert_eq!(shape_fragmentation(&n, &shape(1, 500)), 300);
        assert_eq!(shape_fragmentation(&n, &shape(1, 200)), 0);
    }

    #[test]
    fn whole_gpu_tasks_see_every_partly_used_gpu_as_fragmented() {
        let n = node(&[1000, 300, 600], 8000);
        assert_eq!(shape_fragmentation(&n, &shape(1, 1000)), 900);
    }

    #[test]
    fn a_shape_that_cannot_run_sees_all_idle_gpu_as_fragmented() {
        let n = node(&[1000, 300, 600], 8000);
        assert_eq!(shape_fragmentation(&n, &shape(2, 1000)), 1900);
        let starved = node(&[1000, 300], 500);
        assert_eq!(shape_fragmentation(&starved, &shape(1, 100)), 1300);
        assert_eq!(shape_fragmentation(&starved, &shape(0, 0)), 1300);
        let other_model = TaskShape {
            models: Some(vec!["t4-16g".to_owned()].into()),
            ..shape(1, 100)
        };
        assert_eq!(shape_fragmentation(&n, &other_model), 1900);
    }

    #[test]
    fn cpu_only_tasks_that_fit_fragment_nothing() {
        assert_eq!(
            shape_fragmentation(&node(&[1000, 10], 8000), &shape(0, 0)),
            0
        );
    }

    #[test]
    fn node_fragmentation_is_the_weighted_mean_over_typical_shapes() {
        let n = node(&[1000, 300], 8000);
        let typical = [
            Typical {
                shape: shape(1, 1000),
                weight: 0.5,
            },
            Typical {
                shape: shape(1, 500),
                weight: 0.5,
            },
        ];
        assert!((node_fragmentation(&n, &typical) - 300.0).abs() < 1e-9);
    }

    #[test]
    fn typical_shapes_cover_95_percent_most_frequent_first() {
        let mut shapes = vec![shape(1, 1000); 60];
        shapes.extend(vec![shape(1, 500); 36]);
        shapes.extend(vec![shape(8, 1000); 3]);
        shapes.push(shape(2, 1000));
        let w = Workload::from_shapes(shapes);
        let got: Vec<(u32, u32)> = w
            .typical()
            .iter()
            .map(|t| (t.shape.gpus, t.shape.gpu_milli))
            .collect();
        assert_eq!(got, vec![(1, 1000), (1, 500)]);
        let total: f64 = w.typical().iter().map(|t| t.weight).sum();
        assert!((total - 1.0).abs() < 1e-9);
    }

    #[test]
    fn gaps_that_only_rare_tiny_shares_fit_count_as_waste() {
        let mut shapes = vec![shape(1, 50)];
        shapes.extend(vec![shape(1, 110); 99]);
        shapes.extend(vec![shape(1, 470); 200]);
        shapes.extend(vec![shape(1, 1000); 50]);
        // One share in 300 is below the 0.5 % quantile: 110 is the smallest that counts.
        assert_eq!(Workload::from_shapes(shapes.clone()).smallest_share(), 110);
        shapes.push(shape(1, 50));
        assert_eq!(Workload::from_shapes(shapes).smallest_share(), 50);
        assert_eq!(
            Workload::from_shapes(vec![shape(1, 1000)]).smallest_share(),
            WHOLE_GPU
        );
    }

    #[test]
    fn observing_refreshes_only_after_enough_growth() {
        let mut w = Workload::new();
        for _ in 0..REFRESH_EVERY_BELOW {
            w.observe(shape(1, 1000));
        }
        let v = w.version();
        w.observe(shape(1, 500));
        assert_eq!(w.version(), v, "one more task in 64 is not 5 % growth");
        for _ in 0..4 {
            w.observe(shape(1, 500));
        }
        assert!(w.version() > v);
    }
}
