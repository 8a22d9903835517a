//! A share's tier: `online` (the default) or `batch` (shared/DESIGN.md §8).
//!
//! Where a request's tier comes from, the first that says one:
//! 1. the claim's `GpuShare.tier` (the last claim config for this driver that applies and sets
//!    one);
//! 2. the class: the last of its configs for this driver that sets one, a [`TierPolicy`]'s
//!    `tier` or a class `GpuShare`'s `tier`;
//! 3. `online`.
//!
//! A class whose [`TierPolicy`] says `allowOnline: false` refuses a request whose tier comes
//! out online, so a claim cannot raise itself above its class. A `TierPolicy` belongs to a
//! class only; in a claim it is an error (a claim sets its tier with `GpuShare.tier`).
//!
//! [`request_tier`] is the one place this rule lives: the allocator resolves the tier with it
//! and writes the result into the `AllocatedShares` record, and `tessera validate` and
//! admission refuse with it what the allocator would refuse.

use crate::error::Error;
use crate::names;
use crate::rules::config::AppliedConfig;
use crate::rules::config::{self, TesseraConfig, Tier, TierPolicy};

fn rule(field: String, message: impl Into<String>) -> Error {
    Error::Share {
        field,
        message: message.into(),
    }
}

/// Checks a class's [`TierPolicy`]: `allowOnline: false` needs `tier: batch`, or every
/// request of the class would be refused. `field` names the policy's parameters.
pub fn check_policy(policy: &TierPolicy, field: &str) -> Result<(), Error> {
    if policy.allow_online == Some(false) && policy.tier != Some(Tier::Batch) {
        return Err(rule(
            format!("{field}.allowOnline"),
            format!(
                "allowOnline: false needs tier: batch (the tier is {}), or every request of \
                 the class would be refused",
                policy
                    .tier
                    .map_or("absent, which means online", Tier::as_str)
            ),
        ));
    }
    Ok(())
}

/// The tier of `request` (`req` or `req/sub`) of class `class_name`, from the class's and the
/// claim's configs as they apply to it (see the module docs for the order). `Err` names the
/// config and the rule: a config that does not decode, a `TierPolicy` in a claim, or an
/// online tier that the class forbids.
pub fn request_tier(
    driver: &str,
    request: &str,
    class_name: &str,
    class_configs: &[AppliedConfig<'_>],
    claim_configs: &[AppliedConfig<'_>],
) -> Result<Tier, Error> {
    let mut class_tier = None;
    let mut allow_online = true;
    for decoded in config::applying(class_configs, driver, request) {
        match decoded?.0 {
            TesseraConfig::TierPolicy(policy) => {
                class_tier = policy.tier.or(class_tier);
                if let Some(allow) = policy.allow_online {
                    allow_online = allow;
                }
            }
            TesseraConfig::GpuShare(share) => class_tier = share.tier.or(class_tier),
            TesseraConfig::AllocatedShares(_) => {}
        }
    }
    let mut claim_tier = None;
    for decoded in config::applying(claim_configs, driver, request) {
        let (parsed, context) = decoded?;
        match parsed {
            TesseraConfig::TierPolicy(_) => {
                return Err(rule(
                    format!("{context}.kind"),
                    format!(
                        "{} is a DeviceClass setting; a claim sets its tier with {}.tier",
                        names::TIER_POLICY_KIND,
                        names::GPU_SHARE_KIND
                    ),
                ));
            }
            TesseraConfig::GpuShare(share) => {
                if let Some(tier) = share.tier {
                    claim_tier = Some((tier, context));
                }
            }
            TesseraConfig::AllocatedShares(_) => {}
        }
    }
    let tier = claim_tier
        .as_ref()
        .map(|(t, _)| *t)
        .or(class_tier)
        .unwrap_or_default();
    if tier == Tier::Online && !allow_online {
        let field = claim_tier.map_or_else(
            || format!("DeviceClass {class_name}"),
            |(_, context)| format!("{context}.tier"),
        );
        return Err(rule(
            field,
            format!(
                "DeviceClass {class_name} does not allow the online tier (its {} says \
                 allowOnline: false); ask for tier: batch or use another class",
                names::TIER_POLICY_KIND
            ),
        ));
    }
    Ok(tier)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{applied, opaque};
    use k8s_openapi::api::resource::v1 as res;
    use serde_json::json;

    const DRIVER: &str = "gpu.tessera.dev";

    fn policy(tier: Option<&str>, allow_online: Option<bool>) -> serde_json::Value {
        let mut v = json!({"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "TierPolicy"});
        if let Some(t) = tier {
            v["tier"] = json!(t);
        }
        if let Some(a) = allow_online {
            v["allowOnline"] = json!(a);
        }
        v
    }

    fn share(tier: Option<&str>) -> serde_json::Value {
        let mut v =
            json!({"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuShare", "memory": "4Gi"});
        if let Some(t) = tier {
            v["tier"] = json!(t);
        }
        v
    }

    fn resolve(class: &[serde_json::Value], claim: &[serde_json::Value]) -> Result<Tier, Error> {
        let class: Vec<_> = class.iter().cloned().map(opaque).collect();
        let claim: Vec<_> = claim.iter().cloned().map(opaque).collect();
        request_tier(
            DRIVER,
            "gpu",
            "batch",
            &applied(&class, "DeviceClass batch: spec.config[0]"),
            &applied(&claim, "spec.devices.config[0]"),
        )
    }

    #[test]
    fn a_share_is_online_unless_something_says_batch() {
        assert_eq!(resolve(&[], &[share(None)]).unwrap(), Tier::Online);
        assert_eq!(resolve(&[], &[share(Some("batch"))]).unwrap(), Tier::Batch);
    }

    #[test]
    fn the_class_tier_applies_when_the_claim_sets_none() {
        let class = [policy(Some("batch"), None)];
        assert_eq!(resolve(&class, &[share(None)]).unwrap(), Tier::Batch);
        assert_eq!(resolve(&[share(Some("batch"))], &[]).unwrap(), Tier::Batch);
    }

    #[test]
    fn a_claim_may_raise_itself_only_where_the_class_allows_it() {
        let open = [policy(Some("batch"), None)];
        assert_eq!(
            resolve(&open, &[share(Some("online"))]).unwrap(),
            Tier::Online
        );
        let closed = [policy(Some("batch"), Some(false))];
        let err = resolve(&closed, &[share(Some("online"))])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("spec.devices.config[0].opaque.parameters.tier"),
            "{err}"
        );
        assert!(err.contains("allowOnline: false"), "{err}");
        assert_eq!(
            resolve(&closed, &[share(Some("batch"))]).unwrap(),
            Tier::Batch
        );
        assert_eq!(resolve(&closed, &[share(None)]).unwrap(), Tier::Batch);
    }

    #[test]
    fn a_tier_policy_in_a_claim_is_refused() {
        let err = resolve(&[], &[policy(Some("batch"), None)])
            .unwrap_err()
            .to_string();
        assert!(err.contains("DeviceClass setting"), "{err}");
    }

    #[test]
    fn an_unknown_tier_does_not_decode() {
        let err = resolve(&[], &[share(Some("gold"))])
            .unwrap_err()
            .to_string();
        assert!(err.contains("gold"), "{err}");
    }

    #[test]
    fn forbidding_online_needs_a_batch_tier() {
        let policy_of = |v: serde_json::Value| -> TierPolicy { serde_json::from_value(v).unwrap() };
        let err = check_policy(&policy_of(policy(None, Some(false))), "spec.config[0]")
            .unwrap_err()
            .to_string();
        assert!(err.contains("spec.config[0].allowOnline"), "{err}");
        assert!(check_policy(&policy_of(policy(Some("batch"), Some(false))), "f").is_ok());
        assert!(check_policy(&policy_of(policy(Some("online"), None)), "f").is_ok());
    }

    fn batch_class(policy_params: &serde_json::Value) -> res::DeviceClass {
        serde_json::from_value(json!({
            "metadata": {"name": "batch"},
            "spec": {"config": [{"opaque": {"driver": DRIVER, "parameters": policy_params}}]}
        }))
        .unwrap()
    }

    fn claim_errors(class: &res::DeviceClass, share_params: &serde_json::Value) -> Vec<String> {
        let spec: res::ResourceClaimSpec = serde_json::from_value(json!({"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": "batch"}}],
            "config": [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": share_params}}]
        }}))
        .unwrap();
        let lookup = |name: &str| (name == "batch").then(|| class.clone());
        crate::rules::validation::validate_claim_spec(
            "ResourceClaim ns/c",
            &spec,
            DRIVER,
            &["batch"],
            &lookup,
            &crate::rules::cel::CelCache::new(),
        )
        .iter()
        .map(ToString::to_string)
        .collect()
    }

    #[test]
    fn validation_refuses_what_the_class_forbids_and_accepts_the_rest() {
        let class = batch_class(&policy(Some("batch"), Some(false)));
        let errors = claim_errors(&class, &share(Some("online")));
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].contains("ResourceClaim ns/c"), "{errors:?}");
        assert!(errors[0].contains("allowOnline: false"), "{errors:?}");
        assert!(claim_errors(&class, &share(Some("batch"))).is_empty());
        assert!(claim_errors(&class, &share(None)).is_empty());
        let errors = claim_errors(&class, &policy(Some("batch"), None));
        assert!(
            errors.iter().any(|e| e.contains("DeviceClass setting")),
            "{errors:?}"
        );
    }

    #[test]
    fn class_validation_checks_the_tier_policy() {
        let cel = crate::rules::cel::CelCache::new();
        let bad = batch_class(&policy(None, Some(false)));
        let errors = crate::rules::validation::validate_device_class(&bad, DRIVER, &cel);
        assert_eq!(errors.len(), 1, "{errors:?}");
        let text = errors[0].to_string();
        assert!(text.contains("DeviceClass batch"), "{text}");
        assert!(text.contains("spec.config[0].opaque.parameters"), "{text}");
        assert!(text.contains("allowOnline"), "{text}");
        let good = batch_class(&policy(Some("batch"), Some(false)));
        assert!(crate::rules::validation::validate_device_class(&good, DRIVER, &cel).is_empty());
        let typo = batch_class(
            &json!({"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "TierPolicy", "tier": "gold"}),
        );
        assert_eq!(
            crate::rules::validation::validate_device_class(&typo, DRIVER, &cel).len(),
            1
        );
    }
}
