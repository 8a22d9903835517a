//! `tessera-mps host`: the node's MPS daemon host. It runs in a pod of its own (the chart's
//! `tessera-mps` `DaemonSet`, `updateStrategy: OnDelete`), so the daemons it starts live outside
//! the plugin's container: a plugin restart, crash or rollout leaves them and their clients
//! alone.
//!
//! It follows the plugin's checkpoint, read-only: every recorded claim with an MPS daemon gets
//! its daemon (adopted when one already answers on its control socket), and a daemon is
//! stopped once the checkpoint no longer records any claim that uses it
//! (`tessera_driver::node::mps::reconcile`). The plugin records a claim before it writes the claim's
//! CDI spec and waits for the daemon to answer before it reports the claim prepared; it
//! removes the claim only once it is unprepared. So the checkpoint is the whole interface
//! between the two: a file written atomically, no socket and no API object.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tessera_driver::node::checkpoint::Checkpoint;
use tessera_driver::node::mps;
use tracing::{debug, warn};

use super::MpsSupervisor;
use crate::error::{Error, Result};

/// Where the host reads the checkpoint and how often.
#[derive(Debug, Clone)]
pub struct HostConfig {
    /// The plugin's checkpoint file.
    pub checkpoint: PathBuf,
    /// The current boot's id: a checkpoint of another boot records nothing.
    pub boot_id: String,
    /// Time between two passes.
    pub interval: Duration,
}

fn read(path: &Path, boot_id: &str) -> Result<Checkpoint> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(Checkpoint::decode(&bytes, boot_id)?),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Checkpoint::new(boot_id)),
        Err(e) => Err(Error::io("reading", path, e)),
    }
}

/// One pass: read the checkpoint, start or adopt what it needs, stop what it no longer
/// needs, restart daemons that died. A checkpoint that cannot be read changes nothing (a
/// daemon is never stopped because its claim could not be read). Blocking.
pub fn pass(supervisor: &MpsSupervisor, config: &HostConfig) -> Result<()> {
    let record = read(&config.checkpoint, &config.boot_id)?;
    let step = mps::reconcile(record.mps_daemons(), &supervisor.claims()?);
    for (claim, daemon) in &step.ensure {
        if let Err(e) = supervisor.ensure(claim, daemon) {
            warn!(claim, daemon = %daemon.id, error = %e, "MPS control daemon not running; retrying");
        }
    }
    for claim in &step.release {
        debug!(claim, "claim no longer recorded; releasing its daemon");
        supervisor.release(claim)?;
    }
    supervisor.check(Instant::now())
}

/// Runs passes until the process is stopped. The daemons are the host's children: in a pod
/// they end with its container; outside one, a new host adopts them.
pub fn run(supervisor: &MpsSupervisor, config: &HostConfig) -> ! {
    loop {
        if let Err(e) = pass(supervisor, config) {
            warn!(checkpoint = %config.checkpoint.display(), error = %e, "MPS host pass failed");
        }
        std::thread::sleep(config.interval);
    }
}
