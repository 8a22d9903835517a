//! Whether what a watch of the node's ResourceSlices saw means they must be published again.
//!
//! The kubelet plugin writes its slices, then watches them (field selector `spec.nodeName`,
//! `spec.driver`). Someone else may delete or edit them: kubelet deletes every slice of its
//! node when it starts and 30 s after a driver's last connection drops, an admin may run
//! `kubectl delete` or `kubectl edit`. Each watch event is judged against the record of what
//! the plugin itself last wrote, as the API server stored it:
//!
//! * an event about the plugin's own write (the recorded `resourceVersion`, the recorded
//!   content, or the content a publication in flight is sending) is [`Verdict::InStep`];
//! * the deletion of a slice the plugin does not keep (its own clean-up of surplus slices, or
//!   a publication in flight that no longer needs it) is [`Verdict::InStep`];
//! * everything else is [`Verdict::Drifted`]: the plugin publishes again.
//!
//! Publishing again never writes blindly: it lists the stored slices and writes only when they
//! differ from what the inventory renders. So a false alarm (a watch event that arrives late,
//! after a newer generation was written) costs one listing, never a write, and the plugin's
//! own writes can never start a loop of rewrites.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Value, json};

/// What the plugin last wrote for one slice, as the API server stored it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrittenSlice {
    /// The stored object's `metadata.resourceVersion`.
    pub resource_version: Option<String>,
    /// The pool generation it carries.
    pub generation: i64,
    /// Its [`fingerprint`].
    pub fingerprint: Value,
    /// The fingerprint of what the plugin sent, when it differs from what was stored (the API
    /// server may add fields, such as a taint's `timeAdded`, or drop them, such as taints
    /// where the `DRADeviceTaints` feature is off).
    pub sent: Option<Value>,
}

impl WrittenSlice {
    /// The record of a stored slice (as the API server answered a write or a listing); `None`
    /// for an object without a name.
    pub fn of(stored: &Value) -> Option<(String, Self)> {
        let name = name(stored)?;
        Some((
            name.to_owned(),
            Self {
                resource_version: resource_version(stored).map(str::to_owned),
                generation: generation(stored),
                fingerprint: fingerprint(stored),
                sent: None,
            },
        ))
    }

    /// The record of `stored`, the API server's answer to the plugin sending `sent`.
    pub fn answering(sent: &Value, stored: &Value) -> Option<(String, Self)> {
        let (name, mut written) = Self::of(stored)?;
        let sent = fingerprint(sent);
        if sent != written.fingerprint {
            written.sent = Some(sent);
        }
        Some((name, written))
    }
}

/// A publication being written: the slices it writes (every other slice of the node and
/// driver is deleted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingWrite {
    /// The [`fingerprint`] of each slice being sent, by name.
    pub keep: BTreeMap<String, Value>,
}

impl PendingWrite {
    /// The publication sending `slices` (JSON by name).
    pub fn sending(slices: &BTreeMap<String, Value>) -> Self {
        Self {
            keep: slices
                .iter()
                .map(|(name, slice)| (name.clone(), fingerprint(slice)))
                .collect(),
        }
    }
}

/// What the plugin published last, and what it is writing now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SliceRecord {
    /// The slices of the last completed publication, by name.
    pub written: BTreeMap<String, WrittenSlice>,
    /// The publication in flight, if any.
    pub pending: Option<PendingWrite>,
}

impl SliceRecord {
    /// The record of a completed publication whose stored slices are `stored`.
    pub fn from_stored<'a>(stored: impl IntoIterator<Item = &'a Value>) -> Self {
        Self {
            written: stored.into_iter().filter_map(WrittenSlice::of).collect(),
            pending: None,
        }
    }
}

/// Whether the stored slice `have` already publishes `want`, the slice the plugin would write:
/// the same [`fingerprint`], or `have` is exactly what the API server stored when the plugin
/// last sent `want` (so a server that adds or drops a field is not rewritten forever).
pub fn publishes(record: Option<&SliceRecord>, want: &Value, have: &Value) -> bool {
    let (want, have_print) = (fingerprint(want), fingerprint(have));
    if want == have_print {
        return true;
    }
    name(have)
        .and_then(|n| record?.written.get(n))
        .is_some_and(|w| w.fingerprint == have_print && w.sent.as_ref() == Some(&want))
}

/// What a watch of the node's slices saw.
#[derive(Debug, Clone, Copy)]
pub enum SliceEvent<'a> {
    /// A complete listing (at the start of a watch, and after the watch was lost).
    Listed(&'a [Value]),
    /// A slice was created or changed (`ADDED`, `MODIFIED`).
    Applied(&'a Value),
    /// A slice was deleted (`DELETED`, with its last state).
    Deleted(&'a Value),
}

/// The judgement of one [`SliceEvent`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The stored slices are what the plugin wrote (or is writing).
    InStep,
    /// They are not, for the reason given: publish again.
    Drifted(String),
}

/// The part of a slice the plugin owns: its spec, labels and owner references. Two slices
/// with equal fingerprints publish the same thing.
pub fn fingerprint(slice: &Value) -> Value {
    json!({
        "spec": slice.get("spec").cloned().unwrap_or(Value::Null),
        "labels": slice.pointer("/metadata/labels").cloned().unwrap_or(Value::Null),
        "ownerReferences": slice
            .pointer("/metadata/ownerReferences")
            .cloned()
            .unwrap_or(Value::Null),
    })
}

fn name(slice: &Value) -> Option<&str> {
    slice.pointer("/metadata/name").and_then(Value::as_str)
}

fn resource_version(slice: &Value) -> Option<&str> {
    slice
        .pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
}

fn generation(slice: &Value) -> i64 {
    slice
        .pointer("/spec/pool/generation")
        .and_then(Value::as_i64)
        .unwrap_or(0)
}

/// Judges `event` against `record`, the plugin's own publications (`None` before the first
/// one completed: that publication is still to come, and it lists what is stored first).
pub fn judge(record: Option<&SliceRecord>, event: SliceEvent<'_>) -> Verdict {
    let Some(record) = record else {
        return Verdict::InStep;
    };
    match event {
        SliceEvent::Applied(slice) => applied(record, slice),
        SliceEvent::Deleted(slice) => deleted(record, slice),
        SliceEvent::Listed(slices) => {
            let listed: BTreeSet<&str> = slices.iter().filter_map(name).collect();
            // While a publication is in flight its slices may not all exist yet: a false
            // alarm here costs one listing after it.
            let missing = match &record.pending {
                Some(pending) => pending.keep.keys().find(|n| !listed.contains(n.as_str())),
                None => record.written.keys().find(|n| !listed.contains(n.as_str())),
            };
            if let Some(missing) = missing {
                return Verdict::Drifted(format!("ResourceSlice {missing} is missing"));
            }
            slices
                .iter()
                .map(|s| applied(record, s))
                .find(|v| *v != Verdict::InStep)
                .unwrap_or(Verdict::InStep)
        }
    }
}

fn applied(record: &SliceRecord, slice: &Value) -> Verdict {
    let Some(name) = name(slice) else {
        return Verdict::InStep;
    };
    // Only the content being sent: someone else's edit that keeps the generation in flight
    // is still an edit. (A server that adds a field to what it stores makes this a false
    // alarm, which costs one listing after the publication.)
    if let Some(pending) = &record.pending
        && pending.keep.get(name) == Some(&fingerprint(slice))
    {
        return Verdict::InStep;
    }
    match record.written.get(name) {
        Some(written) => {
            let same_version = written.resource_version.is_some()
                && written.resource_version.as_deref() == resource_version(slice);
            if same_version || written.fingerprint == fingerprint(slice) {
                Verdict::InStep
            } else {
                Verdict::Drifted(format!("ResourceSlice {name} was changed"))
            }
        }
        None => Verdict::Drifted(format!(
            "ResourceSlice {name} is not one the plugin published"
        )),
    }
}

fn deleted(record: &SliceRecord, slice: &Value) -> Verdict {
    let Some(name) = name(slice) else {
        return Verdict::InStep;
    };
    let kept = match &record.pending {
        Some(pending) => pending.keep.contains_key(name),
        None => record.written.contains_key(name),
    };
    if kept {
        Verdict::Drifted(format!("ResourceSlice {name} was deleted"))
    } else {
        Verdict::InStep
    }
}

#[cfg(test)]
mod tests {

    use super::*;

    fn slice(name: &str, rv: &str, generation: i64, devices: &[&str]) -> Value {
        json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {
                "name": name,
                "resourceVersion": rv,
                "labels": {"app.kubernetes.io/managed-by": "tessera-kubelet-plugin"},
            },
            "spec": {
                "driver": "gpu.tessera.dev",
                "nodeName": "n",
                "pool": {"name": "n", "generation": generation, "resourceSliceCount": 2},
                "devices": devices.iter().map(|d| json!({"name": d})).collect::<Vec<_>>(),
            },
        })
    }

    fn drifted(verdict: &Verdict) -> bool {
        matches!(verdict, Verdict::Drifted(_))
    }

    fn record() -> SliceRecord {
        SliceRecord::from_stored(&[
            slice("n-0", "10", 3, &["gpu-0"]),
            slice("n-1", "11", 3, &["gpu-1"]),
        ])
    }

    #[test]
    fn the_plugins_own_writes_are_in_step() {
        let r = record();
        let own = slice("n-0", "10", 3, &["gpu-0"]);
        assert_eq!(judge(Some(&r), SliceEvent::Applied(&own)), Verdict::InStep);
        // The same content under a later resourceVersion (a no-op update, a new annotation).
        let mut annotated = slice("n-0", "12", 3, &["gpu-0"]);
        annotated["metadata"]["annotations"] = json!({"note": "x"});
        assert_eq!(
            judge(Some(&r), SliceEvent::Applied(&annotated)),
            Verdict::InStep
        );
        let listing = [
            slice("n-0", "10", 3, &["gpu-0"]),
            slice("n-1", "11", 3, &["gpu-1"]),
        ];
        assert_eq!(
            judge(Some(&r), SliceEvent::Listed(&listing)),
            Verdict::InStep
        );
    }

    #[test]
    fn a_deleted_slice_has_drifted() {
        let r = record();
        let gone = slice("n-1", "13", 3, &["gpu-1"]);
        assert_eq!(
            judge(Some(&r), SliceEvent::Deleted(&gone)),
            Verdict::Drifted("ResourceSlice n-1 was deleted".to_owned())
        );
        let listing = [slice("n-0", "10", 3, &["gpu-0"])];
        assert_eq!(
            judge(Some(&r), SliceEvent::Listed(&listing)),
            Verdict::Drifted("ResourceSlice n-1 is missing".to_owned())
        );
    }

    #[test]
    fn an_edited_or_unknown_slice_has_drifted() {
        let r = record();
        let edited = slice("n-0", "14", 3, &["gpu-0", "gpu-9"]);
        assert_eq!(
            judge(Some(&r), SliceEvent::Applied(&edited)),
            Verdict::Drifted("ResourceSlice n-0 was changed".to_owned())
        );
        let mut unlabelled = slice("n-0", "15", 3, &["gpu-0"]);
        unlabelled["metadata"]["labels"] = json!({});
        assert!(drifted(&judge(Some(&r), SliceEvent::Applied(&unlabelled))));
        let stranger = slice("n-7", "16", 3, &[]);
        assert!(drifted(&judge(Some(&r), SliceEvent::Applied(&stranger))));
        let listing = [
            slice("n-0", "10", 3, &["gpu-0"]),
            slice("n-1", "11", 3, &["gpu-1"]),
            stranger,
        ];
        assert!(drifted(&judge(Some(&r), SliceEvent::Listed(&listing))));
    }

    #[test]
    fn a_publication_in_flight_is_not_fought() {
        let mut r = record();
        let newer = slice("n-0", "20", 4, &["gpu-0", "gpu-1"]);
        r.pending = Some(PendingWrite::sending(&BTreeMap::from([(
            "n-0".to_owned(),
            newer.clone(),
        )])));
        // Its own write of generation 4, seen before the answer came back.
        assert_eq!(
            judge(Some(&r), SliceEvent::Applied(&newer)),
            Verdict::InStep
        );
        // Someone's edit of it while the publication is still in flight.
        let edited = slice("n-0", "24", 4, &[]);
        assert!(drifted(&judge(Some(&r), SliceEvent::Applied(&edited))));
        // Its own deletion of the slice it no longer needs.
        let surplus = slice("n-1", "21", 3, &["gpu-1"]);
        assert_eq!(
            judge(Some(&r), SliceEvent::Deleted(&surplus)),
            Verdict::InStep
        );
        // Someone else's generation is not its own.
        let foreign = slice("n-0", "22", 9, &[]);
        assert!(drifted(&judge(Some(&r), SliceEvent::Applied(&foreign))));
        let kept = slice("n-0", "23", 4, &["gpu-0", "gpu-1"]);
        assert!(drifted(&judge(Some(&r), SliceEvent::Deleted(&kept))));
    }

    #[test]
    fn nothing_drifts_before_the_first_publication() {
        let gone = slice("n-1", "13", 3, &["gpu-1"]);
        assert_eq!(judge(None, SliceEvent::Deleted(&gone)), Verdict::InStep);
        assert_eq!(judge(None, SliceEvent::Listed(&[])), Verdict::InStep);
    }

    #[test]
    fn what_the_server_made_of_a_write_publishes_what_was_sent() {
        let sent = slice("n-0", "", 3, &["gpu-0"]);
        let mut stored = slice("n-0", "30", 3, &["gpu-0"]);
        stored["spec"]["devices"][0]["taints"] =
            json!([{"key": "k", "effect": "NoSchedule", "timeAdded": "2026-01-01T00:00:00Z"}]);
        let mut sent_tainted = sent.clone();
        sent_tainted["spec"]["devices"][0]["taints"] =
            json!([{"key": "k", "effect": "NoSchedule"}]);
        let record = SliceRecord {
            written: [WrittenSlice::answering(&sent_tainted, &stored).unwrap()].into(),
            pending: None,
        };
        assert!(publishes(Some(&record), &sent_tainted, &stored));
        // Without the record (a restart) it is written once more.
        assert!(!publishes(None, &sent_tainted, &stored));
        // Another inventory is not published by it.
        assert!(!publishes(Some(&record), &sent, &stored));
        assert!(publishes(None, &sent, &slice("n-0", "31", 3, &["gpu-0"])));
    }

    #[test]
    fn fingerprints_ignore_status_of_metadata() {
        let a = slice("n-0", "10", 3, &["gpu-0"]);
        let mut b = a.clone();
        b["metadata"]["resourceVersion"] = json!("99");
        b["metadata"]["managedFields"] = json!([{"manager": "x"}]);
        assert_eq!(fingerprint(&a), fingerprint(&b));
        b["metadata"]["ownerReferences"] = json!([{"kind": "Node"}]);
        assert_ne!(fingerprint(&a), fingerprint(&b));
    }
}
