//! The node's two rules over many claims at once, from one index of what each claim holds:
//! the exclusivity rule (who holds which device, and each GPU whole or as MIG instances) and
//! the online-SM rule (how much of each GPU's SMs the claims' shares may use). Indexed so that
//! checking a claim costs its own devices, not every recorded claim (a call of 10,000 claims
//! would otherwise compare each with all the others).

use std::collections::BTreeMap;

use super::HeldDevice;
use crate::error::{Error, Result};
use crate::node::prepared::PreparedClaim;
use crate::rules::overcommit;

/// Up to two distinct holders: enough to name one that is not the claim asking.
#[derive(Debug, Default, Clone)]
struct Two([Option<String>; 2]);

impl Two {
    fn add(&mut self, uid: &str) {
        match &self.0 {
            [None, _] => self.0[0] = Some(uid.to_owned()),
            [Some(a), None] if a != uid => self.0[1] = Some(uid.to_owned()),
            _ => {}
        }
    }

    fn other_than(&self, uid: &str) -> Option<&str> {
        self.0
            .iter()
            .flatten()
            .map(String::as_str)
            .find(|h| *h != uid)
    }
}

#[derive(Debug, Default, Clone)]
struct Holders {
    any: Two,
    exclusive: Two,
}

impl Holders {
    fn add(&mut self, uid: &str, exclusive: bool) {
        self.any.add(uid);
        if exclusive {
            self.exclusive.add(uid);
        }
    }

    /// A holder other than `uid` that excludes a device held `exclusive`ly or not.
    fn conflict(&self, uid: &str, exclusive: bool) -> Option<&str> {
        if exclusive {
            self.any.other_than(uid)
        } else {
            self.exclusive.other_than(uid)
        }
    }
}

/// What one physical GPU holds.
#[derive(Debug, Default, Clone)]
struct GpuUse {
    /// Holders of the GPU itself (whole or a share of it).
    whole: Holders,
    /// Holders of its MIG instances.
    mig: Holders,
    /// The threads (compute) of every claim's shares of it, counted once per claim.
    threads: i64,
    /// How many of those claims guard its SMs (hold an online share of it).
    guards: u32,
}

impl GpuUse {
    fn holders(&mut self, mig: bool) -> &mut Holders {
        if mig { &mut self.mig } else { &mut self.whole }
    }
}

/// Who holds what, and how much of each GPU's SMs: by device (`pool`, `device`), and by GPU.
#[derive(Debug, Default, Clone)]
pub(super) struct Holdings {
    by_device: BTreeMap<(String, String), Holders>,
    by_gpu: BTreeMap<String, GpuUse>,
}

/// The compute a claim's shares of GPU `gpu` may use together (the node gives one claim one
/// budget per GPU) and whether any of them is online, over `devices` of one claim; `None` when
/// the claim holds no share of it.
fn gpu_threads(devices: &[HeldDevice], gpu: &str) -> Option<(i64, bool)> {
    devices
        .iter()
        .filter(|d| d.gpu_uuid == gpu && !d.mig)
        .filter_map(|d| Some((d.share_compute_percent?, d.share_tier.unwrap_or_default())))
        .fold(None, |acc, (compute, tier)| {
            let (t, online) = acc.unwrap_or((0, false));
            Some((
                t.saturating_add(overcommit::threads(compute)),
                online || overcommit::guards_sms(tier, compute),
            ))
        })
}

/// The GPUs of `devices` that `keep` keeps, each once.
fn gpus_of(devices: &[HeldDevice], keep: impl Fn(&HeldDevice) -> bool) -> Vec<&str> {
    let mut gpus: Vec<&str> = devices
        .iter()
        .filter(|d| keep(d))
        .map(|d| d.gpu_uuid.as_str())
        .collect();
    gpus.sort_unstable();
    gpus.dedup();
    gpus
}

impl Holdings {
    /// Records that `uid` holds `devices`; `earlier`, the devices its record held before
    /// (counted already), no longer use SMs. (Its earlier holdings stay: a claim is never its
    /// own conflict.)
    pub(super) fn add(
        &mut self,
        uid: &str,
        devices: &[HeldDevice],
        earlier: Option<&[HeldDevice]>,
    ) {
        for d in devices {
            self.by_device
                .entry((d.pool.clone(), d.device.clone()))
                .or_default()
                .add(uid, d.exclusive);
            self.by_gpu
                .entry(d.gpu_uuid.clone())
                .or_default()
                .holders(d.mig)
                .add(uid, d.exclusive);
        }
        self.count_sms(devices, 1);
        if let Some(earlier) = earlier {
            self.count_sms(earlier, -1);
        }
    }

    /// Adds (`sign` 1) or takes away (`sign` -1) what `devices` use of each GPU's SMs.
    fn count_sms(&mut self, devices: &[HeldDevice], sign: i64) {
        for gpu in gpus_of(devices, |_| true) {
            if let Some((t, online)) = gpu_threads(devices, gpu) {
                let e = self.by_gpu.entry(gpu.to_owned()).or_default();
                e.threads = e.threads.saturating_add(sign.saturating_mul(t));
                if sign > 0 {
                    e.guards = e.guards.saturating_add(u32::from(online));
                } else {
                    e.guards = e.guards.saturating_sub(u32::from(online));
                }
            }
        }
    }

    /// The first device of `wanted` that another claim than `uid` holds in a way that excludes
    /// it (either holding is whole), with that holder: the same device, or the same GPU once
    /// whole and once as a MIG instance.
    pub(super) fn conflict<'a>(
        &'a self,
        uid: &str,
        wanted: &'a [HeldDevice],
    ) -> Option<(&'a HeldDevice, &'a str)> {
        wanted.iter().find_map(|d| {
            let same_device = self
                .by_device
                .get(&(d.pool.clone(), d.device.clone()))
                .and_then(|h| h.conflict(uid, d.exclusive));
            let other_kind = || {
                let gpu = self.by_gpu.get(&d.gpu_uuid)?;
                let other = if d.mig { &gpu.whole } else { &gpu.mig };
                other.conflict(uid, d.exclusive)
            };
            same_device.or_else(other_kind).map(|holder| (d, holder))
        })
    }

    /// Refuses `claim` holding `devices` (its record held `earlier`) when, on one of its shared
    /// GPUs, an online share is (or would be) and the compute of every recorded claim's shares
    /// there would pass 100 (`overcommit::threads_fit`): the node's own check of what the
    /// allocator keeps.
    pub(super) fn check_sms(
        &self,
        claim: &PreparedClaim,
        devices: &[HeldDevice],
        earlier: Option<&[HeldDevice]>,
    ) -> Result<()> {
        for gpu in gpus_of(devices, |d| d.share_compute_percent.is_some() && !d.mig) {
            let Some(mine) = gpu_threads(devices, gpu) else {
                continue;
            };
            // Every recorded claim's use of the GPU but this claim's own earlier record.
            let (mut used, mut guarded) = self
                .by_gpu
                .get(gpu)
                .map_or((0, 0), |g| (g.threads, g.guards));
            if let Some((t, online)) = earlier.and_then(|devices| gpu_threads(devices, gpu)) {
                used = used.saturating_sub(t);
                guarded = guarded.saturating_sub(u32::from(online));
            }
            if !overcommit::threads_fit(used, guarded, mine) {
                return Err(Error::Prepare {
                    claim: format!("{}/{}", claim.namespace, claim.name),
                    message: format!(
                        "its shares of GPU {gpu} may use {}% compute beside {used}% of the claims \
                         prepared there, past 100% while an online share is on the GPU: online work \
                         keeps the SMs it was promised (batch compute is over-committed only among \
                         batch shares); the allocation was not made by Tessera's allocator under this \
                         rule — delete the pod to allocate it again",
                        mine.0
                    ),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(device: &str, exclusive: bool) -> HeldDevice {
        HeldDevice {
            request: "gpu".to_owned(),
            pool: "node-a".to_owned(),
            device: device.to_owned(),
            gpu_uuid: format!("GPU-{device}"),
            mig: false,
            exclusive,
            cdi_ids: Vec::new(),
            share_memory_bytes: (!exclusive).then_some(1 << 30),
            share_compute_percent: (!exclusive).then_some(10),
            share_id: (!exclusive).then(|| "s".to_owned()),
            share_tier: None,
        }
    }

    #[test]
    fn a_claims_shares_of_two_gpus_each_count_on_their_own_gpu_and_mig_instances_on_none() {
        let mut mig = held("gpu-1", false);
        mig.mig = true;
        let devices = [held("gpu-1", false), held("gpu-2", false), mig];
        let threads = |gpu: &str| gpu_threads(&devices, gpu).map(|t| t.0);
        assert_eq!(threads("GPU-gpu-1"), Some(overcommit::threads(10)));
        assert_eq!(threads("GPU-gpu-2"), Some(overcommit::threads(10)));
        assert_eq!(threads("GPU-gpu-3"), None);
    }

    #[test]
    fn a_claim_recorded_again_counts_its_sms_once_not_on_top_of_its_earlier_record() {
        let mut holdings = Holdings::default();
        let before = [held("gpu-1", false)];
        let mut after = held("gpu-1", false);
        after.share_compute_percent = Some(30);
        holdings.add("a", &before, None);
        holdings.add("a", std::slice::from_ref(&after), Some(&before));
        assert_eq!(
            holdings.by_gpu["GPU-gpu-1"].threads,
            overcommit::threads(30)
        );
    }

    #[test]
    fn a_claim_holding_one_gpu_twice_does_not_hide_another_claims_hold_on_it() {
        // Claim a's two requests share gpu-1 (two holds by one claim), then claim b shares it
        // too. Were a's second hold to take b's place, a asking gpu-1 whole would see no
        // other holder and take a GPU b still holds.
        let mut holdings = Holdings::default();
        holdings.add("a", &[held("gpu-1", false), held("gpu-1", false)], None);
        holdings.add("b", &[held("gpu-1", false)], None);
        let whole = [held("gpu-1", true)];
        let (device, holder) = holdings.conflict("a", &whole).expect("b holds gpu-1");
        assert_eq!(holder, "b");
        assert_eq!(device.device, "gpu-1");
        assert_eq!(
            holdings.conflict("b", &[held("gpu-1", true)]).map(|c| c.1),
            Some("a")
        );
    }
}
