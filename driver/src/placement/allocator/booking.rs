//! Booking a share on a shared GPU: the guaranteed part (counted against the GPU's capacity
//! and written as `consumedCapacity`) and, for batch shares of an over-committing class, the
//! over-committed rest ([`crate::rules::overcommit`] states the rule).

use super::capacity::{self, Amounts};
use super::request::ReqSpec;
use super::snapshot::Snapshot;
use crate::rules::config::Factor;
use crate::rules::overcommit::{self, Booked, Books};
use crate::rules::quantity::Quantity;
use crate::rules::share::PerDeviceShare;

/// What one share books on one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ShareBooking {
    /// Memory bytes.
    pub(crate) memory: Booked,
    /// Compute percent.
    pub(crate) compute: Booked,
}

impl ShareBooking {
    /// The over-committed part, as the search keeps it in flight: (memory bytes, compute).
    pub(crate) fn over(&self) -> (u64, i64) {
        (
            self.memory.over,
            i64::try_from(self.compute.over).unwrap_or(i64::MAX),
        )
    }

    /// Whether any part is over-committed.
    pub(crate) fn overcommitted(&self) -> bool {
        self.memory.over > 0 || self.compute.over > 0
    }
}

fn units(amounts: Option<&Amounts>, name: &str) -> u64 {
    let q = amounts
        .and_then(|a| a.get(name))
        .copied()
        .unwrap_or(Quantity::ZERO);
    u64::try_from(q.ceil_units()).unwrap_or(0)
}

/// Books `per` for request `spec` on shared GPU `dev`, beside committed use and the search's
/// `inflight` guaranteed amounts and `inflight_over` over-committed ones; `None` when it
/// does not fit. Online shares and GPUs that cannot back memory over-commit book with
/// factor 1, which is the rule without tiers.
pub(crate) fn book_share(
    snap: &Snapshot,
    dev: usize,
    spec: &ReqSpec,
    per: PerDeviceShare,
    inflight: Option<&Amounts>,
    inflight_over: Option<(u64, i64)>,
) -> Option<ShareBooking> {
    let entry = &snap.devices[dev];
    let (mem, comp) = entry.share_names();
    let used = &snap.uses[dev].consumed;
    let (over_mem, over_comp) = snap.share_over(dev, inflight_over);
    let memory_factor = if entry.backs_memory_overcommit {
        spec.overcommit.memory
    } else {
        Factor::ONE
    };
    let floor = |name: &str| {
        let cap = entry.capacity.get(name);
        move |x: u64| match cap {
            Some(cap) => {
                capacity::floor_to_policy(Quantity::from_units(i64::try_from(x).ok()?), cap)
                    .and_then(Quantity::as_units)
                    .and_then(|v| u64::try_from(v).ok())
            }
            None => Some(x),
        }
    };
    let memory = overcommit::book(
        Books {
            capacity: entry.memory,
            guaranteed: units(Some(used), &mem).saturating_add(units(inflight, &mem)),
            over: over_mem,
        },
        per.memory_bytes,
        memory_factor,
        floor(&mem),
    )?;
    let compute = overcommit::book(
        Books {
            capacity: u64::try_from(entry.compute).unwrap_or(0),
            guaranteed: units(Some(used), &comp).saturating_add(units(inflight, &comp)),
            over: u64::try_from(over_comp).unwrap_or(0),
        },
        u64::try_from(per.compute_percent).unwrap_or(u64::MAX),
        spec.overcommit.compute,
        floor(&comp),
    )?;
    Some(ShareBooking { memory, compute })
}
