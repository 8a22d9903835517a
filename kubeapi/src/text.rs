//! Text taken from objects, calls and files, made safe to print: the characters a terminal or
//! a log reader would not show as themselves.

use unicode_properties::{GeneralCategory, UnicodeGeneralCategory};

/// Whether `c` must be escaped before it is printed: a control character (`\n`, `\u{0}`,
/// `\u{1b}`: it could end a line, forge one or drive a terminal), a format character
/// (category Cf: bidi overrides such as U+202E, zero-width spaces: they reorder or hide what
/// follows), or a line or paragraph separator (U+2028, U+2029: some readers break the line).
pub fn is_hidden(c: char) -> bool {
    c.is_control()
        || matches!(
            c.general_category(),
            GeneralCategory::Format
                | GeneralCategory::LineSeparator
                | GeneralCategory::ParagraphSeparator
        )
}

/// `text` with every character [`is_hidden`] names written as its escape (`\n`, `\u{1b}`,
/// `\u{202e}`), for a text that reaches a log line, a terminal or `kubectl describe`.
pub fn escaped(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    // Writing to a String cannot fail.
    let _ = write_escaped(&mut out, text);
    out
}

/// Writes `text` to `writer` as [`escaped`] gives it.
pub fn write_escaped(writer: &mut impl std::fmt::Write, text: &str) -> std::fmt::Result {
    for c in text.chars() {
        if is_hidden(c) {
            write!(writer, "{}", c.escape_default())?;
        } else {
            writer.write_char(c)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hidden_characters_are_escaped_and_the_rest_kept() {
        assert_eq!(
            escaped("claim\n\u{1b}[31mé\u{202e}\u{2028}"),
            "claim\\n\\u{1b}[31mé\\u{202e}\\u{2028}"
        );
    }

    #[test]
    fn controls_formats_and_separators_are_hidden_and_text_is_not() {
        for c in [
            '\n', '\0', '\u{1b}', '\u{7f}', '\u{202e}', '\u{2067}', '\u{200b}', '\u{2028}',
            '\u{2029}',
        ] {
            assert!(is_hidden(c), "{c:?}");
        }
        for c in ['a', ' ', 'é', '日', '-', '/', '\u{1F600}'] {
            assert!(!is_hidden(c), "{c:?}");
        }
    }
}
