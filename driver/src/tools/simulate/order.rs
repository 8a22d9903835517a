//! The arrival order of the paper's method: the trace shuffled with a seed, then uniformly
//! random copies of its tasks appended until the next copy would push the total GPU demand
//! above the inflation target (130 % of the cluster's GPUs).
//!
//! The generator is `SplitMix64` (Steele, Lea and Flood, 2014): small, fast and fully
//! determined by the seed, so a seed replays identically on every machine. It is not the
//! paper's generator, so our seed 42 is a different order than the paper's seed 42; the
//! comparison is between means over 10 seeds.

/// A seeded `SplitMix64` generator.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A uniform number in `0..n` (`n > 0`), without modulo bias (Lemire's method).
    pub fn below(&mut self, n: usize) -> usize {
        let n64 = n as u64;
        loop {
            let m = u128::from(self.next_u64()) * u128::from(n64);
            #[allow(clippy::cast_possible_truncation)] // Reason: the low 64 bits, on purpose.
            let low = m as u64;
            if low >= n64.wrapping_neg() % n64 {
                #[allow(clippy::cast_possible_truncation)] // Reason: the high half is below n.
                return (m >> 64) as usize;
            }
        }
    }
}

/// Indices into the trace in arrival order: a seeded shuffle of every task, then random
/// copies while the total demand stays within `target` milli-GPU.
pub fn arrival_order(demands: &[u64], seed: u64, target: u64) -> Vec<usize> {
    let mut rng = Rng::new(seed);
    let mut order: Vec<usize> = (0..demands.len()).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let mut total: u64 = demands.iter().sum();
    // Copies are drawn until the target is reached: with no demand at all it never would be.
    if demands.iter().all(|d| *d == 0) {
        return order;
    }
    loop {
        let pick = rng.below(demands.len());
        if total + demands[pick] > target {
            break;
        }
        total += demands[pick];
        order.push(pick);
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tasks_without_gpu_demand_get_no_copies() {
        assert_eq!(arrival_order(&[0, 0, 0], 42, 6000).len(), 3);
    }

    #[test]
    fn the_same_seed_gives_the_same_order_and_another_seed_another() {
        let demands = vec![1000, 500, 0, 2000, 300];
        let a = arrival_order(&demands, 42, 6000);
        assert_eq!(a, arrival_order(&demands, 42, 6000));
        assert_ne!(a, arrival_order(&demands, 43, 6000));
    }

    #[test]
    fn every_task_arrives_once_before_copies_and_copies_stop_below_the_target() {
        let demands = vec![1000, 500, 0, 2000, 300];
        let order = arrival_order(&demands, 7, 6000);
        let mut first: Vec<usize> = order[..5].to_vec();
        first.sort_unstable();
        assert_eq!(first, vec![0, 1, 2, 3, 4]);
        let total: u64 = order.iter().map(|&i| demands[i]).sum();
        assert!(total <= 6000);
    }

    #[test]
    fn below_stays_in_range() {
        let mut rng = Rng::new(1);
        assert!((0..1000).all(|_| rng.below(3) < 3));
    }
}
