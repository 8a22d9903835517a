//! The exclusivity rule over many claims at once: who holds which device, indexed so that
//! checking a claim costs its own devices, not every recorded claim (a call of 10,000 claims
//! would otherwise compare each with all the others).

use std::collections::BTreeMap;

use super::HeldDevice;

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

/// Who holds what: by device (`pool`, `device`), and by GPU and whether the holding is a MIG
/// instance (a whole GPU and one of its instances overlap).
#[derive(Debug, Default, Clone)]
pub(super) struct Holdings {
    by_device: BTreeMap<(String, String), Holders>,
    by_gpu: BTreeMap<(String, bool), Holders>,
}

impl Holdings {
    /// Records that `uid` holds `devices`.
    pub(super) fn add(&mut self, uid: &str, devices: &[HeldDevice]) {
        for d in devices {
            self.by_device
                .entry((d.pool.clone(), d.device.clone()))
                .or_default()
                .add(uid, d.exclusive);
            self.by_gpu
                .entry((d.gpu_uuid.clone(), d.mig))
                .or_default()
                .add(uid, d.exclusive);
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
                self.by_gpu
                    .get(&(d.gpu_uuid.clone(), !d.mig))
                    .and_then(|h| h.conflict(uid, d.exclusive))
            };
            same_device.or_else(other_kind).map(|holder| (d, holder))
        })
    }
}
