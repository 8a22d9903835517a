//! The CDI spec document: a serde model of the fields Tessera writes, and the minimum spec
//! version those fields need.
//!
//! Field names and nesting follow the Container Device Interface specification
//! (cncf-tags/container-device-interface, `SPEC.md`). Empty optional fields are left out of
//! the JSON so a spec only claims the features it uses. Struct field order is the JSON key
//! order, and maps are `BTreeMap`s, so serialising the same spec always gives the same bytes.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The spec version Tessera writes (see `docs/cdi.md` for runtime compatibility).
pub const CDI_VERSION: &str = "1.1.0";

/// A whole CDI spec file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CdiSpec {
    /// The CDI spec version the document follows.
    pub cdi_version: String,
    /// `vendor/class` of every device in the spec.
    pub kind: String,
    /// Annotations about the spec itself; they never reach the container.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// The devices a container can ask for by `kind=name`.
    pub devices: Vec<CdiDevice>,
    /// Edits applied when any device of the spec is injected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_edits: Option<ContainerEdits>,
}

/// One device of a spec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CdiDevice {
    /// The name after `kind=` in a fully qualified device id.
    pub name: String,
    /// Annotations about the device; they never reach the container.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// Edits applied when this device is injected.
    pub container_edits: ContainerEdits,
}

/// Edits a runtime makes to a container's OCI spec.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ContainerEdits {
    /// `NAME=value` entries; a runtime replaces an existing variable of the same name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// Device nodes to create in the container.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
    /// OCI hooks to run.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hooks: Vec<Hook>,
    /// Mounts to add.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
}

impl ContainerEdits {
    /// Whether the edits change nothing.
    pub fn is_empty(&self) -> bool {
        self.env.is_empty()
            && self.device_nodes.is_empty()
            && self.hooks.is_empty()
            && self.mounts.is_empty()
    }
}

/// A device node. Left-out type, major and minor are filled in by the runtime from the host
/// node, which is why Tessera writes only the path: the `nvidia-caps` major is assigned at
/// driver load and differs between hosts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeviceNode {
    /// Path in the container.
    pub path: String,
    /// Path on the host, when it differs from `path` (needs spec 0.5.0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
    /// `c`, `b` or `p`.
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub node_type: Option<String>,
    /// Device major number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub major: Option<i64>,
    /// Device minor number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor: Option<i64>,
    /// File mode of the node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_mode: Option<u32>,
    /// Cgroup permissions, a combination of `r`, `w` and `m`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permissions: Option<String>,
    /// Owner of the node in the container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// Group of the node in the container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
}

impl DeviceNode {
    /// A node at the same path in the host and the container.
    pub fn at(path: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            ..Self::default()
        }
    }
}

/// A mount.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Mount {
    /// Source on the host.
    pub host_path: String,
    /// Destination in the container.
    pub container_path: String,
    /// OCI mount options, e.g. `ro`, `bind`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
    /// Mount type (needs spec 0.4.0); Tessera says `bind` in `options` instead.
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub mount_type: Option<String>,
}

/// An OCI hook.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Hook {
    /// OCI hook point, e.g. `createContainer`.
    pub hook_name: String,
    /// Absolute path of the program.
    pub path: String,
    /// Arguments, `argv[0]` included.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// Environment of the hook.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// Seconds before the hook is aborted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<i64>,
}

impl CdiSpec {
    /// The oldest spec version that can express this document, decided the way the upstream
    /// CDI library decides it (`MinimumRequiredVersion`): annotations or a dotted class need
    /// 0.6.0; a node `hostPath` or a device name not starting with a letter needs 0.5.0; a
    /// mount `type` needs 0.4.0; anything else 0.3.0. The newer features (`intelRdt`,
    /// `additionalGids`, `netDevices`) are not in this model, so nothing here needs more.
    pub fn minimum_version(&self) -> &'static str {
        let all_edits = || {
            self.devices
                .iter()
                .map(|d| &d.container_edits)
                .chain(self.container_edits.iter())
        };
        let class = self.kind.split_once('/').map_or("", |(_, class)| class);
        if !self.annotations.is_empty()
            || self.devices.iter().any(|d| !d.annotations.is_empty())
            || class.contains('.')
        {
            return "0.6.0";
        }
        if self
            .devices
            .iter()
            .any(|d| !d.name.starts_with(|c: char| c.is_ascii_alphabetic()))
            || all_edits().any(|e| e.device_nodes.iter().any(|n| n.host_path.is_some()))
        {
            return "0.5.0";
        }
        if all_edits().any(|e| e.mounts.iter().any(|m| m.mount_type.is_some())) {
            return "0.4.0";
        }
        "0.3.0"
    }

    /// Lowers `cdi_version` to [`CdiSpec::minimum_version`], for nodes whose container runtime
    /// bundles a CDI library older than [`CDI_VERSION`] (such a runtime refuses any version it
    /// does not know).
    pub fn use_minimum_version(&mut self) {
        self.cdi_version = self.minimum_version().to_owned();
    }

    /// The spec as pretty JSON with a final newline. The same spec always gives the same text,
    /// so the kubelet plugin can compare it with a file on disk and write it atomically.
    pub fn to_json(&self) -> Result<String> {
        let mut text = serde_json::to_string_pretty(self).map_err(|e| Error::Cdi {
            claim: self
                .annotations
                .get(super::ANNOTATION_CLAIM)
                .cloned()
                .unwrap_or_else(|| self.kind.clone()),
            message: format!("cannot serialise the spec: {e}"),
        })?;
        text.push('\n');
        Ok(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str) -> CdiSpec {
        CdiSpec {
            cdi_version: CDI_VERSION.into(),
            kind: "k8s.gpu.tessera.dev/claim".into(),
            annotations: BTreeMap::new(),
            devices: vec![CdiDevice {
                name: name.into(),
                annotations: BTreeMap::new(),
                container_edits: ContainerEdits {
                    device_nodes: vec![DeviceNode::at("/dev/nvidia0")],
                    ..ContainerEdits::default()
                },
            }],
            container_edits: None,
        }
    }

    #[test]
    fn minimum_version_follows_the_features_used() {
        let mut s = spec("gpu0");
        assert_eq!(s.minimum_version(), "0.3.0");
        s.devices[0].container_edits.mounts.push(Mount {
            host_path: "/a".into(),
            container_path: "/b".into(),
            options: vec![],
            mount_type: Some("bind".into()),
        });
        assert_eq!(s.minimum_version(), "0.4.0");
        assert_eq!(spec("0-gpu").minimum_version(), "0.5.0");
        s.annotations.insert("a".into(), "b".into());
        assert_eq!(s.minimum_version(), "0.6.0");
        s.use_minimum_version();
        assert_eq!(s.cdi_version, "0.6.0");
    }

    #[test]
    fn empty_fields_are_left_out_and_names_are_camel_case() {
        let json = spec("gpu0").to_json().unwrap();
        assert!(json.contains("\"cdiVersion\": \"1.1.0\""));
        assert!(json.contains("\"containerEdits\""));
        assert!(json.contains("\"deviceNodes\""));
        assert!(!json.contains("annotations"));
        assert!(!json.contains("hostPath"));
        assert!(!json.contains("null"));
        let back: CdiSpec = serde_json::from_str(&json).unwrap();
        assert_eq!(back, spec("gpu0"));
    }
}
