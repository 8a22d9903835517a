//! Leader election on a coordination.k8s.io Lease, decided purely: given the Lease as read,
//! who we are and the time, whether to take it, renew it, or wait.
//!
//! The rules are client-go's: a Lease held by someone else is free once `renewTime` plus
//! `leaseDurationSeconds` has passed; taking it over increments `leaseTransitions`. Every write
//! carries the resourceVersion read, so two candidates that decide to take the same free Lease
//! cannot both succeed.

use k8s_openapi::api::coordination::v1::LeaseSpec;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};

/// What a candidate should do.
#[derive(Debug, Clone, PartialEq)]
pub enum LeaseAction {
    /// Write this spec (create the Lease when absent, else update it with the resourceVersion
    /// read): we hold the Lease afterwards.
    Write(LeaseSpec),
    /// Someone else holds the Lease until the given time; try again later.
    Wait {
        /// The holder.
        holder: String,
        /// When their hold runs out unless renewed.
        until: Timestamp,
    },
}

/// Decides for `me` at `now`, given the Lease's spec (`None` when there is no Lease yet).
pub fn decide(
    lease: Option<&LeaseSpec>,
    me: &str,
    now: Timestamp,
    duration: SignedDuration,
) -> LeaseAction {
    let seconds = i32::try_from(duration.as_secs()).unwrap_or(i32::MAX);
    let fresh = |transitions: i32, acquired: Option<MicroTime>| LeaseSpec {
        holder_identity: Some(me.to_owned()),
        lease_duration_seconds: Some(seconds),
        acquire_time: Some(acquired.unwrap_or(MicroTime(now))),
        renew_time: Some(MicroTime(now)),
        lease_transitions: Some(transitions),
        ..LeaseSpec::default()
    };
    let Some(spec) = lease else {
        return LeaseAction::Write(fresh(0, None));
    };
    let holder = spec.holder_identity.clone().unwrap_or_default();
    let transitions = spec.lease_transitions.unwrap_or(0);
    if holder == me {
        return LeaseAction::Write(fresh(transitions, spec.acquire_time.clone()));
    }
    let held_for = SignedDuration::from_secs(i64::from(spec.lease_duration_seconds.unwrap_or(0)));
    let until = spec
        .renew_time
        .as_ref()
        .map_or(Timestamp::UNIX_EPOCH, |t| t.0)
        .checked_add(held_for)
        .unwrap_or(Timestamp::MAX);
    if !holder.is_empty() && now < until {
        return LeaseAction::Wait { holder, until };
    }
    LeaseAction::Write(fresh(transitions.saturating_add(1), None))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + s).unwrap_or(Timestamp::UNIX_EPOCH)
    }

    const LEASE: SignedDuration = SignedDuration::from_secs(15);

    fn held_by(who: &str, renewed: i64) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(who.to_owned()),
            lease_duration_seconds: Some(15),
            renew_time: Some(MicroTime(at(renewed))),
            acquire_time: Some(MicroTime(at(0))),
            lease_transitions: Some(3),
            ..LeaseSpec::default()
        }
    }

    #[test]
    fn a_missing_lease_is_taken() {
        let LeaseAction::Write(spec) = decide(None, "a", at(0), LEASE) else {
            panic!("did not take a free lease");
        };
        assert_eq!(spec.holder_identity.as_deref(), Some("a"));
        assert_eq!(spec.lease_transitions, Some(0));
    }

    #[test]
    fn the_holder_renews_and_keeps_its_acquire_time() {
        let LeaseAction::Write(spec) = decide(Some(&held_by("a", 5)), "a", at(10), LEASE) else {
            panic!("the holder did not renew");
        };
        assert_eq!(spec.renew_time, Some(MicroTime(at(10))));
        assert_eq!(spec.acquire_time, Some(MicroTime(at(0))));
        assert_eq!(spec.lease_transitions, Some(3));
    }

    #[test]
    fn a_live_lease_of_another_holder_is_waited_for() {
        assert_eq!(
            decide(Some(&held_by("a", 5)), "b", at(19), LEASE),
            LeaseAction::Wait {
                holder: "a".into(),
                until: at(20)
            }
        );
    }

    #[test]
    fn an_expired_lease_is_taken_over_with_one_more_transition() {
        let LeaseAction::Write(spec) = decide(Some(&held_by("a", 5)), "b", at(20), LEASE) else {
            panic!("an expired lease was not taken over");
        };
        assert_eq!(spec.holder_identity.as_deref(), Some("b"));
        assert_eq!(spec.lease_transitions, Some(4));
        assert_eq!(spec.acquire_time, Some(MicroTime(at(20))));
    }
}
