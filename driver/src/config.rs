//! Tessera's opaque configuration API (`gpu.tessera.dev/v1alpha1`).
//!
//! Two kinds travel in `opaque.parameters` of claims, classes and allocations:
//! * [`GpuShare`], written by users or admins: "this request is a share of a GPU".
//! * [`TierPolicy`], written by admins into a DeviceClass: the [`Tier`] of the class's shares
//!   and whether a claim may raise itself to online.
//! * [`AllocatedShares`], written by the allocator into an allocation's config: the resolved
//!   share of every device (and its tier), after percent conversion and the split over several
//!   cards. The node prepares from this record alone.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::names;
use crate::overcommit::Factor;
use crate::patience::Patience;
use crate::quantity::Quantity;

/// A user's request for a share of one or more GPUs.
///
/// With `count: M` on the request, `memory` and `compute` are totals for the pod, split evenly
/// over M distinct GPUs; `memoryPercent` is a percent of each card's memory.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuShare {
    /// Always `gpu.tessera.dev/v1alpha1`.
    pub api_version: String,
    /// Always `GpuShare`.
    pub kind: String,
    /// GPU memory, in whole GiB (e.g. `10Gi`); total over all cards of the request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<Quantity>,
    /// Percent of each card's memory, 1..=100; exclusive with `memory`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_percent: Option<i64>,
    /// Compute in percent of one GPU, in steps of 5; total over all cards of the request.
    /// Absent means compute is not isolated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute: Option<i64>,
    /// The share's tier; absent means the class's tier (online when the class sets none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier: Option<Tier>,
    /// Delay tolerance: how long the share may wait for a GPU that is already partly used
    /// before it is placed anywhere (`10m`; at most `24h`; `0s` opts out of the class's).
    /// Absent means the class's ([`crate::patience`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub patience: Option<Patience>,
}

/// How a share's work ranks against other shares of the same GPU (shared/DESIGN.md §8).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// Latency-sensitive work: the higher kernel priority. The default.
    #[default]
    Online,
    /// Best-effort work: the lower kernel priority.
    Batch,
}

impl Tier {
    /// Whether this is the default tier (records leave it out).
    #[allow(clippy::trivially_copy_pass_by_ref)] // Reason: serde's skip_serializing_if passes a reference.
    pub fn is_online(&self) -> bool {
        *self == Self::Online
    }

    /// The tier's name as written in configs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Online => "online",
            Self::Batch => "batch",
        }
    }
}

impl std::fmt::Display for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A DeviceClass's tier setting: the tier of the class's shares, and whether a claim's
/// `GpuShare` may raise itself to online. Only a class may carry one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TierPolicy {
    /// Always `gpu.tessera.dev/v1alpha1`.
    pub api_version: String,
    /// Always `TierPolicy`.
    pub kind: String,
    /// The tier of the class's shares when the claim sets none; absent means online.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier: Option<Tier>,
    /// Whether a claim may ask for `tier: online`; absent means yes. `false` needs
    /// `tier: batch`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_online: Option<bool>,
    /// Delay tolerance of the class's shares: how long they may wait for a GPU that is
    /// already partly used ([`crate::patience`]); absent means they do not wait.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub patience: Option<Patience>,
    /// The class's batch shares may book compute up to this factor times a GPU's compute
    /// (online shares never; see [`crate::overcommit`]); absent means 1, no over-commit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_compute_overcommit: Option<Factor>,
    /// The class's batch shares may book memory up to this factor times a GPU's memory, on
    /// GPUs whose node can back it (`enforcement: hami-core`); absent means 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_memory_overcommit: Option<Factor>,
}

/// The resolved share of one device in an allocation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeviceShare {
    /// The request (or `request/subrequest`) the device was allocated for.
    pub request: String,
    /// The pool the device belongs to.
    pub pool: String,
    /// The device name within the pool.
    pub device: String,
    /// Memory limit in bytes: what the share may use.
    pub memory: Quantity,
    /// Compute limit in percent of the GPU; 0 means not isolated. What the share may use.
    pub compute: i64,
    /// The share's tier as the allocator resolved it; absent (records written before tiers)
    /// means online.
    #[serde(default, skip_serializing_if = "Tier::is_online")]
    pub tier: Tier,
    /// The memory the share is guaranteed, when less than `memory` (a batch share whose class
    /// over-commits memory); absent means all of `memory`. The rest is usable only while the
    /// GPU's other shares leave it free.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guaranteed_memory: Option<Quantity>,
    /// The compute the share is guaranteed, when less than `compute` (a batch share whose
    /// class over-commits compute); absent means all of `compute`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guaranteed_compute: Option<i64>,
}

impl DeviceShare {
    /// The memory the share is guaranteed.
    pub fn guaranteed_memory(&self) -> Quantity {
        self.guaranteed_memory.unwrap_or(self.memory)
    }

    /// The compute the share is guaranteed.
    pub fn guaranteed_compute(&self) -> i64 {
        self.guaranteed_compute.unwrap_or(self.compute)
    }
}

/// The allocator's record of the resolved shares in one allocation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AllocatedShares {
    /// Always `gpu.tessera.dev/v1alpha1`.
    pub api_version: String,
    /// Always `AllocatedShares`.
    pub kind: String,
    /// One entry per shared device in the allocation.
    pub devices: Vec<DeviceShare>,
}

impl AllocatedShares {
    /// A record for the given device shares.
    pub fn new(devices: Vec<DeviceShare>) -> Self {
        Self {
            api_version: names::CONFIG_API_VERSION.to_owned(),
            kind: names::ALLOCATED_SHARES_KIND.to_owned(),
            devices,
        }
    }
}

/// One of Tessera's opaque configuration objects, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TesseraConfig {
    /// A share request.
    GpuShare(GpuShare),
    /// An allocation record.
    AllocatedShares(AllocatedShares),
    /// A class's tier setting.
    TierPolicy(TierPolicy),
}

/// Decodes the `opaque.parameters` of a config for this driver.
///
/// `context` names where the parameters came from (object and field) for error messages.
/// Unknown fields, a wrong `apiVersion` or an unknown `kind` are errors: a typo in a share must
/// never silently turn into "no limit".
pub fn decode(parameters: &serde_json::Value, context: &str) -> Result<TesseraConfig> {
    let field = |f: &str| format!("{context}.{f}");
    let api_version = parameters
        .get("apiVersion")
        .and_then(serde_json::Value::as_str);
    if api_version != Some(names::CONFIG_API_VERSION) {
        return Err(Error::Share {
            field: field("apiVersion"),
            message: format!(
                "is {}, must be {}",
                api_version.map_or_else(|| "missing".to_owned(), |v| format!("{v:?}")),
                names::CONFIG_API_VERSION
            ),
        });
    }
    let kind = parameters.get("kind").and_then(serde_json::Value::as_str);
    let decode_err = |e: serde_json::Error| Error::Share {
        field: context.to_owned(),
        message: e.to_string(),
    };
    match kind {
        Some(names::GPU_SHARE_KIND) => Ok(TesseraConfig::GpuShare(
            serde_json::from_value(parameters.clone()).map_err(decode_err)?,
        )),
        Some(names::ALLOCATED_SHARES_KIND) => Ok(TesseraConfig::AllocatedShares(
            serde_json::from_value(parameters.clone()).map_err(decode_err)?,
        )),
        Some(names::TIER_POLICY_KIND) => Ok(TesseraConfig::TierPolicy(
            serde_json::from_value(parameters.clone()).map_err(decode_err)?,
        )),
        other => Err(Error::Share {
            field: field("kind"),
            message: format!(
                "is {}, must be {}, {} or {}",
                other.map_or_else(|| "missing".to_owned(), |v| format!("{v:?}")),
                names::GPU_SHARE_KIND,
                names::TIER_POLICY_KIND,
                names::ALLOCATED_SHARES_KIND
            ),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn decodes_a_share() {
        let cfg = decode(
            &json!({"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuShare", "memory": "10Gi", "compute": 50}),
            "spec",
        )
        .unwrap();
        let TesseraConfig::GpuShare(share) = cfg else {
            panic!("not a share")
        };
        assert_eq!(share.memory, Some(Quantity::parse("10Gi").unwrap()));
        assert_eq!(share.compute, Some(50));
    }

    #[test]
    fn rejects_unknown_fields_and_kinds() {
        let typo =
            json!({"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuShare", "memroy": "10Gi"});
        assert!(
            decode(&typo, "spec")
                .unwrap_err()
                .to_string()
                .contains("memroy")
        );
        let kind = json!({"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "Nope"});
        assert!(
            decode(&kind, "spec")
                .unwrap_err()
                .to_string()
                .contains("kind")
        );
        let version = json!({"apiVersion": "v1", "kind": "GpuShare"});
        assert!(
            decode(&version, "spec")
                .unwrap_err()
                .to_string()
                .contains("apiVersion")
        );
    }

    #[test]
    fn a_share_and_a_class_policy_carry_a_tier() {
        let cfg = decode(
            &json!({"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuShare", "memory": "10Gi", "tier": "batch"}),
            "spec",
        )
        .unwrap();
        let TesseraConfig::GpuShare(share) = cfg else {
            panic!("not a share")
        };
        assert_eq!(share.tier, Some(Tier::Batch));
        let cfg = decode(
            &json!({"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "TierPolicy", "tier": "batch", "allowOnline": false}),
            "spec",
        )
        .unwrap();
        let TesseraConfig::TierPolicy(policy) = cfg else {
            panic!("not a policy")
        };
        assert_eq!(policy.tier, Some(Tier::Batch));
        assert_eq!(policy.allow_online, Some(false));
        let bad = json!({"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuShare", "memory": "1Gi", "tier": "Batch"});
        assert!(
            decode(&bad, "spec")
                .unwrap_err()
                .to_string()
                .contains("Batch")
        );
        let typo = json!({"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "TierPolicy", "allowonline": false});
        assert!(
            decode(&typo, "spec")
                .unwrap_err()
                .to_string()
                .contains("allowonline")
        );
    }

    #[test]
    fn a_record_without_a_tier_is_online_and_an_online_record_stays_as_before() {
        let old = json!({"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "AllocatedShares",
            "devices": [{"request": "gpu", "pool": "n", "device": "gpu-0", "memory": "1Gi", "compute": 0}]});
        let TesseraConfig::AllocatedShares(record) = decode(&old, "status").unwrap() else {
            panic!("not a record")
        };
        assert_eq!(record.devices[0].tier, Tier::Online);
        // Online records serialize as they did before tiers; batch ones name their tier.
        assert_eq!(serde_json::to_value(&record).unwrap(), old);
        let mut batch = record;
        batch.devices[0].tier = Tier::Batch;
        assert_eq!(
            serde_json::to_value(&batch).unwrap()["devices"][0]["tier"],
            json!("batch")
        );
    }
}
