//! Which GPUs this node has: the `GpuDiscovery` seam, its fake backend, and the admin's choice
//! of GPU modes applied on top of any backend.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};

use tessera_driver::node::gpu_mode::ModeChoice;
use tessera_driver::node::inventory::{Inventory, NodeInventory};
use tracing::warn;

use crate::error::{Error, Result};

/// Finds the node's GPUs: NVML on real nodes (`crate::gpus::nvml::NvmlDiscovery`), an inventory file
/// in tests and demos ([`FakeDiscovery`]).
pub trait GpuDiscovery: Send + Sync + std::fmt::Debug {
    /// The node's GPUs and MIG instances as of now.
    fn discover(&self) -> Result<NodeInventory>;
}

/// Reads the node's entry from an inventory file (the format of `docs/inventory.md`).
#[derive(Debug, Clone)]
pub struct FakeDiscovery {
    path: PathBuf,
    node_name: String,
}

impl FakeDiscovery {
    /// Discovery of `node_name`'s GPUs from the inventory file at `path`.
    pub fn new(path: impl Into<PathBuf>, node_name: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            node_name: node_name.into(),
        }
    }

    /// The inventory file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl GpuDiscovery for FakeDiscovery {
    fn discover(&self) -> Result<NodeInventory> {
        let text = crate::claims::input_file::read_text(&self.path, "the inventory file")?;
        let inventory = Inventory::from_yaml(&text)?;
        inventory.node(&self.node_name).cloned().ok_or_else(|| {
            Error::Config(format!(
                "node {} is not in the inventory {}",
                self.node_name,
                self.path.display()
            ))
        })
    }
}

impl<D: GpuDiscovery + ?Sized> GpuDiscovery for Arc<D> {
    fn discover(&self) -> Result<NodeInventory> {
        self.as_ref().discover()
    }
}

/// What a backend discovers, with the admin's choice of modes applied
/// (`tessera_driver::node::gpu_mode`); the choice is shared with whoever follows the node's labels.
#[derive(Debug, Clone)]
pub struct ChosenModes {
    inner: Arc<dyn GpuDiscovery>,
    choice: Arc<RwLock<ModeChoice>>,
    reported: Arc<Mutex<Vec<String>>>,
}

impl ChosenModes {
    /// `inner`'s GPUs with the modes `choice` says.
    pub fn new(inner: Arc<dyn GpuDiscovery>, choice: Arc<RwLock<ModeChoice>>) -> Self {
        Self {
            inner,
            choice,
            reported: Arc::default(),
        }
    }
}

impl GpuDiscovery for ChosenModes {
    fn discover(&self) -> Result<NodeInventory> {
        let mut node = self.inner.discover()?;
        let conflicts = self
            .choice
            .read()
            .map_err(|_| Error::Task("a thread panicked holding the mode choice".to_owned()))?
            .apply(&mut node);
        let texts: Vec<String> = conflicts.iter().map(ToString::to_string).collect();
        if let Ok(mut reported) = self.reported.lock()
            && *reported != texts
        {
            // Once per change, not at every poll.
            for text in &texts {
                warn!(conflict = %text, "GPU mode not applied");
            }
            *reported = texts;
        }
        Ok(node)
    }
}

#[cfg(test)]
mod tests {

    use tessera_driver::node::inventory::GpuMode;

    use super::*;

    #[test]
    fn the_chosen_modes_apply_to_what_the_backend_finds_and_follow_changes() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("inventory.yaml");
        std::fs::write(
            &file,
            "nodes:\n- name: n\n  gpus:\n  - model: t4-16g\n    count: 2\n",
        )
        .unwrap();
        let choice = Arc::new(RwLock::new(
            ModeChoice::from_flags(None, &["1=shared".to_owned()]).unwrap(),
        ));
        let discovery = ChosenModes::new(
            Arc::new(FakeDiscovery::new(&file, "n")),
            Arc::clone(&choice),
        );
        let modes = |d: &ChosenModes| -> Vec<GpuMode> {
            d.discover().unwrap().gpus.iter().map(|g| g.mode).collect()
        };
        assert_eq!(modes(&discovery), [GpuMode::Exclusive, GpuMode::Shared]);
        *choice.write().unwrap() = ModeChoice {
            node: Some(GpuMode::Shared),
            ..ModeChoice::default()
        };
        assert_eq!(modes(&discovery), [GpuMode::Shared, GpuMode::Shared]);
    }
}
