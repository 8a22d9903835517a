//! What a pod asks for, as placement policies see it: its cards and milli-GPU per card
//! ([`pod_ask`]), and the GPU models its requests accept ([`accepted_models`]), which
//! fragmentation-aware policies learn as part of its task shape.

use std::collections::BTreeSet;
use std::sync::Arc;

use super::policy::PodAsk;
use super::reach::class_devices;
use super::request::{ClaimSpec, ReqSpec};
use super::snapshot::{SelectorCache, Snapshot};
use crate::placement::fragmentation::{HostResources, WHOLE_GPU};

/// What the pod asks for, as placement scores see it: its cards (whole devices and share
/// cards over all claims) and the milli-GPU of each (the largest among its requests).
pub(super) fn pod_ask(specs: &[ClaimSpec], host: &HostResources) -> PodAsk {
    let mut ask = PodAsk {
        cards: 0,
        gpu_milli: 0,
        host: *host,
    };
    for claim in specs {
        for alts in &claim.requests {
            let Some(req) = alts.first() else { continue };
            if req.admin {
                continue;
            }
            let share = req.share.as_ref().or(req.capacity_share.as_ref());
            let (cards, milli) = match share {
                Some(s) => {
                    let by_memory = match s.memory {
                        crate::rules::share::MemoryAsk::Percent(p) => u32::from(p) * 10,
                        crate::rules::share::MemoryAsk::Bytes(_) => 0,
                    };
                    let by_compute = u32::try_from(s.compute.clamp(0, 100)).unwrap_or(0) * 10;
                    (s.cards, by_memory.max(by_compute).max(1))
                }
                None => (u32::try_from(req.count).unwrap_or(u32::MAX), WHOLE_GPU),
            };
            ask.cards = ask.cards.saturating_add(cards);
            ask.gpu_milli = ask.gpu_milli.max(milli);
        }
    }
    ask
}

/// The GPU models a pod's GPU requests accept, when their class and selectors leave out some
/// of the cluster's models (`None`: any model, or none matches at all). Each model is judged on
/// the devices the selectors are evaluated on, not guessed from the expressions' text.
pub(super) fn accepted_models(
    snap: &Snapshot,
    cache: &mut SelectorCache,
    specs: &[ClaimSpec],
) -> Option<Arc<[String]>> {
    // The cluster's models, each once (computed when the snapshot was built).
    let all = snap.model_shares.len();
    let mut accepted: BTreeSet<&str> = snap.model_shares.iter().map(|(m, _)| m.as_str()).collect();
    for claim in specs {
        for alts in &claim.requests {
            let Some(req) = alts.first().filter(|r| !r.admin) else {
                continue;
            };
            let models = request_models(snap, cache, req);
            accepted.retain(|m| models.iter().any(|a| a == m));
        }
    }
    (!accepted.is_empty() && accepted.len() < all).then(|| {
        accepted
            .into_iter()
            .map(str::to_owned)
            .collect::<Vec<_>>()
            .into()
    })
}

/// The models of the devices a request's class and selectors select, found once per class and
/// selectors on a snapshot (devices never change in one), not once per pod.
fn request_models(snap: &Snapshot, cache: &mut SelectorCache, req: &ReqSpec) -> Arc<Vec<String>> {
    let key = (req.class.clone(), req.selectors.clone());
    if let Some(models) = cache.request_models.get(&key) {
        return Arc::clone(models);
    }
    let mut models: Vec<String> = Vec::new();
    for &dev in class_devices(snap, cache, req).iter() {
        let Some(model) = snap.devices[dev].gpu_model.as_ref() else {
            continue;
        };
        if models.contains(model) {
            continue;
        }
        if req
            .selectors
            .iter()
            .all(|&e| snap.eval(cache, e, dev).unwrap_or(false))
        {
            models.push(model.clone());
        }
    }
    let models = Arc::new(models);
    cache.request_models.insert(key, Arc::clone(&models));
    models
}
