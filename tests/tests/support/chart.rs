//! The chart rendered without a helm binary, for the chart's suites: templates filled in from
//! values (simple actions and `if`s; lines of other actions left out), and where a container's
//! paths are on the node through the rendered mounts.
#![allow(dead_code, unreachable_pub)] // Reason: each suite uses a different part.

use std::path::{Path, PathBuf};

use serde_yaml::Value;

pub(crate) const RELEASE: &str = "tessera";
pub(crate) const NAMESPACE: &str = "tessera-system";

pub(crate) fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
}

pub(crate) fn chart() -> PathBuf {
    repo().join("deploy/helm/tessera")
}

pub(crate) fn values() -> Value {
    serde_yaml::from_str(&std::fs::read_to_string(chart().join("values.yaml")).unwrap()).unwrap()
}

pub(crate) fn lookup<'a>(values: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.')
        .try_fold(values, |v, key| v.as_mapping()?.get(key))
}

/// The `{{ ... }}` actions of a template, in order, with their byte ranges.
pub(crate) fn actions(text: &str) -> Vec<(usize, usize, String)> {
    let mut found = Vec::new();
    let mut at = 0;
    while let Some(start) = text[at..].find("{{").map(|i| i + at) {
        let end = text[start..].find("}}").map(|i| i + start + 2).unwrap();
        let inner = text[start + 2..end - 2]
            .trim_start_matches('-')
            .trim_end_matches('-')
            .trim()
            .to_owned();
        found.push((start, end, inner));
        at = end;
    }
    found
}

/// What a simple action renders to with the default values; `None` for anything else
/// (control flow, pipelines), whose line is then left out.
pub(crate) fn evaluate(action: &str, values: &Value) -> Option<String> {
    let fullname = RELEASE.to_owned();
    match action {
        "include \"tessera.fullname\" ." => return Some(fullname),
        "include \"tessera.webhookService\" ." | "$service" => {
            return Some(format!("{fullname}-webhook"));
        }
        "include \"tessera.webhookSecret\" ." | "$secretName" => {
            return Some(format!("{fullname}-webhook-tls"));
        }
        "include \"tessera.image\" ." => return Some("tessera:test".to_owned()),
        ".Release.Namespace" => return Some(NAMESPACE.to_owned()),
        ".Release.Name" => return Some(RELEASE.to_owned()),
        _ => {}
    }
    let path = action.strip_prefix(".Values.")?;
    if path.contains(' ') {
        return None;
    }
    match lookup(values, path)? {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

/// Whether a value counts as true in a template's `if`.
pub(crate) fn truthy(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Number(n)) => n.as_f64() != Some(0.0),
        Some(Value::Sequence(s)) => !s.is_empty(),
        Some(Value::Mapping(m)) => !m.is_empty(),
        Some(Value::Tagged(_)) => true,
    }
}

/// The outcome of `if` on a simple `.Values` path (or its `not`); `None` when the condition
/// is more than that (both branches are then kept).
pub(crate) fn condition(expr: &str, values: &Value) -> Option<bool> {
    let (negate, expr) = match expr.strip_prefix("not ") {
        Some(rest) => (true, rest.trim()),
        None => (false, expr),
    };
    let path = expr.strip_prefix(".Values.")?;
    if path.contains(' ') {
        return None;
    }
    Some(truthy(lookup(values, path)) != negate)
}

/// The template with simple actions filled in, `if` on simple values decided, and lines of
/// every other action left out.
pub(crate) fn fill(text: &str, values: &Value) -> String {
    const HOLE: char = '\u{1}';
    let mut filled = String::new();
    // Per open block: whether its current branch is rendered.
    let mut blocks: Vec<bool> = Vec::new();
    let mut at = 0;
    for (start, end, inner) in actions(text) {
        let active = blocks.iter().all(|b| *b);
        if active {
            filled.push_str(&text[at..start]);
        }
        let word = inner.split_whitespace().next().unwrap_or_default();
        match word {
            "if" => blocks.push(condition(inner[2..].trim(), values).unwrap_or(true)),
            "with" | "range" | "define" => blocks.push(true),
            "else" => {
                if let Some(top) = blocks.last_mut() {
                    *top = !*top || inner.starts_with("else if");
                }
            }
            "end" => {
                blocks.pop();
            }
            _ => {}
        }
        if active {
            match evaluate(&inner, values) {
                Some(v) => filled.push_str(&v),
                None => filled.push(HOLE),
            }
        }
        at = end;
    }
    filled.push_str(&text[at..]);
    filled
        .lines()
        .filter(|l| !l.contains(HOLE))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every YAML document of every template, filled in with the default values.
pub(crate) fn documents() -> Vec<(String, Value)> {
    documents_with(&values())
}

/// Every YAML document of every template, filled in with `values`.
pub(crate) fn documents_with(values: &Value) -> Vec<(String, Value)> {
    let mut docs = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(chart().join("templates"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    for file in files {
        let text = fill(&std::fs::read_to_string(&file).unwrap(), values);
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let value = <Value as serde::Deserialize>::deserialize(doc)
                .unwrap_or_else(|e| panic!("{}: not YAML: {e}\n{text}", file.display()));
            if !value.is_null() {
                docs.push((file.display().to_string(), value));
            }
        }
    }
    docs
}

pub(crate) fn find<'a>(docs: &'a [(String, Value)], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .map(|(_, d)| d)
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in the chart"))
}

pub(crate) fn strings(v: &Value) -> Vec<String> {
    v.as_sequence()
        .into_iter()
        .flatten()
        .filter_map(|s| s.as_str().map(str::to_owned))
        .collect()
}

/// Where a path a container names is on the node: through the container's mount with the
/// longest matching `mountPath`, to that volume's `hostPath` under `node`; `None` when no
/// mount of the chart provides it (the image holds only its binaries).
pub(crate) fn on_node(pod: &Value, container: &Value, path: &str, node: &Path) -> Option<PathBuf> {
    let volumes = pod["volumes"].as_sequence().unwrap();
    container["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|m| {
            let at = m["mountPath"].as_str()?;
            let rest = if path == at {
                ""
            } else {
                path.strip_prefix(at)?.strip_prefix('/')?
            };
            let volume = volumes.iter().find(|v| v["name"] == m["name"])?;
            let host = volume["hostPath"]["path"].as_str()?;
            Some((at.len(), node.join(host.trim_start_matches('/')).join(rest)))
        })
        .max_by_key(|(len, _)| *len)
        .map(|(_, p)| p)
}

/// The default values with `nvidiaDriverRoot` set to `root`.
pub(crate) fn with_driver_root(root: &str) -> Value {
    with_value(
        &values(),
        "nvidiaDriverRoot",
        Value::String(root.to_owned()),
    )
}

/// `values` with the value at the dotted `path` set to `value`.
pub(crate) fn with_value(values: &Value, path: &str, value: Value) -> Value {
    let mut out = values.clone();
    let mut at = &mut out;
    let keys: Vec<&str> = path.split('.').collect();
    for key in &keys[..keys.len() - 1] {
        at = at.get_mut(*key).unwrap();
    }
    at.as_mapping_mut()
        .unwrap()
        .insert(Value::String(keys[keys.len() - 1].to_owned()), value);
    out
}
