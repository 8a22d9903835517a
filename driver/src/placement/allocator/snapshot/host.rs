//! Host resources: the CPU and memory of the nodes whose use the caller tracks, which limit
//! where pods go besides their devices.

use super::Snapshot;
use crate::placement::fragmentation::HostResources;

/// CPU and memory of a node whose host resources the caller tracks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct HostState {
    pub(crate) allocatable: HostResources,
    pub(crate) used: HostResources,
}

impl HostState {
    pub(crate) fn free(&self) -> HostResources {
        self.allocatable.minus(&self.used)
    }
}

impl Snapshot {
    /// Tracks a node's CPU and memory: what it has allocatable, and what pods already use.
    /// Nodes never set here are not limited by CPU or memory. Unknown nodes are ignored.
    pub fn set_host(&mut self, node: &str, allocatable: HostResources, used: HostResources) {
        if let Some(&id) = self.node_ids.get(node) {
            let state = Some(HostState { allocatable, used });
            // Unchanged amounts keep the node's cached scores.
            if self.hosts[id] != state {
                self.hosts[id] = state;
                self.node_versions[id] += 1;
            }
        }
    }

    /// Adds a placed pod's CPU and memory to a tracked node's use.
    pub fn add_host_use(&mut self, node: &str, ask: &HostResources) {
        self.change_host_use(node, |used| used.plus(ask));
    }

    /// Removes a departed pod's CPU and memory from a tracked node's use.
    pub fn remove_host_use(&mut self, node: &str, ask: &HostResources) {
        self.change_host_use(node, |used| used.minus(ask));
    }

    /// Changes a tracked node's use and bumps its version (its cached scores are stale).
    fn change_host_use(
        &mut self,
        node: &str,
        change: impl FnOnce(&HostResources) -> HostResources,
    ) {
        if let Some(&id) = self.node_ids.get(node)
            && let Some(h) = self.hosts[id].as_mut()
        {
            h.used = change(&h.used);
            self.node_versions[id] += 1;
        }
    }

    /// Free CPU and memory of a tracked node.
    pub fn host_free(&self, node: &str) -> Option<HostResources> {
        let id = *self.node_ids.get(node)?;
        self.hosts[id].map(|h| h.free())
    }
}
