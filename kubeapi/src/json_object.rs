//! The object type watches and the controller's claim writes decode into: the object's JSON
//! read straight from the response, `metadata.managedFields` skipped while reading (never
//! built), plus the few metadata fields kube-runtime's watcher reads itself (name, namespace,
//! resourceVersion).
//!
//! kube's `DynamicObject` would read the same object three times: its flattened body is first
//! buffered as serde's generic content, then parsed into a typed `ObjectMeta` (managedFields
//! included) and a `serde_json::Value`, and the metadata then has to be written out as JSON
//! again. On a real control plane, where every object carries managedFields and every pod
//! sees several updates (the controller's own writes echoed back, kube-scheduler's status
//! patches and binding, the claim controller's status), that was a large part of the
//! controller's CPU per pod (docs/controller.md, "CPU on a real control plane").

use std::borrow::Cow;
use std::fmt;

use kube::core::{ApiResource, DynamicResourceScope, ObjectMeta, Resource};
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::{Map, Value};

/// One object as the API server sent it, less `metadata.managedFields`; see the module docs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JsonObject {
    /// What the watcher reads: name, namespace and resourceVersion (copies of the JSON's).
    metadata: ObjectMeta,
    /// The whole object but `metadata.managedFields`.
    object: Map<String, Value>,
}

impl JsonObject {
    /// The object's JSON, with `apiVersion` and `kind` filled in from `api` where it came
    /// without them (list items do; decoders need them).
    pub fn into_value(self, api: &ApiResource) -> Value {
        let mut object = self.object;
        if !object.contains_key("apiVersion") || !object.contains_key("kind") {
            object.insert(
                "apiVersion".to_owned(),
                Value::String(api.api_version.clone()),
            );
            object.insert("kind".to_owned(), Value::String(api.kind.clone()));
        }
        Value::Object(object)
    }
}

impl<'de> de::Deserialize<'de> for JsonObject {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(ObjectVisitor)
    }
}

/// Reads the object's top level: `metadata` through [`MetadataSeed`], the rest as JSON.
struct ObjectVisitor;

impl<'de> Visitor<'de> for ObjectVisitor {
    type Value = JsonObject;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a Kubernetes object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<JsonObject, A::Error> {
        let mut object = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let value = if key == "metadata" {
                map.next_value_seed(MetadataSeed)?
            } else {
                map.next_value::<Value>()?
            };
            object.insert(key, value);
        }
        let text = |field: &str| {
            object
                .get("metadata")
                .and_then(|m| m.get(field))
                .and_then(Value::as_str)
                .map(str::to_owned)
        };
        let metadata = ObjectMeta {
            name: text("name"),
            namespace: text("namespace"),
            resource_version: text("resourceVersion"),
            ..ObjectMeta::default()
        };
        Ok(JsonObject { metadata, object })
    }
}

/// Reads an object's metadata as JSON, skipping `managedFields` without building it.
struct MetadataSeed;

impl<'de> DeserializeSeed<'de> for MetadataSeed {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for MetadataSeed {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("object metadata")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut metadata = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if key == "managedFields" {
                map.next_value::<IgnoredAny>()?;
            } else {
                let value = map.next_value::<Value>()?;
                metadata.insert(key, value);
            }
        }
        Ok(Value::Object(metadata))
    }
}

impl Resource for JsonObject {
    type DynamicType = ApiResource;
    type Scope = DynamicResourceScope;

    fn kind(api: &ApiResource) -> Cow<'_, str> {
        api.kind.as_str().into()
    }

    fn group(api: &ApiResource) -> Cow<'_, str> {
        api.group.as_str().into()
    }

    fn version(api: &ApiResource) -> Cow<'_, str> {
        api.version.as_str().into()
    }

    fn api_version(api: &ApiResource) -> Cow<'_, str> {
        api.api_version.as_str().into()
    }

    fn plural(api: &ApiResource) -> Cow<'_, str> {
        api.plural.as_str().into()
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests {

    use super::*;
    use kube::api::{ObjectList, WatchEvent};
    use serde_json::json;

    fn slices() -> ApiResource {
        crate::resource(
            tessera_driver::apiversion::ApiVersion::V1,
            tessera_driver::names::RESOURCE_SLICE,
        )
    }

    #[test]
    fn a_watch_event_becomes_its_json_without_managed_fields() {
        let line = r#"{"type":"MODIFIED","object":{"apiVersion":"resource.k8s.io/v1","kind":"ResourceSlice","metadata":{"name":"s","resourceVersion":"7","managedFields":[{"manager":"kubelet","fieldsV1":{"f:spec":{".":{}}}}],"labels":{"a":"b"}},"spec":{"driver":"gpu.tessera.dev"}}}"#;
        let WatchEvent::Modified(body) =
            serde_json::from_str::<WatchEvent<JsonObject>>(line).unwrap()
        else {
            panic!("a modification");
        };
        assert_eq!(body.meta().resource_version.as_deref(), Some("7"));
        assert_eq!(body.meta().name.as_deref(), Some("s"));
        assert_eq!(
            body.into_value(&slices()),
            json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                   "metadata": {"name": "s", "resourceVersion": "7", "labels": {"a": "b"}},
                   "spec": {"driver": "gpu.tessera.dev"}})
        );
    }

    #[test]
    fn list_items_get_their_type_from_the_resource() {
        let list = r#"{"apiVersion":"resource.k8s.io/v1","kind":"ResourceSliceList","metadata":{"resourceVersion":"9"},"items":[{"metadata":{"name":"s","namespace":"ns","resourceVersion":"8","managedFields":[]},"spec":{}}]}"#;
        let list: ObjectList<JsonObject> = serde_json::from_str(list).unwrap();
        let body = list.items.into_iter().next().unwrap();
        assert_eq!(body.meta().namespace.as_deref(), Some("ns"));
        assert_eq!(
            body.into_value(&slices()),
            json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                   "metadata": {"name": "s", "namespace": "ns", "resourceVersion": "8"},
                   "spec": {}})
        );
    }

    #[test]
    fn a_body_that_is_not_an_object_is_an_error() {
        assert!(serde_json::from_str::<JsonObject>("[1]").is_err());
        assert!(serde_json::from_str::<JsonObject>(r#"{"metadata": 3}"#).is_err());
    }
}
