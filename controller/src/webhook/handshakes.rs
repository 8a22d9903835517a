//! The handshake stage: connections that are accepted but not yet served.
//!
//! The accept loop never waits for anything but the listener. Each accepted connection enters
//! this stage, where it must finish its TLS handshake and get one of the serving slots within
//! the handshake timeout; until then it holds no slot. The stage itself holds at most
//! `capacity` connections: when a new one arrives at a full stage, the connection that has
//! waited longest is dropped to make room. A client that opens connections and sends nothing
//! therefore cannot keep the API server out: its connections neither hold serving slots nor
//! stop the accept loop, and the API server's fresh connection, which finishes its handshake in
//! milliseconds, is never the oldest one waiting.
//!
//! ```text
//! let mut stage = HandshakeStage::new(MAX_HANDSHAKES);
//! let evicted = stage.admit();          // per accepted connection
//! tokio::select! { _ = evicted => return, ready = handshake => serve(ready) }
//! ```

use std::collections::VecDeque;

use tokio::sync::oneshot;

/// Connections in the handshake stage, oldest first.
#[derive(Debug)]
pub(crate) struct HandshakeStage {
    capacity: usize,
    /// One sender per connection still in the stage; sending on it, or dropping it, tells the
    /// connection to give up. A connection that left the stage dropped its receiver.
    waiting: VecDeque<oneshot::Sender<()>>,
}

/// Resolves when the connection is to leave the stage unserved (evicted, or the server stops).
pub(crate) type Eviction = oneshot::Receiver<()>;

impl HandshakeStage {
    /// A stage for at most `capacity` connections at once (at least one).
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            waiting: VecDeque::new(),
        }
    }

    /// Enters one connection; returns what tells it to give up, and whether an older
    /// connection was evicted to make room.
    pub(crate) fn admit(&mut self) -> (Eviction, bool) {
        if self.waiting.len() >= self.capacity {
            // Forget the connections that already left (served, failed or timed out).
            self.waiting.retain(|s| !s.is_closed());
        }
        let mut evicted = false;
        while self.waiting.len() >= self.capacity {
            if let Some(oldest) = self.waiting.pop_front() {
                evicted |= oldest.send(()).is_ok();
            }
        }
        let (tx, rx) = oneshot::channel();
        self.waiting.push_back(tx);
        (rx, evicted)
    }

    /// How many connections may still be in the stage (some may have left since).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.waiting.iter().filter(|s| !s.is_closed()).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_stage_evicts_the_connection_that_waited_longest() {
        let mut stage = HandshakeStage::new(2);
        let (mut first, evicted) = stage.admit();
        assert!(!evicted);
        let (mut second, _) = stage.admit();
        let (mut third, evicted) = stage.admit();
        assert!(evicted);
        assert!(first.try_recv().is_ok(), "the oldest is told to give up");
        assert!(second.try_recv().is_err());
        assert!(third.try_recv().is_err());
        assert_eq!(stage.len(), 2);
    }

    #[test]
    fn connections_that_left_make_room_without_evicting_anyone() {
        let mut stage = HandshakeStage::new(2);
        let (first, _) = stage.admit();
        let (mut second, _) = stage.admit();
        drop(first); // finished its handshake and went on to be served
        let (mut third, evicted) = stage.admit();
        assert!(!evicted);
        assert!(second.try_recv().is_err());
        assert!(third.try_recv().is_err());
    }

    #[test]
    fn dropping_the_stage_tells_every_waiting_connection_to_give_up() {
        let mut stage = HandshakeStage::new(4);
        let (mut one, _) = stage.admit();
        drop(stage);
        assert!(matches!(
            one.try_recv(),
            Err(oneshot::error::TryRecvError::Closed)
        ));
    }
}
