//! Device use: what committed allocations hold of each device ([`DeviceUse`]), read from
//! their results and Tessera's `AllocatedShares` records, added on commit and taken away on
//! release, and the free and over-committed amounts of a shared GPU that follow from it.

use std::collections::HashMap;

use k8s_openapi::api::resource::v1 as res;

use super::super::capacity::{self, Amounts};
use super::pools::DeviceEntry;
use super::{Snapshot, claim_key};
use crate::rules::config::{self, TesseraConfig, Tier};
use crate::rules::nodeselect::NodeScope;
use crate::rules::quantity::Quantity;

/// What is held on one device.
#[derive(Debug, Clone, Default)]
pub(crate) struct DeviceUse {
    /// Allocations holding the whole device.
    pub(crate) exclusive: u32,
    /// Share allocations.
    pub(crate) shares: u32,
    /// Capacity consumed by shares, by name as the device spells it: what they are guaranteed.
    pub(crate) consumed: Amounts,
    /// What batch shares were booked beyond their guarantee ([`crate::rules::overcommit`]), by name.
    pub(crate) over: Amounts,
    /// The SM percentages the shares may use, together ([`crate::rules::overcommit::threads`]).
    pub(crate) threads: i64,
    /// Online shares holding an SM guarantee ([`crate::rules::overcommit::guards_sms`]): while any
    /// is on the GPU, `threads` stays within 100.
    pub(crate) guarded: u32,
}

impl DeviceUse {
    pub(crate) fn holders(&self) -> u32 {
        self.exclusive + self.shares
    }
}

/// A share as the allocator recorded it: what it may use and what it is guaranteed.
#[derive(Debug, Clone, Copy)]
struct RecordedShare {
    memory: Quantity,
    compute: i64,
    guaranteed_memory: Quantity,
    guaranteed_compute: i64,
    tier: Tier,
}

impl RecordedShare {
    /// What was booked beyond the guarantee, by capacity name of `entry` as it spells it.
    fn over(&self, entry: &DeviceEntry) -> Amounts {
        let (mem, comp) = entry.share_names();
        let mut over = Amounts::new();
        let memory = self.memory.saturating_sub(self.guaranteed_memory);
        if memory.nanos() > 0 {
            over.insert(mem, memory);
        }
        let compute = self.compute.saturating_sub(self.guaranteed_compute);
        if compute > 0 {
            over.insert(comp, Quantity::from_units(compute));
        }
        over
    }
}

/// The SM percentage a committed share may use and whether it guards its SMs: from the
/// allocator's record where there is one (what it may use, its tier), else from the compute it
/// consumes, counted as online (a share kube-scheduler booked without a record).
fn share_threads(
    record: Option<&RecordedShare>,
    consumed: &Amounts,
    entry: &DeviceEntry,
) -> (i64, bool) {
    let (compute, tier) = if let Some(r) = record {
        (r.compute, r.tier)
    } else {
        let (_, comp) = entry.share_names();
        let compute = consumed.get(&comp).map_or(0, |q| q.ceil_units());
        (compute, Tier::Online)
    };
    (
        crate::rules::overcommit::threads(compute),
        crate::rules::overcommit::guards_sms(tier, compute),
    )
}

/// One device's part of a committed allocation.
#[derive(Debug, Clone)]
pub(super) struct Contribution {
    device: usize,
    exclusive: bool,
    consumed: Amounts,
    /// Over-committed amounts of a batch share (empty for every other result).
    over: Amounts,
    /// The SM percentage the share may use, and whether it guards its SMs (an online share
    /// with compute); `(0, false)` for whole devices.
    threads: (i64, bool),
}

impl Contribution {
    /// A result holding `device` whole.
    fn whole(device: usize) -> Self {
        Self {
            device,
            exclusive: true,
            consumed: Amounts::new(),
            over: Amounts::new(),
            threads: (0, false),
        }
    }

    /// A share of `device` consuming `consumed`, with `over` booked beyond its guarantee and
    /// the SM `threads` it may use.
    fn share(device: usize, consumed: Amounts, over: Amounts, threads: (i64, bool)) -> Self {
        Self {
            device,
            exclusive: false,
            consumed,
            over,
            threads,
        }
    }
}

impl Snapshot {
    /// Records `allocation` as held by `claim` (replacing what the claim held before).
    /// Results naming devices the snapshot does not know are kept out of the accounting.
    pub fn commit(&mut self, claim: &res::ResourceClaim, allocation: &res::AllocationResult) {
        let key = claim_key(claim);
        self.release(&key);
        let records = self.share_records(allocation);
        let mut contributions = Vec::new();
        let Some(devices) = allocation.devices.as_ref() else {
            return;
        };
        for result in devices.results.iter().flatten() {
            if result.admin_access == Some(true) {
                continue;
            }
            let Some(idx) = self.device_index(&result.driver, &result.pool, &result.device) else {
                continue;
            };
            let entry = &self.devices[idx];
            let record = records.get(&(
                result.request.clone(),
                result.pool.clone(),
                result.device.clone(),
            ));
            let shared = result.share_id.is_some() || (entry.tessera_shared && record.is_some());
            let over = record.map(|r| r.over(entry)).unwrap_or_default();
            let contribution = if !shared {
                Contribution::whole(idx)
            } else if let Some(cc) = result.consumed_capacity.as_ref().filter(|c| !c.is_empty()) {
                let mut consumed = Amounts::new();
                for (name, q) in cc {
                    // A value we cannot read counts as the whole capacity.
                    let key = name.clone();
                    let value = Quantity::from_k8s(q)
                        .ok()
                        .or_else(|| entry.capacity.get(&key).map(|c| c.value));
                    if let Some(v) = value {
                        consumed.insert(key, v);
                    }
                }
                let threads = share_threads(record, &consumed, entry);
                Contribution::share(idx, consumed, over, threads)
            } else if let Some(rec) = record {
                let (mem, comp) = entry.share_names();
                let consumed: Amounts = [
                    (mem, rec.guaranteed_memory),
                    (comp, Quantity::from_units(rec.guaranteed_compute)),
                ]
                .into();
                let threads = share_threads(record, &consumed, entry);
                Contribution::share(idx, consumed, over, threads)
            } else if entry.capacity.is_empty() {
                // A share of a device without capacities consumes nothing: kube-scheduler
                // gives any number of claims their own shareID of it.
                Contribution::share(idx, Amounts::new(), Amounts::new(), (0, false))
            } else {
                let consumed = entry
                    .capacity
                    .iter()
                    .map(|(k, c)| (k.clone(), c.value))
                    .collect();
                let threads = share_threads(None, &consumed, entry);
                Contribution::share(idx, consumed, Amounts::new(), threads)
            };
            contributions.push(contribution);
        }
        for c in &contributions {
            self.apply(c, true);
        }
        self.claims.insert(key, contributions);
    }

    /// Tessera's `AllocatedShares` records in an allocation: (request, pool, device) ->
    /// what the share may use and what it is guaranteed.
    fn share_records(
        &self,
        allocation: &res::AllocationResult,
    ) -> HashMap<(String, String, String), RecordedShare> {
        let mut out = HashMap::new();
        let configs = allocation.devices.as_ref().and_then(|d| d.config.as_ref());
        for cfg in configs.into_iter().flatten() {
            let Some(opaque) = cfg
                .opaque
                .as_ref()
                .filter(|o| o.driver == self.tessera_driver)
            else {
                continue;
            };
            if let Ok(TesseraConfig::AllocatedShares(rec)) =
                config::decode(&opaque.parameters.0, "allocation")
            {
                for d in rec.devices {
                    let share = RecordedShare {
                        memory: d.memory,
                        compute: d.compute,
                        guaranteed_memory: d.guaranteed_memory(),
                        guaranteed_compute: d.guaranteed_compute(),
                        tier: d.tier,
                    };
                    out.insert((d.request, d.pool, d.device), share);
                }
            }
        }
        out
    }

    /// Forgets what the claim with this key (its UID, else `namespace/name`) held.
    pub fn release(&mut self, claim_key: &str) {
        if let Some(contributions) = self.claims.remove(claim_key) {
            for c in &contributions {
                self.apply(c, false);
            }
        }
    }

    /// Whether the snapshot tracks an allocation for this claim key.
    pub fn is_allocated(&self, claim_key: &str) -> bool {
        self.claims.contains_key(claim_key)
    }

    /// A number that changes whenever the use of some device changes (a commit or release
    /// that touched a device), so that figures derived from device use (gauges) are worked
    /// out again only when they can differ.
    pub fn usage_version(&self) -> u64 {
        self.usage_changes
    }

    fn apply(&mut self, c: &Contribution, add: bool) {
        self.usage_changes += 1;
        let before = self.uses[c.device].holders();
        let u = &mut self.uses[c.device];
        match (c.exclusive, add) {
            (true, true) => u.exclusive += 1,
            (true, false) => u.exclusive = u.exclusive.saturating_sub(1),
            (false, true) => {
                u.shares += 1;
                capacity::add_into(&mut u.consumed, &c.consumed);
                capacity::add_into(&mut u.over, &c.over);
                u.threads = u.threads.saturating_add(c.threads.0);
                u.guarded += u32::from(c.threads.1);
            }
            (false, false) => {
                u.shares = u.shares.saturating_sub(1);
                capacity::sub_from(&mut u.consumed, &c.consumed);
                capacity::sub_from(&mut u.over, &c.over);
                u.threads = u.threads.saturating_sub(c.threads.0);
                u.guarded = u.guarded.saturating_sub(u32::from(c.threads.1));
            }
        }
        let after = self.uses[c.device].holders();
        let entry = &self.devices[c.device];
        // Counters are consumed while anybody holds the device.
        if (before == 0) != (after == 0) && !entry.consumes.is_empty() {
            let used = &mut self.counters_used[entry.pool_idx];
            for (set, amounts) in &entry.consumes {
                let slot = used.entry(set.clone()).or_default();
                if after > 0 {
                    capacity::add_into(slot, amounts);
                } else {
                    capacity::sub_from(slot, amounts);
                }
            }
        }
        if let NodeScope::Node(node) = &self.devices[c.device].scope
            && let Some(&id) = self.node_ids.get(node)
        {
            self.refresh_summary(id);
        }
    }

    /// Fullness of a device in permille: 1000 when held whole.
    pub(crate) fn fullness(&self, idx: usize) -> u64 {
        let u = &self.uses[idx];
        let e = &self.devices[idx];
        if u.exclusive > 0 || (!e.multi && !e.tessera_shared && u.holders() > 0) {
            return 1000;
        }
        let mut worst = 0;
        for (name, used) in &u.consumed {
            if let Some(cap) = e.capacity.get(name)
                && cap.value.nanos() > 0
            {
                let p = used.nanos().saturating_mul(1000) / cap.value.nanos();
                worst = worst.max(u64::try_from(p.clamp(0, 1000)).unwrap_or(1000));
            }
        }
        if worst == 0 && u.shares > 0 {
            worst = 1;
        }
        worst
    }

    /// Free Tessera memory (bytes) and compute (percent) of a shared GPU, committed use only.
    pub(crate) fn share_free(&self, idx: usize, inflight: Option<&Amounts>) -> (u64, i64) {
        let e = &self.devices[idx];
        let (mem, comp) = &e.share_keys;
        let used = |name: &str| {
            let a = self.uses[idx]
                .consumed
                .get(name)
                .copied()
                .unwrap_or(Quantity::ZERO);
            let b = inflight
                .and_then(|i| i.get(name))
                .copied()
                .unwrap_or(Quantity::ZERO);
            a.saturating_add(b).ceil_units()
        };
        let mem_used = u64::try_from(used(mem)).unwrap_or(0);
        (e.memory.saturating_sub(mem_used), e.compute - used(comp))
    }

    /// The SM percentages the shares of a shared GPU may use together, and how many of them
    /// guard their SMs: committed use plus `inflight` ([`crate::rules::overcommit::threads_fit`]).
    pub(crate) fn share_threads(&self, idx: usize, inflight: Option<(i64, u32)>) -> (i64, u32) {
        let u = &self.uses[idx];
        let (t, g) = inflight.unwrap_or_default();
        (u.threads.saturating_add(t), u.guarded.saturating_add(g))
    }

    /// What batch shares of a shared GPU were booked beyond their guarantee: memory bytes and
    /// compute percent, committed use plus `inflight` ([`crate::rules::overcommit`]).
    pub(crate) fn share_over(&self, idx: usize, inflight: Option<(u64, i64)>) -> (u64, i64) {
        let (mem, comp) = &self.devices[idx].share_keys;
        let over = &self.uses[idx].over;
        let get = |name: &str| {
            over.get(name)
                .copied()
                .unwrap_or(Quantity::ZERO)
                .ceil_units()
        };
        let (m, c) = inflight.unwrap_or_default();
        (
            u64::try_from(get(mem)).unwrap_or(0).saturating_add(m),
            get(comp).saturating_add(c),
        )
    }
}
