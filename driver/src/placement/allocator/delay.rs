//! The delay rule (shared/DESIGN.md §8): a delay-tolerant share goes only into a fragment.
//!
//! A *fragment* is a shared GPU that already holds at least one share and is not held whole:
//! putting patient work there fills a gap instead of opening an empty GPU that a large request
//! might need later. An allocator made with [`Allocator::fragments_only`] places every
//! delay-tolerant request (one with a [`Patience`], see [`crate::rules::patience`]) only on
//! fragments; other requests of the same pod are placed as usual. Whether a pod still waits
//! is [`crate::rules::patience::waits_until`] of [`Allocator::pod_patience`]; once it stops waiting,
//! callers place it with an ordinary allocator.
//!
//! ```text
//! let until = patience::waits_until(allocator.pod_patience(&snapshot, &claims), created, now);
//! let result = match until {
//!     Some(_) => fragments.place_pod(..),   // fragments = Allocator::new(..).fragments_only()
//!     None => allocator.place_pod(..),
//! };
//! ```

use k8s_openapi::api::resource::v1 as res;

use super::request::{self, ClaimSpec};
use super::snapshot::DeviceUse;
use super::{Allocator, Snapshot};
use crate::rules::config::Patience;

/// Whether a device in this use is a fragment: it holds shares and nobody holds it whole.
pub(crate) fn is_fragment(used: &DeviceUse) -> bool {
    used.shares > 0 && used.exclusive == 0
}

/// Marks every delay-tolerant request of `specs` to take fragments only.
pub(crate) fn restrict(specs: &mut [ClaimSpec]) {
    for alternative in specs
        .iter_mut()
        .flat_map(|c| c.requests.iter_mut())
        .flatten()
    {
        alternative.fragments_only = alternative.patience.is_some();
    }
}

/// Whether any config for `driver` of the claims, or of any class, has a `patience`: the
/// common case (none does) is answered without reading the claims' requests.
fn mentions_patience(driver: &str, snapshot: &Snapshot, claims: &[&res::ResourceClaim]) -> bool {
    let has = |opaque: Option<&res::OpaqueDeviceConfiguration>| {
        opaque.is_some_and(|o| o.driver == driver && o.parameters.0.get("patience").is_some())
    };
    let in_claims = claims.iter().any(|c| {
        c.spec
            .devices
            .iter()
            .flat_map(|d| d.config.iter().flatten())
            .any(|cfg| has(cfg.opaque.as_ref()))
    });
    in_claims
        || snapshot.classes.values().any(|class| {
            class
                .spec
                .config
                .iter()
                .flatten()
                .any(|cfg| has(cfg.opaque.as_ref()))
        })
}

impl Allocator {
    /// The same allocator, placing delay-tolerant shares only on fragments (see the module
    /// docs); its failures carry the short reason (callers say "waits for a fragment").
    #[must_use]
    pub fn fragments_only(mut self) -> Self {
        self.fragments_only = true;
        self.explain = false;
        self
    }

    /// The patience of a pod with `claims`: the shortest among its delay-tolerant requests
    /// (the pod stops waiting when its least patient request does), `None` when none is
    /// delay-tolerant or a claim is malformed (placing it then says what is wrong).
    pub fn pod_patience(
        &self,
        snapshot: &Snapshot,
        claims: &[&res::ResourceClaim],
    ) -> Option<Patience> {
        if !mentions_patience(&self.options.driver_name, snapshot, claims) {
            return None;
        }
        let mut cache = snapshot.selectors();
        let mut shortest: Option<Patience> = None;
        for claim in claims {
            let spec =
                request::prepare_claim(snapshot, &mut cache, &self.options.driver_name, claim)
                    .ok()?;
            for p in spec.requests.iter().flatten().filter_map(|r| r.patience) {
                shortest = Some(shortest.map_or(p, |s| s.min(p)));
            }
        }
        shortest
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::Node;
    use serde_json::json;

    use super::*;
    use crate::node::slices::{self, RenderOptions};
    use crate::placement::allocator::{AllocatorOptions, Policy};
    use crate::testing::{
        self, BATCH_CLASS_YAML as BATCH_CLASS, SHARED_CLASS_YAML as SHARED_CLASS,
    };

    /// One node `n` with `gpus` shared A100s.
    fn snapshot(gpus: usize, batch_patience: Option<&str>) -> Snapshot {
        let inventory = testing::inventory(&format!(
            "nodes:\n- name: n\n  mode: shared\n  gpus:\n  - model: a100-80g\n    count: {gpus}\n"
        ));
        let slices = slices::render(&inventory.nodes[0], &RenderOptions::default()).unwrap();
        let mut batch: serde_json::Value = serde_yaml::from_str(BATCH_CLASS).unwrap();
        if let Some(p) = batch_patience {
            batch["spec"]["config"][0]["opaque"]["parameters"]["patience"] = json!(p);
        }
        let classes = vec![
            serde_yaml::from_str(SHARED_CLASS).unwrap(),
            serde_json::from_value(batch).unwrap(),
        ];
        Snapshot::new(&slices, &classes, &[]).unwrap()
    }

    fn share(name: &str, class: &str, memory: &str, patience: Option<&str>) -> res::ResourceClaim {
        let mut params = testing::gpu_share(memory);
        if let Some(p) = patience {
            params["patience"] = json!(p);
        }
        testing::gpu_claim(name, class, Some(params))
    }

    fn nodes() -> Vec<Node> {
        vec![testing::k8s_node("n")]
    }

    fn allocator() -> Allocator {
        Allocator::new(AllocatorOptions {
            policy: Policy::FirstFit,
            ..AllocatorOptions::default()
        })
    }

    fn device(p: &super::super::Placement) -> String {
        testing::results(&p.allocations[0])[0].device.clone()
    }

    fn place(
        snap: &mut Snapshot,
        a: &Allocator,
        claim: &res::ResourceClaim,
    ) -> Option<super::super::Placement> {
        let p = a.allocate(snap, &[claim], &nodes()).ok()?;
        snap.commit(claim, &p.allocations[0]);
        Some(p)
    }

    #[test]
    fn a_delay_tolerant_share_waits_while_every_gpu_is_empty() {
        let mut snap = snapshot(2, None);
        let patient = share("patient", "shared.gpu.tessera.dev", "10Gi", Some("10m"));
        let fragments = allocator().fragments_only();
        assert!(place(&mut snap, &fragments, &patient).is_none());
        // Placed normally, it would have taken the first empty GPU.
        assert!(allocator().allocate(&snap, &[&patient], &nodes()).is_ok());
    }

    #[test]
    fn a_delay_tolerant_share_goes_into_a_partly_used_gpu_not_an_empty_one() {
        let mut snap = snapshot(3, None);
        let a = allocator();
        let first = share("first", "shared.gpu.tessera.dev", "10Gi", None);
        let second = share("second", "shared.gpu.tessera.dev", "75Gi", None);
        assert_eq!(device(&place(&mut snap, &a, &first).unwrap()), "gpu-0");
        assert_eq!(device(&place(&mut snap, &a, &second).unwrap()), "gpu-1");
        snap.release("uid-first");
        // gpu-0 is empty again and first-fit takes it; a patient share takes gpu-1.
        let patient = share("patient", "shared.gpu.tessera.dev", "5Gi", Some("10m"));
        let normal = a.allocate(&snap, &[&patient], &nodes()).unwrap();
        assert_eq!(device(&normal), "gpu-0");
        let p = place(&mut snap, &a.fragments_only(), &patient).unwrap();
        assert_eq!(
            device(&p),
            "gpu-1",
            "the partly used GPU, not the empty gpu-0"
        );
    }

    #[test]
    fn a_fragment_too_small_for_the_share_does_not_count() {
        let mut snap = snapshot(2, None);
        let big = share("big", "shared.gpu.tessera.dev", "75Gi", None);
        place(&mut snap, &allocator(), &big).unwrap();
        let patient = share("patient", "shared.gpu.tessera.dev", "10Gi", Some("1h"));
        assert!(place(&mut snap, &allocator().fragments_only(), &patient).is_none());
        let fits = share("fits", "shared.gpu.tessera.dev", "5Gi", Some("1h"));
        let p = place(&mut snap, &allocator().fragments_only(), &fits).unwrap();
        assert_eq!(device(&p), "gpu-0");
    }

    #[test]
    fn shares_without_patience_are_placed_as_usual_by_a_fragments_only_allocator() {
        let mut snap = snapshot(1, None);
        let plain = share("plain", "shared.gpu.tessera.dev", "10Gi", None);
        assert!(place(&mut snap, &allocator().fragments_only(), &plain).is_some());
        let opted_out = share("opted-out", "batch.gpu.tessera.dev", "10Gi", Some("0s"));
        let mut snap = snapshot(1, Some("30m"));
        assert!(place(&mut snap, &allocator().fragments_only(), &opted_out).is_some());
    }

    #[test]
    fn the_pods_patience_comes_from_the_class_or_the_claim_and_the_shortest_wins() {
        let snap = snapshot(1, Some("30m"));
        let a = allocator();
        let class = share("c", "batch.gpu.tessera.dev", "10Gi", None);
        let own = share("o", "shared.gpu.tessera.dev", "10Gi", Some("10m"));
        let none = share("x", "shared.gpu.tessera.dev", "10Gi", None);
        assert_eq!(
            a.pod_patience(&snap, &[&class]),
            Some(Patience::parse("30m").unwrap())
        );
        assert_eq!(
            a.pod_patience(&snap, &[&class, &own]),
            Some(Patience::parse("10m").unwrap())
        );
        assert_eq!(a.pod_patience(&snap, &[&none]), None);
        let malformed = share("m", "shared.gpu.tessera.dev", "10Gi", Some("soon"));
        assert_eq!(a.pod_patience(&snap, &[&malformed]), None);
    }
}
