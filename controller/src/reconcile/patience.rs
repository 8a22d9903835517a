//! Delay-tolerant pods wait for a fragment (shared/DESIGN.md §8, docs/controller.md).
//!
//! A gated pod whose claims have a patience ([`tessera_driver::rules::patience`]) is placed with the
//! fragments-only allocator until its patience, counted from the pod's creation, runs out;
//! while no fragment fits it stays gated with the condition reason `WaitingForFragment` and a
//! message that says until when. The deadline is a function of the pod alone, so a restarted
//! or newly elected controller keeps the same one. The pass asks to be woken when the earliest
//! deadline of a waiting pod passes ([`super::PassReport::wake_in`]).

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1 as res;
use k8s_openapi::jiff::Timestamp;
use tessera_driver::placement::allocator::{Allocator, Snapshot};
use tessera_driver::{names, rules::patience};

use super::NotPlaced;

/// Until when `pod`, with `claims`, waits for a fragment at `now`; `None` when it is placed
/// like any other pod.
pub(super) fn waits_until(
    allocator: &Allocator,
    snapshot: &Snapshot,
    pod: &Pod,
    claims: &[&res::ResourceClaim],
    now: Timestamp,
) -> Option<Timestamp> {
    let created = pod.metadata.creation_timestamp.as_ref().map(|t| t.0);
    patience::waits_until(allocator.pod_patience(snapshot, claims), created, now)
}

/// What a pod that waits for a fragment until `until` is told.
pub(super) fn waiting(until: Timestamp) -> NotPlaced {
    NotPlaced::Waiting {
        reason: names::REASON_WAITING_FOR_FRAGMENT,
        message: format!(
            "waits for a fragment until {until}: the pod is delay-tolerant, and no GPU that is \
             already partly used has room for it; from then on it is placed on any GPU"
        ),
        until: Some(until),
    }
}
