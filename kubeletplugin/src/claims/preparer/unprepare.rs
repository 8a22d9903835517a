//! The unprepare phase: a call's claims recorded started, their host directories moved aside
//! and specs removed, their entries dropped.

use tessera_driver::node::cdi;
use tessera_driver::node::checkpoint::{ClaimEntry, PrepareState};
use tracing::{debug, info, warn};

use super::{CdiPreparer, OneOutcome as _, Outcomes, fail_unanswered, finish, mismatch, shared};
use crate::claims::cancel::Cancel;
use crate::claims::{ClaimRef, atomic_file, crash};
use crate::error::{Error, Result};

impl CdiPreparer {
    /// Unprepares a claim (one claim of [`CdiPreparer::unprepare_all_blocking`]). Blocking.
    pub fn unprepare_blocking(&self, claim: &ClaimRef) -> Result<()> {
        self.unprepare_all_blocking(std::slice::from_ref(claim), &Cancel::new())
            .only_outcome()
    }

    /// Unprepares the claims of one call: one write to record them started, their host
    /// directories moved aside and their specs removed (one sync for all), one write to drop
    /// their entries. A claim whose entry names another namespace or name than kubelet's is
    /// refused. Blocking.
    pub fn unprepare_all_blocking(&self, claims: &[ClaimRef], cancel: &Cancel) -> Vec<Result<()>> {
        let mut out: Outcomes<()> = claims.iter().map(|_| None).collect();
        let begun = self.begin_unprepare_all(claims, cancel, &mut out);
        let removing = match begun {
            Ok(removing) => removing,
            Err(e) => return fail_unanswered(out, &e),
        };
        if removing.is_empty() {
            return finish(out);
        }
        crash::point(crash::UNPREPARE_AFTER_CHECKPOINT_STARTED);
        let mut specs = Vec::new();
        for (index, entry) in removing {
            let _span = claims[index].span("unprepare").entered();
            if cancel.is_cancelled() {
                out[index] = Some(Err(Error::Cancelled));
                continue;
            }
            match self.discard_dirs(&entry) {
                Ok(()) => specs.push(index),
                Err(e) => out[index] = Some(Err(e)),
            }
        }
        crash::point(crash::UNPREPARE_AFTER_HOST_DIRS_REMOVED);
        let names: Vec<String> = specs
            .iter()
            .map(|&i| cdi::spec_file_name(&claims[i].uid))
            .collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let mut gone = Vec::new();
        for (index, result) in specs
            .into_iter()
            .zip(atomic_file::remove_all(&self.config.cdi_dir, &refs))
        {
            match result {
                Ok(()) => gone.push(index),
                Err(e) => out[index] = Some(Err(e)),
            }
        }
        crash::point(crash::UNPREPARE_AFTER_CDI_REMOVED);
        let removed = (|| {
            let mut record = self.lock()?;
            let mut next = record.clone();
            for &index in &gone {
                next.remove(&claims[index].uid);
            }
            self.commit(&mut record, next)
        })();
        if let Err(e) = removed {
            for index in gone {
                out[index] = Some(Err(shared(&e)));
            }
            return finish(out);
        }
        crash::point(crash::UNPREPARE_AFTER_CHECKPOINT_REMOVED);
        for index in gone {
            let claim = &claims[index];
            let _span = claim.span("unprepare").entered();
            if let Some(supervisor) = &self.mps {
                // The claim is gone from the record either way; a daemon that does not stop
                // cleanly is killed and forgotten by the supervisor.
                if let Err(e) = supervisor.release(&claim.uid) {
                    warn!(%claim, error = %e, "stopping the claim's MPS daemon failed");
                }
            }
            info!(%claim, "unprepared");
            out[index] = Some(Ok(()));
        }
        finish(out)
    }

    /// Records "unprepare started" for every claim of `claims` the checkpoint holds, in one
    /// write; returns them with their entries. The others get their outcome in `out`: not
    /// prepared is fine, an entry of another namespace or name is refused.
    pub(super) fn begin_unprepare_all(
        &self,
        claims: &[ClaimRef],
        cancel: &Cancel,
        out: &mut Outcomes<()>,
    ) -> Result<Vec<(usize, ClaimEntry)>> {
        let mut record = self.lock()?;
        let mut next = record.clone();
        let mut changed = false;
        let mut removing = Vec::new();
        for (index, claim) in claims.iter().enumerate() {
            let _span = claim.span("unprepare").entered();
            if cancel.is_cancelled() {
                out[index] = Some(Err(Error::Cancelled));
                continue;
            }
            if let Err(e) = claim.validate() {
                out[index] = Some(Err(e));
                continue;
            }
            let Some(entry) = next.get(&claim.uid).cloned() else {
                debug!(%claim, "not prepared; nothing to undo");
                out[index] = Some(Ok(()));
                continue;
            };
            if entry.namespace != claim.namespace || entry.name != claim.name {
                out[index] = Some(Err(mismatch(claim, &entry)));
                continue;
            }
            if entry.state != PrepareState::UnprepareStarted {
                next.begin_unprepare(&claim.uid);
                changed = true;
            }
            removing.push((index, entry));
        }
        if changed {
            self.commit(&mut record, next)?;
        }
        Ok(removing)
    }
}
