//! A linear pre-scan of YAML or JSON text that bounds how deeply it nests, before a parser sees
//! it.
//!
//! The YAML parser's cost grows with the square of the flow nesting depth (`[[[…]]]`): each
//! flow level keeps a possible simple key that every later token re-checks. Kubernetes objects
//! nest about fifteen levels deep; [`MAX_NESTING`] is far above that, and refusing deeper text
//! up front keeps every parse linear in the size of the input.
//!
//! The scan counts flow brackets outside quoted scalars and comments, and block nesting by
//! indentation (plus compact `- - -` entries). It is conservative on purpose: a bracket inside a
//! block scalar counts as nesting, which matters only for text holding dozens of unbalanced
//! opening brackets.

/// The deepest nesting accepted (flow and block levels together).
pub const MAX_NESTING: usize = 100;

/// Where the text first nests deeper than allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooDeep {
    /// The 1-based line.
    pub line: usize,
    /// The depth reached there.
    pub depth: usize,
}

/// Checks that `text` nests at most `max` levels deep; linear in the length of `text`.
pub fn check_nesting(text: &str, max: usize) -> Result<(), TooDeep> {
    let bytes = text.as_bytes();
    let mut flow = 0_usize;
    // Indentations of the open block levels, innermost last.
    let mut indents: Vec<usize> = Vec::new();
    let mut line = 1_usize;
    let mut i = 0_usize;
    let mut at_line_start = true;
    // The previous significant byte, to tell where a quoted scalar may start.
    let mut previous = b'\n';
    while i < bytes.len() {
        let b = bytes[i];
        if at_line_start {
            at_line_start = false;
            let start = i;
            while i < bytes.len() && bytes[i] == b' ' {
                i += 1;
            }
            let indent = i - start;
            let blank = i >= bytes.len() || matches!(bytes[i], b'\n' | b'\r' | b'#');
            if !blank && flow == 0 {
                while indents.last().is_some_and(|top| *top >= indent) {
                    indents.pop();
                }
                indents.push(indent);
                // Compact entries: "- - - x" opens one level per indicator.
                let mut j = i;
                let mut compact = 0;
                while j + 1 < bytes.len()
                    && matches!(bytes[j], b'-' | b'?')
                    && matches!(bytes[j + 1], b' ' | b'\t')
                {
                    compact += 1;
                    j += 2;
                    while j < bytes.len() && bytes[j] == b' ' {
                        j += 1;
                    }
                }
                let depth = indents.len() + compact;
                if depth > max {
                    return Err(TooDeep { line, depth });
                }
            }
            continue;
        }
        match b {
            b'\n' => {
                line += 1;
                at_line_start = true;
                previous = b'\n';
            }
            b'#' if matches!(previous, b' ' | b'\t' | b'\n') => {
                while i < bytes.len() && bytes[i] != b'\n' {
                    i += 1;
                }
                continue;
            }
            b'"' | b'\'' if quote_may_start(previous) => {
                i = skip_quoted(bytes, i, &mut line);
                previous = b'"';
                continue;
            }
            b'[' | b'{' => {
                flow += 1;
                let depth = flow + indents.len();
                if depth > max {
                    return Err(TooDeep { line, depth });
                }
                previous = b;
            }
            b']' | b'}' => {
                flow = flow.saturating_sub(1);
                previous = b;
            }
            b' ' | b'\t' | b'\r' => {
                if previous != b'\n' {
                    previous = b' ';
                }
            }
            _ => previous = b,
        }
        i += 1;
    }
    Ok(())
}

fn quote_may_start(previous: u8) -> bool {
    matches!(
        previous,
        b' ' | b'\t' | b'\n' | b'[' | b'{' | b',' | b':' | b'-' | b'?'
    )
}

/// The index just past the quoted scalar starting at `start` (or the end of the text).
fn skip_quoted(bytes: &[u8], start: usize, line: &mut usize) -> usize {
    let quote = bytes[start];
    let mut i = start + 1;
    while i < bytes.len() {
        match bytes[i] {
            b'\n' => *line += 1,
            b'\\' if quote == b'"' => i += 1,
            b'\'' if quote == b'\'' && bytes.get(i + 1) == Some(&b'\'') => i += 1,
            c if c == quote => return i + 1,
            _ => {}
        }
        i += 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubernetes_objects_pass() {
        let text = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: a # [[[[\nspec:\n  containers:\n  - name: c\n    args: [\"[[[[\", '{{{{']\n    env:\n    - {name: A, value: \"x\"}\n";
        assert_eq!(check_nesting(text, 8), Ok(()));
    }

    #[test]
    fn deep_flow_nesting_is_refused_at_the_limit() {
        let text = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert_eq!(
            check_nesting(&text, MAX_NESTING),
            Err(TooDeep {
                line: 1,
                depth: MAX_NESTING + 1
            })
        );
    }

    #[test]
    fn deep_block_nesting_is_refused() {
        let compact = format!("{}x\n", "- ".repeat(500));
        assert!(check_nesting(&compact, MAX_NESTING).is_err());
        let mut indented = String::new();
        for d in 0..200 {
            indented.push_str(&" ".repeat(d));
            indented.push('k');
            indented.push_str(&d.to_string());
            indented.push_str(":\n");
        }
        assert!(check_nesting(&indented, MAX_NESTING).is_err());
    }

    #[test]
    fn brackets_in_quotes_and_comments_do_not_count() {
        let text = format!(
            "a: \"{}\"\nb: '{}'\n# {}\n",
            "[".repeat(500),
            "{".repeat(500),
            "[".repeat(500)
        );
        assert_eq!(check_nesting(&text, 4), Ok(()));
    }
}
