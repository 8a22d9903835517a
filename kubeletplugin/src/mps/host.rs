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
use crate::error::Result;

/// Where the host reads the checkpoint and how often.
#[derive(Debug, Clone)]
pub struct HostConfig {
    /// The plugin's checkpoint file.
    pub checkpoint: PathBuf,
    /// Reads it as the plugin reads its input files (a regular file of at most 64 MiB,
    /// `crate::claims::input_file`); `None` when it does not exist.
    pub read: fn(&Path) -> Result<Option<Vec<u8>>>,
    /// The current boot's id: a checkpoint of another boot records nothing.
    pub boot_id: String,
    /// Time between two passes.
    pub interval: Duration,
}

/// The checkpoint `config` names; a missing one records nothing.
fn read(config: &HostConfig) -> Result<Checkpoint> {
    match (config.read)(&config.checkpoint)? {
        Some(bytes) => Ok(Checkpoint::decode(&bytes, &config.boot_id)?),
        None => Ok(Checkpoint::new(config.boot_id.clone())),
    }
}

/// One pass: read the checkpoint, start or adopt what it needs, stop what it no longer
/// needs, restart daemons that died. A checkpoint that cannot be read changes nothing (a
/// daemon is never stopped because its claim could not be read). Blocking.
pub fn pass(supervisor: &MpsSupervisor, config: &HostConfig) -> Result<()> {
    let record = read(config)?;
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
