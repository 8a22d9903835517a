//! Per-node summaries: what each node has free ([`NodeSummary`]), kept up to date as device
//! use changes so the allocator skips nodes without searching them, and the cluster-wide gaps
//! and free milli-GPU by model that follow from them.

use super::Snapshot;
use crate::placement::fragmentation::WHOLE_GPU;
use crate::placement::packing::{GapCounts, ModelFree};

/// Per-node figures that let the allocator skip nodes that cannot fit a claim.
#[derive(Debug, Clone, Default)]
pub(crate) struct NodeSummary {
    /// Devices on the node.
    pub(crate) devices: u32,
    /// Devices without `allowMultipleAllocations` that nobody holds.
    pub(crate) free_plain: u32,
    /// Tessera shared GPUs not held whole with some memory free.
    pub(crate) share_avail: u32,
    /// The most free memory on one Tessera shared GPU.
    pub(crate) share_max_free: u64,
    /// Sum of each device's fullness in permille.
    pub(crate) used_permille: u64,
    /// Free milli-GPU of each Tessera GPU (not MIG instances), in device order.
    pub(crate) gpu_free: Vec<u32>,
    /// The device index of each entry of `gpu_free`.
    pub(crate) gpu_devices: Vec<usize>,
    /// The `model` attribute of the node's first Tessera GPU.
    pub(crate) model: Option<String>,
    /// Per Tessera shared GPU not held whole: (free memory bytes, memory bytes).
    pub(crate) share_free: Vec<(u64, u64)>,
}

impl Snapshot {
    pub(super) fn refresh_summary(&mut self, node: usize) {
        let mut s = NodeSummary::default();
        for &idx in &self.local[node] {
            let e = &self.devices[idx];
            let u = &self.uses[idx];
            s.devices += 1;
            if !e.multi && u.holders() == 0 {
                s.free_plain += 1;
            }
            if e.tessera_shared && u.exclusive == 0 {
                let (free, _) = self.share_free(idx, None);
                if free > 0 {
                    s.share_avail += 1;
                    s.share_max_free = s.share_max_free.max(free);
                }
            }
            s.used_permille += self.fullness(idx);
            if let Some(model) = &e.gpu_model {
                if s.model.is_none() && !model.is_empty() {
                    s.model = Some(model.clone());
                }
                s.gpu_free.push(self.gpu_free_milli(idx));
                s.gpu_devices.push(idx);
            }
            if e.tessera_shared && u.exclusive == 0 {
                let (free, _) = self.share_free(idx, None);
                s.share_free.push((free, e.memory));
            }
        }
        let old = &self.summaries[node];
        for &free in &old.gpu_free {
            self.gaps.remove(free);
        }
        let idle = |free: &[u32]| free.iter().map(|&f| u64::from(f)).sum::<u64>();
        self.model_free
            .remove(old.model.as_deref(), idle(&old.gpu_free));
        for &free in &s.gpu_free {
            self.gaps.add(free);
        }
        self.model_free.add(s.model.as_deref(), idle(&s.gpu_free));
        self.summaries[node] = s;
        self.node_versions[node] += 1;
    }

    /// Partly used Tessera GPUs by free milli-GPU, over all nodes.
    pub fn gaps(&self) -> &GapCounts {
        &self.gaps
    }

    /// Free milli-GPU of Tessera GPUs, in total and by model.
    pub fn model_free(&self) -> &ModelFree {
        &self.model_free
    }

    /// Free milli-GPU of a Tessera GPU: 1000 when nobody holds it, 0 when held whole, else
    /// its free memory in milli of its memory (rounded down).
    fn gpu_free_milli(&self, idx: usize) -> u32 {
        let e = &self.devices[idx];
        let u = &self.uses[idx];
        if u.holders() == 0 {
            return WHOLE_GPU;
        }
        if u.exclusive > 0 || !e.tessera_shared || e.memory == 0 {
            return 0;
        }
        let (free, compute) = self.share_free(idx, None);
        let by_memory = u128::from(free) * u128::from(WHOLE_GPU) / u128::from(e.memory);
        let by_compute = u128::try_from(compute.clamp(0, 100)).unwrap_or(0) * 10;
        u32::try_from(by_memory.min(by_compute)).unwrap_or(0)
    }

    /// The model and free milli-GPU of each Tessera GPU of one node.
    pub fn node_gpu_free(&self, node: &str) -> Option<(Option<&str>, &[u32])> {
        let s = &self.summaries[*self.node_ids.get(node)?];
        Some((s.model.as_deref(), s.gpu_free.as_slice()))
    }

    /// Free milli-GPU of every Tessera GPU, node by node (nodes by name), for bookkeeping
    /// checks and fragmentation reports.
    pub fn gpu_free_by_node(&self) -> Vec<(&str, Option<&str>, &[u32])> {
        let mut names: Vec<(&String, &usize)> = self.node_ids.iter().collect();
        names.sort_unstable();
        names
            .into_iter()
            .map(|(n, &id)| {
                let s = &self.summaries[id];
                (n.as_str(), s.model.as_deref(), s.gpu_free.as_slice())
            })
            .collect()
    }
}
