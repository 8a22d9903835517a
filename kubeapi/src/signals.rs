//! The stop signal of a long-running binary.
//!
//! A signal that arrives before its handler is installed takes the default action: `SIGTERM`
//! ends the process at once, with no clean shutdown and a failed exit. A binary that starts
//! serving before it first awaits its stop would be killed by a `SIGTERM` in that window (kubelet
//! stops a plugin's pod as soon as it likes), so the handlers are installed when
//! [`shutdown`] is called, not when its future is first polled.

use std::future::Future;

use tokio::signal::unix::{SignalKind, signal};

/// Installs handlers for `SIGTERM` and `SIGINT` now, and returns a future that completes when
/// either arrives. Call it inside the runtime, before the binary starts serving. A handler that
/// cannot be installed is logged, and the future waits for the other signal.
pub fn shutdown() -> impl Future<Output = ()> + Send + 'static {
    let install = |kind: SignalKind, name: &'static str| match signal(kind) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, signal = name, "cannot watch the signal; the binary stops on the other");
            None
        }
    };
    let term = install(SignalKind::terminate(), "SIGTERM");
    let int = install(SignalKind::interrupt(), "SIGINT");
    async move {
        let wait = |s: Option<tokio::signal::unix::Signal>| async move {
            match s {
                Some(mut s) => {
                    s.recv().await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            () = wait(term) => {}
            () = wait(int) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "current_thread")]
    async fn a_sigterm_sent_before_the_future_is_polled_is_caught_and_ends_it() {
        let stop = shutdown();
        // The signal comes while nothing awaits the stop yet, as a SIGTERM during start-up does.
        send_sigterm_to_this_process();
        tokio::time::timeout(std::time::Duration::from_secs(10), stop)
            .await
            .expect("the SIGTERM sent before the first poll ends the stop future");
    }

    fn send_sigterm_to_this_process() {
        let status = std::process::Command::new("kill")
            .args(["-TERM", &std::process::id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }
}
