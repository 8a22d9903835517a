//! A directory the node creates on the host for a claim or an MPS daemon, and the mode it gets.
//!
//! Each lies below a root the admin configured (`hamiCore.cacheDir`, `mps.pipeDirRoot`,
//! `mps.logDirRoot`). The kubelet plugin creates it from that root down through directory
//! handles that never follow a link, so the root is the one path of it resolved as written.

use std::collections::BTreeSet;

/// Mode of a host directory containers write (HAMi-core's accounting and lock directories):
/// they may run as any user, and HAMi-core in each of their processes creates and locks files
/// there. World-writable with the sticky bit, like the `/tmp` HAMi-core uses by default; only
/// the claim's own containers see them.
pub const CONTAINER_DIR_MODE: u32 = 0o1777;
/// Mode of a host directory only the node writes, such as the one that holds the directories a
/// claim's containers write: no container sees it, so no tenant can put a link in it.
pub const NODE_DIR_MODE: u32 = 0o755;

/// A host directory the node creates (and moves aside when it is no longer used).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostDir {
    /// The admin's root it lies below (an absolute, normalised path).
    pub root: String,
    /// Its path on the host: `root`, `/`, and one or more segments.
    pub path: String,
    /// Its mode ([`CONTAINER_DIR_MODE`], [`NODE_DIR_MODE`]).
    pub mode: u32,
    /// The uid it belongs to; `None`: the node's (the plugin's) user.
    pub owner: Option<u32>,
}

impl HostDir {
    /// `root/relative` with [`NODE_DIR_MODE`].
    pub fn node(root: &str, relative: &str) -> Self {
        Self::at(root, relative, NODE_DIR_MODE)
    }

    /// `root/relative` with [`CONTAINER_DIR_MODE`].
    pub fn container(root: &str, relative: &str) -> Self {
        Self::at(root, relative, CONTAINER_DIR_MODE)
    }

    /// `root/relative` with `mode`.
    pub fn at(root: &str, relative: &str, mode: u32) -> Self {
        let trimmed = root.trim_end_matches('/');
        Self {
            root: if trimmed.is_empty() { "/" } else { trimmed }.to_owned(),
            path: format!("{trimmed}/{relative}"),
            mode,
            owner: None,
        }
    }

    /// The same directory, given to `owner` (`None`: the node's user).
    #[must_use]
    pub fn owned_by(self, owner: Option<u32>) -> Self {
        Self { owner, ..self }
    }

    /// Its segments below the root, in order.
    pub fn segments(&self) -> Vec<&str> {
        self.path
            .strip_prefix(self.root.as_str())
            .unwrap_or_default()
            .split('/')
            .filter(|s| !s.is_empty())
            .collect()
    }

    /// Whether users other than the node's may write it.
    pub fn world_writable(&self) -> bool {
        self.mode & 0o002 != 0
    }
}

/// The entries of a claim root (`hamiCore.cacheDir`) that a starting plugin moves to the
/// reaper: every one named like a claim's own directory (a Kubernetes UID, which is a UUID)
/// that no claim of the record holds. Such a directory belonged to a record that was dropped
/// (of another boot, lost, or rolled back) and its containers may have left anything in it; it
/// is never handed to a new claim. Other names are left alone, should the root hold anything
/// else.
pub fn dropped<'a, I>(names: I, recorded: &BTreeSet<&str>) -> Vec<&'a str>
where
    I: IntoIterator<Item = &'a str>,
{
    names
        .into_iter()
        .filter(|n| is_uuid(n) && !recorded.contains(n))
        .collect()
}

/// `8-4-4-4-12` hex digits, as Kubernetes writes object UIDs.
fn is_uuid(s: &str) -> bool {
    let groups: Vec<&str> = s.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, n)| g.len() == n && g.bytes().all(|b| b.is_ascii_hexdigit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_start_drops_the_claim_directories_no_record_holds_and_nothing_else() {
        let kept = "0b7e2a64-1c0f-4a58-9d55-3f1f8e0c2a11";
        let lost = "7d1e2f30-4a5b-4c6d-8e9f-0a1b2c3d4e5f";
        let names = [
            kept,
            lost,
            ".tessera-reap",
            "probe-0",
            "not-a-uid",
            "7d1e2f30-4a5b-4c6d-8e9f-0a1b2c3d4e5",
            "7d1e2f30x4a5b-4c6d-8e9f-0a1b2c3d4e5f",
        ];
        assert_eq!(dropped(names, &BTreeSet::from([kept])), [lost]);
    }

    #[test]
    fn a_host_dir_is_its_root_and_the_segments_below() {
        let d = HostDir::container("/run/tessera/hami/", "uid-1/cache");
        assert_eq!(d.root, "/run/tessera/hami");
        assert_eq!(d.path, "/run/tessera/hami/uid-1/cache");
        assert_eq!(d.segments(), ["uid-1", "cache"]);
        assert!(d.world_writable());
        assert!(!HostDir::node("/r", "u").world_writable());
        let top = HostDir::node("/", "srv");
        assert_eq!((top.root.as_str(), top.path.as_str()), ("/", "/srv"));
        assert_eq!(top.segments(), ["srv"]);
    }
}
