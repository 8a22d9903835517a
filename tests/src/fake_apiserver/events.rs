//! Events as the real API server keeps them: one store, served as core v1 `Event`s and as
//! events.k8s.io/v1 `Event`s.
//!
//! The fake stores every Event in the core v1 shape (the shape the API server stores them
//! in) and converts at the edge of the events.k8s.io/v1 API: `regarding` is core's
//! `involvedObject`, `note` its `message`, `reportingController` its `reportingComponent`,
//! and `deprecatedSource`, `deprecatedFirstTimestamp`, `deprecatedLastTimestamp`,
//! `deprecatedCount` its `source`, `firstTimestamp`, `lastTimestamp`, `count`; every other
//! field has one name in both. An Event written through one API reads back through the other.
//!
//! Writes through events.k8s.io/v1 are checked as the API server checks them: a new Event
//! needs `eventTime`, a `type` of `Normal` or `Warning`, `reportingController` (a qualified
//! name), `reportingInstance`, `action` and `reason` (each at most 128 characters), a `note`
//! of at most 1024, and none of the deprecated fields; an `involvedObject` without a
//! namespace only in `default` or `kube-system`; a `series` counts at least 2 and has its
//! `lastObservedTime`. An update (PUT or PATCH: kube-runtime's `Recorder` patches `series`
//! onto an Event it repeats) keeps every field but `series` and the metadata as it was.
//! Writes through core v1 are not checked here, as the API server checks them only loosely.

use serde_json::{Map, Value, json};

use super::StatusError;

/// The events.k8s.io group, served in v1 only.
pub const GROUP: &str = "events.k8s.io";
/// The only version of [`GROUP`] the fake serves.
pub(crate) const VERSION: &str = "v1";

/// (events.k8s.io/v1 name, core v1 name) of every field whose name differs.
const RENAMED: [(&str, &str); 7] = [
    ("regarding", "involvedObject"),
    ("note", "message"),
    ("reportingController", "reportingComponent"),
    ("deprecatedSource", "source"),
    ("deprecatedFirstTimestamp", "firstTimestamp"),
    ("deprecatedLastTimestamp", "lastTimestamp"),
    ("deprecatedCount", "count"),
];

/// The API server's limits on an events.k8s.io/v1 Event's fields, in bytes (Go's `len`).
const REPORTING_INSTANCE_LIMIT: usize = 128;
const ACTION_LIMIT: usize = 128;
const REASON_LIMIT: usize = 128;
const NOTE_LIMIT: usize = 1024;

fn renamed(value: Value, from_events: bool) -> Value {
    let Value::Object(map) = value else {
        return value;
    };
    let out: Map<String, Value> = map
        .into_iter()
        .map(|(k, v)| {
            let name = RENAMED
                .iter()
                .find(|(events, core)| if from_events { *events } else { *core } == k)
                .map_or(k, |(events, core)| {
                    (*if from_events { core } else { events }).to_owned()
                });
            (name, v)
        })
        .collect();
    Value::Object(out)
}

/// An Event (or part of one: a merge patch) written through events.k8s.io/v1, as core v1
/// keeps it.
pub(crate) fn to_core(value: Value) -> Value {
    let mut core = renamed(value, true);
    if let Some(Value::String(v)) = core.get_mut("apiVersion") {
        "v1".clone_into(v);
    }
    core
}

/// A stored Event (or a list of them) as events.k8s.io/v1 serves it.
pub(crate) fn from_core(value: Value) -> Value {
    let mut value = value;
    if let Some(Value::Array(items)) = value.get_mut("items") {
        for item in items.iter_mut() {
            *item = from_core(std::mem::take(item));
        }
        return value;
    }
    let mut event = renamed(value, false);
    if let Value::Object(map) = &mut event {
        map.insert("apiVersion".to_owned(), json!(format!("{GROUP}/{VERSION}")));
        map.insert("kind".to_owned(), json!("Event"));
        // The API server leaves out what an events.k8s.io/v1 Event does not set.
        map.retain(|_, v| !v.is_null() && *v != json!({}));
    }
    event
}

/// A JSON patch's operations with their paths in core v1's field names.
pub(crate) fn json_patch_to_core(patch: Value) -> Value {
    let Value::Array(ops) = patch else {
        return patch;
    };
    let rename = |path: &str| -> String {
        let mut parts = path.splitn(3, '/');
        let (Some(""), Some(first)) = (parts.next(), parts.next()) else {
            return path.to_owned();
        };
        let first = RENAMED
            .iter()
            .find(|(events, _)| *events == first)
            .map_or(first, |(_, core)| core);
        match parts.next() {
            Some(rest) => format!("/{first}/{rest}"),
            None => format!("/{first}"),
        }
    };
    Value::Array(
        ops.into_iter()
            .map(|mut op| {
                for field in ["path", "from"] {
                    if let Some(Value::String(p)) = op.get_mut(field) {
                        *p = rename(p);
                    }
                }
                op
            })
            .collect(),
    )
}

fn text<'a>(event: &'a Value, field: &str) -> &'a str {
    event.get(field).and_then(Value::as_str).unwrap_or("")
}

fn is_set(event: &Value, field: &str) -> bool {
    match event.get(field) {
        None | Some(Value::Null) => false,
        Some(Value::Object(m)) => m.values().any(|v| !v.is_null() && *v != json!("")),
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Number(n)) => n.as_i64() != Some(0),
        Some(_) => true,
    }
}

/// Whether `name` is a Kubernetes qualified name: an optional DNS-subdomain prefix and `/`,
/// then at most 63 alphanumerics, `-`, `_` or `.`, starting and ending alphanumeric.
fn is_qualified_name(name: &str) -> bool {
    let (prefix, local) = match name.split_once('/') {
        Some((p, l)) => (Some(p), l),
        None => (None, name),
    };
    let prefix_ok = prefix.is_none_or(|p| {
        !p.is_empty()
            && p.len() <= 253
            && p.split('.').all(|label| {
                !label.is_empty()
                    && label.len() <= 63
                    && label
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                    && !label.starts_with('-')
                    && !label.ends_with('-')
            })
    });
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    prefix_ok
        && !local.is_empty()
        && local.len() <= 63
        && edge(local.chars().next())
        && edge(local.chars().last())
        && local
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// What the API server says of every events.k8s.io/v1 Event written (core field names in,
/// events.k8s.io/v1 field names in the messages).
fn common(event: &Value, problems: &mut Vec<String>) {
    let namespace = event
        .pointer("/metadata/namespace")
        .and_then(Value::as_str)
        .unwrap_or("");
    let regarding_namespace = event
        .pointer("/involvedObject/namespace")
        .and_then(Value::as_str)
        .unwrap_or("");
    if regarding_namespace.is_empty() && namespace != "default" && namespace != "kube-system" {
        problems.push(
            "regarding.namespace: Invalid value: \"\": does not match event.namespace".to_owned(),
        );
    }
    let controller = text(event, "reportingComponent");
    if controller.is_empty() {
        problems.push("reportingController: Required value".to_owned());
    } else if !is_qualified_name(controller) {
        problems.push(format!(
            "reportingController: Invalid value: {controller:?}: must be a qualified name"
        ));
    }
    for (field, core, limit) in [
        (
            "reportingInstance",
            "reportingInstance",
            REPORTING_INSTANCE_LIMIT,
        ),
        ("action", "action", ACTION_LIMIT),
        ("reason", "reason", REASON_LIMIT),
    ] {
        let value = text(event, core);
        if value.is_empty() {
            problems.push(format!("{field}: Required value"));
        } else if value.len() > limit {
            problems.push(format!(
                "{field}: Invalid value: \"\": can have at most {limit} characters"
            ));
        }
    }
    if text(event, "message").len() > NOTE_LIMIT {
        problems.push(format!(
            "note: Invalid value: \"\": can have at most {NOTE_LIMIT} characters"
        ));
    }
    if let Some(series) = event.get("series").filter(|s| !s.is_null()) {
        if series.get("count").and_then(Value::as_i64).unwrap_or(0) < 2 {
            problems.push("series.count: Invalid value: should be at least 2".to_owned());
        }
        if !is_set(series, "lastObservedTime") {
            problems.push("series.lastObservedTime: Required value".to_owned());
        }
    }
}

fn invalid(event: &Value, problems: &[String]) -> Result<(), StatusError> {
    if problems.is_empty() {
        return Ok(());
    }
    let name = event
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("");
    Err(StatusError::new(
        422,
        "Invalid",
        format!(
            "Event.{GROUP} {name:?} is invalid: [{}]",
            problems.join(", ")
        ),
    ))
}

/// Checks an Event created through events.k8s.io/v1 (`event` in core v1 field names).
pub(crate) fn check_create(event: &Value) -> Result<(), StatusError> {
    let mut problems = Vec::new();
    common(event, &mut problems);
    if !is_set(event, "eventTime") {
        problems.push("eventTime: Required value".to_owned());
    }
    let kind = text(event, "type");
    if kind != "Normal" && kind != "Warning" {
        problems.push(format!(
            "type: Invalid value: {kind:?}: must be Normal or Warning"
        ));
    }
    for (events, core) in RENAMED.iter().filter(|(e, _)| e.starts_with("deprecated")) {
        if is_set(event, core) {
            problems.push(format!("{events}: Invalid value: \"\": needs to be unset"));
        }
    }
    invalid(event, &problems)
}

/// Checks an update through events.k8s.io/v1 of `old` to `new` (both in core v1 field names):
/// only `series` and the metadata change.
pub(crate) fn check_update(new: &Value, old: &Value) -> Result<(), StatusError> {
    let mut problems = Vec::new();
    common(new, &mut problems);
    let immutable = [
        "involvedObject",
        "reason",
        "message",
        "source",
        "firstTimestamp",
        "lastTimestamp",
        "count",
        "type",
        "eventTime",
        "action",
        "related",
        "reportingComponent",
        "reportingInstance",
    ];
    for core in immutable {
        let unset = |e: &Value| !is_set(e, core);
        if new.get(core) != old.get(core) && !(unset(new) && unset(old)) {
            let field = RENAMED
                .iter()
                .find(|(_, c)| *c == core)
                .map_or(core, |(e, _)| e);
            problems.push(format!("{field}: Invalid value: field is immutable"));
        }
    }
    invalid(new, &problems)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_reads_the_same_through_both_apis() {
        let written = json!({
            "apiVersion": "events.k8s.io/v1",
            "kind": "Event",
            "metadata": {"name": "p.1", "namespace": "ns"},
            "regarding": {"kind": "Pod", "name": "p", "namespace": "ns"},
            "note": "why",
            "reason": "Why",
            "reportingController": "tessera-controller",
        });
        let core = to_core(written.clone());
        assert_eq!(core["apiVersion"], "v1");
        assert_eq!(core["involvedObject"]["name"], "p");
        assert_eq!(core["message"], "why");
        assert_eq!(core["reportingComponent"], "tessera-controller");
        assert_eq!(from_core(core), written);
    }

    #[test]
    fn qualified_names_are_checked_as_kubernetes_checks_them() {
        for good in [
            "tessera-controller",
            "gpu.tessera.dev/controller",
            "a",
            "A_b.c",
        ] {
            assert!(is_qualified_name(good), "{good}");
        }
        for bad in ["", "-a", "a-", "a b", "/a", "Gpu.dev/a", &"a".repeat(64)] {
            assert!(!is_qualified_name(bad), "{bad}");
        }
    }

    #[test]
    fn json_patch_paths_name_core_fields() {
        let patch = json!([{"op": "replace", "path": "/series/count", "value": 3},
                           {"op": "replace", "path": "/note", "value": "x"}]);
        let core = json_patch_to_core(patch);
        assert_eq!(core[0]["path"], "/series/count");
        assert_eq!(core[1]["path"], "/message");
    }
}
