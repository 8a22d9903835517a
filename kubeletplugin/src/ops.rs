//! The operations wing: the process's logs ([`init_logs`]), its Prometheus metrics ([`metrics`],
//! fed around the preparer) and the `/metrics`, `/healthz`, `/readyz` endpoint
//! ([`health_http`]). The tasks that run them next to the plugin's sockets are started by
//! `cli::ops_tasks`.
//!
//! May import: `kubelet` (readiness follows kubelet's registration verdict), `claims` (the
//! preparer the metrics wrap) and `error`. Nothing here imports `gpus`, `accounting`,
//! `publisher` or `cli`.

pub mod health_http;
pub mod metrics;

use clap::ValueEnum;

/// How log lines are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Plain,
    /// One JSON object per line, for log collectors.
    Json,
}

/// Installs the process's log subscriber; `RUST_LOG` sets the level (default `info`).
pub fn init_logs(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Plain => builder.fmt_fields(escaped_fields()).init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// The plain format's fields, with every control character escaped (`\n`, `\u{0}`, `\u{1b}`),
/// and every format character or line separator too ([`tessera_kubeapi::text::is_hidden`]),
/// in the message and in each value: claim names and UIDs come from kubelet's calls, errors
/// quote what the API server sent, and none of them may end a line or forge one. (The JSON
/// format escapes them already.)
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

fn write_escaped(writer: &mut impl std::fmt::Write, text: &str) -> std::fmt::Result {
    for c in text.chars() {
        if tessera_kubeapi::text::is_hidden(c) {
            write!(writer, "{}", c.escape_default())?;
        } else {
            writer.write_char(c)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

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

    #[test]
    fn a_plain_log_line_cannot_be_forged_by_a_claim_name() {
        let buffer = Buffer::default();
        let out = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || out.clone())
            .with_ansi(false)
            .fmt_fields(escaped_fields())
            .finish();
        let name = "c\n2026-01-01T00:00:00Z  INFO forged: prepared\u{0}\u{1b}[31m\u{202e}\u{2028}";
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(claim = %name, uid = ?name, "claim {name} failed");
        });
        let text = String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap();
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(
            !text.contains(['\0', '\u{1b}', '\u{202e}', '\u{2028}']),
            "{text:?}"
        );
        assert!(text.contains("claim=c\\n2026"), "{text}");
        assert!(text.contains("claim c\\n2026"), "{text}");
    }
}
