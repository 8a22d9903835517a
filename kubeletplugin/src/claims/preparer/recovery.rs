//! Recovery at start: what a crash interrupted is finished, every half-done claim rolled back.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use tessera_driver::node::cdi::{self, Enforcement};
use tessera_driver::node::checkpoint::{Checkpoint, ClaimEntry};
use tessera_driver::node::host_dir;
use tracing::{debug, info, warn};

use super::{CHECKPOINT_FILE, CdiPreparer, cdi_spec_prefix, top_dirs};
use crate::claims::{atomic_file, crash};
use crate::error::{Error, Result};

impl CdiPreparer {
    /// Finishes what a crash interrupted: temp files of interrupted writes go, every claim
    /// recorded as half prepared or half unprepared is rolled back to absent, every CDI spec
    /// of ours that no entry records goes (a record of another boot, or a leak), and the trees
    /// an earlier run set aside are removed in the background. A host directory that cannot be
    /// removed is a warning, never a failed start.
    pub(super) fn recover(&self) -> Result<()> {
        let temps = atomic_file::remove_temp_files(&self.config.state_dir, CHECKPOINT_FILE)?
            + atomic_file::remove_temp_files(&self.config.cdi_dir, &cdi_spec_prefix())?;
        if temps > 0 {
            info!(files = temps, "removed temp files of interrupted writes");
        }
        let mut record = self.lock()?;
        let mut parents = BTreeSet::new();
        if let Enforcement::HamiCore { cache_dir, .. } = &self.config.enforcement {
            parents.insert(PathBuf::from(cache_dir));
        }
        for entry in record.claims.values() {
            for dir in top_dirs(&entry.host_dirs) {
                if let Some(parent) = Path::new(dir).parent() {
                    parents.insert(parent.to_owned());
                }
            }
        }
        for parent in &parents {
            self.reaper.resume(parent);
        }
        let unfinished = record.unfinished();
        if !unfinished.is_empty() {
            let mut next = record.clone();
            for uid in &unfinished {
                if let Some(entry) = next.get(uid) {
                    if let Err(e) = self.discard_dirs(entry) {
                        warn!(claim = %uid, error = %e, "a host directory of a claim a crash left half done could not be removed");
                    }
                    crash::point(crash::UNPREPARE_AFTER_HOST_DIRS_REMOVED);
                    atomic_file::remove(&self.config.cdi_dir, &cdi::spec_file_name(uid))?;
                    crash::point(crash::UNPREPARE_AFTER_CDI_REMOVED);
                }
                next.remove(uid);
                info!(claim = %uid, "rolled back a claim a crash left half done");
            }
            self.commit(&mut record, next)?;
        }
        self.drop_unrecorded_dirs(&record);
        self.remove_orphan_specs(&record)
    }

    /// Moves to the reaper every claim directory under the HAMi-core cache directory that
    /// `record` does not hold ([`host_dir::dropped`]): its record was of another boot, lost, or
    /// rolled back, and a tenant may have left anything in it, links included. A directory that
    /// cannot be moved is a warning (creating a claim's directories refuses anything it did not
    /// make anyway).
    fn drop_unrecorded_dirs(&self, record: &Checkpoint) {
        let Enforcement::HamiCore { cache_dir, .. } = &self.config.enforcement else {
            return;
        };
        let root = Path::new(cache_dir);
        let names = match list_names(root) {
            Ok(names) => names,
            Err(e) => {
                warn!(path = %root.display(), error = %e, "cannot list the claim directories");
                return;
            }
        };
        let recorded: BTreeSet<&str> = record
            .claims
            .values()
            .flat_map(|e| &e.host_dirs)
            .filter_map(|d| Path::new(d).strip_prefix(root).ok())
            .filter_map(|rest| rest.iter().next()?.to_str())
            .collect();
        for name in host_dir::dropped(names.iter().map(String::as_str), &recorded) {
            let dir = root.join(name);
            match self.reaper.discard(&dir) {
                Ok(_) => {
                    info!(path = %dir.display(), "moved a claim directory no record holds to the reaper");
                }
                Err(e) => {
                    warn!(path = %dir.display(), error = %e, "a claim directory no record holds could not be moved aside");
                }
            }
        }
    }

    /// Removes every spec file of ours whose claim `record` does not hold.
    pub(super) fn remove_orphan_specs(&self, record: &Checkpoint) -> Result<()> {
        let dir = &self.config.cdi_dir;
        let entries = std::fs::read_dir(dir).map_err(|e| Error::io("listing", dir, e))?;
        let prefix = cdi_spec_prefix();
        let mut orphans = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| Error::io("listing", dir, e))?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let Some(uid) = name
                .strip_prefix(&prefix)
                .and_then(|rest| rest.strip_suffix(".json"))
            else {
                continue;
            };
            if !record.claims.keys().any(|k| cdi::spec_file_name(k) == name) {
                debug!(claim = %uid.escape_debug(), "a CDI spec no entry records");
                orphans.push(name.to_owned());
            }
        }
        if orphans.is_empty() {
            return Ok(());
        }
        let names: Vec<&str> = orphans.iter().map(String::as_str).collect();
        for result in atomic_file::remove_all(dir, &names) {
            result?;
        }
        info!(
            specs = orphans.len(),
            "removed CDI specs of claims the checkpoint does not record (another boot's, or left by a failure)"
        );
        Ok(())
    }

    /// Moves the claim's host directories aside for the reaper (each one rename, whatever a
    /// container left in them).
    pub(super) fn discard_dirs(&self, entry: &ClaimEntry) -> Result<()> {
        for dir in top_dirs(&entry.host_dirs) {
            self.reaper.discard(Path::new(dir))?;
        }
        Ok(())
    }
}

/// The names in `dir` that are text (others are no claim's); none when it does not exist.
fn list_names(dir: &Path) -> Result<Vec<String>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io("listing", dir, e)),
    };
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("listing", dir, e))?;
        if let Ok(name) = entry.file_name().into_string() {
            names.push(name);
        }
    }
    Ok(names)
}
