//! The fake API server's object store: objects as JSON, one global resourceVersion counter,
//! and an event log that watches replay from.

use std::collections::{BTreeMap, VecDeque};

use serde_json::{Value, json};

use super::{Kind, Verb};

/// An error answered as a `metav1.Status`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusError {
    /// HTTP status code.
    pub code: u16,
    /// `reason`, e.g. `Conflict`.
    pub reason: &'static str,
    /// Human-readable message.
    pub message: String,
}

impl StatusError {
    pub(crate) fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            reason,
            message: message.into(),
        }
    }

    pub(crate) fn not_found(kind: &Kind, name: &str) -> Self {
        Self::new(
            404,
            "NotFound",
            format!("{}.{} {name:?} not found", kind.resource, kind.group),
        )
    }

    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message)
    }

    /// The `metav1.Status` body.
    pub fn to_status(&self) -> Value {
        json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        })
    }
}

/// One change, as a watch sends it.
#[derive(Debug, Clone)]
pub(crate) struct Event {
    pub(crate) rv: u64,
    pub(crate) resource: &'static str,
    pub(crate) namespace: Option<String>,
    pub(crate) kind: &'static str,
    pub(crate) object: Value,
}

type Key = (&'static str, Option<String>, String);

/// A recorded request, for tests to assert on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedRequest {
    /// What was done.
    pub verb: Verb,
    /// The resource, with `/status` for the subresource.
    pub resource: String,
    /// The object's name, if the request named one.
    pub name: Option<String>,
    /// The HTTP status code answered.
    pub code: u16,
}

#[derive(Debug, Default)]
pub(crate) struct Store {
    pub(crate) rv: u64,
    objects: BTreeMap<Key, Value>,
    pub(crate) events: Vec<Event>,
    uid_counter: u64,
    pub(crate) faults: BTreeMap<(Verb, String), VecDeque<u16>>,
    pub(crate) requests: Vec<RecordedRequest>,
    /// Whether writes record `metadata.managedFields`, as a real server does.
    pub(crate) managed_fields: bool,
    /// Creation and deletion timestamps from the wall clock instead of the fixed time.
    pub(crate) wall_clock: bool,
    /// Who the write being carried out comes from (its `User-Agent`), for `managedFields`.
    pub(crate) manager: String,
}

/// The `fieldsV1` set of a JSON value: every field as `f:<name>`, list items as `i:<index>`,
/// leaves as `{}` (the shape, and about the size, of what a real API server records).
pub fn fields_v1(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| (format!("f:{k}"), fields_v1(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Object(
            items
                .iter()
                .enumerate()
                .map(|(i, v)| (format!("i:{i}"), fields_v1(v)))
                .collect(),
        ),
        _ => json!({}),
    }
}

impl Store {
    /// Records who wrote what in `metadata.managedFields` (one entry per manager, operation
    /// and subresource, replaced by that manager's next write), when enabled.
    fn manage(&self, object: &mut Value, old: Option<&Value>, subresource: Option<&str>) {
        if !self.managed_fields {
            return;
        }
        let mut entries: Vec<Value> = old
            .and_then(|o| o.pointer("/metadata/managedFields"))
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let manager = if self.manager.is_empty() {
            "unknown"
        } else {
            self.manager.as_str()
        };
        let operation = "Update";
        entries.retain(|e| {
            !(e["manager"] == manager
                && e["operation"] == operation
                && e.get("subresource").and_then(Value::as_str) == subresource)
        });
        let mut written = object.clone();
        if let Some(Value::Object(meta)) = written.get_mut("metadata") {
            meta.retain(|k, _| {
                matches!(
                    k.as_str(),
                    "labels" | "annotations" | "finalizers" | "ownerReferences"
                )
            });
        }
        let mut entry = json!({
            "manager": manager,
            "operation": operation,
            "apiVersion": object.get("apiVersion").cloned().unwrap_or(Value::Null),
            "time": now(),
            "fieldsType": "FieldsV1",
            "fieldsV1": fields_v1(&written),
        });
        if let Some(sub) = subresource {
            entry["subresource"] = json!(sub);
        }
        entries.push(entry);
        set_meta(object, "managedFields", Value::Array(entries));
    }
}

fn meta_str<'a>(object: &'a Value, field: &str) -> Option<&'a str> {
    object
        .get("metadata")
        .and_then(|m| m.get(field))
        .and_then(Value::as_str)
}

fn set_meta(object: &mut Value, field: &str, value: Value) {
    if let Some(Value::Object(meta)) = object.get_mut("metadata") {
        meta.insert(field.to_owned(), value);
    }
}

fn has_finalizers(object: &Value) -> bool {
    object
        .pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .is_some_and(|f| !f.is_empty())
}

/// The fixed timestamp: tests compare stored objects, and wall-clock time would not help them.
const FIXED_TIME: &str = "2026-01-01T00:00:00Z";

fn now() -> String {
    FIXED_TIME.to_owned()
}

impl Store {
    /// A creation or deletion timestamp ([`Store::wall_clock`]).
    fn timestamp(&self) -> String {
        if self.wall_clock {
            // Whole seconds, as the API server writes them.
            let clock = k8s_openapi::jiff::Timestamp::now();
            k8s_openapi::jiff::Timestamp::from_second(clock.as_second())
                .map_or_else(|_| now(), |t| t.to_string())
        } else {
            now()
        }
    }

    fn bump(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    fn record(
        &mut self,
        kind: &Kind,
        namespace: Option<&String>,
        event: &'static str,
        object: &Value,
    ) {
        self.events.push(Event {
            rv: self.rv,
            resource: kind.resource,
            namespace: namespace.cloned(),
            kind: event,
            object: object.clone(),
        });
    }

    pub(crate) fn get(
        &self,
        kind: &Kind,
        namespace: Option<&String>,
        name: &str,
    ) -> Result<Value, StatusError> {
        self.objects
            .get(&(kind.resource, namespace.cloned(), name.to_owned()))
            .cloned()
            .ok_or_else(|| StatusError::not_found(kind, name))
    }

    /// Objects of `kind`, in `namespace` when given, in key order.
    pub(crate) fn names_where(
        &self,
        kind: &Kind,
        predicate: impl Fn(&Value) -> bool,
    ) -> Vec<String> {
        self.objects
            .iter()
            .filter(|((r, _, _), v)| *r == kind.resource && predicate(v))
            .map(|((_, _, name), _)| name.clone())
            .collect()
    }

    pub(crate) fn list(&self, kind: &Kind, namespace: Option<&String>) -> Vec<Value> {
        self.objects
            .iter()
            .filter(|((r, ns, _), _)| {
                *r == kind.resource && (namespace.is_none() || ns.as_ref() == namespace)
            })
            .map(|(_, v)| v.clone())
            .collect()
    }

    pub(crate) fn create(
        &mut self,
        kind: &Kind,
        namespace: Option<&String>,
        mut object: Value,
    ) -> Result<Value, StatusError> {
        if !object.is_object() {
            return Err(StatusError::bad_request("the body is not an object"));
        }
        if !object.get("metadata").is_some_and(Value::is_object) {
            object["metadata"] = json!({});
        }
        let name = match (meta_str(&object, "name"), meta_str(&object, "generateName")) {
            (Some(n), _) if !n.is_empty() => n.to_owned(),
            (_, Some(prefix)) => {
                self.uid_counter += 1;
                format!("{prefix}{:05x}", self.uid_counter)
            }
            _ => {
                return Err(StatusError::new(
                    422,
                    "Invalid",
                    "metadata.name: Required value",
                ));
            }
        };
        let key = (kind.resource, namespace.cloned(), name.clone());
        if self.objects.contains_key(&key) {
            return Err(StatusError::new(
                409,
                "AlreadyExists",
                format!("{}.{} {name:?} already exists", kind.resource, kind.group),
            ));
        }
        self.uid_counter += 1;
        let rv = self.bump();
        set_meta(&mut object, "name", json!(name));
        if let Some(ns) = namespace {
            set_meta(&mut object, "namespace", json!(ns));
        }
        set_meta(
            &mut object,
            "uid",
            json!(format!("00000000-0000-4000-8000-{:012x}", self.uid_counter)),
        );
        set_meta(&mut object, "resourceVersion", json!(rv.to_string()));
        set_meta(&mut object, "creationTimestamp", json!(self.timestamp()));
        set_meta(&mut object, "generation", json!(1));
        if kind.has_status
            && let Value::Object(map) = &mut object
        {
            // Status is written through its subresource only.
            map.remove("status");
        }
        self.manage(&mut object, None, None);
        self.record(kind, namespace, "ADDED", &object);
        self.objects.insert(key, object.clone());
        Ok(object)
    }

    /// Binds a pod as `pods/<name>/binding` does: sets `spec.nodeName` to the binding's
    /// target. A pod already bound, or still carrying scheduling gates, or whose UID is not
    /// the binding's, is a 409 Conflict.
    pub(crate) fn bind(
        &mut self,
        kind: &Kind,
        namespace: Option<&String>,
        name: &str,
        binding: &Value,
    ) -> Result<(), StatusError> {
        let mut pod = self.get(kind, namespace, name)?;
        let conflict = |why: String| {
            StatusError::new(
                409,
                "Conflict",
                format!("Operation cannot be fulfilled on pods/binding {name:?}: {why}"),
            )
        };
        let Some(node) = binding.pointer("/target/name").and_then(Value::as_str) else {
            return Err(StatusError::new(
                422,
                "Invalid",
                "target.name: Required value",
            ));
        };
        if let Some(uid) = binding.pointer("/metadata/uid").and_then(Value::as_str)
            && Some(uid) != meta_str(&pod, "uid")
        {
            return Err(conflict(format!("the pod's UID is not {uid}")));
        }
        if let Some(bound) = pod.pointer("/spec/nodeName").and_then(Value::as_str) {
            return Err(conflict(format!(
                "pod {name} is already assigned to node {bound:?}"
            )));
        }
        if pod
            .pointer("/spec/schedulingGates")
            .and_then(Value::as_array)
            .is_some_and(|g| !g.is_empty())
        {
            return Err(conflict(format!(
                "pod {name} has non-empty .spec.schedulingGates"
            )));
        }
        pod["spec"]["nodeName"] = json!(node);
        self.update(kind, namespace, name, pod, false).map(|_| ())
    }

    /// Replaces an object (or, with `status`, only its status), checking the
    /// resourceVersion precondition when the new object carries one.
    pub(crate) fn update(
        &mut self,
        kind: &Kind,
        namespace: Option<&String>,
        name: &str,
        mut object: Value,
        status: bool,
    ) -> Result<Value, StatusError> {
        let old = self.get(kind, namespace, name)?;
        if !object.is_object() {
            return Err(StatusError::bad_request("the body is not an object"));
        }
        if let Some(body_name) = meta_str(&object, "name")
            && body_name != name
        {
            return Err(StatusError::bad_request(format!(
                "the name in the body ({body_name}) does not match the URL ({name})"
            )));
        }
        if let Some(rv) = meta_str(&object, "resourceVersion")
            && !rv.is_empty()
            && Some(rv) != meta_str(&old, "resourceVersion")
        {
            return Err(StatusError::new(
                409,
                "Conflict",
                format!(
                    "Operation cannot be fulfilled on {}.{} {name:?}: the object has been \
                     modified; please apply your changes to the latest version and try again",
                    kind.resource, kind.group
                ),
            ));
        }
        let mut new = if status {
            let mut kept = old.clone();
            kept["status"] = object.get("status").cloned().unwrap_or(Value::Null);
            kept
        } else {
            if !object.get("metadata").is_some_and(Value::is_object) {
                object["metadata"] = json!({});
            }
            if kind.has_status
                && let Value::Object(map) = &mut object
            {
                match old.get("status") {
                    Some(s) => {
                        map.insert("status".to_owned(), s.clone());
                    }
                    None => {
                        map.remove("status");
                    }
                }
            }
            for field in [
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "namespace",
                "name",
            ] {
                if let Some(v) = old.get("metadata").and_then(|m| m.get(field)) {
                    set_meta(&mut object, field, v.clone());
                }
            }
            let generation = old
                .pointer("/metadata/generation")
                .and_then(Value::as_i64)
                .unwrap_or(1);
            let changed = old.get("spec") != object.get("spec");
            set_meta(
                &mut object,
                "generation",
                json!(if changed { generation + 1 } else { generation }),
            );
            object
        };
        if new.get("status").is_some_and(Value::is_null)
            && let Value::Object(map) = &mut new
        {
            map.remove("status");
        }
        let rv = self.bump();
        set_meta(&mut new, "resourceVersion", json!(rv.to_string()));
        self.manage(&mut new, Some(&old), status.then_some("status"));
        if new.pointer("/metadata/deletionTimestamp").is_some() && !has_finalizers(&new) {
            // The last finalizer of an object being deleted is gone: the object goes.
            self.objects
                .remove(&(kind.resource, namespace.cloned(), name.to_owned()));
            self.record(kind, namespace, "DELETED", &new);
            return Ok(new);
        }
        self.record(kind, namespace, "MODIFIED", &new);
        self.objects.insert(
            (kind.resource, namespace.cloned(), name.to_owned()),
            new.clone(),
        );
        Ok(new)
    }

    pub(crate) fn delete(
        &mut self,
        kind: &Kind,
        namespace: Option<&String>,
        name: &str,
    ) -> Result<Value, StatusError> {
        let key = (kind.resource, namespace.cloned(), name.to_owned());
        let at = self.timestamp();
        if let Some(object) = self.objects.get_mut(&key)
            && has_finalizers(object)
        {
            // Finalizers hold the object: it is only marked for deletion.
            if object.pointer("/metadata/deletionTimestamp").is_some() {
                return Ok(object.clone());
            }
            set_meta(object, "deletionTimestamp", json!(at));
            let mut object = object.clone();
            let rv = self.bump();
            set_meta(&mut object, "resourceVersion", json!(rv.to_string()));
            self.record(kind, namespace, "MODIFIED", &object);
            self.objects.insert(key, object.clone());
            return Ok(object);
        }
        let mut object = self
            .objects
            .remove(&key)
            .ok_or_else(|| StatusError::not_found(kind, name))?;
        let rv = self.bump();
        set_meta(&mut object, "resourceVersion", json!(rv.to_string()));
        self.record(kind, namespace, "DELETED", &object);
        Ok(object)
    }

    /// The next queued fault for `verb` on `resource`, if any.
    pub(crate) fn take_fault(&mut self, verb: Verb, resource: &str) -> Option<u16> {
        let queue = self.faults.get_mut(&(verb, resource.to_owned()))?;
        let code = queue.pop_front();
        if queue.is_empty() {
            self.faults.remove(&(verb, resource.to_owned()));
        }
        code
    }
}
