//! What the live defragmentation did, as the leader records it on a node
//! (`gpu.tessera.dev/defrag`) before it evicts anything: the pending pod the room is for and
//! every eviction of the last hour. The budget of a restarted or new leader is counted from
//! these records, so a restart never evicts past it; a record that cannot be read spends the
//! whole budget (fail closed).

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::core::v1::Node;
use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::names;

/// How long the room made for a pod is kept for it: other pods are not placed on that node
/// meanwhile, and the pod is placed only there.
pub const HOLD: SignedDuration = SignedDuration::from_mins(10);

/// How long an eviction counts against the budget.
pub const WINDOW: SignedDuration = SignedDuration::from_hours(1);

/// One eviction made by defragmentation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Evicted {
    /// `namespace/name` of the evicted pod.
    pub pod: String,
    /// Its UID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    /// When the eviction was decided (recorded before it was asked for).
    #[serde(with = "rfc3339")]
    pub at: Timestamp,
}

/// A node's defragmentation record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DefragRecord {
    /// `namespace/name` of the pending pod the room on this node is for.
    pub room_for: String,
    /// Its UID: a new pod by that name is not held for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub room_for_uid: Option<String>,
    /// When the room was made.
    #[serde(with = "rfc3339")]
    pub at: Timestamp,
    /// The evictions on this node in the hour before `at`, and those made at `at`.
    pub evicted: Vec<Evicted>,
}

/// Timestamps as RFC 3339 text, as Kubernetes writes them.
mod rfc3339 {
    use jiff::Timestamp;
    use serde::{Deserialize as _, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(t: &Timestamp, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&t.to_string())
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Timestamp, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

impl DefragRecord {
    /// The record to write on a node where room is made now for `pod` by evicting `pods`
    /// (`namespace/name`, UID): `previous` evictions older than [`WINDOW`] are dropped.
    pub fn made(
        previous: Option<&Self>,
        pod: &str,
        uid: Option<&str>,
        pods: &[(String, Option<String>)],
        now: Timestamp,
    ) -> Self {
        let mut evicted: Vec<Evicted> = previous
            .into_iter()
            .flat_map(|r| &r.evicted)
            .filter(|e| in_window(e.at, now))
            .cloned()
            .collect();
        evicted.extend(pods.iter().map(|(p, u)| Evicted {
            pod: p.clone(),
            uid: u.clone(),
            at: now,
        }));
        Self {
            room_for: pod.to_owned(),
            room_for_uid: uid.map(str::to_owned),
            at: now,
            evicted,
        }
    }

    /// The annotation's value.
    pub fn to_annotation(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The record on `node`, `None` when it has none.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the node and the annotation, for a record that does not
    /// parse.
    pub fn of(node: &Node) -> Result<Option<Self>, Error> {
        let Some(text) = node
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(names::ANNOTATION_DEFRAG))
        else {
            return Ok(None);
        };
        serde_json::from_str(text)
            .map(Some)
            .map_err(|e| Error::Invalid {
                object: format!("Node {}", node.metadata.name.as_deref().unwrap_or_default()),
                field: format!("metadata.annotations[{}]", names::ANNOTATION_DEFRAG),
                message: format!("not a defragmentation record: {e}"),
            })
    }

    /// Whether the room is still held for `pod` (with `uid`) at `now`.
    pub fn holds_for(&self, pod: &str, uid: Option<&str>, now: Timestamp) -> bool {
        self.room_for == pod && self.room_for_uid.as_deref() == uid && self.holding(now)
    }

    /// Whether the room is still held (for whichever pod) at `now`.
    pub fn holding(&self, now: Timestamp) -> bool {
        self.at <= now && now < self.at.saturating_add(HOLD).unwrap_or(Timestamp::MAX)
    }
}

fn in_window(at: Timestamp, now: Timestamp) -> bool {
    let since = now.saturating_sub(WINDOW).unwrap_or(Timestamp::MIN);
    at > since && at <= now
}

/// When each eviction of the last hour was made, over every node's record (an eviction is
/// counted once, however many records name it).
pub fn evictions(records: &[DefragRecord], now: Timestamp) -> Vec<Timestamp> {
    let mut seen = std::collections::BTreeSet::new();
    records
        .iter()
        .flat_map(|r| &r.evicted)
        .filter(|e| in_window(e.at, now) && seen.insert((e.pod.clone(), e.uid.clone(), e.at)))
        .map(|e| e.at)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    fn pods(names: &[&str]) -> Vec<(String, Option<String>)> {
        names
            .iter()
            .map(|n| ((*n).to_owned(), Some(format!("uid-{n}"))))
            .collect()
    }

    #[test]
    fn a_new_record_keeps_the_last_hours_evictions_and_drops_older_ones() {
        let first = DefragRecord::made(
            None,
            "ns/a",
            None,
            &pods(&["ns/x"]),
            at("2026-01-01T10:00:00Z"),
        );
        let second = DefragRecord::made(
            Some(&first),
            "ns/b",
            Some("u"),
            &pods(&["ns/y"]),
            at("2026-01-01T10:30:00Z"),
        );
        assert_eq!(
            second.evicted.len(),
            2,
            "the eviction half an hour ago still counts"
        );
        let third = DefragRecord::made(
            Some(&second),
            "ns/c",
            None,
            &pods(&["ns/z"]),
            at("2026-01-01T11:10:00Z"),
        );
        let kept: Vec<&str> = third.evicted.iter().map(|e| e.pod.as_str()).collect();
        assert_eq!(
            kept,
            ["ns/y", "ns/z"],
            "the eviction over an hour ago is dropped"
        );
    }

    #[test]
    fn evictions_are_counted_once_over_records_and_only_within_the_hour() {
        let now = at("2026-01-01T11:00:00Z");
        let old = DefragRecord::made(
            None,
            "ns/a",
            None,
            &pods(&["ns/x"]),
            at("2026-01-01T09:59:00Z"),
        );
        let recent = DefragRecord::made(
            None,
            "ns/b",
            None,
            &pods(&["ns/y", "ns/w"]),
            at("2026-01-01T10:30:00Z"),
        );
        let copy = recent.clone();
        assert_eq!(evictions(&[old, recent, copy], now).len(), 2);
    }

    #[test]
    fn the_room_is_held_for_that_pod_and_uid_for_the_hold_time_only() {
        let made = at("2026-01-01T10:00:00Z");
        let r = DefragRecord::made(None, "ns/big", Some("u1"), &pods(&["ns/x"]), made);
        assert!(r.holds_for("ns/big", Some("u1"), at("2026-01-01T10:09:59Z")));
        assert!(
            !r.holds_for("ns/big", Some("u2"), made),
            "another pod by that name"
        );
        assert!(!r.holds_for("ns/other", Some("u1"), made));
        assert!(
            !r.holding(at("2026-01-01T10:10:00Z")),
            "the hold ends after HOLD"
        );
    }

    #[test]
    fn a_record_round_trips_through_its_annotation_and_a_bad_one_is_an_error_naming_the_node() {
        let r = DefragRecord::made(
            None,
            "ns/big",
            Some("u1"),
            &pods(&["ns/x"]),
            at("2026-01-01T10:00:00Z"),
        );
        let mut node = crate::testing::k8s_node("n1");
        node.metadata.annotations =
            Some([(names::ANNOTATION_DEFRAG.to_owned(), r.to_annotation())].into());
        assert_eq!(DefragRecord::of(&node).unwrap(), Some(r));
        node.metadata.annotations =
            Some([(names::ANNOTATION_DEFRAG.to_owned(), "{not json".to_owned())].into());
        let e = DefragRecord::of(&node).unwrap_err();
        assert!(
            e.to_string().contains("Node n1") && e.to_string().contains(names::ANNOTATION_DEFRAG)
        );
    }
}
