//! Crash points for the crash-safety tests, compiled into every build and inert unless the
//! environment names one.
//!
//! `TESSERA_CRASH_AT=<point>` makes the process abort the moment it reaches `<point>`;
//! `TESSERA_CRASH_SKIP=<n>` lets the first `n` visits pass (the same point is visited by every
//! atomic write, for example). Aborting loses everything in memory and nothing on disk, which
//! for on-disk state is what SIGKILL or a power cut of the process does.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// Environment variable naming the crash point.
pub const CRASH_AT_ENV: &str = "TESSERA_CRASH_AT";
/// Environment variable: how many visits of the crash point pass before the abort.
pub const CRASH_SKIP_ENV: &str = "TESSERA_CRASH_SKIP";

/// Every crash point the plugin has, in the order a prepare then an unprepare visits them.
pub const POINTS: &[&str] = &[
    PREPARE_AFTER_CHECKPOINT_STARTED,
    PREPARE_AFTER_HOST_DIRS,
    PREPARE_AFTER_CDI_WRITTEN,
    PREPARE_AFTER_CHECKPOINT_COMPLETED,
    UNPREPARE_AFTER_CHECKPOINT_STARTED,
    UNPREPARE_AFTER_HOST_DIRS_REMOVED,
    UNPREPARE_AFTER_CDI_REMOVED,
    UNPREPARE_AFTER_CHECKPOINT_REMOVED,
    ATOMIC_WRITE_TEMP_SYNCED,
    ATOMIC_WRITE_RENAMED,
];

/// Prepare: "prepare started" is durable; nothing else is written.
pub const PREPARE_AFTER_CHECKPOINT_STARTED: &str = "prepare-after-checkpoint-started";
/// Prepare: the claim's host directories exist.
pub const PREPARE_AFTER_HOST_DIRS: &str = "prepare-after-host-dirs";
/// Prepare: the CDI spec is durable; the checkpoint still says "started".
pub const PREPARE_AFTER_CDI_WRITTEN: &str = "prepare-after-cdi-written";
/// Prepare: "prepare completed" is durable; kubelet has no answer yet.
pub const PREPARE_AFTER_CHECKPOINT_COMPLETED: &str = "prepare-after-checkpoint-completed";
/// Unprepare: "unprepare started" is durable; nothing is removed yet.
pub const UNPREPARE_AFTER_CHECKPOINT_STARTED: &str = "unprepare-after-checkpoint-started";
/// Unprepare: the host directories are gone.
pub const UNPREPARE_AFTER_HOST_DIRS_REMOVED: &str = "unprepare-after-host-dirs-removed";
/// Unprepare: the CDI spec is gone; the checkpoint still has the claim.
pub const UNPREPARE_AFTER_CDI_REMOVED: &str = "unprepare-after-cdi-removed";
/// Unprepare: the claim is gone from the checkpoint; kubelet has no answer yet.
pub const UNPREPARE_AFTER_CHECKPOINT_REMOVED: &str = "unprepare-after-checkpoint-removed";
/// Any atomic write: the temp file is written and synced, not yet renamed.
pub const ATOMIC_WRITE_TEMP_SYNCED: &str = "atomic-write-temp-synced";
/// Any atomic write: renamed into place, directory not yet synced.
pub const ATOMIC_WRITE_RENAMED: &str = "atomic-write-renamed";

struct Armed {
    point: String,
    skip: u64,
    visits: AtomicU64,
}

fn armed() -> Option<&'static Armed> {
    static ARMED: OnceLock<Option<Armed>> = OnceLock::new();
    ARMED
        .get_or_init(|| {
            let point = std::env::var(CRASH_AT_ENV).ok().filter(|p| !p.is_empty())?;
            let skip = std::env::var(CRASH_SKIP_ENV)
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            tracing::warn!(%point, skip, "crash point armed: this process will abort there");
            Some(Armed {
                point,
                skip,
                visits: AtomicU64::new(0),
            })
        })
        .as_ref()
}

/// Aborts the process when the environment names `point` and its skip count is used up.
pub fn point(point: &str) {
    if let Some(armed) = armed()
        && armed.point == point
        && armed.visits.fetch_add(1, Ordering::SeqCst) >= armed.skip
    {
        tracing::error!(point, "crash point reached: aborting");
        std::process::abort();
    }
}
