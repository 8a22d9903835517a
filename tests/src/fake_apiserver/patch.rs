//! JSON merge patch (RFC 7386), JSON patch (RFC 6902) and the selector languages of list and
//! watch, over `serde_json::Value`.

use serde_json::Value;

/// Applies a JSON merge patch to `target`.
pub(crate) fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(patch_map) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(serde_json::Map::new());
    }
    if let Value::Object(target_map) = target {
        for (key, value) in patch_map {
            if value.is_null() {
                target_map.remove(key);
            } else {
                merge_patch(target_map.entry(key.clone()).or_insert(Value::Null), value);
            }
        }
    }
}

fn unescape(token: &str) -> String {
    token.replace("~1", "/").replace("~0", "~")
}

fn split_pointer(path: &str) -> Result<Vec<String>, String> {
    if path.is_empty() {
        return Ok(Vec::new());
    }
    let rest = path
        .strip_prefix('/')
        .ok_or_else(|| format!("path {path:?} does not start with '/'"))?;
    Ok(rest.split('/').map(unescape).collect())
}

fn parent_mut<'a>(doc: &'a mut Value, tokens: &[String]) -> Result<&'a mut Value, String> {
    let mut at = doc;
    for token in tokens {
        at = match at {
            Value::Object(map) => map
                .get_mut(token)
                .ok_or_else(|| format!("no member {token:?}"))?,
            Value::Array(items) => {
                let i: usize = token
                    .parse()
                    .map_err(|_| format!("bad array index {token:?}"))?;
                items
                    .get_mut(i)
                    .ok_or_else(|| format!("index {i} out of range"))?
            }
            _ => return Err(format!("cannot descend into {token:?}")),
        };
    }
    Ok(at)
}

fn add(doc: &mut Value, path: &str, value: Value) -> Result<(), String> {
    let tokens = split_pointer(path)?;
    let Some((last, head)) = tokens.split_last() else {
        *doc = value;
        return Ok(());
    };
    match parent_mut(doc, head)? {
        Value::Object(map) => {
            map.insert(last.clone(), value);
            Ok(())
        }
        Value::Array(items) => {
            if last == "-" {
                items.push(value);
                return Ok(());
            }
            let i: usize = last
                .parse()
                .map_err(|_| format!("bad array index {last:?}"))?;
            if i > items.len() {
                return Err(format!("index {i} out of range"));
            }
            items.insert(i, value);
            Ok(())
        }
        _ => Err(format!("cannot add at {path:?}")),
    }
}

fn remove(doc: &mut Value, path: &str) -> Result<Value, String> {
    let tokens = split_pointer(path)?;
    let Some((last, head)) = tokens.split_last() else {
        return Err("cannot remove the whole document".to_owned());
    };
    match parent_mut(doc, head)? {
        Value::Object(map) => map
            .remove(last)
            .ok_or_else(|| format!("no member {last:?}")),
        Value::Array(items) => {
            let i: usize = last
                .parse()
                .map_err(|_| format!("bad array index {last:?}"))?;
            if i >= items.len() {
                return Err(format!("index {i} out of range"));
            }
            Ok(items.remove(i))
        }
        _ => Err(format!("cannot remove at {path:?}")),
    }
}

fn get<'a>(doc: &'a Value, path: &str) -> Result<&'a Value, String> {
    doc.pointer(path)
        .ok_or_else(|| format!("path {path:?} does not exist"))
}

/// Applies a strict JSON patch: any failing operation fails the whole patch.
pub(crate) fn json_patch(target: &mut Value, ops: &Value) -> Result<(), String> {
    let ops = ops
        .as_array()
        .ok_or_else(|| "a JSON patch must be an array".to_owned())?;
    let mut doc = target.clone();
    for op in ops {
        let field = |k: &str| op.get(k).and_then(Value::as_str);
        let path = field("path").ok_or_else(|| "operation without path".to_owned())?;
        let value = || {
            op.get("value")
                .cloned()
                .ok_or_else(|| format!("operation on {path:?} without value"))
        };
        match field("op") {
            Some("add") => add(&mut doc, path, value()?)?,
            Some("remove") => {
                remove(&mut doc, path)?;
            }
            Some("replace") => {
                remove(&mut doc, path)?;
                add(&mut doc, path, value()?)?;
            }
            Some("test") => {
                if *get(&doc, path)? != value()? {
                    return Err(format!("test of {path:?} failed"));
                }
            }
            Some("move") => {
                let from = field("from").ok_or_else(|| "move without from".to_owned())?;
                let moved = remove(&mut doc, from)?;
                add(&mut doc, path, moved)?;
            }
            Some("copy") => {
                let from = field("from").ok_or_else(|| "copy without from".to_owned())?;
                let copied = get(&doc, from)?.clone();
                add(&mut doc, path, copied)?;
            }
            other => return Err(format!("unknown operation {other:?}")),
        }
    }
    *target = doc;
    Ok(())
}

/// One requirement of a label selector.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

/// Splits on commas that are not inside parentheses.
fn split_top(selector: &str) -> Vec<String> {
    let mut parts = Vec::new();
    let mut depth = 0_i32;
    let mut current = String::new();
    for c in selector.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(std::mem::take(&mut current));
                continue;
            }
            _ => {}
        }
        current.push(c);
    }
    parts.push(current);
    parts
        .into_iter()
        .map(|p| p.trim().to_owned())
        .filter(|p| !p.is_empty())
        .collect()
}

fn parse_set(s: &str) -> Result<Vec<String>, String> {
    let inner = s
        .trim()
        .strip_prefix('(')
        .and_then(|s| s.strip_suffix(')'))
        .ok_or_else(|| format!("bad set {s:?}"))?;
    Ok(inner.split(',').map(|v| v.trim().to_owned()).collect())
}

fn parse_label_selector(selector: &str) -> Result<Vec<Requirement>, String> {
    split_top(selector)
        .into_iter()
        .map(|part| {
            if let Some((k, v)) = part.split_once("!=") {
                return Ok(Requirement::NotEquals(k.trim().into(), v.trim().into()));
            }
            if let Some((k, v)) = part.split_once("==").or_else(|| part.split_once('=')) {
                return Ok(Requirement::Equals(k.trim().into(), v.trim().into()));
            }
            if let Some((k, v)) = part.split_once(" notin ") {
                return Ok(Requirement::NotIn(k.trim().into(), parse_set(v)?));
            }
            if let Some((k, v)) = part.split_once(" in ") {
                return Ok(Requirement::In(k.trim().into(), parse_set(v)?));
            }
            if let Some(k) = part.strip_prefix('!') {
                return Ok(Requirement::NotExists(k.trim().into()));
            }
            if part.contains([' ', '(', ')']) {
                return Err(format!("cannot parse label selector {part:?}"));
            }
            Ok(Requirement::Exists(part))
        })
        .collect()
}

/// Whether `object` matches the label selector (`k=v`, `k==v`, `k!=v`, `k in (..)`,
/// `k notin (..)`, `k`, `!k`, comma-separated).
pub(crate) fn matches_labels(object: &Value, selector: &str) -> Result<bool, String> {
    let labels = object
        .pointer("/metadata/labels")
        .and_then(Value::as_object);
    let label = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
    Ok(parse_label_selector(selector)?.iter().all(|r| match r {
        Requirement::Equals(k, v) => label(k) == Some(v.as_str()),
        Requirement::NotEquals(k, v) => label(k) != Some(v.as_str()),
        Requirement::In(k, vs) => label(k).is_some_and(|l| vs.iter().any(|v| v == l)),
        Requirement::NotIn(k, vs) => label(k).is_none_or(|l| vs.iter().all(|v| v != l)),
        Requirement::Exists(k) => label(k).is_some(),
        Requirement::NotExists(k) => label(k).is_none(),
    }))
}

/// The value at a dotted field path as a field selector compares it (strings as they are,
/// other scalars printed, absent as the empty string).
fn field_value(object: &Value, path: &str) -> String {
    let mut at = object;
    for key in path.split('.') {
        match at.get(key) {
            Some(v) => at = v,
            None => return String::new(),
        }
    }
    match at {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// Whether `object` matches the field selector (`path=v`, `path==v`, `path!=v`,
/// comma-separated; any dotted path, e.g. `spec.nodeName`).
pub(crate) fn matches_fields(object: &Value, selector: &str) -> Result<bool, String> {
    for part in split_top(selector) {
        let (path, value, equal) = if let Some((k, v)) = part.split_once("!=") {
            (k, v, false)
        } else if let Some((k, v)) = part.split_once("==").or_else(|| part.split_once('=')) {
            (k, v, true)
        } else {
            return Err(format!("cannot parse field selector {part:?}"));
        };
        if (field_value(object, path.trim()) == value.trim()) != equal {
            return Ok(false);
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {

    use serde_json::json;

    use super::*;

    #[test]
    fn merge_patch_removes_nulls_and_merges_objects() {
        let mut doc = json!({"a": {"b": 1, "c": 2}, "d": 3});
        merge_patch(&mut doc, &json!({"a": {"b": null, "e": 4}, "d": [1]}));
        assert_eq!(doc, json!({"a": {"c": 2, "e": 4}, "d": [1]}));
    }

    #[test]
    fn json_patch_is_all_or_nothing() {
        let mut doc = json!({"a": [1, 2]});
        json_patch(
            &mut doc,
            &json!([{"op": "add", "path": "/a/-", "value": 3}, {"op": "replace", "path": "/a/0", "value": 0}]),
        )
        .unwrap();
        assert_eq!(doc, json!({"a": [0, 2, 3]}));
        let err = json_patch(
            &mut doc,
            &json!([{"op": "remove", "path": "/a/0"}, {"op": "test", "path": "/a/0", "value": 9}]),
        );
        assert!(err.is_err());
        assert_eq!(doc, json!({"a": [0, 2, 3]}));
    }

    #[test]
    fn selectors_match() {
        let o =
            json!({"metadata": {"labels": {"app": "x", "tier": "a"}}, "spec": {"nodeName": "n1"}});
        assert!(matches_labels(&o, "app=x,tier in (a, b)").unwrap());
        assert!(!matches_labels(&o, "app!=x").unwrap());
        assert!(matches_labels(&o, "!missing,app").unwrap());
        assert!(matches_fields(&o, "spec.nodeName=n1").unwrap());
        assert!(!matches_fields(&o, "spec.nodeName=n2").unwrap());
    }
}
