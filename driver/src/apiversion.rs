//! Reading and writing resource.k8s.io objects in every API version Tessera serves.
//!
//! The canonical model is resource.k8s.io/v1 (`k8s_openapi::api::resource::v1`). Documents in
//! v1beta2 (structurally the same as v1) and v1beta1 (device fields nested under `basic`,
//! request fields flat instead of under `exactly`, `nodeName`/`allNodes` as plain values) are
//! converted to v1 on the way in, following the upstream conversion rules; `ResourceSlices` are
//! converted back on the way out for API servers older than 1.34.

use std::fmt;

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::resource::{v1, v1beta1, v1beta2};
use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::names;

mod allocation;
pub mod nesting;
pub mod validate;

pub use allocation::encode_allocation;

/// A served version of the resource.k8s.io API group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ApiVersion {
    /// `resource.k8s.io/v1`, Kubernetes 1.34 and later.
    V1,
    /// `resource.k8s.io/v1beta2`, Kubernetes 1.33.
    V1beta2,
    /// `resource.k8s.io/v1beta1`, Kubernetes 1.32.
    V1beta1,
}

impl ApiVersion {
    /// Every version, newest first (the order to prefer when an API server serves several).
    pub const ALL: [Self; 3] = [Self::V1, Self::V1beta2, Self::V1beta1];

    /// The `apiVersion` string, e.g. `resource.k8s.io/v1`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::V1 => names::RESOURCE_API_V1,
            Self::V1beta2 => names::RESOURCE_API_V1BETA2,
            Self::V1beta1 => names::RESOURCE_API_V1BETA1,
        }
    }

    /// The version an `apiVersion` string names, if Tessera serves it.
    pub fn from_api_version(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|v| v.as_str() == s)
    }
}

impl fmt::Display for ApiVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for ApiVersion {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::from_api_version(s).ok_or_else(|| Error::Decode {
            context: "apiVersion".into(),
            message: format!(
                "{s:?} is not a served version; expected one of {}",
                supported()
            ),
        })
    }
}

fn supported() -> String {
    ApiVersion::ALL
        .iter()
        .map(|v| v.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// A decoded document, always in its v1 shape.
#[derive(Debug, Clone, PartialEq)]
#[allow(
    clippy::large_enum_variant,
    reason = "built once per input document and matched at once; boxing would burden every caller"
)]
pub enum Object {
    /// A `DeviceClass`.
    DeviceClass(v1::DeviceClass),
    /// A `ResourceSlice`.
    ResourceSlice(v1::ResourceSlice),
    /// A `ResourceClaim`.
    ResourceClaim(v1::ResourceClaim),
    /// A `ResourceClaimTemplate`.
    ResourceClaimTemplate(v1::ResourceClaimTemplate),
    /// A core v1 `Node`.
    Node(core::Node),
    /// A core v1 `Pod`.
    Pod(core::Pod),
}

impl Object {
    /// The object's kind, e.g. `ResourceClaim`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::DeviceClass(_) => "DeviceClass",
            Self::ResourceSlice(_) => "ResourceSlice",
            Self::ResourceClaim(_) => "ResourceClaim",
            Self::ResourceClaimTemplate(_) => "ResourceClaimTemplate",
            Self::Node(_) => "Node",
            Self::Pod(_) => "Pod",
        }
    }

    /// The object's metadata.
    pub fn metadata(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        match self {
            Self::DeviceClass(o) => &o.metadata,
            Self::ResourceSlice(o) => &o.metadata,
            Self::ResourceClaim(o) => &o.metadata,
            Self::ResourceClaimTemplate(o) => &o.metadata,
            Self::Node(o) => &o.metadata,
            Self::Pod(o) => &o.metadata,
        }
    }
}

/// `Kind namespace/name` (or `Kind name`) from a raw document, for error messages.
fn describe(doc: &Map<String, Value>, kind: &str) -> String {
    let meta = doc.get("metadata").and_then(Value::as_object);
    let field = |k: &str| meta.and_then(|m| m.get(k)).and_then(Value::as_str);
    match (field("namespace"), field("name").or(field("generateName"))) {
        (Some(ns), Some(name)) => format!("{kind} {ns}/{name}"),
        (None, Some(name)) => format!("{kind} {name}"),
        _ => format!("{kind} (unnamed)"),
    }
}

fn typed<T: serde::de::DeserializeOwned>(doc: Value, context: &str) -> Result<T> {
    serde_path_to_error::deserialize(doc).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        Error::Decode {
            context: context.to_owned(),
            message: if path == "." {
                inner.to_string()
            } else {
                format!("{path}: {inner}")
            },
        }
    })
}

/// Decodes one Kubernetes document (already parsed from YAML or JSON) into its v1 shape.
///
/// Accepts resource.k8s.io v1, v1beta2 and v1beta1 `DeviceClass`, `ResourceSlice`,
/// `ResourceClaim` and `ResourceClaimTemplate`, and core v1 `Node` and `Pod`. Errors are
/// [`Error::Decode`] whose context names `context` (e.g. the file) and the object, and whose
/// message names the field path.
pub fn decode_document(doc: Value, context: &str) -> Result<Object> {
    let Value::Object(mut map) = doc else {
        return Err(Error::Decode {
            context: context.to_owned(),
            message: format!("expected a Kubernetes object, found {}", value_kind(&doc)),
        });
    };
    let text = |key: &str| map.get(key).and_then(Value::as_str).map(str::to_owned);
    let (Some(api_version), Some(kind)) = (text("apiVersion"), text("kind")) else {
        return Err(Error::Decode {
            context: format!("{context}: {}", describe(&map, "object")),
            message: "apiVersion and kind must both be set (strings)".to_owned(),
        });
    };
    let ctx = format!("{context}: {} ({api_version})", describe(&map, &kind));
    if api_version == names::CORE_API_V1 {
        return match kind.as_str() {
            "Node" => typed(Value::Object(map), &ctx).map(Object::Node),
            "Pod" => typed(Value::Object(map), &ctx).map(Object::Pod),
            _ => Err(unsupported(&ctx, &api_version, &kind)),
        };
    }
    let Some(version) = ApiVersion::from_api_version(&api_version) else {
        return Err(unsupported(&ctx, &api_version, &kind));
    };
    if !matches!(
        kind.as_str(),
        "DeviceClass" | "ResourceSlice" | "ResourceClaim" | "ResourceClaimTemplate"
    ) {
        return Err(unsupported(&ctx, &api_version, &kind));
    }
    if version == ApiVersion::V1beta1 {
        // Decode in the document's own shape first, so errors name the fields as written.
        let doc = Value::Object(map);
        let normalized = match kind.as_str() {
            "DeviceClass" => to_value::<v1beta1::DeviceClass>(doc, &ctx)?,
            "ResourceSlice" => to_value::<v1beta1::ResourceSlice>(doc, &ctx)?,
            "ResourceClaim" => to_value::<v1beta1::ResourceClaim>(doc, &ctx)?,
            _ => to_value::<v1beta1::ResourceClaimTemplate>(doc, &ctx)?,
        };
        let Value::Object(m) = normalized else {
            return Err(Error::Decode {
                context: ctx,
                message: "object did not serialize to a map".to_owned(),
            });
        };
        map = m;
        v1beta1_to_v1(&kind, &mut map);
    }
    map.insert(
        "apiVersion".to_owned(),
        Value::String(names::RESOURCE_API_V1.to_owned()),
    );
    let doc = Value::Object(map);
    match kind.as_str() {
        "DeviceClass" => typed(doc, &ctx).map(Object::DeviceClass),
        "ResourceSlice" => typed(doc, &ctx).map(Object::ResourceSlice),
        "ResourceClaim" => typed(doc, &ctx).map(Object::ResourceClaim),
        _ => typed(doc, &ctx).map(Object::ResourceClaimTemplate),
    }
}

fn unsupported(ctx: &str, api_version: &str, kind: &str) -> Error {
    Error::Decode {
        context: ctx.to_owned(),
        message: format!(
            "unsupported apiVersion/kind {api_version}/{kind}; supported: DeviceClass, \
             ResourceSlice, ResourceClaim, ResourceClaimTemplate in {}; Node and Pod in v1",
            supported()
        ),
    }
}

fn value_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// Decodes into `T` (with field paths in errors) and back into a value.
fn to_value<T>(doc: Value, ctx: &str) -> Result<Value>
where
    T: serde::de::DeserializeOwned + serde::Serialize,
{
    let t: T = typed(doc, ctx)?;
    serde_json::to_value(&t).map_err(|e| Error::Decode {
        context: ctx.to_owned(),
        message: e.to_string(),
    })
}

/// The request fields v1beta1 keeps flat and v1 nests under `exactly`.
const EXACT_REQUEST_FIELDS: [&str; 7] = [
    "deviceClassName",
    "selectors",
    "allocationMode",
    "count",
    "adminAccess",
    "tolerations",
    "capacity",
];

fn v1beta1_to_v1(kind: &str, map: &mut Map<String, Value>) {
    match kind {
        "ResourceSlice" => {
            if let Some(spec) = map.get_mut("spec").and_then(Value::as_object_mut) {
                // v1beta1 carries these as plain values; their zero values mean "unset".
                if spec.get("nodeName").and_then(Value::as_str) == Some("") {
                    spec.remove("nodeName");
                }
                if spec.get("allNodes").and_then(Value::as_bool) == Some(false) {
                    spec.remove("allNodes");
                }
                for device in array_mut(spec, "devices") {
                    if let Some(Value::Object(basic)) = device.remove("basic") {
                        device.extend(basic);
                    }
                }
            }
        }
        "ResourceClaim" => convert_claim_spec(map.get_mut("spec")),
        "ResourceClaimTemplate" => convert_claim_spec(
            map.get_mut("spec")
                .and_then(Value::as_object_mut)
                .and_then(|s| s.get_mut("spec")),
        ),
        _ => {}
    }
}

fn array_mut<'a>(
    map: &'a mut Map<String, Value>,
    key: &str,
) -> impl Iterator<Item = &'a mut Map<String, Value>> {
    map.get_mut(key)
        .and_then(Value::as_array_mut)
        .into_iter()
        .flatten()
        .filter_map(Value::as_object_mut)
}

fn convert_claim_spec(spec: Option<&mut Value>) {
    let Some(devices) = spec
        .and_then(Value::as_object_mut)
        .and_then(|s| s.get_mut("devices"))
        .and_then(Value::as_object_mut)
    else {
        return;
    };
    for request in array_mut(devices, "requests") {
        let mut exactly = Map::new();
        let mut any_set = false;
        for key in EXACT_REQUEST_FIELDS {
            let Some(value) = request.remove(key) else {
                continue;
            };
            // Upstream treats the zero value of each field as "not set".
            let set = match (&value, key) {
                (Value::Null, _) => false,
                (Value::String(s), "deviceClassName" | "allocationMode") => !s.is_empty(),
                (Value::Number(n), "count") => n.as_i64() != Some(0),
                _ => true,
            };
            any_set |= set;
            if !value.is_null() {
                exactly.insert(key.to_owned(), value);
            }
        }
        if any_set {
            request.insert("exactly".to_owned(), Value::Object(exactly));
        }
    }
}

/// Writes a v1 `ResourceSlice` in the shape of `version`.
///
/// Errors with [`Error::Invalid`] when the slice uses a field `version` cannot carry, rather
/// than letting the field be dropped silently.
pub fn encode_slice(slice: &v1::ResourceSlice, version: ApiVersion) -> Result<Value> {
    let object = format!(
        "ResourceSlice {}",
        slice.metadata.name.as_deref().unwrap_or("(unnamed)")
    );
    let mut value = serde_json::to_value(slice)
        .map_err(|e| Error::invalid(&object, "", format!("cannot serialize: {e}")))?;
    if version == ApiVersion::V1 {
        return Ok(value);
    }
    let Value::Object(map) = &mut value else {
        return Err(Error::invalid(&object, "", "not an object".to_owned()));
    };
    map.insert(
        "apiVersion".to_owned(),
        Value::String(version.as_str().to_owned()),
    );
    if version == ApiVersion::V1beta1
        && let Some(spec) = map.get_mut("spec").and_then(Value::as_object_mut)
    {
        for device in array_mut(spec, "devices") {
            let name = device.remove("name");
            let basic = std::mem::take(device);
            if let Some(name) = name {
                device.insert("name".to_owned(), name);
            }
            device.insert("basic".to_owned(), Value::Object(basic));
        }
    }
    let round_trip = match version {
        ApiVersion::V1beta2 => round_trip::<v1beta2::ResourceSlice>(&value),
        _ => round_trip::<v1beta1::ResourceSlice>(&value),
    }
    .map_err(|m| Error::invalid(&object, "", m))?;
    if let Some(path) = first_difference(&value, &round_trip, String::new()) {
        return Err(Error::invalid(
            &object,
            path,
            format!("{version} cannot carry this field"),
        ));
    }
    Ok(value)
}

fn round_trip<T>(value: &Value) -> std::result::Result<Value, String>
where
    T: serde::de::DeserializeOwned + serde::Serialize,
{
    let t: T = serde_json::from_value(value.clone()).map_err(|e| e.to_string())?;
    serde_json::to_value(&t).map_err(|e| e.to_string())
}

/// The path of the first value present in `a` and missing or different in `b`.
fn first_difference(have: &Value, kept: &Value, path: String) -> Option<String> {
    match (have, kept) {
        (Value::Object(have_map), Value::Object(kept_map)) => {
            have_map.iter().find_map(|(key, value)| {
                let child = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                match kept_map.get(key) {
                    Some(other) => first_difference(value, other, child),
                    None => Some(child),
                }
            })
        }
        (Value::Array(have_items), Value::Array(kept_items)) => have_items
            .iter()
            .zip(kept_items)
            .enumerate()
            .find_map(|(i, (value, other))| first_difference(value, other, format!("{path}[{i}]")))
            .or_else(|| (have_items.len() != kept_items.len()).then(|| path.clone())),
        _ => (have != kept).then_some(path),
    }
}

/// Renders a value as YAML with keys sorted, as `kubectl get -o yaml` prints it. A JSON array
/// renders as several documents separated by `---`.
pub fn to_kubectl_yaml(value: &Value) -> String {
    match value {
        Value::Array(items) => items
            .iter()
            .map(one_document)
            .collect::<Vec<_>>()
            .join("---\n"),
        other => one_document(other),
    }
}

fn one_document(value: &Value) -> String {
    // serde_yaml cannot fail on a JSON value (every key is a string); the fallback keeps this
    // function total without a panic.
    serde_yaml::to_string(&sorted(value)).unwrap_or_else(|e| format!("# {e}\n"))
}

/// Rebuilds maps in key order, so the output is sorted even if `serde_json` keeps insertion order.
fn sorted(value: &Value) -> Value {
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            Value::Object(
                keys.into_iter()
                    .map(|k| (k.clone(), sorted(&map[k])))
                    .collect(),
            )
        }
        Value::Array(items) => Value::Array(items.iter().map(sorted).collect()),
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests;
