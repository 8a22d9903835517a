//! Placement policies: which node, and which devices on it, a claim gets among those that fit.
//!
//! A policy only orders candidates; feasibility is the allocator's. Policies are pluggable
//! through [`PlacementPolicy`], so a new one (e.g. fragmentation-aware) needs no change to the
//! search.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// What a policy sees of one candidate node.
#[derive(Debug, Clone, Copy)]
pub struct NodeView<'a> {
    /// The node's name.
    pub name: &'a str,
    /// The node's position in the candidate list the caller gave.
    pub position: usize,
    /// Devices on the node.
    pub devices: u32,
    /// Sum over its devices of their fullness in permille (1000 = full).
    pub used_permille: u64,
}

/// What a policy sees of one candidate device.
#[derive(Debug, Clone, Copy)]
pub struct DeviceView {
    /// The device's position in kube-scheduler's order on this node.
    pub position: usize,
    /// Fullness in permille (1000 = held whole).
    pub used_permille: u64,
}

/// Orders candidate nodes and devices. Lower scores are tried first; equal scores keep
/// kube-scheduler's order.
pub trait PlacementPolicy: fmt::Debug + Send + Sync {
    /// The policy's name.
    fn name(&self) -> &str;
    /// The score of a node.
    fn node_score(&self, node: &NodeView<'_>) -> i64;
    /// The score of a device.
    fn device_score(&self, device: &DeviceView) -> i64;
    /// Whether the policy reorders nodes at all; when not, nodes are tried lazily in the
    /// caller's order and the search stops at the first that fits.
    fn orders_nodes(&self) -> bool {
        true
    }
    /// Whether multi-device requests prefer one `NVLink` island, then one NUMA node.
    fn prefers_topology(&self) -> bool;
}

/// The built-in policies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    /// kube-scheduler's order: nodes as given, devices as published.
    #[default]
    FirstFit,
    /// The fullest node and device that fit, to keep whole GPUs free.
    Binpack,
    /// The emptiest node and device, to spread load.
    Spread,
}

impl Policy {
    /// Every built-in policy.
    pub const ALL: [Self; 3] = [Self::FirstFit, Self::Binpack, Self::Spread];
}

fn fullness(node: &NodeView<'_>) -> i64 {
    let per_device = node.used_permille / u64::from(node.devices.max(1));
    i64::try_from(per_device).unwrap_or(i64::MAX)
}

impl PlacementPolicy for Policy {
    fn name(&self) -> &str {
        match self {
            Self::FirstFit => "first-fit",
            Self::Binpack => "binpack",
            Self::Spread => "spread",
        }
    }

    fn node_score(&self, node: &NodeView<'_>) -> i64 {
        match self {
            Self::FirstFit => 0,
            Self::Binpack => -fullness(node),
            Self::Spread => fullness(node),
        }
    }

    fn device_score(&self, device: &DeviceView) -> i64 {
        let used = i64::try_from(device.used_permille).unwrap_or(i64::MAX);
        match self {
            Self::FirstFit => 0,
            Self::Binpack => -used,
            Self::Spread => used,
        }
    }

    fn orders_nodes(&self) -> bool {
        !matches!(self, Self::FirstFit)
    }

    fn prefers_topology(&self) -> bool {
        !matches!(self, Self::FirstFit)
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Policy {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                Error::invalid(
                    "allocator options",
                    "policy",
                    format!("unknown policy {s:?}; expected first-fit, binpack or spread"),
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_round_trip_through_their_names() {
        for p in Policy::ALL {
            assert_eq!(p.to_string().parse::<Policy>().unwrap(), p);
        }
        assert!(
            "best-fit"
                .parse::<Policy>()
                .unwrap_err()
                .to_string()
                .contains("unknown policy")
        );
    }

    #[test]
    fn binpack_prefers_full_and_spread_prefers_empty() {
        let view = |used| NodeView {
            name: "n",
            position: 0,
            devices: 2,
            used_permille: used,
        };
        assert!(Policy::Binpack.node_score(&view(1500)) < Policy::Binpack.node_score(&view(100)));
        assert!(Policy::Spread.node_score(&view(100)) < Policy::Spread.node_score(&view(1500)));
        assert_eq!(
            Policy::FirstFit.node_score(&view(100)),
            Policy::FirstFit.node_score(&view(1500))
        );
    }
}
