//! Delay tolerance (shared/DESIGN.md §8): a share that may wait for a fragment.
//!
//! A request is delay-tolerant when a `patience` applies to it: a duration written as
//! `GpuShare.patience` in the claim, else in the class (a `TierPolicy`'s or a class
//! `GpuShare`'s `patience`). A claim's `patience: 0s` opts out of its class's. Such a request
//! is placed only on a GPU that already holds another share (a *fragment*), until its pod has
//! waited `patience` since it was created; from then on it is placed like any other request.
//! The allocator applies the rule ([`crate::placement::allocator::Allocator::fragments_only`]); the
//! controller keeps the pod gated meanwhile and says so in its condition.
//!
//! [`Patience`] reads and writes the duration (`90s`, `10m`, `1h30m`; whole seconds, at most
//! [`MAX_PATIENCE_SECONDS`]), so a malformed or unbounded patience never decodes: admission and
//! `tessera validate` refuse it with the config's field. [`request_patience`] is the one place
//! that resolves which patience applies to a request.

use k8s_openapi::jiff::Timestamp;

use crate::error::Error;
use crate::rules::config::{self, AppliedConfig, Patience, TesseraConfig};

/// Whether a pod with `patience`, created at `created`, still waits for a fragment at `now`:
/// `Some(deadline)` while it does, `None` when it is placed normally (no patience, a zero
/// one, no creation time, or the deadline passed).
pub fn waits_until(
    patience: Option<Patience>,
    created: Option<Timestamp>,
    now: Timestamp,
) -> Option<Timestamp> {
    let patience = patience.filter(|p| !p.is_zero())?;
    let deadline = patience.deadline(created?);
    (now < deadline).then_some(deadline)
}

/// The patience of `request` (`req` or `req/sub`), from the class's and the claim's configs
/// as they apply to it: the claim's last `GpuShare.patience`, else the class's last
/// (`TierPolicy` or `GpuShare`); `None` when neither sets one or the one that applies is zero.
/// `Err` names a config that does not decode.
pub fn request_patience(
    driver: &str,
    request: &str,
    class_configs: &[AppliedConfig<'_>],
    claim_configs: &[AppliedConfig<'_>],
) -> Result<Option<Patience>, Error> {
    let find = |configs: &[AppliedConfig<'_>]| -> Result<Option<Patience>, Error> {
        let mut found = None;
        for decoded in config::applying(configs, driver, request) {
            match decoded?.0 {
                TesseraConfig::TierPolicy(p) => found = p.patience.or(found),
                TesseraConfig::GpuShare(s) => found = s.patience.or(found),
                TesseraConfig::AllocatedShares(_) => {}
            }
        }
        Ok(found)
    };
    let patience = match find(claim_configs)? {
        Some(p) => Some(p),
        None => find(class_configs)?,
    };
    Ok(patience.filter(|p| !p.is_zero()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{applied, opaque};
    use k8s_openapi::api::resource::v1 as res;
    use serde_json::json;

    #[test]
    fn durations_read_as_written_and_print_back() {
        for (text, secs) in [
            ("90s", 90),
            ("10m", 600),
            ("2h", 7200),
            ("1h30m", 5400),
            ("1h0m5s", 3605),
            ("0s", 0),
            ("24h", 86_400),
        ] {
            let p = Patience::parse(text).unwrap();
            assert_eq!(p.as_secs(), secs, "{text}");
            assert_eq!(Patience::parse(&p.to_string()).unwrap(), p);
        }
        assert_eq!(Patience::parse("90m").unwrap().to_string(), "1h30m");
    }

    #[test]
    fn malformed_or_unbounded_durations_are_refused() {
        for text in [
            "", "10", "m", "1.5h", "-5m", "10M", "5m1h", "1m1m", "1d", " 5m", "1234567s",
        ] {
            let err = Patience::parse(text).unwrap_err();
            assert!(err.contains("not a duration"), "{text}: {err}");
        }
        let err = Patience::parse("25h").unwrap_err();
        assert!(err.contains("24h"), "{err}");
        assert!(Patience::parse("1440m").is_ok());
        assert!(Patience::parse("1441m").is_err());
    }

    #[test]
    fn a_pod_waits_until_its_creation_plus_patience() {
        let created: Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        let p = Some(Patience::parse("10m").unwrap());
        let early: Timestamp = "2026-01-01T00:09:59Z".parse().unwrap();
        let late: Timestamp = "2026-01-01T00:10:00Z".parse().unwrap();
        let deadline: Timestamp = "2026-01-01T00:10:00Z".parse().unwrap();
        assert_eq!(waits_until(p, Some(created), early), Some(deadline));
        assert_eq!(waits_until(p, Some(created), late), None);
        assert_eq!(waits_until(None, Some(created), early), None);
        assert_eq!(
            waits_until(Some(Patience::default()), Some(created), early),
            None
        );
        assert_eq!(waits_until(p, None, early), None);
    }

    fn resolve(
        class: &[serde_json::Value],
        claim: &[serde_json::Value],
    ) -> Result<Option<Patience>, Error> {
        let class: Vec<_> = class.iter().cloned().map(opaque).collect();
        let claim: Vec<_> = claim.iter().cloned().map(opaque).collect();
        request_patience(
            "gpu.tessera.dev",
            "gpu",
            &applied(&class, "DeviceClass batch: spec.config[0]"),
            &applied(&claim, "spec.devices.config[0]"),
        )
    }

    fn policy(patience: &str) -> serde_json::Value {
        json!({"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "TierPolicy", "tier": "batch", "patience": patience})
    }

    fn share(patience: Option<&str>) -> serde_json::Value {
        let mut v =
            json!({"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuShare", "memory": "4Gi"});
        if let Some(p) = patience {
            v["patience"] = json!(p);
        }
        v
    }

    #[test]
    fn the_claim_patience_wins_over_the_class_and_zero_opts_out() {
        let ten = Patience::parse("10m").unwrap();
        assert_eq!(resolve(&[], &[share(None)]).unwrap(), None);
        assert_eq!(
            resolve(&[policy("10m")], &[share(None)]).unwrap(),
            Some(ten)
        );
        assert_eq!(
            resolve(&[policy("1h")], &[share(Some("10m"))]).unwrap(),
            Some(ten)
        );
        assert_eq!(
            resolve(&[policy("10m")], &[share(Some("0s"))]).unwrap(),
            None
        );
        assert_eq!(resolve(&[share(Some("10m"))], &[]).unwrap(), Some(ten));
    }

    #[test]
    fn a_bad_patience_is_an_error_naming_the_config() {
        let err = resolve(&[], &[share(Some("forever"))])
            .unwrap_err()
            .to_string();
        assert!(err.contains("spec.devices.config[0]"), "{err}");
        assert!(err.contains("patience"), "{err}");
        let err = resolve(&[policy("48h")], &[]).unwrap_err().to_string();
        assert!(err.contains("24h"), "{err}");
    }

    #[test]
    fn validation_refuses_a_bad_patience_in_a_claim_or_a_class() {
        let cel = crate::rules::cel::CelCache::new();
        let class: res::DeviceClass = serde_json::from_value(json!({
            "metadata": {"name": "batch"},
            "spec": {"config": [{"opaque": {"driver": "gpu.tessera.dev", "parameters": policy("2d")}}]}
        }))
        .unwrap();
        let errors =
            crate::rules::validation::validate_device_class(&class, "gpu.tessera.dev", &cel);
        assert_eq!(errors.len(), 1, "{errors:?}");
        let text = errors[0].to_string();
        assert!(text.contains("DeviceClass batch"), "{text}");
        assert!(text.contains("patience"), "{text}");
        let claim_errors = |patience: &str| -> Vec<String> {
            let spec: res::ResourceClaimSpec = serde_json::from_value(json!({"devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": "shared"}}],
                "config": [{"requests": ["gpu"], "opaque": {"driver": "gpu.tessera.dev", "parameters": share(Some(patience))}}]
            }}))
            .unwrap();
            let lookup = |_: &str| None;
            crate::rules::validation::validate_claim_spec(
                "ResourceClaim ns/c",
                &spec,
                "gpu.tessera.dev",
                &["shared"],
                &lookup,
                &cel,
            )
            .iter()
            .map(ToString::to_string)
            .collect()
        };
        // The config is reported where it is written, and again for the request it applies to.
        let errors = claim_errors("48h");
        assert!(!errors.is_empty());
        for e in &errors {
            assert!(e.contains("ResourceClaim ns/c"), "{errors:?}");
            assert!(e.contains("spec.devices.config[0]"), "{errors:?}");
            assert!(e.contains("24h"), "{errors:?}");
        }
        assert!(claim_errors("45m").is_empty());
    }
}
