//! Reading the CLI's input: files and folders of Kubernetes YAML or JSON, as `kubectl -f` does.

use std::collections::BTreeMap;
use std::io::Read as _;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::resource::v1 as res;
use serde::Deserialize;
use tessera_driver::apiversion::validate::{describe, validate_object};
use tessera_driver::apiversion::{Object, decode_document, nesting};
use tessera_driver::rules::cel::CelCache;
use tessera_driver::tools::batch::BatchInput;

use crate::error::{Error, Result};

/// The largest input file read (`kubectl` sends objects of at most 3 MiB each; this leaves room
/// for thousands of them in one file).
pub const MAX_INPUT_BYTES: usize = 64 << 20;

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
    /// Kind, namespace and name of every object read, and where it was read.
    seen: BTreeMap<(&'static str, String, String), String>,
    /// CEL selectors compiled while checking objects.
    cel: std::sync::Arc<CelCache>,
    /// Whether objects the API server would refuse are kept, their problems listed in
    /// [`Objects::refused`], instead of failing the load (`tessera validate` shows them all).
    keep_refused: bool,
    /// Why the API server would refuse objects of the input, one line per problem.
    pub refused: Vec<String>,
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

    /// Adds one decoded object; `context` names where it came from. Refuses a second object of
    /// the same kind, namespace and name, as the API server would.
    pub fn push(&mut self, context: &str, object: Object) -> Result<()> {
        let key = (
            object.kind(),
            object.metadata().namespace.clone().unwrap_or_default(),
            object.metadata().name.clone().unwrap_or_default(),
        );
        if let Some(first) = self.seen.get(&key) {
            return Err(Error::Malformed(format!(
                "{context}: {}: already defined in {first}; each namespace/name may appear once",
                describe(&object)
            )));
        }
        self.seen.insert(key, context.to_owned());
        match object {
            Object::DeviceClass(o) => self.classes.push(o),
            Object::ResourceSlice(o) => self.slices.push(o),
            Object::ResourceClaim(o) => self.claims.push(o),
            Object::ResourceClaimTemplate(o) => self.templates.push(o),
            Object::Node(o) => self.nodes.push(o),
            Object::Pod(o) => self.pods.push(o),
        }
        Ok(())
    }

    /// Reads every document of the given files and folders (`-` is standard input); an object
    /// the API server would refuse fails the load.
    pub fn load(paths: &[PathBuf]) -> Result<Self> {
        Self::default().load_paths(paths)
    }

    /// As [`Objects::load`], but objects the API server would refuse are kept and their
    /// problems listed in [`Objects::refused`], so every mistake can be shown at once. Input
    /// that does not decode still fails the load.
    pub fn load_listing_refusals(paths: &[PathBuf]) -> Result<Self> {
        Self {
            keep_refused: true,
            ..Self::default()
        }
        .load_paths(paths)
    }

    fn load_paths(mut self, paths: &[PathBuf]) -> Result<Self> {
        for path in expand(paths)? {
            let read = |source| Error::Read {
                path: path.clone(),
                source,
            };
            let mut bytes = Vec::new();
            let limit = MAX_INPUT_BYTES as u64 + 1;
            if path.as_os_str() == "-" {
                std::io::stdin().lock().take(limit).read_to_end(&mut bytes)
            } else {
                std::fs::File::open(&path).and_then(|f| f.take(limit).read_to_end(&mut bytes))
            }
            .map_err(read)?;
            let name = path.display().to_string();
            if bytes.len() > MAX_INPUT_BYTES {
                return Err(Error::Malformed(format!(
                    "{name}: larger than {} MiB; split the input into several files",
                    MAX_INPUT_BYTES >> 20
                )));
            }
            let text = String::from_utf8(bytes)
                .map_err(|e| Error::Malformed(format!("{name}: not UTF-8 text: {e}")))?;
            self.load_text(&name, &text)?;
        }
        Ok(self)
    }

    /// Decodes every document of one YAML or JSON text; `name` names it in errors.
    ///
    /// The text is bounded first ([`MAX_INPUT_BYTES`], [`nesting::MAX_NESTING`]); then each
    /// document is decoded, checked as the API server would check it, and kept, one at a time,
    /// so memory follows what is kept rather than the text.
    pub fn load_text(&mut self, name: &str, text: &str) -> Result<()> {
        if text.len() > MAX_INPUT_BYTES {
            return Err(Error::Malformed(format!(
                "{name}: larger than {} MiB; split the input into several files",
                MAX_INPUT_BYTES >> 20
            )));
        }
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        if let Err(deep) = nesting::check_nesting(text, nesting::MAX_NESTING) {
            return Err(Error::Malformed(format!(
                "{name}: line {}: nested {} levels deep, more than the limit of {}",
                deep.line,
                deep.depth,
                nesting::MAX_NESTING
            )));
        }
        for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
            let context = format!("{name}: document {}", i + 1);
            // Through serde_yaml's own value first: it refuses duplicate keys, as kubectl does,
            // where a JSON map would silently keep the last one.
            let yaml = serde_yaml::Value::deserialize(doc)
                .map_err(|e| Error::Malformed(format!("{context}: not valid YAML or JSON: {e}")))?;
            let value = serde_json::to_value(&yaml).map_err(|e| {
                Error::Malformed(format!("{context}: not a Kubernetes object: {e}"))
            })?;
            drop(yaml);
            self.load_value(&context, value)?;
        }
        Ok(())
    }

    fn load_value(&mut self, context: &str, mut value: serde_json::Value) -> Result<()> {
        if value.is_null() {
            return Ok(());
        }
        if value.get("kind").and_then(serde_json::Value::as_str) == Some("List") {
            let items = match value.get_mut("items").map(serde_json::Value::take) {
                Some(serde_json::Value::Array(items)) => items,
                None | Some(serde_json::Value::Null) => Vec::new(),
                Some(_) => {
                    return Err(Error::Malformed(format!(
                        "{context}: List: items: expected a list"
                    )));
                }
            };
            for (i, item) in items.into_iter().enumerate() {
                self.load_value(&format!("{context}: items[{i}]"), item)?;
            }
            return Ok(());
        }
        let object =
            decode_document(value, context).map_err(|e| Error::Malformed(e.to_string()))?;
        let problems = validate_object(&object, &self.cel);
        if self.keep_refused {
            self.refused
                .extend(problems.iter().map(|p| format!("{context}: {p}")));
        } else if !problems.is_empty() {
            let list: Vec<String> = problems.iter().map(ToString::to_string).collect();
            return Err(Error::Malformed(format!(
                "{context}: the API server would refuse this object:\n  {}",
                list.join("\n  ")
            )));
        }
        self.push(context, object)
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
