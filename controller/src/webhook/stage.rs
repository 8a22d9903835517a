//! A stage of the webhook's connections: a bounded set in which every connection that waits on
//! its peer can be evicted to make room for a new one, the one that has waited longest first.
//!
//! A connection waits on its peer while the peer owes it bytes: the TLS handshake, a request's
//! head, a request's body. It is busy from the moment a request's body is complete until the
//! answer is handed to the connection; a busy connection is never evicted, and when every
//! place is busy a new connection is turned away. Two bounds decide whom a new connection
//! evicts:
//!
//! * one peer address may have at most `per_peer` connections waiting on it: one more from it
//!   evicts its own that has waited longest, so a peer that opens connections and dribbles or
//!   says nothing only ever evicts its own;
//! * the stage holds at most `capacity` connections: at a full stage a new connection evicts
//!   the one of any peer that has waited longest (many peers together can fill it).
//!
//! The API server's connection, which sends its review within milliseconds of its handshake,
//! is then never kept waiting: it takes a free place, or the place of a slow connection that
//! has waited longer. No lock is held while a peer is awaited; the stage's lock guards a few
//! map operations.
//!
//! ```text
//! let stage = Stage::new(Bounds { capacity: 512, per_peer: 128 });
//! let place = stage.enter(peer_ip);            // per connection; may evict a waiting one
//! tokio::select! { () = place.evicted() => return, done = serve => ... }
//! let busy = place.busy()?;                    // a request is complete; answer it
//! drop(busy);                                  // waiting on the peer again, as the newest
//! ```

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::watch;

/// How many connections a stage holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// Connections in the stage at once, waiting or busy.
    pub capacity: usize,
    /// Connections of one peer address waiting on it at once.
    pub per_peer: usize,
}

/// A bounded stage of connections; cloning it gives another handle on the same stage.
#[derive(Debug, Clone)]
pub(crate) struct Stage {
    line: Arc<Mutex<Line>>,
}

/// What the stage holds.
#[derive(Debug)]
struct Line {
    bounds: Bounds,
    /// The next connection number or waiting ticket (one sequence: later is larger).
    next: u64,
    /// Every connection in the stage, by its number.
    places: HashMap<u64, Seat>,
    /// The waiting connections, oldest first: their ticket, then their number.
    waiting: BTreeMap<u64, u64>,
    /// The same, by peer address (a peer with none waiting has no entry).
    waiting_by_peer: HashMap<IpAddr, BTreeMap<u64, u64>>,
}

/// One connection in the stage.
#[derive(Debug)]
struct Seat {
    peer: IpAddr,
    /// The ticket it took when it began to wait on its peer; `None` while it is busy.
    ticket: Option<u64>,
    /// Set when the connection is evicted.
    evict: watch::Sender<bool>,
}

/// A connection's place in a stage; dropping it leaves the stage.
#[derive(Debug)]
pub(crate) struct Place {
    line: Arc<Mutex<Line>>,
    number: u64,
    evicted: watch::Receiver<bool>,
}

/// A place while it is busy with a request; dropping it makes the place wait again, as the
/// newest waiting connection.
#[derive(Debug)]
pub(crate) struct Busy<'a> {
    place: &'a Place,
}

/// Whom a new connection evicted to get its place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Evicted {
    /// Nobody: there was room.
    Nobody,
    /// The connection of its own peer that had waited longest (the peer's bound).
    OwnOldest,
    /// The connection of any peer that had waited longest (the stage was full).
    Oldest,
}

/// What [`Stage::enter`] did.
#[derive(Debug)]
pub(crate) enum Entry {
    /// The connection has a place.
    Placed { place: Place, evicted: Evicted },
    /// Every place is busy: the connection is turned away.
    Full,
}

fn lock(line: &Mutex<Line>) -> MutexGuard<'_, Line> {
    line.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Line {
    fn ticket(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    /// Puts the connection `number` of `peer` at the end of the waiting line.
    fn wait(&mut self, number: u64, peer: IpAddr) -> u64 {
        let ticket = self.ticket();
        self.waiting.insert(ticket, number);
        self.waiting_by_peer
            .entry(peer)
            .or_default()
            .insert(ticket, number);
        ticket
    }

    /// Takes `ticket` of `peer` out of the waiting line.
    fn stop_waiting(&mut self, ticket: u64, peer: IpAddr) {
        self.waiting.remove(&ticket);
        if let Some(own) = self.waiting_by_peer.get_mut(&peer) {
            own.remove(&ticket);
            if own.is_empty() {
                self.waiting_by_peer.remove(&peer);
            }
        }
    }

    /// Takes the connection `number` out of the stage; tells it when `evict`.
    fn remove(&mut self, number: u64, evict: bool) {
        if let Some(seat) = self.places.remove(&number) {
            if let Some(ticket) = seat.ticket {
                self.stop_waiting(ticket, seat.peer);
            }
            if evict {
                seat.evict.send_replace(true);
            }
        }
    }

    /// The connection that has waited longest: of `peer`, or of anyone.
    fn oldest(&self, peer: Option<IpAddr>) -> Option<u64> {
        let line = match peer {
            Some(peer) => self.waiting_by_peer.get(&peer)?,
            None => &self.waiting,
        };
        line.first_key_value().map(|(_, number)| *number)
    }

    fn waiting_of(&self, peer: IpAddr) -> usize {
        self.waiting_by_peer.get(&peer).map_or(0, BTreeMap::len)
    }
}

impl Stage {
    /// A stage within `bounds` (each at least one).
    pub(crate) fn new(bounds: Bounds) -> Self {
        Self {
            line: Arc::new(Mutex::new(Line {
                bounds: Bounds {
                    capacity: bounds.capacity.max(1),
                    per_peer: bounds.per_peer.max(1),
                },
                next: 0,
                places: HashMap::new(),
                waiting: BTreeMap::new(),
                waiting_by_peer: HashMap::new(),
            })),
        }
    }

    /// Enters one connection from `peer`, waiting on it; evicts a waiting connection where a
    /// bound needs it (see the module's text), and turns the new one away when the stage is
    /// full of busy connections.
    pub(crate) fn enter(&self, peer: IpAddr) -> Entry {
        let mut line = lock(&self.line);
        let mut evicted = Evicted::Nobody;
        if line.waiting_of(peer) >= line.bounds.per_peer
            && let Some(own) = line.oldest(Some(peer))
        {
            line.remove(own, true);
            evicted = Evicted::OwnOldest;
        }
        if line.places.len() >= line.bounds.capacity {
            let Some(oldest) = line.oldest(None) else {
                return Entry::Full;
            };
            line.remove(oldest, true);
            evicted = Evicted::Oldest;
        }
        let number = line.ticket();
        let (evict, receiver) = watch::channel(false);
        let ticket = line.wait(number, peer);
        line.places.insert(
            number,
            Seat {
                peer,
                ticket: Some(ticket),
                evict,
            },
        );
        Entry::Placed {
            place: Place {
                line: Arc::clone(&self.line),
                number,
                evicted: receiver,
            },
            evicted,
        }
    }

    /// Evicts every waiting connection (the server stops); busy ones finish.
    pub(crate) fn evict_waiting(&self) {
        let mut line = lock(&self.line);
        while let Some(oldest) = line.oldest(None) {
            line.remove(oldest, true);
        }
    }

    /// How many connections are in the stage.
    #[cfg(test)]
    fn len(&self) -> usize {
        lock(&self.line).places.len()
    }
}

impl Place {
    /// Completes when the connection has been evicted (at once if it already was).
    pub(crate) async fn evicted(&self) {
        // The sender goes with the seat, after it said `true`: either way the place is gone.
        let _ = self.evicted.clone().wait_for(|evicted| *evicted).await;
    }

    /// Whether the connection has been evicted.
    #[cfg(test)]
    fn is_evicted(&self) -> bool {
        *self.evicted.borrow()
    }

    /// The place, busy with a request until the returned value is dropped; `None` when the
    /// connection was evicted already.
    pub(crate) fn busy(&self) -> Option<Busy<'_>> {
        let mut line = lock(&self.line);
        let seat = line.places.get_mut(&self.number)?;
        let peer = seat.peer;
        if let Some(ticket) = seat.ticket.take() {
            line.stop_waiting(ticket, peer);
        }
        Some(Busy { place: self })
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        let mut line = lock(&self.place.line);
        let number = self.place.number;
        let Some(seat) = line.places.get(&number) else {
            return;
        };
        if seat.ticket.is_none() {
            let peer = seat.peer;
            let ticket = line.wait(number, peer);
            if let Some(seat) = line.places.get_mut(&number) {
                seat.ticket = Some(ticket);
            }
        }
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        lock(&self.line).remove(self.number, false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 1));
    const B: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 2));

    fn stage(capacity: usize, per_peer: usize) -> Stage {
        Stage::new(Bounds { capacity, per_peer })
    }

    fn placed(entry: Entry) -> (Place, Evicted) {
        match entry {
            Entry::Placed { place, evicted } => (place, evicted),
            Entry::Full => panic!("the stage turned the connection away"),
        }
    }

    #[test]
    fn a_full_stage_evicts_the_connection_that_waited_longest() {
        let stage = stage(2, 2);
        let (first, evicted) = placed(stage.enter(A));
        assert_eq!(evicted, Evicted::Nobody);
        let (second, _) = placed(stage.enter(B));
        let (third, evicted) = placed(stage.enter(B));
        assert_eq!(evicted, Evicted::Oldest);
        assert!(first.is_evicted(), "the oldest is told to leave");
        assert!(!second.is_evicted());
        assert!(!third.is_evicted());
        assert_eq!(stage.len(), 2);
    }

    #[test]
    fn a_peer_past_its_bound_evicts_its_own_oldest_and_nobody_elses() {
        let stage = stage(8, 2);
        let (others, _) = placed(stage.enter(A));
        let (first, _) = placed(stage.enter(B));
        let (second, _) = placed(stage.enter(B));
        let (third, evicted) = placed(stage.enter(B));
        assert_eq!(evicted, Evicted::OwnOldest);
        assert!(first.is_evicted());
        assert!(
            !others.is_evicted(),
            "another peer's older connection stays"
        );
        assert!(!second.is_evicted());
        assert!(!third.is_evicted());
    }

    #[test]
    fn a_busy_connection_is_never_evicted_and_waits_again_as_the_newest() {
        let stage = stage(2, 2);
        let (first, _) = placed(stage.enter(A));
        let (second, _) = placed(stage.enter(A));
        let busy = first.busy().unwrap();
        let (third, evicted) = placed(stage.enter(B));
        assert_eq!(evicted, Evicted::Oldest);
        assert!(second.is_evicted(), "the oldest waiting one leaves");
        assert!(!first.is_evicted(), "the busy one stays");
        drop(busy);
        let (_fourth, _) = placed(stage.enter(B));
        assert!(third.is_evicted(), "third waited longer than first now");
        assert!(!first.is_evicted());
    }

    #[test]
    fn busy_connections_do_not_count_against_their_peers_bound() {
        let stage = stage(8, 1);
        let (answering, _) = placed(stage.enter(A));
        let _busy = answering.busy().unwrap();
        let (_waiting, evicted) = placed(stage.enter(A));
        assert_eq!(evicted, Evicted::Nobody);
        assert!(!answering.is_evicted());
    }

    #[test]
    fn a_stage_of_busy_connections_turns_a_new_one_away() {
        let stage = stage(1, 1);
        let (only, _) = placed(stage.enter(A));
        let _busy = only.busy().unwrap();
        assert!(matches!(stage.enter(B), Entry::Full));
        assert!(!only.is_evicted());
    }

    #[test]
    fn connections_that_left_make_room_without_evicting_anyone() {
        let stage = stage(2, 2);
        let (first, _) = placed(stage.enter(A));
        let (second, _) = placed(stage.enter(A));
        drop(first);
        let (third, evicted) = placed(stage.enter(A));
        assert_eq!(evicted, Evicted::Nobody);
        assert!(!second.is_evicted());
        assert!(!third.is_evicted());
    }

    #[test]
    fn an_evicted_connection_cannot_become_busy() {
        let stage = stage(1, 1);
        let (first, _) = placed(stage.enter(A));
        let (_second, _) = placed(stage.enter(B));
        assert!(first.busy().is_none());
        drop(first);
        assert_eq!(stage.len(), 1);
    }

    #[test]
    fn stopping_evicts_every_waiting_connection_and_keeps_the_busy_ones() {
        let stage = stage(4, 4);
        let (waiting, _) = placed(stage.enter(A));
        let (answering, _) = placed(stage.enter(B));
        let _busy = answering.busy().unwrap();
        stage.evict_waiting();
        assert!(waiting.is_evicted());
        assert!(!answering.is_evicted());
    }
}
