//! What the host lets a test do, for the tests that build a root of their own and run in it.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Whether this process may make mount namespaces and change root (`CAP_SYS_ADMIN` and
/// `CAP_SYS_CHROOT` effective; root in CI containers usually may not).
pub fn may_mount_and_chroot() -> bool {
    const CAP_SYS_CHROOT: u32 = 18;
    const CAP_SYS_ADMIN: u32 = 21;
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let effective = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or(0);
    effective & (1 << CAP_SYS_ADMIN) != 0 && effective & (1 << CAP_SYS_CHROOT) != 0
}

/// The shared libraries `binary` loads, as the dynamic loader lists them (what `ldd` does);
/// `None` where no known loader is present or it cannot list them.
pub fn libraries(binary: &Path) -> Option<Vec<PathBuf>> {
    let out = ["/lib64/ld-linux-x86-64.so.2", "/lib/ld-linux-aarch64.so.1"]
        .iter()
        .filter(|l| Path::new(l).exists())
        .find_map(|loader| {
            Command::new(loader)
                .arg("--list")
                .arg(binary)
                .output()
                .ok()
                .filter(|o| o.status.success())
        })?;
    Some(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_whitespace().find(|w| w.starts_with('/')))
            .map(PathBuf::from)
            .collect(),
    )
}

/// A loopback port nobody listens on now, for a server the test starts (another process may
/// still take it before the server binds: the tests that use it retry or fail clearly).
///
/// # Panics
/// Where no loopback port can be bound at all.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind(("127.0.0.1", 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding a loopback port")
}

/// Makes room for at least `needed` open files in this process: the soft limit (`ulimit -n`)
/// is raised as far as the hard one allows. Returns the soft limit now in force, or a message
/// naming both limits where the hard one is below `needed`.
///
/// # Errors
/// Where the hard limit is below `needed`, or the soft one cannot be raised.
pub fn open_files_for(needed: u64) -> Result<u64, String> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    let soft = limit.current.unwrap_or(u64::MAX);
    if soft >= needed {
        return Ok(soft);
    }
    let hard = limit.maximum.unwrap_or(u64::MAX);
    if hard < needed {
        return Err(format!(
            "{needed} open files are needed and the hard limit is {hard} (soft {soft}): raise it (ulimit -Hn) and run again"
        ));
    }
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(hard),
            maximum: limit.maximum,
        },
    )
    .map_err(|e| format!("raising the open-file limit from {soft} to {hard}: {e}"))?;
    Ok(hard)
}
