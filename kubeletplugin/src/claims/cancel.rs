//! A call's cancellation: kubelet gives up on a call (its deadline passes, or it closes the
//! stream), tonic drops the call's future, and the blocking work the call started, which no
//! drop can stop, sees the flag and stops at the next claim.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Set once the call it belongs to is given up.
#[derive(Debug, Clone, Default)]
pub struct Cancel(Arc<AtomicBool>);

impl Cancel {
    /// A call not cancelled (yet).
    pub fn new() -> Self {
        Self::default()
    }

    /// Marks the call given up.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// Whether the call was given up.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    /// A guard that cancels the call when dropped before [`OnDrop::finish`]: held by the call's
    /// future, it fires exactly when tonic drops that future unfinished.
    pub fn on_drop(&self) -> OnDrop {
        OnDrop(Some(self.clone()))
    }
}

/// See [`Cancel::on_drop`].
#[derive(Debug)]
pub struct OnDrop(Option<Cancel>);

impl OnDrop {
    /// The call finished: dropping the guard now cancels nothing.
    pub fn finish(mut self) {
        self.0 = None;
    }
}

impl Drop for OnDrop {
    fn drop(&mut self) {
        if let Some(cancel) = self.0.take() {
            cancel.cancel();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_guard_cancels_and_a_finished_one_does_not() {
        let cancel = Cancel::new();
        cancel.on_drop().finish();
        assert!(!cancel.is_cancelled());
        drop(cancel.on_drop());
        assert!(cancel.is_cancelled());
    }
}
