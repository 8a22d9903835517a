//! The API server's rules for labels and annotations, which every kind shares
//! (upstream's `ValidateLabels` and `ValidateAnnotations` in apimachinery's object-meta
//! validation).
//!
//! * A label key and an annotation key are qualified names: an optional DNS-subdomain prefix
//!   and `/`, then a name of at most 63 characters, alphanumeric at both ends, with `-`, `_`
//!   and `.` inside. Annotation keys are checked in lower case (their case does not matter).
//! * A label value is empty or such a name (at most 63 characters).
//! * All annotation keys and values together take at most 256 KiB (262,144 bytes, counted in
//!   bytes of UTF-8).

use std::collections::BTreeMap;

use crate::rules::limits;

/// `TotalAnnotationSizeLimitB`: bytes of all annotation keys and values of one object.
pub const MAX_ANNOTATIONS_BYTES: usize = 256 * 1024;
/// The longest name part of a qualified name, and the longest label value.
const MAX_NAME: usize = 63;

/// Whether `s` is the name part of a qualified name (or a non-empty label value).
fn is_name_part(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= MAX_NAME
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

/// Why `key` is not a qualified name, if it is not.
fn qualified_name_problem(key: &str) -> Option<String> {
    let (prefix, name) = match key.split('/').collect::<Vec<_>>()[..] {
        [name] => (None, name),
        [prefix, name] => (Some(prefix), name),
        _ => {
            return Some(format!(
                "{key:?} must be a qualified name: a name with at most one '/' before it"
            ));
        }
    };
    if let Some(prefix) = prefix
        && !limits::is_dns_subdomain(prefix, limits::MAX_DNS_SUBDOMAIN)
    {
        return Some(format!(
            "{key:?}: the prefix {prefix:?} must be a DNS subdomain of at most {} characters",
            limits::MAX_DNS_SUBDOMAIN
        ));
    }
    (!is_name_part(name)).then(|| {
        format!(
            "{key:?}: the name {name:?} must be at most {MAX_NAME} characters of letters, digits, \
             '-', '_' and '.', beginning and ending with a letter or digit"
        )
    })
}

/// The problems of an object's labels, as (field, message).
pub(super) fn label_problems(labels: &BTreeMap<String, String>) -> Vec<(String, String)> {
    let mut problems = Vec::new();
    for (key, value) in labels {
        if let Some(p) = qualified_name_problem(key) {
            problems.push(("metadata.labels".to_owned(), p));
        }
        if !value.is_empty() && !is_name_part(value) {
            problems.push((
                format!("metadata.labels[{key}]"),
                format!(
                    "{value:?} must be empty or at most {MAX_NAME} characters of letters, \
                     digits, '-', '_' and '.', beginning and ending with a letter or digit"
                ),
            ));
        }
    }
    problems
}

/// The problems of an object's annotations, as (field, message).
pub(super) fn annotation_problems(annotations: &BTreeMap<String, String>) -> Vec<(String, String)> {
    let mut problems = Vec::new();
    for key in annotations.keys() {
        if let Some(p) = qualified_name_problem(&key.to_lowercase()) {
            problems.push(("metadata.annotations".to_owned(), p));
        }
    }
    let total = annotations
        .iter()
        .map(|(k, v)| k.len().saturating_add(v.len()))
        .fold(0usize, usize::saturating_add);
    if total > MAX_ANNOTATIONS_BYTES {
        problems.push((
            "metadata.annotations".to_owned(),
            format!(
                "keys and values take {total} bytes together; at most {MAX_ANNOTATIONS_BYTES} \
                 bytes (256 KiB) are allowed"
            ),
        ));
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::string_map as map;

    #[test]
    fn annotations_up_to_256_kib_in_all_are_accepted_and_one_byte_more_is_not() {
        let key = "example.com/note";
        let at_limit = "x".repeat(MAX_ANNOTATIONS_BYTES - key.len());
        assert!(annotation_problems(&map(&[(key, &at_limit)])).is_empty());
        let over = format!("{at_limit}x");
        let problems = annotation_problems(&map(&[(key, &over)]));
        assert_eq!(problems.len(), 1);
        assert_eq!(problems[0].0, "metadata.annotations");
        assert!(problems[0].1.contains("262145 bytes"), "{problems:?}");
    }

    #[test]
    fn keys_are_qualified_names_and_annotation_keys_ignore_case() {
        assert!(annotation_problems(&map(&[("Example.COM/Note", "")])).is_empty());
        assert_eq!(label_problems(&map(&[("Example.COM/app", "a")])).len(), 1);
        assert!(label_problems(&map(&[("app.kubernetes.io/name", "tessera")])).is_empty());
        assert_eq!(annotation_problems(&map(&[("a/b/c", "")])).len(), 1);
        assert_eq!(annotation_problems(&map(&[("-a", "")])).len(), 1);
        assert_eq!(annotation_problems(&map(&[(&"a".repeat(64), "")])).len(), 1);
    }

    #[test]
    fn label_values_are_empty_or_short_names() {
        assert!(label_problems(&map(&[("a", "")])).is_empty());
        assert_eq!(label_problems(&map(&[("a", "-x")])).len(), 1);
        assert_eq!(label_problems(&map(&[("a", &"v".repeat(64))])).len(), 1);
    }
}
