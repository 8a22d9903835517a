//! The capability minors of MIG instances: which `/dev/nvidia-caps/nvidia-cap<minor>` grants
//! access to a GPU instance, and which to one of its compute instances.
//!
//! The NVIDIA driver lists them in `/proc/driver/nvidia-caps/mig-minors`, one `<name> <minor>`
//! a line: `gpu<g>/gi<i>/access <minor>` for GPU instance `i` of the GPU with minor `g`
//! (`/dev/nvidia<g>`), and `gpu<g>/gi<i>/ci<c>/access <minor>` for its compute instance `c`;
//! other names (`config`, `monitor`) are not about instances. [`MigMinors::parse`] reads that
//! text (the kubelet plugin reads the file, bounded); [`MigMinors::driver_layout`] gives the
//! layout the driver writes, for nodes simulated from a fake-inventory file.

use std::collections::BTreeMap;

use crate::error::{Error, Result};

/// Where the kubelet plugin reads the table on a node.
pub const MIG_MINORS_PATH: &str = "/proc/driver/nvidia-caps/mig-minors";

/// The driver's layout: minors 1 and 2 are `config` and `monitor`; then each GPU minor has
/// 15 GPU instances, each an access minor followed by those of its 8 compute instances.
const LAYOUT_FIRST: u32 = 3;
const LAYOUT_GPU_INSTANCES: u32 = 15;
const LAYOUT_COMPUTE_INSTANCES: u32 = 8;
const LAYOUT_PER_GI: u32 = 1 + LAYOUT_COMPUTE_INSTANCES;
const LAYOUT_PER_GPU: u32 = LAYOUT_GPU_INSTANCES * LAYOUT_PER_GI;

/// A node's MIG capability minors, as the driver lists them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MigMinors {
    /// (GPU minor, GPU instance id) -> the GPU instance's access minor.
    gpu_instances: BTreeMap<(u32, u32), u32>,
    /// (GPU minor, GPU instance id, compute instance id) -> the compute instance's access minor.
    compute_instances: BTreeMap<(u32, u32, u32), u32>,
}

/// What one line of the table names.
enum Entry {
    GpuInstance(u32, u32),
    ComputeInstance(u32, u32, u32),
}

/// The number after `prefix` in `part` (`gi7` with `gi` gives 7); only plain decimal digits.
fn numbered(part: &str, prefix: &str) -> Option<u32> {
    let digits = part.strip_prefix(prefix)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// What a line's name names: `None` for a name about no instance (`config`, `monitor`, or
/// one this parser does not know), which the table leaves out.
fn entry(name: &str) -> Option<Entry> {
    let parts: Vec<&str> = name.split('/').collect();
    match parts.as_slice() {
        [gpu, gi, "access"] => Some(Entry::GpuInstance(
            numbered(gpu, "gpu")?,
            numbered(gi, "gi")?,
        )),
        [gpu, gi, ci, "access"] => Some(Entry::ComputeInstance(
            numbered(gpu, "gpu")?,
            numbered(gi, "gi")?,
            numbered(ci, "ci")?,
        )),
        _ => None,
    }
}

impl MigMinors {
    /// Reads the text of `/proc/driver/nvidia-caps/mig-minors`. A line that is not
    /// `<name> <minor>`, an instance listed twice, or one minor given to two entries is an
    /// error naming the line: a table that could hand one instance's access to another is
    /// not used at all.
    pub fn parse(text: &str) -> Result<Self> {
        let mut table = Self::default();
        let mut owner: BTreeMap<u32, usize> = BTreeMap::new();
        for (i, line) in text.lines().enumerate() {
            let number = i + 1;
            let err = |message: String| Error::Inventory {
                field: format!("{MIG_MINORS_PATH} line {number}"),
                message,
            };
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (name, minor) = match fields.as_slice() {
                [] => continue,
                [name, minor] => (*name, *minor),
                _ => {
                    return Err(err(format!(
                        "{line:?} is not `<name> <minor>` (two fields)"
                    )));
                }
            };
            let minor: u32 = minor
                .parse()
                .map_err(|_| err(format!("minor {minor:?} of {name} is not a whole number")))?;
            if let Some(first) = owner.insert(minor, number) {
                return Err(err(format!(
                    "minor {minor} of {name} is also given on line {first}; a minor grants \
                     one capability"
                )));
            }
            let twice = match entry(name) {
                None => false,
                Some(Entry::GpuInstance(g, gi)) => {
                    table.gpu_instances.insert((g, gi), minor).is_some()
                }
                Some(Entry::ComputeInstance(g, gi, ci)) => {
                    table.compute_instances.insert((g, gi, ci), minor).is_some()
                }
            };
            if twice {
                return Err(err(format!("{name} is listed twice")));
            }
        }
        Ok(table)
    }

    /// The table the driver writes for GPUs with these minors: see the layout above. Fake
    /// nodes use it, so that what they prepare looks like a real node's.
    pub fn driver_layout(gpu_minors: impl IntoIterator<Item = u32>) -> Self {
        let mut table = Self::default();
        for g in gpu_minors {
            for gi in 0..LAYOUT_GPU_INSTANCES {
                let (gi_minor, _) = layout_minors(g, gi, 0);
                table.gpu_instances.insert((g, gi), gi_minor);
                for ci in 0..LAYOUT_COMPUTE_INSTANCES {
                    table
                        .compute_instances
                        .insert((g, gi, ci), layout_minors(g, gi, ci).1);
                }
            }
        }
        table
    }

    /// The access minors of GPU instance `gpu_instance` of the GPU with minor `gpu_minor`, and
    /// of its compute instance `compute_instance`; `None` unless the table lists both.
    pub fn minors(
        &self,
        gpu_minor: u32,
        gpu_instance: u32,
        compute_instance: u32,
    ) -> Option<(u32, u32)> {
        let gi = self.gpu_instances.get(&(gpu_minor, gpu_instance))?;
        let ci = self
            .compute_instances
            .get(&(gpu_minor, gpu_instance, compute_instance))?;
        Some((*gi, *ci))
    }
}

/// The driver layout's minors of GPU instance `gpu_instance` of the GPU with minor
/// `gpu_minor`, and of its compute instance `compute_instance`. Saturates instead of wrapping
/// onto another instance's minor.
fn layout_minors(gpu_minor: u32, gpu_instance: u32, compute_instance: u32) -> (u32, u32) {
    let gi_minor = gpu_minor
        .saturating_mul(LAYOUT_PER_GPU)
        .saturating_add(gpu_instance.saturating_mul(LAYOUT_PER_GI))
        .saturating_add(LAYOUT_FIRST);
    (
        gi_minor,
        gi_minor.saturating_add(1).saturating_add(compute_instance),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const DRIVER_TEXT: &str = "config 1\nmonitor 2\ngpu0/gi0/access 3\ngpu0/gi0/ci0/access 4\n\
                               gpu0/gi0/ci1/access 5\ngpu1/gi2/access 156\n\
                               gpu1/gi2/ci0/access 157\n";

    #[test]
    fn the_drivers_table_gives_each_instance_the_minors_it_lists() {
        let table = MigMinors::parse(DRIVER_TEXT).unwrap();
        assert_eq!(table.minors(0, 0, 0), Some((3, 4)));
        assert_eq!(table.minors(0, 0, 1), Some((3, 5)));
        assert_eq!(table.minors(1, 2, 0), Some((156, 157)));
    }

    #[test]
    fn an_instance_the_table_does_not_list_has_no_minors() {
        let table = MigMinors::parse(DRIVER_TEXT).unwrap();
        // GPU instance listed, compute instance not; GPU not listed; GPU instance not listed.
        assert_eq!(table.minors(1, 2, 1), None);
        assert_eq!(table.minors(2, 0, 0), None);
        assert_eq!(table.minors(1, 0, 0), None);
        let only_ci = MigMinors::parse("gpu0/gi1/ci0/access 13\n").unwrap();
        assert_eq!(only_ci.minors(0, 1, 0), None);
    }

    #[test]
    fn blank_lines_are_skipped_and_still_counted() {
        let table = MigMinors::parse("config 1\n\n   \ngpu0/gi0/access 3\ngpu0/gi0/ci0/access 4\n")
            .unwrap();
        assert_eq!(table.minors(0, 0, 0), Some((3, 4)));
        let e = MigMinors::parse("\n\ngpu0/gi0/access x\n").unwrap_err();
        assert!(e.to_string().contains("line 3"), "{e}");
    }

    #[test]
    fn a_malformed_line_is_an_error_naming_the_line() {
        for (text, says) in [
            ("config 1\ngpu0/gi0/access\n", "line 2"),
            ("gpu0/gi0/access 3 4\n", "two fields"),
            ("gpu0/gi0/access three\n", "not a whole number"),
            ("gpu0/gi0/access -3\n", "not a whole number"),
        ] {
            let e = MigMinors::parse(text).unwrap_err().to_string();
            assert!(e.contains(says), "{text:?}: {e}");
            assert!(e.contains(MIG_MINORS_PATH), "{e}");
        }
    }

    #[test]
    fn one_minor_for_two_entries_or_one_instance_listed_twice_is_refused() {
        let e = MigMinors::parse("gpu0/gi0/access 3\ngpu0/gi1/access 3\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("line 2") && e.contains("also given on line 1"),
            "{e}"
        );
        let e = MigMinors::parse("gpu0/gi0/ci0/access 4\ngpu0/gi0/ci0/access 5\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("listed twice"), "{e}");
        let e = MigMinors::parse("gpu0/gi0/access 3\ngpu0/gi0/access 4\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("listed twice"), "{e}");
    }

    #[test]
    fn names_about_no_instance_are_left_out() {
        let table =
            MigMinors::parse("config 1\nmonitor 2\ngpu0/gi0/mystery 9\ngpux/gi0/access 8\n")
                .unwrap();
        assert_eq!(table, MigMinors::default());
        assert_eq!(
            MigMinors::parse("gpu0/gi/access 3\ngpu0/gi+1/access 4\ngpu0/gi0/cix/access 5\n")
                .unwrap(),
            MigMinors::default()
        );
    }

    #[test]
    fn the_driver_layout_numbers_per_gpu_gpu_instance_and_compute_instance() {
        let table = MigMinors::driver_layout([0, 1, 2]);
        assert_eq!(table.minors(0, 0, 0), Some((3, 4)));
        assert_eq!(table.minors(0, 0, 7), Some((3, 11)));
        assert_eq!(table.minors(0, 1, 0), Some((12, 13)));
        assert_eq!(table.minors(0, 14, 7), Some((129, 137)));
        assert_eq!(table.minors(1, 0, 0), Some((138, 139)));
        assert_eq!(table.minors(2, 1, 2), Some((282, 285)));
        // Only the GPUs it was given, and only 15 GPU and 8 compute instances each.
        assert_eq!(table.minors(3, 0, 0), None);
        assert_eq!(table.minors(0, 15, 0), None);
        assert_eq!(table.minors(0, 0, 8), None);
    }

    #[test]
    fn the_driver_layout_saturates_instead_of_wrapping_onto_another_minor() {
        assert_eq!(layout_minors(u32::MAX, 0, 0), (u32::MAX, u32::MAX));
        assert_eq!(layout_minors(0, u32::MAX, 0).0, u32::MAX);
        assert_eq!(layout_minors(0, 0, u32::MAX).1, u32::MAX);
    }
}
