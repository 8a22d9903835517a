//! Regular expressions of selectors (`matches`, `find`, `findAll`): bounded and compiled once.
//!
//! A pattern is refused before it is compiled when it is longer than [`MAX_PATTERN_LENGTH`]
//! bytes or its [`weight`] (about the number of automaton states it compiles to, repetitions
//! expanded and Unicode classes counted by their ranges) exceeds [`MAX_PATTERN_WEIGHT`]; that
//! bounds both the work of compiling it and, with the text length, the work of one match (the
//! regex crate matches in time proportional to states × text). Compiled patterns are kept in a
//! process-wide cache, so a selector evaluated against thousands of devices compiles each of its
//! patterns once.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};

use regex_syntax::hir::{Class, Hir, HirKind};

/// The longest pattern accepted, in bytes.
pub(crate) const MAX_PATTERN_LENGTH: usize = 1024;

/// The heaviest pattern accepted (see [`weight`]).
pub(crate) const MAX_PATTERN_WEIGHT: u64 = 10_000;

/// The most compiled patterns kept; when full, an arbitrary one makes room.
const CACHE_CAPACITY: usize = 1024;

/// The regex crate's own limit on a compiled program, a second line of defence.
const COMPILED_SIZE_LIMIT: usize = 4 << 20;

type Compiled = Result<Arc<regex::Regex>, String>;

static CACHE: LazyLock<Mutex<HashMap<String, Compiled>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// The weight of `pattern`: literal characters, plus the ranges of each character class,
/// multiplied out through repetitions (an unbounded repetition counts its minimum plus one).
/// `Err` says why the pattern is refused: it does not parse, or it is too long or too heavy.
pub(crate) fn weight(pattern: &str) -> Result<u64, String> {
    if pattern.len() > MAX_PATTERN_LENGTH {
        return Err(format!(
            "regular expression is {} bytes long, more than the limit of {MAX_PATTERN_LENGTH}",
            pattern.len()
        ));
    }
    let hir = regex_syntax::ParserBuilder::new()
        .nest_limit(64)
        .build()
        .parse(pattern)
        .map_err(|e| format!("invalid regular expression {pattern:?}: {e}"))?;
    let w = hir_weight(&hir);
    if w > MAX_PATTERN_WEIGHT {
        return Err(format!(
            "regular expression {pattern:?} is too expensive: it expands to about {w} states, \
             more than the limit of {MAX_PATTERN_WEIGHT} (use smaller repetition counts or \
             ASCII classes such as [a-zA-Z0-9_] instead of \\w)"
        ));
    }
    Ok(w)
}

fn hir_weight(hir: &Hir) -> u64 {
    match hir.kind() {
        HirKind::Empty | HirKind::Look(_) => 1,
        HirKind::Literal(l) => l.0.len() as u64,
        HirKind::Class(Class::Unicode(c)) => c.ranges().len().max(1) as u64,
        HirKind::Class(Class::Bytes(c)) => c.ranges().len().max(1) as u64,
        HirKind::Repetition(r) => {
            let times = u64::from(r.max.unwrap_or(r.min.saturating_add(1)).max(1));
            hir_weight(&r.sub).saturating_mul(times)
        }
        HirKind::Capture(c) => hir_weight(&c.sub),
        HirKind::Concat(subs) | HirKind::Alternation(subs) => subs
            .iter()
            .fold(1u64, |acc, s| acc.saturating_add(hir_weight(s))),
    }
}

/// `pattern` compiled, from the cache when it was compiled before; `Err` says why it is refused.
pub(crate) fn compiled(pattern: &str) -> Compiled {
    if let Ok(cache) = CACHE.lock()
        && let Some(hit) = cache.get(pattern)
    {
        return hit.clone();
    }
    let result = weight(pattern).and_then(|_| {
        regex::RegexBuilder::new(pattern)
            .size_limit(COMPILED_SIZE_LIMIT)
            .build()
            .map(Arc::new)
            .map_err(|e| format!("invalid regular expression {pattern:?}: {e}"))
    });
    if let Ok(mut cache) = CACHE.lock() {
        if cache.len() >= CACHE_CAPACITY
            && let Some(victim) = cache.keys().next().cloned()
        {
            cache.remove(&victim);
        }
        cache.insert(pattern.to_owned(), result.clone());
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simple_patterns_are_light() {
        assert!(weight("^a100").is_ok_and(|w| w < 10));
        assert!(weight("^(a100|h100)-[0-9]+g$").is_ok_and(|w| w < 50));
    }

    #[test]
    fn repeated_unicode_classes_are_refused() {
        let e = weight(r"\w{200}").unwrap_err();
        assert!(e.contains("too expensive"), "{e}");
        assert!(
            weight(&"a".repeat(2000))
                .unwrap_err()
                .contains("bytes long")
        );
        assert!(
            weight("(")
                .unwrap_err()
                .contains("invalid regular expression")
        );
    }

    #[test]
    fn a_pattern_is_compiled_once() {
        let a = compiled("^cached-[0-9]$").unwrap();
        let b = compiled("^cached-[0-9]$").unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        assert!(a.is_match("cached-7"));
    }
}
