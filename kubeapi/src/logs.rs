//! The process's log lines, written one way by every Tessera binary (the controller, the kubelet
//! plugin, `tessera-mps`): plain lines for people, or one JSON object per line for collectors.
//!
//! Plain lines escape, in the message and in every field of the event and its spans, each
//! character [`crate::text::is_hidden`] names (control characters such as `\n` and `\u{1b}`,
//! format characters such as U+202E, line separators): object names, claim UIDs and the API
//! server's error texts reach log lines, and none of them may end a line, forge one, drive a
//! terminal or read as other than it is. (The JSON format escapes them already.) Colour codes
//! are written only to a terminal, and not where `NO_COLOR` is set: a container's log, a pipe
//! or a file gets plain text.
//!
//! ```no_run
//! use tessera_kubeapi::logs::{LogFormat, Stream};
//! tessera_kubeapi::logs::init(LogFormat::Plain, Stream::Stdout);
//! ```

use std::io::IsTerminal as _;

use tracing_subscriber::fmt::MakeWriter;

use crate::text::write_escaped;

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Plain,
    /// One JSON object per line, for log collectors.
    Json,
}

/// Where a binary writes its log lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// Standard output (the controller's).
    Stdout,
    /// Standard error (the node agent's, whose standard output may carry answers).
    Stderr,
}

impl Stream {
    fn is_terminal(self) -> bool {
        match self {
            Self::Stdout => std::io::stdout().is_terminal(),
            Self::Stderr => std::io::stderr().is_terminal(),
        }
    }
}

/// Whether lines are coloured: only on a `terminal`, and not where `NO_COLOR` is set to
/// anything but the empty text (no-color.org).
pub fn colour(terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    terminal && no_color.is_none_or(std::ffi::OsStr::is_empty)
}

/// Installs the process's log subscriber, writing to `stream`; `RUST_LOG` sets the level
/// (default `info`). A subscriber installed before stays (the call does nothing).
pub fn init(format: LogFormat, stream: Stream) {
    let colour = colour(
        stream.is_terminal(),
        std::env::var_os("NO_COLOR").as_deref(),
    );
    let installed = match stream {
        Stream::Stdout => {
            tracing::subscriber::set_global_default(subscriber(format, std::io::stdout, colour))
        }
        Stream::Stderr => {
            tracing::subscriber::set_global_default(subscriber(format, std::io::stderr, colour))
        }
    };
    // Already installed: by a test, or by a library caller that chose its own.
    let _ = installed;
}

/// The subscriber [`init`] installs, writing to `writer`, with colour codes only when
/// `colour`.
pub fn subscriber<W>(
    format: LogFormat,
    writer: W,
    colour: bool,
) -> Box<dyn tracing::Subscriber + Send + Sync>
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer);
    match format {
        LogFormat::Plain => Box::new(
            builder
                .with_ansi(colour)
                .fmt_fields(escaped_fields())
                .finish(),
        ),
        LogFormat::Json => Box::new(builder.json().finish()),
    }
}

/// The plain format's fields: the message and each value (of the event and of its spans) with
/// every hidden character escaped ([`crate::text::write_escaped`]).
pub fn escaped_fields() -> impl for<'w> tracing_subscriber::fmt::FormatFields<'w> + 'static {
    use tracing_subscriber::field::MakeExt as _;
    tracing_subscriber::fmt::format::debug_fn(|writer, field, value| {
        let text = format!("{value:?}");
        let name = field.name();
        if name != "message" {
            write!(writer, "{name}=")?;
        }
        write_escaped(writer, &text)
    })
    .delimited(" ")
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// What a subscriber wrote, as a pipe or a file would hold it.
    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buffer {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Buffer {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
        }
    }

    const FORGED: &str =
        "c\n2026-01-01T00:00:00Z  INFO forged: prepared\u{0}\u{1b}[31m\u{202e}\u{2028}";

    /// The plain lines the subscriber writes off a terminal for a warning naming `FORGED` in
    /// a span's field, the event's fields (shown and debugged) and the message.
    fn plain_lines() -> String {
        let buffer = Buffer::default();
        let out = buffer.clone();
        let subscriber = subscriber(LogFormat::Plain, move || out.clone(), false);
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("work", pod = %FORGED);
            let _entered = span.enter();
            tracing::warn!(claim = %FORGED, uid = ?FORGED, "claim {FORGED} failed");
        });
        buffer.text()
    }

    #[test]
    fn a_plain_log_line_cannot_be_forged_by_a_name() {
        let text = plain_lines();
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(
            !text.contains(['\0', '\u{1b}', '\u{202e}', '\u{2028}']),
            "{text:?}"
        );
        assert!(text.contains("claim=c\\n2026"), "{text}");
        assert!(text.contains("claim c\\n2026"), "{text}");
        assert!(text.contains("pod=c\\n2026"), "the span's field: {text}");
        assert!(text.contains("\\u{202e}"), "{text}");
    }

    #[test]
    fn lines_off_a_terminal_carry_no_colour_codes() {
        let text = plain_lines();
        assert!(!text.contains('\u{1b}'), "{text:?}");
        assert!(text.contains("WARN"), "{text}");
    }

    #[test]
    fn colour_is_for_a_terminal_without_no_color() {
        assert!(colour(true, None));
        assert!(colour(true, Some("".as_ref())));
        assert!(!colour(true, Some("1".as_ref())));
        assert!(!colour(false, None));
    }

    #[test]
    fn json_lines_escape_what_they_quote() {
        let buffer = Buffer::default();
        let out = buffer.clone();
        let subscriber = subscriber(LogFormat::Json, move || out.clone(), false);
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(claim = %FORGED, "claim failed");
        });
        let text = buffer.text();
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(!text.contains(['\0', '\u{1b}']), "{text:?}");
        let line: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
        assert_eq!(line["fields"]["claim"], FORGED);
    }
}
