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

/// The largest input file read, the same bound as the kubelet plugin's files.
pub use tessera_driver::rules::limits::MAX_INPUT_BYTES;

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
    /// Whether objects that cannot be used are left out, each with its error in
    /// [`Objects::refusals`], instead of failing the load (`tessera allocate`, as
    /// `kubectl apply -f` goes on past an invalid object).
    skip_refused: bool,
    /// The objects left out, with their errors, in input order.
    pub refusals: Vec<Refusal>,
    /// Each ResourceClaim as the input wrote it (its own API version and fields), by namespace
    /// and name, so that results can be written into the claim as the user gave it.
    pub claim_documents: BTreeMap<(String, String), serde_json::Value>,
}

/// An object of the input that was left out, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The error: where (file and document), which object, which field, which rule.
    pub message: String,
    /// Kind, namespace (empty for cluster-scoped kinds) and name, when the document says them.
    pub object: Option<(String, String, String)>,
    /// For a Pod: the ResourceClaims it names (`spec.resourceClaims[].resourceClaimName`).
    pub pod_claims: Vec<String>,
}

impl Refusal {
    /// A refusal of something that names no object (a whole file, a document that is not one).
    pub fn of_input(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            object: None,
            pod_claims: Vec::new(),
        }
    }

    /// A refusal of the object `document` describes.
    fn of_document(message: String, document: &serde_json::Value) -> Self {
        let text = |v: &serde_json::Value| v.as_str().map(str::to_owned);
        let kind = text(&document["kind"]);
        let name = text(&document["metadata"]["name"]);
        let namespaced = !matches!(
            kind.as_deref(),
            Some("DeviceClass" | "ResourceSlice" | "Node")
        );
        let namespace = if namespaced {
            text(&document["metadata"]["namespace"]).unwrap_or_else(|| "default".to_owned())
        } else {
            String::new()
        };
        let pod_claims = if kind.as_deref() == Some("Pod") {
            document["spec"]["resourceClaims"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|c| text(&c["resourceClaimName"]))
                .collect()
        } else {
            Vec::new()
        };
        Self {
            message,
            object: kind.zip(name).map(|(k, n)| (k, namespace, n)),
            pod_claims,
        }
    }
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

    /// Where an object of the input was read (`FILE: document N`), by kind, namespace (empty
    /// for cluster-scoped kinds) and name.
    pub fn source(&self, kind: &str, namespace: &str, name: &str) -> Option<&str> {
        self.seen
            .iter()
            .find(|((k, ns, n), _)| *k == kind && ns == namespace && n == name)
            .map(|(_, context)| context.as_str())
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

    /// As [`Objects::load`], but what cannot be used (a file that does not parse, an object the
    /// API server would refuse, a second object of one name) is left out with its error in
    /// [`Objects::refusals`], and the rest is loaded. A path that cannot be read still fails
    /// the load, as it fails `kubectl apply -f`.
    pub fn load_skipping_refused(paths: &[PathBuf]) -> Result<Self> {
        Self {
            skip_refused: true,
            ..Self::default()
        }
        .load_paths(paths)
    }

    /// Leaves out what `refusal` describes when refusals are skipped; fails with `error`
    /// otherwise.
    pub(crate) fn refuse(&mut self, refusal: Refusal, error: Error) -> Result<()> {
        if self.skip_refused {
            self.refusals.push(refusal);
            Ok(())
        } else {
            Err(error)
        }
    }

    /// [`Self::refuse`] of input that is not what it should be, where `message` says why.
    fn refuse_input(&mut self, message: String) -> Result<()> {
        self.refuse(
            Refusal::of_input(message.clone()),
            Error::Malformed(message),
        )
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
                let message = format!(
                    "{name}: larger than {} MiB; split the input into several files",
                    MAX_INPUT_BYTES >> 20
                );
                self.refuse_input(message)?;
                continue;
            }
            match String::from_utf8(bytes) {
                Ok(text) => self.load_text(&name, &text)?,
                Err(e) => {
                    let message = format!("{name}: not UTF-8 text: {e}");
                    self.refuse_input(message)?;
                }
            }
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
            let message = format!(
                "{name}: larger than {} MiB; split the input into several files",
                MAX_INPUT_BYTES >> 20
            );
            return self.refuse_input(message);
        }
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        if let Err(deep) = nesting::check_nesting(text, nesting::MAX_NESTING) {
            let message = format!(
                "{name}: line {}: nested {} levels deep, more than the limit of {}",
                deep.line,
                deep.depth,
                nesting::MAX_NESTING
            );
            return self.refuse_input(message);
        }
        for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
            let context = format!("{name}: document {}", i + 1);
            // Through serde_yaml's own value first: it refuses duplicate keys, as kubectl does,
            // where a JSON map would silently keep the last one.
            let yaml = match serde_yaml::Value::deserialize(doc) {
                Ok(yaml) => yaml,
                Err(e) => {
                    // The parser does not go on past a broken document.
                    let message = format!("{context}: not valid YAML or JSON: {e}");
                    let skipped = format!("{message} (the rest of {name} was not read)");
                    return self.refuse(Refusal::of_input(skipped), Error::Malformed(message));
                }
            };
            match serde_json::to_value(&yaml) {
                Ok(value) => {
                    drop(yaml);
                    self.load_value(&context, value)?;
                }
                Err(e) => {
                    let message = format!("{context}: not a Kubernetes object: {e}");
                    self.refuse_input(message)?;
                }
            }
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
                    let message = format!("{context}: List: items: expected a list");
                    return self.refuse_input(message);
                }
            };
            for (i, item) in items.into_iter().enumerate() {
                self.load_value(&format!("{context}: items[{i}]"), item)?;
            }
            return Ok(());
        }
        // What is needed to name a refused object, and the claim as written.
        let keep = self.skip_refused || value["kind"] == "ResourceClaim";
        let original = keep.then(|| value.clone());
        let refusal = |message: String| match &original {
            Some(document) => Refusal::of_document(message, document),
            None => Refusal::of_input(message),
        };
        let object = match decode_document(value, context) {
            Ok(object) => object,
            Err(e) => {
                let message = e.to_string();
                return self.refuse(refusal(message.clone()), Error::Malformed(message));
            }
        };
        let problems = validate_object(&object, &self.cel);
        if self.keep_refused {
            self.refused
                .extend(problems.iter().map(|p| format!("{context}: {p}")));
        } else if !problems.is_empty() {
            let list: Vec<String> = problems.iter().map(ToString::to_string).collect();
            let message = format!(
                "{context}: the API server would refuse this object:\n  {}",
                list.join("\n  ")
            );
            return self.refuse(refusal(message.clone()), Error::Malformed(message));
        }
        let claim = match &object {
            Object::ResourceClaim(c) => Some((
                c.metadata
                    .namespace
                    .clone()
                    .unwrap_or_else(|| "default".to_owned()),
                c.metadata.name.clone().unwrap_or_default(),
            )),
            _ => None,
        };
        match self.push(context, object) {
            Ok(()) => {
                if let (Some(key), Some(document)) = (claim, original) {
                    self.claim_documents.insert(key, document);
                }
                Ok(())
            }
            // A second object of one name: the first stays, so this one names no object.
            Err(e) => self.refuse(Refusal::of_input(e.to_string()), e),
        }
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
