//! Reading the CLI's input: files and folders of Kubernetes YAML or JSON, as `kubectl -f` does.

use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::resource::v1 as res;
use serde::Deserialize;
use tessera_driver::apiversion::{Object, decode_document};
use tessera_driver::batch::BatchInput;

use crate::error::{Error, Result};

/// Every object the input held, by kind, each in input order.
#[derive(Debug, Default, Clone)]
pub struct Objects {
    /// DeviceClasses.
    pub classes: Vec<res::DeviceClass>,
    /// ResourceSlices.
    pub slices: Vec<res::ResourceSlice>,
    /// ResourceClaims (allocated ones count as used, the others are pending).
    pub claims: Vec<res::ResourceClaim>,
    /// ResourceClaimTemplates.
    pub templates: Vec<res::ResourceClaimTemplate>,
    /// Nodes.
    pub nodes: Vec<core::Node>,
    /// Pods.
    pub pods: Vec<core::Pod>,
}

impl Objects {
    /// The objects as the batch allocator reads them.
    pub fn batch_input(&self) -> BatchInput<'_> {
        BatchInput {
            classes: &self.classes,
            slices: &self.slices,
            claims: &self.claims,
            nodes: &self.nodes,
            pods: &self.pods,
        }
    }

    /// Adds one decoded object.
    pub fn push(&mut self, object: Object) {
        match object {
            Object::DeviceClass(o) => self.classes.push(o),
            Object::ResourceSlice(o) => self.slices.push(o),
            Object::ResourceClaim(o) => self.claims.push(o),
            Object::ResourceClaimTemplate(o) => self.templates.push(o),
            Object::Node(o) => self.nodes.push(o),
            Object::Pod(o) => self.pods.push(o),
        }
    }

    /// Reads every document of the given files and folders (`-` is standard input).
    pub fn load(paths: &[PathBuf]) -> Result<Self> {
        let mut objects = Self::default();
        for path in expand(paths)? {
            let text = if path.as_os_str() == "-" {
                std::io::read_to_string(std::io::stdin()).map_err(|source| Error::Read {
                    path: path.clone(),
                    source,
                })?
            } else {
                std::fs::read_to_string(&path).map_err(|source| Error::Read {
                    path: path.clone(),
                    source,
                })?
            };
            objects.load_text(&path.display().to_string(), &text)?;
        }
        Ok(objects)
    }

    /// Decodes every document of one YAML or JSON text; `name` names it in errors.
    pub fn load_text(&mut self, name: &str, text: &str) -> Result<()> {
        for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
            let context = format!("{name}: document {}", i + 1);
            // Through serde_yaml's own value first: it refuses duplicate keys, as kubectl does,
            // where a JSON map would silently keep the last one.
            let yaml = serde_yaml::Value::deserialize(doc)
                .map_err(|e| Error::Malformed(format!("{context}: not valid YAML or JSON: {e}")))?;
            let value = serde_json::to_value(&yaml).map_err(|e| {
                Error::Malformed(format!("{context}: not a Kubernetes object: {e}"))
            })?;
            self.load_value(&context, value)?;
        }
        Ok(())
    }

    fn load_value(&mut self, context: &str, value: serde_json::Value) -> Result<()> {
        if value.is_null() {
            return Ok(());
        }
        if value.get("kind").and_then(serde_json::Value::as_str) == Some("List") {
            let items = value
                .get("items")
                .and_then(serde_json::Value::as_array)
                .cloned()
                .unwrap_or_default();
            for (i, item) in items.into_iter().enumerate() {
                self.load_value(&format!("{context}: items[{i}]"), item)?;
            }
            return Ok(());
        }
        let object =
            decode_document(value, context).map_err(|e| Error::Malformed(e.to_string()))?;
        self.push(object);
        Ok(())
    }
}

/// Expands folders into their YAML and JSON files, sorted by name, as `kubectl -f DIR` does.
fn expand(paths: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for path in paths {
        if path.is_dir() {
            let read = |source| Error::Read {
                path: path.clone(),
                source,
            };
            let mut entries: Vec<PathBuf> = std::fs::read_dir(path)
                .map_err(read)?
                .filter_map(std::result::Result::ok)
                .map(|e| e.path())
                .filter(|p| is_manifest(p))
                .collect();
            entries.sort();
            files.extend(entries);
        } else {
            files.push(path.clone());
        }
    }
    Ok(files)
}

fn is_manifest(path: &Path) -> bool {
    path.is_file()
        && path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| matches!(e, "yaml" | "yml" | "json"))
}
