//! What `/proc` says about a GPU process, read as bytes.
//!
//! `/proc/<pid>/stat` and `/proc/<pid>/cgroup` hold names a tenant chooses: the command
//! (`prctl(PR_SET_NAME)` takes any 15 bytes, `)`, spaces and newlines included) and the names
//! of any sub-cgroups it may create below its container's. Neither is UTF-8 by rule, so the
//! plugin hands both over as bytes and the rules here never assume more than the kernel
//! promises. One process that cannot be read or attributed is left out of the pass with a
//! [`Skip`]; it never fails the pass for the other processes on the node.

use super::GpuProcess;

/// Why a process NVML listed was left out of one accounting pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Skip {
    /// Its `/proc` files could not be read (not because it ended: that is no skip).
    Unreadable,
    /// Its `stat` has no start time where the kernel writes one.
    BadStat,
    /// Its cgroup lines name different pods.
    PodsDisagree,
}

impl Skip {
    /// Every reason, for metrics that list each.
    pub const ALL: [Self; 3] = [Self::Unreadable, Self::BadStat, Self::PodsDisagree];

    /// The metric label of the reason.
    pub const fn label(self) -> &'static str {
        match self {
            Self::Unreadable => "unreadable",
            Self::BadStat => "bad_stat",
            Self::PodsDisagree => "pods_disagree",
        }
    }
}

/// The pod a process's cgroups put it in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attribution {
    /// Every line that names a pod names this one (its UID).
    Pod(String),
    /// No line names a pod: the process runs outside kubelet's pods.
    NoPod,
    /// Two lines name different pods: whose it is cannot be told.
    Disagree,
}

/// The start time of a process, in clock ticks since boot: field 22 of `/proc/<pid>/stat`.
///
/// Field 2 is the command in parentheses, and the command may itself hold `)`, spaces and any
/// other byte; the kernel writes no `)` after it, so the fields are counted from the *last*
/// `)`. `None` when the text has no such field.
pub fn start_ticks(stat: &[u8]) -> Option<u64> {
    let close = stat.iter().rposition(|&b| b == b')')?;
    // After the `)` comes field 3 (the state): field 22 is the 20th field there.
    let field = stat[close + 1..]
        .split(u8::is_ascii_whitespace)
        .filter(|f| !f.is_empty())
        .nth(19)?;
    if field.is_empty() || field.len() > 20 || !field.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(field).ok()?.parse().ok()
}

/// The pod whose cgroup `/proc/<pid>/cgroup` (the bytes as read) puts the process in.
///
/// Each line is `<hierarchy>:<controllers>:<path>`. The v2 line (`0::`) is read first, then the
/// v1 lines; the process belongs to a pod only when every line that names a pod names the same
/// one. On cgroup v1 a process can sit in different groups per hierarchy, and a tenant who can
/// write one of them (often `name=systemd`) could otherwise blame another pod; a cgroup name may
/// even hold a newline and forge a whole line. Lines that disagree leave the process
/// unattributed: it is left alone, and never counted against anyone.
pub fn attribute(cgroup: &[u8]) -> Attribution {
    let mut lines: Vec<&[u8]> = cgroup
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .collect();
    lines.sort_by_key(|l| !l.starts_with(b"0::"));
    let mut found: Option<String> = None;
    for line in lines {
        let Some(uid) = cgroup_path(line).and_then(pod_in_path) else {
            continue;
        };
        match &found {
            None => found = Some(uid),
            Some(first) if *first == uid => {}
            Some(_) => return Attribution::Disagree,
        }
    }
    found.map_or(Attribution::NoPod, Attribution::Pod)
}

/// The path of a cgroup line: what follows its second `:`.
fn cgroup_path(line: &[u8]) -> Option<&[u8]> {
    let mut parts = line.splitn(3, |&b| b == b':');
    parts.next()?;
    parts.next()?;
    parts.next()
}

/// The UID of the first pod segment of a cgroup path, or `None` outside kubelet's pods.
///
/// Kubelet puts every container under a pod cgroup named after the pod's UID, below a
/// `kubepods` root. The cgroupfs driver writes `.../kubepods/<qos>/pod<uid>/<container>`; the
/// systemd driver writes `kubepods-<qos>-pod<uid>.slice` below `kubepods.slice` and
/// `kubepods-<qos>.slice`, with the UID's dashes as underscores (Guaranteed pods have no `<qos>`
/// segment). Under a cgroup namespace the path is relative (`/../..`, the `kubepods` root may be
/// above the reader's) but keeps the pod's segment. The first pod segment is kubelet's: any
/// a tenant adds lies below its container's cgroup.
fn pod_in_path(path: &[u8]) -> Option<String> {
    let mut under_kubepods = false;
    for segment in path.split(|&b| b == b'/') {
        if segment == b"kubepods" || segment.starts_with(b"kubepods.") || segment == b".." {
            under_kubepods = true;
            continue;
        }
        if under_kubepods && let Some(uid) = segment.strip_prefix(b"pod").filter(|u| is_pod_uid(u))
        {
            return Some(ascii(uid));
        }
        if let Some(slice) = segment
            .strip_prefix(b"kubepods-")
            .and_then(|s| s.strip_suffix(b".slice"))
            && let Some(at) = slice.windows(3).rposition(|w| w == b"pod")
        {
            let uid: Vec<u8> = slice[at + 3..]
                .iter()
                .map(|&b| if b == b'_' { b'-' } else { b })
                .collect();
            if is_pod_uid(&uid) {
                return Some(ascii(&uid));
            }
        }
    }
    None
}

/// A pod UID as kubelet names cgroups after it: an RFC 4122 UUID, or the 32 hex digits of a
/// static pod's manifest hash.
fn is_pod_uid(s: &[u8]) -> bool {
    let (mut hex, mut dashes) = (0, 0);
    for &b in s {
        match b {
            b'-' => dashes += 1,
            b if b.is_ascii_hexdigit() => hex += 1,
            _ => return false,
        }
    }
    hex == 32 && (dashes == 0 || dashes == 4)
}

/// Bytes already checked to be ASCII, as text.
fn ascii(bytes: &[u8]) -> String {
    bytes.iter().map(|&b| char::from(b)).collect()
}

/// A process NVML listed, with its `stat` and `cgroup` as read: what the pass judges, or why it
/// is left out of this pass.
pub fn observe(
    pid: u32,
    gpu_uuid: &str,
    used_bytes: u64,
    stat: &[u8],
    cgroup: &[u8],
) -> Result<GpuProcess, Skip> {
    let start_ticks = start_ticks(stat).ok_or(Skip::BadStat)?;
    let pod_uid = match attribute(cgroup) {
        Attribution::Pod(uid) => Some(uid),
        Attribution::NoPod => None,
        Attribution::Disagree => return Err(Skip::PodsDisagree),
    };
    Ok(GpuProcess {
        pid,
        gpu_uuid: gpu_uuid.to_owned(),
        used_bytes,
        start_ticks,
        pod_uid,
    })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const UID: &str = "0c6f33a4-5e2b-4a1b-9e0c-51d4b2a3f7e1";
    const OTHER: &str = "7d1e2f30-4a5b-4c6d-8e9f-0a1b2c3d4e5f";

    /// A stat line as the kernel writes it, with `comm` as given and start time 987654.
    fn stat(comm: &[u8]) -> Vec<u8> {
        let mut out = b"4242 (".to_vec();
        out.extend_from_slice(comm);
        out.extend_from_slice(
            b") S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000000 200 \
              18446744073709551615\n",
        );
        out
    }

    fn pod(uid: &str) -> Attribution {
        Attribution::Pod(uid.to_owned())
    }

    #[test]
    fn the_start_time_is_counted_after_the_last_parenthesis_whatever_the_command_holds() {
        for comm in [
            &b"python"[..],
            b"a (weird) name",
            b") S 1 2 3 4",
            b"\xff\xfe",
            b"x)\n) 0 0",
            b"",
        ] {
            assert_eq!(start_ticks(&stat(comm)), Some(987_654), "{comm:?}");
        }
    }

    #[test]
    fn a_stat_without_a_start_time_reads_as_none() {
        for text in [
            &b"4242 (short) S 1 2"[..],
            b"no parenthesis at all",
            b"",
            b"4242 (x) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 -5 1",
            b"4242 (x) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 99999999999999999999999 1",
            b"4242 (x) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 \xff1 1",
        ] {
            assert_eq!(start_ticks(text), None, "{text:?}");
        }
    }

    #[test]
    fn the_pod_uid_is_read_from_the_cgroup_of_either_kubelet_cgroup_driver() {
        let systemd = b"0::/kubepods.slice/kubepods-burstable.slice/\
                   kubepods-burstable-pod0c6f33a4_5e2b_4a1b_9e0c_51d4b2a3f7e1.slice/\
                   cri-containerd-3f2a.scope\n";
        assert_eq!(attribute(systemd), pod(UID));
        let guaranteed =
            b"0::/kubepods.slice/kubepods-pod0c6f33a4_5e2b_4a1b_9e0c_51d4b2a3f7e1.slice/crio-9.scope";
        assert_eq!(attribute(guaranteed), pod(UID));
        let cgroupfs =
            b"12:memory:/kubepods/besteffort/pod0c6f33a4-5e2b-4a1b-9e0c-51d4b2a3f7e1/3f2a\n\
                    0::/kubepods/besteffort/pod0c6f33a4-5e2b-4a1b-9e0c-51d4b2a3f7e1/3f2a\n";
        assert_eq!(attribute(cgroupfs), pod(UID));
        let namespaced =
            b"0::/../../kubepods-besteffort-pod0c6f33a4_5e2b_4a1b_9e0c_51d4b2a3f7e1.slice/x.scope";
        assert_eq!(attribute(namespaced), pod(UID));
        let namespaced_cgroupfs =
            b"0::/../../burstable/pod0c6f33a4-5e2b-4a1b-9e0c-51d4b2a3f7e1/3f2a";
        assert_eq!(attribute(namespaced_cgroupfs), pod(UID));
        let static_pod = b"0::/kubepods/burstable/pod5f1e8a8c9d0b4e7fa1b2c3d4e5f60718/abc";
        assert_eq!(
            attribute(static_pod),
            pod("5f1e8a8c9d0b4e7fa1b2c3d4e5f60718")
        );
    }

    #[test]
    fn processes_outside_kubelets_pods_have_no_pod() {
        for text in [
            &b"0::/system.slice/nvidia-persistenced.service\n"[..],
            b"0::/user.slice/user-0.slice/session-1.scope\n",
            b"0::/pod0c6f33a4-5e2b-4a1b-9e0c-51d4b2a3f7e1/x\n",
            b"0::/kubepods/besteffort/podnot-a-uid/x\n",
            b"",
            b"garbage",
            b"\xff\xfe\n\x00",
        ] {
            assert_eq!(attribute(text), Attribution::NoPod, "{text:?}");
        }
    }

    #[test]
    fn a_sub_cgroup_whose_name_is_not_utf8_still_leaves_the_pod_known() {
        let text = format!("0::/kubepods/besteffort/pod{UID}/ctr/").into_bytes();
        let mut odd = text.clone();
        odd.extend_from_slice(b"\xff\xfe\n");
        assert_eq!(attribute(&odd), pod(UID));
    }

    #[test]
    fn a_pod_a_tenant_names_below_its_own_is_not_the_one_it_is_in() {
        let text = format!("0::/kubepods/besteffort/pod{UID}/ctr/kubepods/pod{OTHER}/x\n");
        assert_eq!(attribute(text.as_bytes()), pod(UID));
    }

    #[test]
    fn v1_lines_that_name_another_pod_than_the_v2_line_leave_the_process_unattributed() {
        // A process of pod B whose `name=systemd` group names pod A is neither A's nor B's.
        let text = format!(
            "12:name=systemd:/kubepods/besteffort/pod{UID}/x\n\
             4:memory:/kubepods/besteffort/pod{OTHER}/y\n\
             0::/kubepods/besteffort/pod{OTHER}/y\n"
        );
        assert_eq!(attribute(text.as_bytes()), Attribution::Disagree);
        // Lines that name no pod do not disagree.
        let text = format!("12:name=systemd:/\n4:memory:/kubepods/besteffort/pod{OTHER}/y\n0::/\n");
        assert_eq!(attribute(text.as_bytes()), pod(OTHER));
    }

    #[test]
    fn a_line_forged_by_a_newline_in_a_cgroup_name_leaves_the_process_unattributed() {
        let text = format!("0::/kubepods/besteffort/pod{UID}/ctr/x\n0::/kubepods/pod{OTHER}\n");
        assert_eq!(attribute(text.as_bytes()), Attribution::Disagree);
    }

    #[test]
    fn a_process_is_observed_or_skipped_with_its_reason() {
        let cgroup = format!("0::/kubepods/besteffort/pod{UID}/x\n");
        let p = observe(7, "GPU-1", 9, &stat(b"\xff"), cgroup.as_bytes()).unwrap();
        assert_eq!(
            (p.pid, p.start_ticks, p.pod_uid.as_deref()),
            (7, 987_654, Some(UID))
        );
        assert_eq!(
            observe(7, "GPU-1", 9, b"7 (x", cgroup.as_bytes()),
            Err(Skip::BadStat)
        );
        let split = format!("1:cpu:/kubepods/pod{OTHER}/x\n0::/kubepods/pod{UID}/x\n");
        assert_eq!(
            observe(7, "GPU-1", 9, &stat(b"x"), split.as_bytes()),
            Err(Skip::PodsDisagree)
        );
    }

    proptest! {
        /// Whatever bytes a process names itself, its start time is read.
        #[test]
        fn any_command_keeps_the_start_time(comm in prop::collection::vec(any::<u8>(), 0..64)) {
            prop_assert_eq!(start_ticks(&stat(&comm)), Some(987_654));
        }

        /// Any bytes at all: an answer, never a panic.
        #[test]
        fn any_bytes_are_an_answer(
            stat in prop::collection::vec(any::<u8>(), 0..300),
            cgroup in prop::collection::vec(any::<u8>(), 0..300),
        ) {
            let _ = observe(1, "GPU-1", 1, &stat, &cgroup);
        }

        /// A process is attributed to a pod only when every line naming a pod names it.
        #[test]
        fn attribution_needs_every_pod_naming_line_to_agree(
            lines in prop::collection::vec((0..3usize, any::<bool>()), 1..6)
        ) {
            let pods = [Some(UID), Some(OTHER), None];
            let text: String = lines
                .iter()
                .enumerate()
                .map(|(i, (p, v2))| {
                    let path = pods[*p].map_or("/system.slice/x".to_owned(), |u| {
                        format!("/kubepods/besteffort/pod{u}/c")
                    });
                    if *v2 { format!("0::{path}\n") } else { format!("{i}:cpu:{path}\n") }
                })
                .collect();
            let named: std::collections::BTreeSet<&str> =
                lines.iter().filter_map(|(p, _)| pods[*p]).collect();
            let expected = match named.len() {
                0 => Attribution::NoPod,
                1 => pod(named.first().copied().unwrap_or_default()),
                _ => Attribution::Disagree,
            };
            prop_assert_eq!(attribute(text.as_bytes()), expected);
        }
    }
}
