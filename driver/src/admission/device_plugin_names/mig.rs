//! The NVIDIA device plugin's MIG "mixed" strategy: `nvidia.com/mig-<profile>: N` for N MIG
//! devices of that profile, one request per profile.

use super::claim::Builder;
use super::request::ContainerAsk;
use crate::error::Result;
use crate::names;

/// NVIDIA device plugin, MIG "mixed" strategy: `nvidia.com/mig-<profile>`.
pub const NVIDIA_MIG_PREFIX: &str = "nvidia.com/mig-";

/// Whether `name` is one of this dialect's names.
pub(super) fn is_name(name: &str) -> bool {
    name.starts_with(NVIDIA_MIG_PREFIX)
}

/// Whether a MIG profile name is well formed (`1g.10gb`, `1g.10gb+me`, `1c.2g.20gb`).
fn valid_mig_profile(profile: &str) -> bool {
    !profile.is_empty()
        && profile.len() <= 40
        && profile.contains("g.")
        && profile
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'+')
}

/// Each `nvidia.com/mig-<profile>: N` as the request `mig-<profile>`: N MIG devices whose
/// `profile` attribute (of `driver`) is that profile.
pub(super) fn add(b: &mut Builder, ask: &ContainerAsk, driver: &str, object: &str) -> Result<()> {
    for (name, n) in &ask.resources {
        let Some(profile) = name.strip_prefix(NVIDIA_MIG_PREFIX) else {
            continue;
        };
        if *n == 0 {
            continue;
        }
        if !valid_mig_profile(profile) {
            return Err(ask.error(
                object,
                name,
                &format!("{name}: {profile:?} is not a MIG profile name (like 1g.10gb)"),
            ));
        }
        let request = format!("mig-{}", profile.replace(['.', '+'], "-"));
        let selector = format!(
            "device.attributes[\"{driver}\"].{} == \"{profile}\"",
            names::ATTR_MIG_PROFILE
        );
        b.request("mig", &request, names::CLASS_MIG_GPU, *n, Some(selector));
    }
    Ok(())
}
