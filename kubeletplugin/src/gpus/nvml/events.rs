//! Waiting for NVML's XID events on a thread of its own (the wait blocks).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tessera_driver::node::health::{GpuEvent, GpuHealthTracker};
use tracing::{info, warn};

use super::{NvmlEvents, NvmlLibrary, locked};
use crate::error::{Error, Result};

/// Takes one event (or none within `timeout`) into `health`; returns whether a GPU's health
/// changed.
pub fn watch_step(
    events: &mut dyn NvmlEvents,
    health: &Mutex<GpuHealthTracker>,
    timeout: Duration,
) -> Result<bool> {
    let Some(event) = events.wait(timeout)? else {
        return Ok(false);
    };
    let changed = locked(health)?.observe(&event.uuid, GpuEvent::Xid(event.xid));
    if changed {
        warn!(uuid = %event.uuid, xid = event.xid, "GPU is unhealthy after a critical XID");
    } else {
        info!(uuid = %event.uuid, xid = event.xid, "XID reported; the GPU's health is unchanged");
    }
    Ok(changed)
}

/// The thread that waits for XID events and wakes the inventory watcher on a health change.
#[derive(Debug)]
pub struct NvmlHealthWatcher {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl NvmlHealthWatcher {
    /// Starts waiting for events of `lib`'s GPUs, `wait` at a time (the longest a stop takes).
    pub fn start(
        lib: Arc<dyn NvmlLibrary>,
        health: Arc<Mutex<GpuHealthTracker>>,
        wake: Arc<tokio::sync::Notify>,
        wait: Duration,
    ) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("nvml-events".to_owned())
            .spawn(move || {
                let mut events = match lib.events() {
                    Ok(e) => e,
                    Err(e) => {
                        warn!(error = %e, "no XID events; GPU health comes from queries only");
                        return;
                    }
                };
                while !stopping.load(Ordering::Relaxed) {
                    match watch_step(events.as_mut(), &health, wait) {
                        Ok(true) => wake.notify_one(),
                        Ok(false) => {}
                        Err(e) => {
                            warn!(error = %e, "waiting for NVML events failed");
                            std::thread::sleep(wait);
                        }
                    }
                }
            })
            .map_err(|e| Error::io("starting", "the NVML event thread", e))?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }

    /// Stops the thread (within one wait).
    pub fn shutdown(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
