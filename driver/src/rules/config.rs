//! Tessera's opaque configuration API (`gpu.tessera.dev/v1alpha1`).
//!
//! Two kinds travel in `opaque.parameters` of claims, classes and allocations:
//! * [`GpuShare`], written by users or admins: "this request is a share of a GPU".
//! * [`TierPolicy`], written by admins into a DeviceClass: the [`Tier`] of the class's shares
//!   and whether a claim may raise itself to online.
//! * [`AllocatedShares`], written by the allocator into an allocation's config: the resolved
//!   share of every device (and its tier), after percent conversion and the split over several
//!   cards. The node prepares from this record alone.

use std::fmt;

use k8s_openapi::api::resource::v1 as res;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Error, Result};
use crate::names;
use crate::rules::quantity::Quantity;

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
    /// Absent means the class's ([`crate::rules::patience`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub patience: Option<Patience>,
}

/// How a share's work ranks against other shares of the same GPU (shared/DESIGN.md §8).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// Latency-sensitive work: keeps the SMs it was promised (no compute over-commit beside
    /// it, `crate::rules::overcommit`) and the higher priority variable (a hint). The default.
    #[default]
    Online,
    /// Best-effort work: may be over-committed among batch shares; the lower priority variable.
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
    /// already partly used ([`crate::rules::patience`]); absent means they do not wait.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub patience: Option<Patience>,
    /// The class's batch shares may book compute up to this factor times a GPU's compute
    /// (online shares never; see [`crate::rules::overcommit`]); absent means 1, no over-commit.
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

/// One opaque config as it applies to requests: from a class (all requests of the class) or
/// from the claim (the listed requests, or all when none are listed).
#[derive(Debug, Clone, Copy)]
pub struct AppliedConfig<'a> {
    /// The requests the config names; empty means all.
    pub requests: &'a [String],
    /// The opaque config.
    pub opaque: &'a res::OpaqueDeviceConfiguration,
    /// Where it came from, for error messages (e.g. `spec.devices.config[0]`).
    pub field: &'a str,
}

impl AppliedConfig<'_> {
    /// Whether this config applies to `request` (a request name, or `parent/sub` for a
    /// firstAvailable subrequest, to which configs naming the parent apply too).
    pub fn applies_to(&self, request: &str) -> bool {
        applies(self.requests, request)
    }
}

/// Whether a config naming `requests` (empty: every request) applies to `request`: a request
/// name, or `parent/sub` for a firstAvailable subrequest, to which a config naming the parent
/// applies too. The one rule of config scoping: [`AppliedConfig::applies_to`] and the node's
/// preparation (`crate::node::prepare`) both ask it.
pub fn applies(requests: &[String], request: &str) -> bool {
    let parent = request.split_once('/').map_or(request, |(p, _)| p);
    requests.is_empty() || requests.iter().any(|r| r == request || r == parent)
}

/// Each config of `configs` that is for `driver` and applies to `request`, in order, decoded,
/// with the field of its parameters (`….opaque.parameters`) for error messages; `Err` names a
/// config that does not decode. Tier, patience, over-commit and the share rule all read their
/// configs through this one walk.
pub fn applying<'c, 'a: 'c>(
    configs: impl IntoIterator<Item = &'c AppliedConfig<'a>> + 'c,
    driver: &'c str,
    request: &'c str,
) -> impl Iterator<Item = Result<(TesseraConfig, String)>> + 'c {
    configs
        .into_iter()
        .filter(move |c| c.opaque.driver == driver && c.applies_to(request))
        .map(|c| {
            let context = format!("{}.opaque.parameters", c.field);
            decode(&c.opaque.parameters.0, &context).map(|config| (config, context))
        })
}

/// The field names of a class's configs, for error messages (`DeviceClass x: spec.config[0]`).
pub fn class_config_fields(class_name: &str, class: Option<&res::DeviceClass>) -> Vec<String> {
    let n = class
        .and_then(|c| c.spec.config.as_ref())
        .map_or(0, Vec::len);
    (0..n)
        .map(|i| format!("DeviceClass {class_name}: spec.config[{i}]"))
        .collect()
}

/// A class's opaque configs; they apply to every request of the class.
pub fn class_configs<'a>(
    class: Option<&'a res::DeviceClass>,
    fields: &'a [String],
) -> Vec<AppliedConfig<'a>> {
    class
        .iter()
        .flat_map(|c| c.spec.config.iter().flatten())
        .zip(fields)
        .filter_map(|(c, field)| {
            c.opaque.as_ref().map(|opaque| AppliedConfig {
                requests: &[],
                opaque,
                field,
            })
        })
        .collect()
}

/// The field names of a claim's configs, for error messages (`spec.devices.config[0]`).
pub fn claim_config_fields(claim: &res::DeviceClaim) -> Vec<String> {
    (0..claim.config.as_ref().map_or(0, Vec::len))
        .map(|i| format!("spec.devices.config[{i}]"))
        .collect()
}

/// A claim's opaque configs, each applying to the requests it names (all when none).
pub fn claim_configs<'a>(
    claim: &'a res::DeviceClaim,
    fields: &'a [String],
) -> Vec<AppliedConfig<'a>> {
    claim
        .config
        .iter()
        .flatten()
        .zip(fields)
        .filter_map(|(c, field)| {
            c.opaque.as_ref().map(|opaque| AppliedConfig {
                requests: c.requests.as_deref().unwrap_or_default(),
                opaque,
                field,
            })
        })
        .collect()
}

/// The longest patience a share may have: one day.
pub const MAX_PATIENCE_SECONDS: u64 = 24 * 60 * 60;

/// How long a delay-tolerant share may wait for a fragment; zero means it does not wait.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Patience(u64);

impl Patience {
    /// A patience of `seconds`, or why not (more than [`MAX_PATIENCE_SECONDS`]).
    pub fn from_secs(seconds: u64) -> Result<Self, String> {
        if seconds > MAX_PATIENCE_SECONDS {
            return Err(format!(
                "{seconds}s is longer than the longest patience, 24h: a delay-tolerant share \
                 must be placed within a day"
            ));
        }
        Ok(Self(seconds))
    }

    /// The patience in seconds.
    pub fn as_secs(self) -> u64 {
        self.0
    }

    /// Whether the share does not wait at all.
    pub fn is_zero(self) -> bool {
        self.0 == 0
    }

    /// Reads `90s`, `10m`, `2h`, `1h30m` (hours, minutes, seconds, each at most once and in
    /// that order, whole numbers), bounded by [`MAX_PATIENCE_SECONDS`].
    pub fn parse(text: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "{text:?} is not a duration: write whole hours, minutes and seconds such as \
                 \"90s\", \"10m\" or \"1h30m\""
            )
        };
        if text.is_empty() {
            return Err(bad());
        }
        let mut total: u64 = 0;
        let mut rest = text;
        let mut last_unit = 0;
        while !rest.is_empty() {
            let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
            if digits == 0 || digits > 6 {
                return Err(bad());
            }
            let value: u64 = rest[..digits].parse().map_err(|_| bad())?;
            let (unit, scale) = match rest.as_bytes().get(digits) {
                Some(b'h') => (1, 3600),
                Some(b'm') => (2, 60),
                Some(b's') => (3, 1),
                _ => return Err(bad()),
            };
            if unit <= last_unit {
                return Err(bad());
            }
            last_unit = unit;
            total = total.saturating_add(value.saturating_mul(scale));
            rest = &rest[digits + 1..];
        }
        Self::from_secs(total)
    }

    /// When a pod created at `created` stops waiting.
    pub fn deadline(self, created: Timestamp) -> Timestamp {
        let secs = i64::try_from(self.0).unwrap_or(i64::MAX);
        created
            .checked_add(SignedDuration::from_secs(secs))
            .unwrap_or(Timestamp::MAX)
    }
}

impl fmt::Display for Patience {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (h, m, s) = (self.0 / 3600, self.0 / 60 % 60, self.0 % 60);
        if self.0 == 0 {
            return f.write_str("0s");
        }
        if h > 0 {
            write!(f, "{h}h")?;
        }
        if m > 0 {
            write!(f, "{m}m")?;
        }
        if s > 0 {
            write!(f, "{s}s")?;
        }
        Ok(())
    }
}

impl Serialize for Patience {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Patience {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        Self::parse(&text).map_err(|m| serde::de::Error::custom(format!("patience: {m}")))
    }
}

/// An over-commit factor, kept exactly in hundredths: 1.0 (no over-commit) to 10.0, at most
/// two decimals. Written as a number (`2`, `1.5`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Factor(u32);

impl Factor {
    /// No over-commit.
    pub const ONE: Self = Self(100);
    /// The largest factor a class may set.
    pub const MAX: Self = Self(1000);

    /// The factor `hundredths / 100`, if within 1.0..=10.0.
    pub fn from_hundredths(hundredths: u32) -> Option<Self> {
        (Self::ONE.0..=Self::MAX.0)
            .contains(&hundredths)
            .then_some(Self(hundredths))
    }

    /// Whether the factor allows any over-commit.
    pub fn overcommits(self) -> bool {
        self.0 > Self::ONE.0
    }

    /// `f × total`, rounded down.
    pub fn scale(self, total: u64) -> u64 {
        u64::try_from(u128::from(total) * u128::from(self.0) / 100).unwrap_or(u64::MAX)
    }

    /// Reads a factor from a number; the message says which rule the value breaks.
    pub fn from_f64(value: f64) -> Result<Self, String> {
        if !value.is_finite() || !(1.0..=10.0).contains(&value) {
            return Err(format!(
                "over-commit factor {value} is outside 1.0..=10.0 (1 means no over-commit)"
            ));
        }
        let hundredths = (value * 100.0).round();
        if (value * 100.0 - hundredths).abs() > 1e-6 {
            return Err(format!(
                "over-commit factor {value} has more than two decimals; write e.g. 1.5 or 2.25"
            ));
        }
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        // Reason: 100..=1000 checked above.
        Ok(Self(hundredths as u32))
    }
}

impl fmt::Display for Factor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_multiple_of(100) {
            write!(f, "{}", self.0 / 100)
        } else if self.0.is_multiple_of(10) {
            write!(f, "{}.{}", self.0 / 100, (self.0 % 100) / 10)
        } else {
            write!(f, "{}.{:02}", self.0 / 100, self.0 % 100)
        }
    }
}

impl Serialize for Factor {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.0.is_multiple_of(100) {
            s.serialize_u32(self.0 / 100)
        } else {
            s.serialize_f64(f64::from(self.0) / 100.0)
        }
    }
}

impl<'de> Deserialize<'de> for Factor {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let value = f64::deserialize(d)?;
        Self::from_f64(value).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_config_of_a_class_applies_each_named_by_its_own_field() {
        // The policy sits in the class's second config, after another driver's: it holds as
        // the first would, and an error in it names spec.config[1].
        let class = crate::testing::class_from_yaml(
            r"
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {name: shared-gpu}
spec:
  config:
  - opaque:
      driver: other.example.com
      parameters: {mode: any}
  - opaque:
      driver: gpu.tessera.dev
      parameters:
        apiVersion: gpu.tessera.dev/v1alpha1
        kind: TierPolicy
        tier: batch
        allowOnline: false
",
        );
        let fields = class_config_fields("shared-gpu", Some(&class));
        assert_eq!(
            fields,
            [
                "DeviceClass shared-gpu: spec.config[0]",
                "DeviceClass shared-gpu: spec.config[1]"
            ]
        );
        let configs = class_configs(Some(&class), &fields);
        assert_eq!(configs.len(), 2, "no config of the class is dropped");
        assert_eq!(configs[1].opaque.driver, "gpu.tessera.dev");
        assert_eq!(configs[1].field, "DeviceClass shared-gpu: spec.config[1]");
        let applied: Vec<String> = applying(&configs, "gpu.tessera.dev", "gpu")
            .map(|c| c.unwrap().1)
            .collect();
        assert_eq!(
            applied,
            ["DeviceClass shared-gpu: spec.config[1].opaque.parameters"]
        );
    }

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

    #[test]
    fn a_config_applies_to_the_requests_it_names_and_their_subrequests_and_an_empty_list_to_all() {
        let opaque: res::OpaqueDeviceConfiguration = serde_json::from_value(json!({
            "driver": "gpu.tessera.dev",
            "parameters": {"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuShare"}
        }))
        .unwrap();
        let named = ["gpu".to_owned()];
        let cfg = AppliedConfig {
            requests: &named,
            opaque: &opaque,
            field: "spec.devices.config[0]",
        };
        assert!(cfg.applies_to("gpu"));
        assert!(cfg.applies_to("gpu/small"));
        assert!(!cfg.applies_to("other"));
        assert!(!cfg.applies_to("other/gpu"));
        let all = AppliedConfig {
            requests: &[],
            ..cfg
        };
        assert!(all.applies_to("gpu") && all.applies_to("other/small"));
    }
}
