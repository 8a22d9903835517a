//! Which GPUs this node has: the `GpuDiscovery` seam.

use std::path::{Path, PathBuf};

use tessera_driver::inventory::{Inventory, NodeInventory};

use crate::error::{Error, Result};

/// Finds the node's GPUs. The NVML backend comes later; the fake one reads an inventory file.
pub trait GpuDiscovery: Send + Sync {
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
        let text =
            std::fs::read_to_string(&self.path).map_err(|e| Error::io("reading", &self.path, e))?;
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
