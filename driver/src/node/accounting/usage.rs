//! What each claim's processes use of its booking, as one accounting pass measured it: the
//! numbers behind the claim's `MemoryWithinBooking` condition and the per-claim metrics.
//!
//! The same attribution as [`super::judge`]: a process counts for the claims its pod uses that
//! book its GPU, a process NVML lists twice counts once at its larger reading, and claims that
//! one pod's processes cannot be told apart on a GPU are measured together (each of them reports
//! the unit's use against the unit's booking). A booked GPU without any of the claim's
//! processes reads zero: the pass listed it and found nothing.

use std::collections::{BTreeMap, BTreeSet};

use super::{Consumers, GpuProcess, bookings, claims_of_pod, one_per_process, units};
use crate::node::checkpoint::Checkpoint;

/// One claim's use of one GPU it books.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuUse {
    /// GPU memory its processes hold there, in bytes (with the claims counted with it).
    pub used_bytes: u64,
    /// What it booked there, in bytes (with the claims counted with it).
    pub booked_bytes: u64,
    /// How many other claims are counted with it (their pod uses them all on this GPU).
    pub counted_with: usize,
}

impl GpuUse {
    /// Whether the processes stay within the booking.
    pub fn within_booking(&self) -> bool {
        self.used_bytes <= self.booked_bytes
    }
}

/// One pass's measurement: claim UID, then GPU UUID, to the claim's use there.
pub type Usage = BTreeMap<String, BTreeMap<String, GpuUse>>;

/// Measures every claim of `record` on every GPU it books (see the module's rule).
pub fn usage(record: &Checkpoint, consumers: &Consumers, processes: &[GpuProcess]) -> Usage {
    let booked = bookings(record);
    let seen = one_per_process(processes);
    let mut attributed: BTreeMap<&str, Vec<(u64, BTreeSet<&str>)>> = BTreeMap::new();
    for ((gpu, _), p) in seen {
        let Some(claims) = booked.get(gpu) else {
            continue;
        };
        let candidates = claims_of_pod(claims, consumers, p.pod_uid.as_deref());
        if !candidates.is_empty() {
            attributed
                .entry(gpu)
                .or_default()
                .push((p.used_bytes, candidates));
        }
    }
    let mut out = Usage::new();
    for (gpu, claims) in &booked {
        let found = attributed.get(gpu).map(Vec::as_slice).unwrap_or_default();
        let mut measured: BTreeSet<&str> = BTreeSet::new();
        for unit in units(found.iter().map(|(_, c)| c)) {
            let used_bytes = found
                .iter()
                .filter(|(_, c)| c.is_subset(&unit))
                .fold(0u64, |sum, (bytes, _)| sum.saturating_add(*bytes));
            let booked_bytes = unit
                .iter()
                .filter_map(|uid| claims.get(uid))
                .fold(0u64, |sum, b| sum.saturating_add(b.bytes));
            for uid in &unit {
                measured.insert(uid);
                out.entry((*uid).to_owned()).or_default().insert(
                    (*gpu).to_owned(),
                    GpuUse {
                        used_bytes,
                        booked_bytes,
                        counted_with: unit.len().saturating_sub(1),
                    },
                );
            }
        }
        for (uid, booking) in claims {
            if !measured.contains(uid) {
                out.entry((*uid).to_owned()).or_default().insert(
                    (*gpu).to_owned(),
                    GpuUse {
                        used_bytes: 0,
                        booked_bytes: booking.bytes,
                        counted_with: 0,
                    },
                );
            }
        }
    }
    out
}
