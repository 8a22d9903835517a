//! The rule that keeps a spec's bind sources out of a tenant's reach.
//!
//! A container runtime resolves a bind mount's host path when the container starts, following
//! any link on the way. A directory mounted read-write into a container is the tenant's: they
//! may replace anything inside it with a link. So a host path that lies inside such a directory
//! (another mount's source, or a path the node itself uses) is a path the tenant can redirect,
//! and the next container start binds wherever the link points: the host's `/`, read-write,
//! was one start away when a claim's lock directory lay inside its cache directory.
//!
//! [`check_sources`] refuses any spec whose mount sources nest or coincide, and any node path
//! that lies inside a source mounted read-write. It runs on every rendered spec.

use crate::error::Result;

use super::check;
use super::spec::Mount;

/// Whether a mount is read-write in the container: OCI mounts are read-write unless `ro`.
pub fn is_read_write(mount: &Mount) -> bool {
    !mount.options.iter().any(|o| o == "ro")
}

/// Whether the normalised absolute path `inner` is `outer` or lies below it (whole segments:
/// `/a/bc` is not inside `/a/b`).
pub fn lies_within(inner: &str, outer: &str) -> bool {
    inner == outer
        || inner
            .strip_prefix(outer)
            .is_some_and(|rest| rest.starts_with('/'))
}

/// Checks the mounts of one container and the host paths the node uses beside them:
///
/// * every source is an absolute, normalised path of plain characters (so ancestry can be
///   decided from the text alone);
/// * no source lies inside (or is) another source of the same container, whatever either's
///   access: inside a read-write one it is the tenant's to redirect, and a pair that nests one
///   way today nests the other way after the next change;
/// * no node path lies inside (or is) a source mounted read-write.
///
/// `who` names the claim in the error.
pub fn check_sources(who: &str, mounts: &[&Mount], node_paths: &[&str]) -> Result<()> {
    for (i, m) in mounts.iter().enumerate() {
        check::host_path(who, &format!("mounts[{i}].hostPath"), &m.host_path)?;
    }
    for (i, a) in mounts.iter().enumerate() {
        for (j, b) in mounts.iter().enumerate().skip(i + 1) {
            let (inner, outer) = if lies_within(&a.host_path, &b.host_path) {
                ((i, a), (j, b))
            } else if lies_within(&b.host_path, &a.host_path) {
                ((j, b), (i, a))
            } else {
                continue;
            };
            return Err(check::err(
                who,
                format!(
                    "mounts[{}].hostPath {:?} lies inside mounts[{}].hostPath {:?} ({} at {:?}): \
                     a container that can write the outer directory could replace the inner \
                     one with a link, which the next container start would follow; every bind \
                     source of a container must lie apart from the others",
                    inner.0,
                    inner.1.host_path,
                    outer.0,
                    outer.1.host_path,
                    if is_read_write(outer.1) {
                        "read-write"
                    } else {
                        "read-only"
                    },
                    outer.1.container_path,
                ),
            ));
        }
    }
    for (k, path) in node_paths.iter().enumerate() {
        check::host_path(who, &format!("nodePaths[{k}]"), path)?;
        if let Some((i, m)) = mounts
            .iter()
            .enumerate()
            .find(|(_, m)| is_read_write(m) && lies_within(path, &m.host_path))
        {
            return Err(check::err(
                who,
                format!(
                    "the node's path {path:?} lies inside mounts[{i}].hostPath {:?}, which \
                     containers write at {:?}: a tenant could replace it with a link",
                    m.host_path, m.container_path
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn mount(host: &str, access: &str) -> Mount {
        Mount {
            host_path: host.to_owned(),
            container_path: format!("/in{host}"),
            options: vec![access.to_owned(), "bind".to_owned()],
            mount_type: None,
        }
    }

    fn check(mounts: &[Mount], node: &[&str]) -> Result<()> {
        let refs: Vec<&Mount> = mounts.iter().collect();
        check_sources("ns/claim", &refs, node)
    }

    #[test]
    fn a_source_inside_a_read_write_source_is_refused_naming_both() {
        let err = check(
            &[mount("/c/uid", "rw"), mount("/c/uid/vgpulock", "rw")],
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("ns/claim"), "{err}");
        assert!(
            err.contains("mounts[1].hostPath \"/c/uid/vgpulock\" lies inside mounts[0].hostPath \"/c/uid\" (read-write"),
            "{err}"
        );
    }

    #[test]
    fn nesting_is_refused_whichever_comes_first_and_whatever_the_access() {
        for pair in [
            [mount("/c/uid/lock", "rw"), mount("/c/uid", "rw")],
            [mount("/c/uid/lib.so", "ro"), mount("/c/uid", "rw")],
            [mount("/c/uid", "ro"), mount("/c/uid/cache", "rw")],
            [mount("/c/uid", "rw"), mount("/c/uid", "rw")],
        ] {
            assert!(check(&pair, &[]).is_err(), "{pair:?}");
        }
    }

    #[test]
    fn siblings_and_prefixes_of_a_name_lie_apart() {
        check(
            &[
                mount("/c/uid/cache", "rw"),
                mount("/c/uid/vgpulock", "rw"),
                mount("/c/uid-2", "rw"),
                mount("/c/uid/cache2", "ro"),
            ],
            &["/c/uid", "/c"],
        )
        .unwrap();
    }

    #[test]
    fn a_node_path_inside_a_read_write_source_is_refused_but_inside_a_read_only_one_is_not() {
        let err = check(&[mount("/run/mps/x/pipe", "rw")], &["/run/mps/x/pipe/log"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("the node's path \"/run/mps/x/pipe/log\""),
            "{err}"
        );
        check(&[mount("/lib/hami", "ro")], &["/lib/hami/state"]).unwrap();
    }

    #[test]
    fn a_source_that_is_not_normalised_is_refused_before_ancestry_is_judged() {
        // `/c/x/../uid` is `/c/uid` to the kernel but not to a text comparison.
        let err = check(&[mount("/c/uid", "rw"), mount("/c/x/../uid/l", "rw")], &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("mounts[1].hostPath"), "{err}");
        assert!(err.contains("normalised"), "{err}");
        assert!(check(&[mount("c/uid", "rw")], &[]).is_err());
    }

    #[test]
    fn options_without_ro_are_read_write() {
        let mut m = mount("/a", "rw");
        m.options = vec!["bind".into()];
        assert!(is_read_write(&m));
        assert!(!is_read_write(&mount("/a", "ro")));
    }

    fn segment() -> impl Strategy<Value = String> {
        prop::sample::select(vec!["a", "b", "ab", "a.b", "a-b", "uid", "vgpulock"])
            .prop_map(str::to_owned)
    }

    fn path() -> impl Strategy<Value = String> {
        prop::collection::vec(segment(), 1..5).prop_map(|s| format!("/{}", s.join("/")))
    }

    proptest! {
        /// The check refuses a set of sources exactly when two of them nest, as the file
        /// system's own component-wise ancestry says.
        #[test]
        fn sources_are_refused_exactly_when_two_nest(
            paths in prop::collection::vec((path(), any::<bool>()), 0..6)
        ) {
            let mounts: Vec<Mount> = paths
                .iter()
                .map(|(p, rw)| mount(p, if *rw { "rw" } else { "ro" }))
                .collect();
            let nest = paths.iter().enumerate().any(|(i, (a, _))| {
                paths.iter().enumerate().any(|(j, (b, _))| {
                    i != j && std::path::Path::new(a).starts_with(b)
                })
            });
            prop_assert_eq!(check(&mounts, &[]).is_err(), nest);
        }

        /// Whatever lies below a read-write source is refused as a node path and as a second
        /// source.
        #[test]
        fn anything_below_a_read_write_source_is_refused(
            outer in path(),
            below in prop::collection::vec(segment(), 0..3),
        ) {
            let inner = if below.is_empty() {
                outer.clone()
            } else {
                format!("{outer}/{}", below.join("/"))
            };
            prop_assert!(check(&[mount(&outer, "rw")], &[&inner]).is_err());
            prop_assert!(check(&[mount(&outer, "rw"), mount(&inner, "ro")], &[]).is_err());
        }
    }
}
