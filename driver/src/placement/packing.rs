//! Where a share of one GPU packs best: the Sum-of-Squares rule of online bin packing.
//!
//! Shares of one GPU are items in bins of 1000 milli-GPU. Fragmentation-aware scores judge one
//! node at a time; what they cannot see is the cluster-wide supply of gaps that later shares
//! will need. The Sum-of-Squares rule (Csirik, Johnson, Kenyon, Orlin, Shor and Weber, "On the
//! Sum-of-Squares algorithm for bin packing", J. ACM 53(1), 2006) keeps that supply balanced:
//! with `N(g)` the number of partly used GPUs that have `g` milli free, a share goes where
//! `Σ N(g)²` grows least. Gaps that many GPUs already have are consumed first and rare gaps
//! are not made more common, so the free milli left over tends to come in amounts that later
//! shares can fill. For item sizes from a fixed set its expected waste is near that of the
//! best offline packing, without knowing the sizes' distribution in advance.

use crate::placement::fragmentation::WHOLE_GPU;

/// How many GPUs have each amount of free milli-GPU, counting only partly used GPUs
/// (`0 < free < 1000`): an untouched GPU is an empty bin, a full one is no bin at all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GapCounts {
    counts: Vec<u32>,
}

impl Default for GapCounts {
    fn default() -> Self {
        Self {
            counts: vec![0; WHOLE_GPU as usize + 1],
        }
    }
}

impl GapCounts {
    /// No partly used GPU.
    pub fn new() -> Self {
        Self::default()
    }

    fn slot(free: u32) -> Option<usize> {
        (free > 0 && free < WHOLE_GPU).then_some(free as usize)
    }

    /// Counts a GPU with `free` milli free.
    pub fn add(&mut self, free: u32) {
        if let Some(i) = Self::slot(free) {
            self.counts[i] = self.counts[i].saturating_add(1);
        }
    }

    /// Stops counting a GPU with `free` milli free.
    pub fn remove(&mut self, free: u32) {
        if let Some(i) = Self::slot(free) {
            self.counts[i] = self.counts[i].saturating_sub(1);
        }
    }

    /// Partly used GPUs with exactly `free` milli free.
    pub fn count(&self, free: u32) -> u32 {
        Self::slot(free).map_or(0, |i| self.counts[i])
    }

    /// How much `Σ N(g)²` grows when a share of `milli` goes on a GPU with `free` milli free
    /// (`free = 1000`: an untouched GPU). Gaps below `smallest` (the smallest share expected)
    /// can never be filled and count as full. Lower is better; `None` when it does not fit.
    pub fn growth(&self, free: u32, milli: u32, smallest: u32) -> Option<i64> {
        if milli > free || free > WHOLE_GPU {
            return None;
        }
        let live = |g: u32| g >= smallest && g > 0 && g < WHOLE_GPU;
        let n = |g: u32| i64::from(self.count(g));
        let left = free - milli;
        // The GPU leaves the count of its old gap (if it had one) and joins its new one (if
        // one can still be filled).
        let leave = if live(free) { 1 - 2 * n(free) } else { 0 };
        let join = if live(left) { 2 * n(left) + 1 } else { 0 };
        Some(leave + join)
    }
}

/// Free milli-GPU over the whole cluster, in total and by GPU model: how much room is left
/// for tasks that accept only some models.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelFree {
    total: u64,
    by_model: Vec<(String, u64)>,
}

impl ModelFree {
    /// Nothing free.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a node's free milli-GPU (its GPUs are of `model`).
    pub fn add(&mut self, model: Option<&str>, free: u64) {
        self.total = self.total.saturating_add(free);
        if let Some(m) = model {
            match self.by_model.iter_mut().find(|(name, _)| name == m) {
                Some((_, f)) => *f = f.saturating_add(free),
                None => self.by_model.push((m.to_owned(), free)),
            }
        }
    }

    /// Takes back what [`Self::add`] added.
    pub fn remove(&mut self, model: Option<&str>, free: u64) {
        self.total = self.total.saturating_sub(free);
        if let Some((_, f)) =
            model.and_then(|m| self.by_model.iter_mut().find(|(name, _)| name == m))
        {
            *f = f.saturating_sub(free);
        }
    }

    /// Free milli-GPU over all GPUs.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Free milli-GPU on GPUs of `model`.
    pub fn of(&self, model: &str) -> u64 {
        self.by_model
            .iter()
            .find(|(name, _)| name == model)
            .map_or(0, |(_, f)| *f)
    }

    /// Whether taking `demand` milli-GPU of `model` leaves less of it free than tasks that need
    /// this model are expected to ask for before the cluster is full: `pressure` (their share
    /// of all GPU demand) of what is free in the whole cluster after the placement.
    pub fn eats_reserve(&self, model: &str, demand: u64, pressure: f64) -> bool {
        if pressure <= 0.0 {
            return false;
        }
        #[allow(clippy::cast_precision_loss)] // Reason: milli-GPU totals, far below 2^52.
        let (left, total) = (
            self.of(model).saturating_sub(demand) as f64,
            self.total.saturating_sub(demand) as f64,
        );
        left < pressure * total
    }

    /// The models whose reserve taking `demand` milli-GPU would eat into
    /// ([`Self::eats_reserve`]), each model's pressure given by `pressure`; none for a pod
    /// that takes no GPU.
    pub fn held_back(&self, demand: u64, pressure: impl Fn(&str) -> f64) -> Vec<String> {
        if demand == 0 {
            return Vec::new();
        }
        self.by_model
            .iter()
            .filter(|(m, _)| self.eats_reserve(m, demand, pressure(m)))
            .map(|(m, _)| m.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_keeps_what_its_restricted_tasks_are_expected_to_need() {
        let mut free = ModelFree::new();
        free.add(Some("t4"), 3000);
        free.add(Some("a100"), 7000);
        assert_eq!(free.total(), 10_000);
        // Tasks that need t4 bring 20 % of the demand: after taking 1000 of t4, 2000 are
        // left, more than 20 % of the 9000 free in all.
        assert!(!free.eats_reserve("t4", 1000, 0.2));
        // With 25 %, 2000 is less than 2250.
        assert!(free.eats_reserve("t4", 1000, 0.25));
        assert!(!free.eats_reserve("t4", 1000, 0.0));
        let pressure = |m: &str| if m == "t4" { 0.25 } else { 0.0 };
        assert_eq!(free.held_back(1000, pressure), vec!["t4".to_owned()]);
        assert!(free.held_back(0, pressure).is_empty());
        free.remove(Some("t4"), 3000);
        assert_eq!(free.of("t4"), 0);
    }

    #[test]
    fn only_partly_used_gpus_are_counted() {
        let mut g = GapCounts::new();
        g.add(1000);
        g.add(0);
        g.add(190);
        g.add(190);
        assert_eq!(g.count(190), 2);
        assert_eq!(g.count(1000), 0);
        g.remove(190);
        assert_eq!(g.count(190), 1);
    }

    #[test]
    fn growth_is_the_change_of_the_sum_of_squares() {
        let mut g = GapCounts::new();
        for free in [190, 190, 530, 350] {
            g.add(free);
        }
        let sum = |g: &GapCounts| {
            (1..WHOLE_GPU)
                .map(|f| i64::from(g.count(f)).pow(2))
                .sum::<i64>()
        };
        for (free, milli) in [
            (1000, 810),
            (1000, 470),
            (530, 470),
            (350, 320),
            (190, 160),
            (350, 350),
        ] {
            let mut after = g.clone();
            after.remove(free);
            after.add(free - milli);
            assert_eq!(
                g.growth(free, milli, 1),
                Some(sum(&after) - sum(&g)),
                "{free} {milli}"
            );
        }
        assert_eq!(g.growth(190, 320, 1), None);
    }

    #[test]
    fn a_share_that_fills_a_common_gap_beats_opening_a_gpu() {
        let mut g = GapCounts::new();
        for _ in 0..5 {
            g.add(530);
        }
        // A 470 share: into one of the five 530 gaps (leaving 60) rather than a new GPU.
        assert!(g.growth(530, 470, 1) < g.growth(1000, 470, 1));
    }
}
