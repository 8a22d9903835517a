//! A GPU's mode as the admin chooses it, per node or per GPU, from the plugin's flags and the
//! node's labels; and applying that choice to a discovered inventory.
//!
//! Precedence, strongest first: the per-GPU label (`gpu.tessera.dev/mode.gpu-<index>`), the
//! node label (`gpu.tessera.dev/mode`), the per-GPU flag (`--gpu-mode-override <index>=<mode>`),
//! the node flag (`--gpu-mode`), and what discovery found (exclusive on NVML nodes; the file's
//! mode on fake ones). MIG is a hardware setting the plugin never changes: a GPU with MIG mode
//! enabled publishes its MIG instances whatever is chosen, and choosing `mig` for a GPU without
//! MIG mode changes nothing. A node-wide choice silently applies to the GPUs it can; a choice
//! naming one GPU that the hardware contradicts is reported as a conflict.

use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::names;
use crate::node::inventory::{GpuMode, NodeInventory};

/// The admin's choice of modes for one node.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ModeChoice {
    /// The mode of every GPU not named in `gpus`.
    pub node: Option<GpuMode>,
    /// Modes of single GPUs, by index.
    pub gpus: BTreeMap<u32, GpuMode>,
}

/// A chosen mode the plugin did not apply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModeConflict {
    /// The GPU's device name (`gpu-<index>`).
    pub gpu: String,
    /// The mode chosen for it.
    pub chosen: GpuMode,
    /// The mode it keeps.
    pub kept: GpuMode,
}

impl std::fmt::Display for ModeConflict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.kept {
            GpuMode::Mig => write!(
                f,
                "GPU {}: mode {} is chosen, but MIG mode is enabled on the GPU; the plugin never \
                 changes it (disable MIG mode with nvidia-smi to use the GPU whole or shared)",
                self.gpu, self.chosen
            ),
            _ => write!(
                f,
                "GPU {}: mode mig is chosen, but MIG mode is not enabled on the GPU; it stays {} \
                 (enable MIG mode and create instances with nvidia-smi)",
                self.gpu, self.kept
            ),
        }
    }
}

fn parse_mode(value: &str, what: &str) -> Result<GpuMode> {
    value.trim().parse().map_err(|_| Error::Invalid {
        object: what.to_owned(),
        field: "mode".to_owned(),
        message: format!("{value:?} is not a GPU mode; expected exclusive, shared or mig"),
    })
}

impl ModeChoice {
    /// The choice the plugin's flags make: `node` for every GPU, `overrides` as
    /// `<index>=<mode>` for single GPUs.
    pub fn from_flags(node: Option<GpuMode>, overrides: &[String]) -> Result<Self> {
        let mut gpus = BTreeMap::new();
        for o in overrides {
            let bad = |message: String| Error::Invalid {
                object: "flag --gpu-mode-override".to_owned(),
                field: o.clone(),
                message,
            };
            let (index, mode) = o
                .split_once('=')
                .ok_or_else(|| bad("expected <gpu index>=<mode>, e.g. 3=shared".to_owned()))?;
            let index: u32 = index
                .trim()
                .parse()
                .map_err(|_| bad(format!("{index:?} is not a GPU index")))?;
            let mode = parse_mode(mode, "flag --gpu-mode-override")?;
            if gpus.insert(index, mode).is_some() {
                return Err(bad(format!("GPU {index} is named twice")));
            }
        }
        Ok(Self { node, gpus })
    }

    /// The choice a node's labels make. A label with a bad value or a bad GPU index is left out
    /// and reported (naming the label and the rule), so one typo does not stop the node.
    pub fn from_labels(labels: &BTreeMap<String, String>) -> (Self, Vec<String>) {
        let mut choice = Self::default();
        let mut problems = Vec::new();
        for (key, value) in labels {
            let what = format!("node label {key}");
            if key == names::LABEL_GPU_MODE {
                match parse_mode(value, &what) {
                    Ok(mode) => choice.node = Some(mode),
                    Err(e) => problems.push(e.to_string()),
                }
            } else if let Some(index) = key.strip_prefix(names::LABEL_GPU_MODE_PER_GPU_PREFIX) {
                let Ok(index) = index.parse::<u32>() else {
                    problems.push(format!(
                        "{what}: {index:?} is not a GPU index (expected {}<index>)",
                        names::LABEL_GPU_MODE_PER_GPU_PREFIX
                    ));
                    continue;
                };
                match parse_mode(value, &what) {
                    Ok(mode) => {
                        choice.gpus.insert(index, mode);
                    }
                    Err(e) => problems.push(e.to_string()),
                }
            }
        }
        (choice, problems)
    }

    /// This choice over `base` (labels over flags): a node-wide choice here replaces all of
    /// `base` (its per-GPU choices too); otherwise this choice's per-GPU modes replace
    /// `base`'s for those GPUs.
    #[must_use]
    pub fn over(&self, base: &Self) -> Self {
        if self.node.is_some() {
            return self.clone();
        }
        let mut gpus = base.gpus.clone();
        gpus.extend(self.gpus.iter().map(|(i, m)| (*i, *m)));
        Self {
            node: base.node,
            gpus,
        }
    }

    /// The mode chosen for GPU `index`, if any.
    pub fn mode_of(&self, index: u32) -> Option<GpuMode> {
        self.gpus.get(&index).copied().or(self.node)
    }

    /// Applies the choice to `node`'s GPUs; returns the choices not applied. Labels are
    /// layered over flags by the caller (`labels.over(&flags)`).
    pub fn apply(&self, node: &mut NodeInventory) -> Vec<ModeConflict> {
        let mut conflicts = Vec::new();
        for gpu in &mut node.gpus {
            let Some(chosen) = self.mode_of(gpu.index) else {
                continue;
            };
            // A node-wide choice is the default of the GPUs it can apply to; only a choice
            // naming the GPU is a conflict when the hardware disagrees.
            let named = self.gpus.contains_key(&gpu.index);
            match (gpu.mode, chosen) {
                (GpuMode::Mig, GpuMode::Mig) => {}
                (GpuMode::Mig, _) | (_, GpuMode::Mig) => {
                    if named {
                        conflicts.push(ModeConflict {
                            gpu: gpu.device_name(),
                            chosen,
                            kept: gpu.mode,
                        });
                    }
                }
                (_, mode) => gpu.mode = mode,
            }
        }
        conflicts
    }
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::testing::string_map as labels;

    fn node() -> NodeInventory {
        crate::testing::node_inventory(
            "nodes:\n- name: n\n  gpus:\n  - model: a100-80g\n    count: 3\n  - model: a100-80g\n    mode: mig\n    mig:\n    - profile: 7g.80gb\n",
        )
    }

    #[test]
    fn labels_win_over_flags_and_per_gpu_wins_over_node() {
        let flags =
            ModeChoice::from_flags(Some(GpuMode::Shared), &["0=exclusive".to_owned()]).unwrap();
        let (chosen, problems) = ModeChoice::from_labels(&labels(&[
            ("gpu.tessera.dev/mode", "exclusive"),
            ("gpu.tessera.dev/mode.gpu-2", "shared"),
            ("kubernetes.io/hostname", "n"),
        ]));
        assert!(problems.is_empty());
        let choice = chosen.over(&flags);
        let mut n = node();
        assert!(choice.apply(&mut n).is_empty());
        let modes: Vec<GpuMode> = n.gpus.iter().map(|g| g.mode).collect();
        assert_eq!(
            modes,
            [
                GpuMode::Exclusive,
                GpuMode::Exclusive,
                GpuMode::Shared,
                GpuMode::Mig
            ]
        );

        // A node label beats a flag naming one GPU; a per-GPU label keeps the other flags.
        let flags = ModeChoice::from_flags(None, &["0=exclusive".to_owned()]).unwrap();
        let (node_label, _) =
            ModeChoice::from_labels(&labels(&[("gpu.tessera.dev/mode", "shared")]));
        assert_eq!(node_label.over(&flags).mode_of(0), Some(GpuMode::Shared));
        let (gpu_label, _) =
            ModeChoice::from_labels(&labels(&[("gpu.tessera.dev/mode.gpu-1", "shared")]));
        let both = gpu_label.over(&flags);
        assert_eq!(both.mode_of(0), Some(GpuMode::Exclusive));
        assert_eq!(both.mode_of(1), Some(GpuMode::Shared));
    }

    #[test]
    fn mig_is_never_switched_on_or_off() {
        let choice = ModeChoice::from_flags(
            Some(GpuMode::Shared),
            &["1=mig".to_owned(), "3=exclusive".to_owned()],
        )
        .unwrap();
        assert!(
            ModeChoice::from_flags(Some(GpuMode::Mig), &[])
                .unwrap()
                .apply(&mut node())
                .is_empty(),
            "a node-wide choice is a default, never a conflict"
        );
        let mut n = node();
        let conflicts = choice.apply(&mut n);
        assert_eq!(conflicts.len(), 2);
        assert_eq!(n.gpus[1].mode, GpuMode::Exclusive);
        assert_eq!(n.gpus[3].mode, GpuMode::Mig);
        assert!(conflicts[0].to_string().contains("MIG mode is not enabled"));
        assert!(conflicts[1].to_string().contains("never changes it"));
        assert_eq!(n.gpus[0].mode, GpuMode::Shared);
    }

    #[test]
    fn bad_flags_are_errors_and_bad_labels_are_reported_and_skipped() {
        for bad in ["3", "x=shared", "1=half", "1=shared,1=shared"] {
            let overrides: Vec<String> = bad.split(',').map(str::to_owned).collect();
            let e = ModeChoice::from_flags(None, &overrides).unwrap_err();
            assert!(e.to_string().contains("--gpu-mode-override"), "{e}");
        }
        let (choice, problems) = ModeChoice::from_labels(&labels(&[
            ("gpu.tessera.dev/mode", "sharde"),
            ("gpu.tessera.dev/mode.gpu-x", "shared"),
            ("gpu.tessera.dev/mode.gpu-1", "shared"),
        ]));
        assert_eq!(choice.mode_of(1), Some(GpuMode::Shared));
        assert_eq!(choice.node, None);
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems.iter().any(|p| p.contains("\"sharde\"")));
    }
}
