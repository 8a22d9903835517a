//! A ResourceSlice as the allocator keeps it: the fields some decision reads, in a compact
//! form. A long-lived holder (the controller's cluster view) keeps thousands of slices; as
//! k8s-openapi types every device costs about 8 KB (each attribute a 168-byte struct of
//! eight options in a B-tree node of eleven slots), in this form about 1.5 KB. Attribute
//! and capacity names are shared between the devices of a slice, each attribute is an enum
//! of its one value, and metadata keeps only the name and `resourceVersion`.
//!
//! Nothing is interpreted here: quantities stay as written (the snapshot parses them and
//! reports what does not parse), and an attribute keeps the value the API reads from it.

use std::collections::HashSet;
use std::sync::Arc;

use k8s_openapi::api::resource::v1 as res;

use crate::rules::nodeselect::NodeScope;

/// One attribute's value. The API requires exactly one of `DeviceAttribute`'s fields; an
/// object that sets several keeps the first in the order below, the one CEL reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttributeValue {
    /// `string`.
    String(Box<str>),
    /// `bool`.
    Bool(bool),
    /// `int`.
    Int(i64),
    /// `version` (semantic version, as written).
    Version(Box<str>),
    /// `strings`.
    Strings(Box<[String]>),
    /// `bools`.
    Bools(Box<[bool]>),
    /// `ints`.
    Ints(Box<[i64]>),
    /// `versions`.
    Versions(Box<[String]>),
    /// No field set (the API rejects it; CEL fails every selector on such a device).
    Empty,
}

impl From<res::DeviceAttribute> for AttributeValue {
    fn from(a: res::DeviceAttribute) -> Self {
        if let Some(s) = a.string {
            Self::String(s.into())
        } else if let Some(b) = a.bool {
            Self::Bool(b)
        } else if let Some(i) = a.int {
            Self::Int(i)
        } else if let Some(v) = a.version {
            Self::Version(v.into())
        } else if let Some(l) = a.strings {
            Self::Strings(l.into())
        } else if let Some(l) = a.bools {
            Self::Bools(l.into())
        } else if let Some(l) = a.ints {
            Self::Ints(l.into())
        } else if let Some(l) = a.versions {
            Self::Versions(l.into())
        } else {
            Self::Empty
        }
    }
}

impl AttributeValue {
    /// The value as text, for a scalar (string, int, version or bool).
    pub(crate) fn text(&self) -> Option<String> {
        match self {
            Self::String(s) | Self::Version(s) => Some(s.to_string()),
            Self::Int(i) => Some(i.to_string()),
            Self::Bool(b) => Some(b.to_string()),
            _ => None,
        }
    }
}

/// A device as the allocator keeps it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PublishedDevice {
    /// `name`.
    pub(crate) name: String,
    /// `attributes`, sorted by name as the API map is.
    attributes: Box<[(Arc<str>, AttributeValue)]>,
    /// `capacity`, sorted by name, quantities as written.
    capacity: Box<[(Arc<str>, res::DeviceCapacity)]>,
    pub(crate) allow_multiple_allocations: Option<bool>,
    pub(crate) binds_to_node: Option<bool>,
    pub(crate) binding_conditions: Option<Vec<String>>,
    pub(crate) binding_failure_conditions: Option<Vec<String>>,
    pub(crate) consumes_counters: Vec<res::DeviceCounterConsumption>,
    pub(crate) taints: Vec<res::DeviceTaint>,
    /// The device's own node scope, kept only when its slice selects nodes per device.
    pub(crate) scope: Option<NodeScope>,
}

impl PublishedDevice {
    /// The attribute spelled exactly `name`.
    pub(crate) fn attribute(&self, name: &str) -> Option<&AttributeValue> {
        self.attributes
            .binary_search_by(|(k, _)| (**k).cmp(name))
            .ok()
            .map(|i| &self.attributes[i].1)
    }

    /// Every attribute, by name.
    pub(crate) fn attributes(&self) -> impl Iterator<Item = (&str, &AttributeValue)> {
        self.attributes.iter().map(|(k, v)| (&**k, v))
    }

    /// Every capacity, by name as written.
    pub(crate) fn capacities(&self) -> impl Iterator<Item = (&str, &res::DeviceCapacity)> {
        self.capacity.iter().map(|(k, v)| (&**k, v))
    }

    /// How many attributes and capacities the device lists (the API bounds the sum).
    pub(crate) fn entries(&self) -> usize {
        self.attributes.len() + self.capacity.len()
    }

    /// The compact form of `device`, its names taken from (and added to) `names`.
    fn new(device: res::Device, per_device: bool, names: &mut Names) -> Self {
        let scope = per_device.then(|| {
            NodeScope::from_fields(
                device.node_name.as_ref(),
                device.all_nodes,
                device.node_selector.as_ref(),
            )
        });
        Self {
            name: device.name,
            attributes: device
                .attributes
                .into_iter()
                .flatten()
                .map(|(k, v)| (names.get(k), AttributeValue::from(v)))
                .collect(),
            capacity: device
                .capacity
                .into_iter()
                .flatten()
                .map(|(k, v)| (names.get(k), v))
                .collect(),
            allow_multiple_allocations: device.allow_multiple_allocations,
            binds_to_node: device.binds_to_node,
            binding_conditions: device.binding_conditions,
            binding_failure_conditions: device.binding_failure_conditions,
            consumes_counters: device.consumes_counters.unwrap_or_default(),
            taints: device.taints.unwrap_or_default(),
            scope,
        }
    }
}

impl From<res::Device> for PublishedDevice {
    fn from(device: res::Device) -> Self {
        Self::new(device, false, &mut Names::default())
    }
}

/// Attribute and capacity names shared between the devices of one slice (every device of
/// a slice usually lists the same ones).
#[derive(Default)]
struct Names(HashSet<Arc<str>>);

impl Names {
    fn get(&mut self, name: String) -> Arc<str> {
        if let Some(known) = self.0.get(name.as_str()) {
            return Arc::clone(known);
        }
        let name: Arc<str> = name.into();
        self.0.insert(Arc::clone(&name));
        name
    }
}

/// A ResourceSlice as the allocator keeps it.
#[derive(Debug, Clone, PartialEq)]
pub struct PublishedSlice {
    /// `metadata.name`.
    pub(crate) name: String,
    /// `metadata.resourceVersion`.
    resource_version: Option<String>,
    /// `spec.driver`.
    pub(crate) driver: String,
    /// `spec.pool`.
    pub(crate) pool: res::ResourcePool,
    /// From `spec.nodeName`, `spec.allNodes` and `spec.nodeSelector`.
    pub(crate) scope: NodeScope,
    /// `spec.sharedCounters`.
    pub(crate) shared_counters: Vec<res::CounterSet>,
    /// `spec.devices`.
    pub(crate) devices: Vec<PublishedDevice>,
}

impl PublishedSlice {
    /// `metadata.name`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `metadata.resourceVersion`.
    pub fn resource_version(&self) -> Option<&str> {
        self.resource_version.as_deref()
    }
}

impl From<res::ResourceSlice> for PublishedSlice {
    fn from(slice: res::ResourceSlice) -> Self {
        let spec = slice.spec;
        let per_device = spec.per_device_node_selection == Some(true);
        let mut names = Names::default();
        Self {
            name: slice.metadata.name.unwrap_or_default(),
            resource_version: slice.metadata.resource_version,
            scope: NodeScope::from_fields(
                spec.node_name.as_ref(),
                spec.all_nodes,
                spec.node_selector.as_ref(),
            ),
            driver: spec.driver,
            pool: spec.pool,
            shared_counters: spec.shared_counters.unwrap_or_default(),
            devices: spec
                .devices
                .into_iter()
                .flatten()
                .map(|d| PublishedDevice::new(d, per_device, &mut names))
                .collect(),
        }
    }
}

impl From<&res::ResourceSlice> for PublishedSlice {
    fn from(slice: &res::ResourceSlice) -> Self {
        Self::from(slice.clone())
    }
}

#[cfg(test)]
mod tests {

    use super::*;
    use serde_json::json;

    #[test]
    fn a_published_slice_keeps_every_field_the_allocator_reads() {
        let slice: res::ResourceSlice = serde_json::from_value(json!({
            "metadata": {"name": "n1-gpus", "resourceVersion": "7",
                "labels": {"a": "b"}, "managedFields": [{"manager": "kubelet"}]},
            "spec": {"driver": "gpu.tessera.dev", "nodeName": "n1",
                "pool": {"name": "n1", "generation": 3, "resourceSliceCount": 1},
                "sharedCounters": [{"name": "s", "counters": {"memory": {"value": "80Gi"}}}],
                "devices": [
                    {"name": "gpu-0",
                     "attributes": {"type": {"string": "gpu"}, "index": {"int": 0},
                                    "mig": {"bool": true}, "driverVersion": {"version": "550.1.2"},
                                    "tags": {"strings": ["a", "b"]}},
                     "capacity": {"memory": {"value": "80Gi",
                        "requestPolicy": {"default": "1Gi", "validRange": {"min": "1Gi", "step": "1Gi"}}}},
                     "consumesCounters": [{"counterSet": "s", "counters": {"memory": {"value": "80Gi"}}}],
                     "allowMultipleAllocations": true, "bindsToNode": true,
                     "bindingConditions": ["ready"],
                     "taints": [{"key": "k", "value": "v", "effect": "NoSchedule"}]},
                    {"name": "gpu-1", "attributes": {"type": {"string": "gpu"}}}]}
        }))
        .unwrap();
        let p = PublishedSlice::from(&slice);
        assert_eq!((p.name(), p.resource_version()), ("n1-gpus", Some("7")));
        assert_eq!(p.driver, "gpu.tessera.dev");
        assert_eq!(p.pool, slice.spec.pool);
        assert_eq!(p.scope, NodeScope::Node("n1".to_owned()));
        assert_eq!(
            Some(&p.shared_counters),
            slice.spec.shared_counters.as_ref()
        );
        let d = &p.devices[0];
        let api = &slice.spec.devices.as_ref().unwrap()[0];
        assert_eq!(d.name, "gpu-0");
        assert_eq!(
            d.attribute("type"),
            Some(&AttributeValue::String("gpu".into()))
        );
        assert_eq!(d.attribute("index"), Some(&AttributeValue::Int(0)));
        assert_eq!(d.attribute("mig"), Some(&AttributeValue::Bool(true)));
        assert_eq!(
            d.attribute("driverVersion"),
            Some(&AttributeValue::Version("550.1.2".into()))
        );
        assert_eq!(
            d.attribute("tags"),
            Some(&AttributeValue::Strings(
                vec!["a".into(), "b".into()].into()
            ))
        );
        assert_eq!(d.attribute("absent"), None);
        let caps: Vec<_> = d
            .capacities()
            .map(|(k, v)| (k.to_owned(), v.clone()))
            .collect();
        let want: Vec<_> = api.capacity.clone().unwrap().into_iter().collect();
        assert_eq!(caps, want);
        assert_eq!(d.entries(), 6);
        assert_eq!(Some(&d.consumes_counters), api.consumes_counters.as_ref());
        assert_eq!(Some(&d.taints), api.taints.as_ref());
        assert_eq!(d.allow_multiple_allocations, Some(true));
        assert_eq!(d.binds_to_node, Some(true));
        assert_eq!(d.binding_conditions, Some(vec!["ready".to_owned()]));
        assert_eq!(d.scope, None);
        // Both devices share one copy of the name `type`.
        let name = |d: &PublishedDevice| {
            Arc::clone(&d.attributes.iter().find(|(k, _)| &**k == "type").unwrap().0)
        };
        assert!(Arc::ptr_eq(&name(d), &name(&p.devices[1])));
    }

    #[test]
    fn per_device_node_selection_keeps_each_device_scope() {
        let slice: res::ResourceSlice = serde_json::from_value(json!({
            "metadata": {"name": "s"},
            "spec": {"driver": "d", "perDeviceNodeSelection": true,
                "pool": {"name": "p", "generation": 1, "resourceSliceCount": 1},
                "devices": [{"name": "a", "nodeName": "n2"}, {"name": "b", "allNodes": true}]}
        }))
        .unwrap();
        let p = PublishedSlice::from(slice);
        assert_eq!(p.devices[0].scope, Some(NodeScope::Node("n2".to_owned())));
        assert_eq!(p.devices[1].scope, Some(NodeScope::All));
    }

    #[test]
    fn an_attribute_without_a_value_is_kept_as_empty() {
        assert_eq!(
            AttributeValue::from(res::DeviceAttribute::default()),
            AttributeValue::Empty
        );
    }
}
