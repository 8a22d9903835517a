//! Batch over-commit (shared/DESIGN.md §8): how much of a GPU a share is guaranteed, and how
//! much more it may use, competing with the GPU's other batch shares (never beside online work).
//!
//! The rule, per shared GPU with capacity `C` (compute 100, memory its bytes), where
//! `guaranteed` sums what every share on it is guaranteed and `over` what batch shares were
//! booked beyond their guarantee:
//!
//! * **Guaranteed never exceeds the GPU:** `sum(guaranteed) ≤ C`. Online shares are always
//!   guaranteed in full, so `sum(online) ≤ C` and online is never over-committed.
//! * **SMs an online share is guaranteed stay its own** ([`threads_fit`]): on a GPU that holds
//!   an online share, the compute (SM percentages) every share *may use* adds up to at most
//!   100. A share without compute is "not isolated": it sets no thread limit and counts 0 here,
//!   so it can still take SMs from online work (docs/cdi.md says so). MPS
//!   client priority was measured to protect nothing (an online client at p50 50 µs alone ran
//!   at 1,642 µs beside a 100 % batch client, at either priority; 66 µs beside a 30 % one), so
//!   only SM partitioning protects online work. Batch compute is therefore over-committed only
//!   among batch shares, on GPUs without online shares.
//! * **A batch share of a class with factor `f` > 1** fits when
//!   `sum(guaranteed) + sum(over) + ask ≤ f × C` (that is `sum(online) + sum(batch) ≤ f × C`).
//!   It is guaranteed what is still free, rounded down to the device's request policy
//!   (`min(ask, C − sum(guaranteed))`), and the rest of its ask is over-committed.
//! * **Factor 1** (the default, and always for online shares): the whole ask must be free and is
//!   guaranteed, exactly as without tiers.
//! * **One claim, one budget per GPU:** the shares of one claim's requests on the same GPU
//!   add up on the node, and may together use at most `C` (the search checks it where it
//!   places the second one).
//! * **Last resort:** the allocator places a pod with over-commit only when it fits nowhere
//!   without (`Allocator::allocate_pod` tries the pod with every factor 1 first).
//! * **Memory** is over-committed only when the class sets a memory factor **and** the GPU's
//!   node backs it (`enforcement: hami-core`, whose oversubscription spills to host memory);
//!   everywhere else a batch share's memory is guaranteed in full like an online one.
//!
//! Only the guaranteed part is written as `consumedCapacity`, so what kube-scheduler sums for a
//! device never exceeds its capacity and it keeps placing its own shares in what is truly
//! free; the `AllocatedShares` record carries both numbers (`memory`/`compute`: what the share
//! may use; `guaranteedMemory`/`guaranteedCompute`: what it is guaranteed, written only when
//! smaller). Factors come from the class's `TierPolicy` alone ([`request_overcommit`]), never
//! from a claim.

use crate::error::Error;
use crate::rules::config::{self, AppliedConfig, Factor, TesseraConfig, Tier};

/// The over-commit factors that apply to one request's batch shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Overcommit {
    /// Batch compute may be booked up to this times the GPU's compute.
    pub compute: Factor,
    /// Batch memory may be booked up to this times the GPU's memory, on GPUs that back it.
    pub memory: Factor,
}

impl Overcommit {
    /// No over-commit: every share guaranteed in full.
    pub const NONE: Self = Self {
        compute: Factor::ONE,
        memory: Factor::ONE,
    };

    /// Whether any over-commit applies.
    pub fn any(self) -> bool {
        self.compute.overcommits() || self.memory.overcommits()
    }
}

/// The over-commit factors of a batch request of class `class_name`: the last class
/// `TierPolicy` that applies to the request and sets each factor wins; claim configs never
/// count (a claim cannot carry a `TierPolicy`, see [`crate::rules::tier`]). Call it for batch
/// requests only: online shares are never over-committed.
pub fn request_overcommit(
    driver: &str,
    request: &str,
    class_configs: &[AppliedConfig<'_>],
) -> Result<Overcommit, Error> {
    let mut out = Overcommit::NONE;
    for decoded in config::applying(class_configs, driver, request) {
        if let TesseraConfig::TierPolicy(policy) = decoded?.0 {
            if let Some(f) = policy.batch_compute_overcommit {
                out.compute = f;
            }
            if let Some(f) = policy.batch_memory_overcommit {
                out.memory = f;
            }
        }
    }
    Ok(out)
}

/// The SM percentage a share with `compute` may use on its GPU, as the thread-percentage
/// sum counts it: its compute (0 for a share without compute, which is not isolated).
pub fn threads(compute: i64) -> i64 {
    compute.clamp(0, 100)
}

/// Whether a share guards the GPU's SMs: an online share, which batch over-commit must not
/// crowd out.
pub fn guards_sms(tier: Tier, _compute: i64) -> bool {
    tier == Tier::Online
}

/// Whether a share that may use `share.0` percent of the SMs (and guards them when
/// `share.1`) fits beside shares that may use `used` percent together, `guarded` of which
/// guard theirs: when any share on the GPU guards its SMs, all together stay within 100.
pub fn threads_fit(used: i64, guarded: u32, share: (i64, bool)) -> bool {
    (guarded == 0 && !share.1) || used.saturating_add(share.0) <= 100
}

/// One GPU's books in one resource (memory bytes or compute percent).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Books {
    /// The GPU's capacity.
    pub capacity: u64,
    /// What the shares on it are guaranteed, together.
    pub guaranteed: u64,
    /// What batch shares on it were booked beyond their guarantee, together.
    pub over: u64,
}

/// What one share books of one resource on one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Booked {
    /// Guaranteed: written as `consumedCapacity`, counted against the capacity.
    pub guaranteed: u64,
    /// Over-committed: usable only when the GPU's other shares leave it idle.
    pub over: u64,
}

/// Books `ask` of one resource. `factor` is 1 for online shares and for memory on GPUs that
/// cannot back over-commit. `floor` rounds a guarantee down to a value the device's request
/// policy accepts (`None`: no such value, e.g. below the policy's minimum). `None` when the
/// share does not fit.
pub fn book(
    books: Books,
    ask: u64,
    factor: Factor,
    floor: impl Fn(u64) -> Option<u64>,
) -> Option<Booked> {
    let free = books.capacity.saturating_sub(books.guaranteed);
    if ask <= free {
        return Some(Booked {
            guaranteed: ask,
            over: 0,
        });
    }
    if !factor.overcommits() {
        return None;
    }
    let booked = books
        .guaranteed
        .saturating_add(books.over)
        .saturating_add(ask);
    if booked > factor.scale(books.capacity) {
        return None;
    }
    let guaranteed = floor(free)?;
    Some(Booked {
        guaranteed,
        over: ask - guaranteed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn factor(h: u32) -> Factor {
        Factor::from_hundredths(h).unwrap()
    }

    #[test]
    fn factors_are_exact_hundredths_within_one_to_ten() {
        assert_eq!(Factor::from_f64(2.0).unwrap(), factor(200));
        assert_eq!(Factor::from_f64(1.25).unwrap(), factor(125));
        assert!(Factor::from_f64(0.5).unwrap_err().contains("1.0..=10.0"));
        assert!(Factor::from_f64(10.5).is_err());
        assert!(Factor::from_f64(f64::NAN).is_err());
        assert!(
            Factor::from_f64(1.333)
                .unwrap_err()
                .contains("two decimals")
        );
        let f: Factor = serde_json::from_str("2").unwrap();
        assert_eq!(f, factor(200));
        assert_eq!(serde_json::to_string(&factor(150)).unwrap(), "1.5");
        assert_eq!(serde_json::to_string(&factor(300)).unwrap(), "3");
        assert_eq!(factor(125).to_string(), "1.25");
        assert_eq!(factor(150).to_string(), "1.5");
        assert!(serde_json::from_str::<Factor>("\"2\"").is_err());
    }

    #[test]
    fn class_validation_refuses_a_bad_factor_naming_the_field() {
        let class = |factor: serde_json::Value| -> k8s_openapi::api::resource::v1::DeviceClass {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "batch"},
                "spec": {"config": [{"opaque": {"driver": "gpu.tessera.dev", "parameters": {
                    "apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "TierPolicy",
                    "tier": "batch", "batchComputeOvercommit": factor}}}]}
            }))
            .unwrap()
        };
        let cel = crate::rules::cel::CelCache::new();
        let check =
            |f| crate::rules::validation::validate_device_class(&class(f), "gpu.tessera.dev", &cel);
        assert!(check(serde_json::json!(2)).is_empty());
        assert!(check(serde_json::json!(1.5)).is_empty());
        for bad in [
            serde_json::json!(0.5),
            serde_json::json!(11),
            serde_json::json!("2"),
        ] {
            let errors = check(bad.clone());
            assert_eq!(errors.len(), 1, "{bad}: {errors:?}");
            let text = errors[0].to_string();
            assert!(text.contains("DeviceClass batch"), "{text}");
        }
    }

    #[test]
    fn beside_an_online_share_with_compute_the_sm_percentages_stay_within_the_gpu() {
        // Online 70 % guards its SMs: batch may add 30 %, not 35 %, whatever its factor.
        let online = (threads(70), guards_sms(Tier::Online, 70));
        assert!(threads_fit(0, 0, online));
        assert!(threads_fit(
            70,
            1,
            (threads(30), guards_sms(Tier::Batch, 30))
        ));
        assert!(!threads_fit(70, 1, (threads(35), false)));
        // An online share does not join a GPU whose batch shares may use more than it leaves.
        assert!(!threads_fit(100, 0, online));
        assert!(!threads_fit(150, 0, (threads(5), true)));
        // Among batch shares nothing is guarded: their over-commit is their own.
        assert!(threads_fit(
            150,
            0,
            (threads(60), guards_sms(Tier::Batch, 60))
        ));
        // A share without compute counts nothing (it is not isolated).
        assert_eq!(threads(0), 0);
        assert!(threads_fit(
            100,
            1,
            (threads(0), guards_sms(Tier::Online, 0))
        ));
    }

    #[test]
    fn a_share_that_fits_is_guaranteed_in_full_whatever_the_factor() {
        let books = Books {
            capacity: 100,
            guaranteed: 40,
            over: 0,
        };
        for f in [Factor::ONE, factor(200)] {
            assert_eq!(
                book(books, 60, f, Some),
                Some(Booked {
                    guaranteed: 60,
                    over: 0
                })
            );
        }
    }

    #[test]
    fn without_a_factor_nothing_is_over_committed() {
        let books = Books {
            capacity: 100,
            guaranteed: 70,
            over: 0,
        };
        assert_eq!(book(books, 35, Factor::ONE, Some), None);
    }

    #[test]
    fn a_batch_share_is_guaranteed_what_is_free_and_over_commits_the_rest() {
        let books = Books {
            capacity: 100,
            guaranteed: 70,
            over: 0,
        };
        assert_eq!(
            book(books, 50, factor(200), Some),
            Some(Booked {
                guaranteed: 30,
                over: 20
            })
        );
        // Booked in all (guaranteed + over + ask) may reach f × C, never pass it.
        let full = Books {
            capacity: 100,
            guaranteed: 100,
            over: 50,
        };
        assert_eq!(
            book(full, 50, factor(200), Some),
            Some(Booked {
                guaranteed: 0,
                over: 50
            })
        );
        assert_eq!(book(full, 55, factor(200), Some), None);
        assert_eq!(book(full, 5, factor(150), Some), None);
    }

    #[test]
    fn the_guarantee_rounds_down_to_the_policy_or_the_share_does_not_fit() {
        let gib = 1u64 << 30;
        let books = Books {
            capacity: 15 * gib + gib / 2,
            guaranteed: 12 * gib,
            over: 0,
        };
        let whole_gib = |x: u64| (x >= gib).then_some(x / gib * gib);
        assert_eq!(
            book(books, 8 * gib, factor(200), whole_gib),
            Some(Booked {
                guaranteed: 3 * gib,
                over: 5 * gib
            })
        );
        let almost_full = Books {
            guaranteed: 15 * gib,
            ..books
        };
        assert_eq!(book(almost_full, 2 * gib, factor(200), whole_gib), None);
    }
}
