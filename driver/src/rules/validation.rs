//! Static checks of DeviceClasses and claims, before anything is allocated.
//!
//! `tessera validate` and the admission webhook call these: every CEL expression compiles, every
//! Tessera opaque config decodes, and every share obeys the share rules. Each problem is an
//! [`Error`] naming the object, the field and the rule; a whole object is checked, so a user
//! sees all their mistakes at once.

use k8s_openapi::api::resource::v1 as res;

use crate::error::Error;
use crate::rules::cel::CelCache;
use crate::rules::config::{
    self, AppliedConfig, TesseraConfig, claim_config_fields, claim_configs, class_config_fields,
    class_configs,
};
use crate::rules::quantity::Quantity;
use crate::rules::share::ShareRequest;

/// The parts of a request (or subrequest) that decide whether and how it is a share.
#[derive(Debug, Clone, Copy)]
pub struct ShareInput<'a> {
    /// `req` or `req/sub`.
    pub request: &'a str,
    /// The request's `count` (absent means 1).
    pub count: Option<i64>,
    /// The request's `allocationMode` (absent means `ExactCount`).
    pub allocation_mode: Option<&'a str>,
    /// The request's `capacity.requests`.
    pub capacity: Option<&'a res::CapacityRequirements>,
    /// The field path of the request, for error messages.
    pub field: &'a str,
}

/// Where a request's `capacity.requests` make it a Tessera share.
#[derive(Debug, Clone, Copy)]
pub enum CapacityShares<'a> {
    /// When the request's class is one of these (static checks, with no devices at hand).
    InClasses(&'a [&'a str]),
    /// Always: the allocator applies such a share to Tessera's devices only, where the
    /// request lands on another driver's device it is plain consumable capacity.
    OnTesseraDevices,
}

/// What a request is as far as Tessera's shares go.
#[derive(Debug, Clone)]
pub enum RequestShare {
    /// Not a share.
    Plain,
    /// Sized by a `GpuShare` opaque config.
    Config(ShareRequest),
    /// Sized by `capacity.requests`; an `Err` names the share rule they break (with
    /// [`CapacityShares::OnTesseraDevices`] that matters only on Tessera's devices).
    Capacity(Result<ShareRequest, Error>),
}

impl RequestShare {
    /// The share, or the rule it breaks; `Ok(None)` for a plain request.
    pub fn into_result(self) -> Result<Option<ShareRequest>, Error> {
        match self {
            Self::Plain => Ok(None),
            Self::Config(s) => Ok(Some(s)),
            Self::Capacity(r) => r.map(Some),
        }
    }
}

/// Decides whether a request is a Tessera share and what it asks: the one place that rule
/// lives (the allocator, `tessera validate` and admission all use it).
///
/// A request is a share when a [`config::GpuShare`] for `driver` applies to it (class configs
/// apply to every request of the class, the last config wins), or when it has
/// `capacity.requests` that `capacity_rule` counts as a share. `Err` is a mistake that makes
/// the request invalid wherever it lands: an undecodable or user-written `AllocatedShares`
/// config, a broken `GpuShare` rule, both kinds of sizing at once, a `GpuShare` with
/// `allocationMode: All`. Native `capacity.requests` are sized as kube-scheduler sizes them,
/// `All` and capacities other than memory and compute included; only a negative request and
/// compute above 100 are refused.
pub fn request_share(
    driver: &str,
    input: &ShareInput<'_>,
    class_name: &str,
    class_configs: &[AppliedConfig<'_>],
    claim_configs: &[AppliedConfig<'_>],
    capacity_rule: CapacityShares<'_>,
) -> Result<RequestShare, Error> {
    let mut gpu_share = None;
    let configs = class_configs.iter().chain(claim_configs);
    for decoded in config::applying(configs, driver, input.request) {
        let (parsed, context) = decoded?;
        match parsed {
            TesseraConfig::GpuShare(share) => gpu_share = Some((share, context)),
            // The tier is decided by `crate::rules::tier::request_tier`.
            TesseraConfig::TierPolicy(_) => {}
            TesseraConfig::AllocatedShares(_) => {
                return Err(Error::Share {
                    field: format!("{context}.kind"),
                    message: ALLOCATED_SHARES_BY_USER.to_owned(),
                });
            }
        }
    }
    let capacity = input
        .capacity
        .and_then(|c| c.requests.as_ref())
        .filter(|r| !r.is_empty());
    let capacity_counts = match capacity_rule {
        CapacityShares::InClasses(classes) => classes.contains(&class_name),
        CapacityShares::OnTesseraDevices => true,
    };
    let capacity = capacity.filter(|_| capacity_counts || gpu_share.is_some());
    if gpu_share.is_none() && capacity.is_none() {
        return Ok(RequestShare::Plain);
    }
    let all = input.allocation_mode.is_some_and(|m| m == "All");
    let rule = |field: String, message: String| Error::Share { field, message };
    let fixed_count = || -> Result<u32, Error> {
        if all {
            return Err(rule(
                format!("{}.allocationMode", input.field),
                "a share needs an exact count of cards, not All".to_owned(),
            ));
        }
        let count = input.count.unwrap_or(1);
        let max = crate::rules::limits::MAX_REQUESTS;
        if count < 1 {
            return Err(rule(
                format!("{}.count", input.field),
                format!("count {count} must be at least 1"),
            ));
        }
        u32::try_from(count)
            .ok()
            .filter(|c| *c as usize <= max)
            .ok_or_else(|| {
                rule(
                    format!("{}.count", input.field),
                    format!(
                        "count {count} is more than the {max} devices one claim can be allocated"
                    ),
                )
            })
    };
    match (gpu_share, capacity) {
        (Some(_), Some(_)) => Err(rule(
            format!("{}.capacity.requests", input.field),
            "set either capacity.requests or a GpuShare config, not both".to_owned(),
        )),
        (Some((share, context)), None) => {
            let count = fixed_count()?;
            ShareRequest::from_gpu_share(&share, count, &context).map(RequestShare::Config)
        }
        // Native requests are sized per device, and `All` takes a share of each device, as
        // kube-scheduler allocates them.
        (None, Some(requests)) => Ok(RequestShare::Capacity(
            if all { Ok(1) } else { fixed_count() }.and_then(|count| {
                let field = format!("{}.capacity.requests", input.field);
                let mut parsed = std::collections::BTreeMap::new();
                for (name, q) in requests {
                    parsed.insert(name.clone(), Quantity::from_k8s(q)?);
                }
                ShareRequest::from_capacity_requests(&parsed, count, &field)
            }),
        )),
        (None, None) => Ok(RequestShare::Plain),
    }
}

/// Why a user's `AllocatedShares` config is refused.
const ALLOCATED_SHARES_BY_USER: &str = "AllocatedShares is written by the allocator, not by claims";

/// Checks a DeviceClass: its selectors compile and its Tessera configs decode.
pub fn validate_device_class(class: &res::DeviceClass, driver: &str, cel: &CelCache) -> Vec<Error> {
    let object = format!(
        "DeviceClass {}",
        class.metadata.name.as_deref().unwrap_or("<unnamed>")
    );
    let mut errors = Vec::new();
    for (i, selector) in class.spec.selectors.iter().flatten().enumerate() {
        if let Some(sel) = &selector.cel
            && let Err(e) = cel.compile(&sel.expression)
        {
            errors.push(Error::invalid(
                &object,
                format!("spec.selectors[{i}].cel.expression"),
                e.to_string(),
            ));
        }
    }
    for (i, cfg) in class.spec.config.iter().flatten().enumerate() {
        if let Some(opaque) = cfg.opaque.as_ref().filter(|o| o.driver == driver) {
            let field = format!("spec.config[{i}].opaque.parameters");
            match config::decode(&opaque.parameters.0, &field) {
                Ok(TesseraConfig::GpuShare(share)) => {
                    if let Err(e) = ShareRequest::from_gpu_share(&share, 1, &field) {
                        errors.push(Error::invalid(&object, field, e.to_string()));
                    }
                }
                Ok(TesseraConfig::TierPolicy(policy)) => {
                    if let Err(e) = crate::rules::tier::check_policy(&policy, &field) {
                        errors.push(Error::invalid(&object, field, e.to_string()));
                    }
                }
                Ok(TesseraConfig::AllocatedShares(_)) => errors.push(Error::invalid(
                    &object,
                    format!("{field}.kind"),
                    ALLOCATED_SHARES_BY_USER,
                )),
                Err(e) => errors.push(Error::invalid(&object, field, e.to_string())),
            }
        }
    }
    errors
}

/// Checks a claim (or a claim template's spec): selectors compile, Tessera configs decode,
/// capacity requests are not negative, and every share obeys the share rules.
///
/// `classes` resolves class names to the classes known to the caller (a missing class is not
/// an error here: it may be created later), `object` names the claim in messages.
#[allow(clippy::too_many_lines)] // Reason: every check of one claim, read top to bottom.
pub fn validate_claim_spec(
    object: &str,
    spec: &res::ResourceClaimSpec,
    driver: &str,
    share_classes: &[&str],
    classes: &dyn Fn(&str) -> Option<res::DeviceClass>,
    cel: &CelCache,
) -> Vec<Error> {
    let mut errors = Vec::new();
    let Some(devices) = &spec.devices else {
        return errors;
    };
    let claim_fields = claim_config_fields(devices);
    let claim_configs = claim_configs(devices, &claim_fields);
    // Fields of configs that do not decode: reported here once, not again by every request
    // the config applies to.
    let mut undecodable: Vec<String> = Vec::new();
    for (field, cfg) in claim_fields.iter().zip(devices.config.iter().flatten()) {
        if let Some(opaque) = cfg.opaque.as_ref().filter(|o| o.driver == driver)
            && let Err(e) =
                config::decode(&opaque.parameters.0, &format!("{field}.opaque.parameters"))
        {
            errors.push(match e {
                Error::Share { field, message } => {
                    undecodable.push(field.clone());
                    Error::invalid(object, field, message)
                }
                other => Error::invalid(object, field.clone(), other.to_string()),
            });
        }
    }
    for (i, request) in devices.requests.iter().flatten().enumerate() {
        let field = format!("spec.devices.requests[{i}]");
        let mut check = |name: String,
                         field: String,
                         class_name: &str,
                         selectors: Option<&Vec<res::DeviceSelector>>,
                         count: Option<i64>,
                         mode: Option<&str>,
                         capacity: Option<&res::CapacityRequirements>| {
            for (j, sel) in selectors.into_iter().flatten().enumerate() {
                if let Some(cel_sel) = &sel.cel
                    && let Err(e) = cel.compile(&cel_sel.expression)
                {
                    errors.push(Error::invalid(
                        object,
                        format!("{field}.selectors[{j}].cel.expression"),
                        e.to_string(),
                    ));
                }
            }
            let bad_quantities = capacity_quantity_errors(object, &name, &field, capacity);
            let bad_quantity = !bad_quantities.is_empty();
            errors.extend(bad_quantities);
            if bad_quantity {
                // The share rules would only repeat what is wrong with the quantity.
                return;
            }
            let class = classes(class_name);
            let class_fields = class_config_fields(class_name, class.as_ref());
            let class_configs = class_configs(class.as_ref(), &class_fields);
            let input = ShareInput {
                request: &name,
                count,
                allocation_mode: mode,
                capacity,
                field: &field,
            };
            if let Err(e) = request_share(
                driver,
                &input,
                class_name,
                &class_configs,
                &claim_configs,
                CapacityShares::InClasses(share_classes),
            )
            .and_then(RequestShare::into_result)
            .and_then(|_| {
                crate::rules::tier::request_tier(
                    driver,
                    &name,
                    class_name,
                    &class_configs,
                    &claim_configs,
                )
            }) {
                match e {
                    // Already reported with the config.
                    Error::Share {
                        field: share_field, ..
                    } if undecodable.contains(&share_field) => {}
                    // A share error names its own field (in the request or in a config), as a
                    // path from the claim's root like every other error here.
                    Error::Share {
                        field: share_field,
                        message,
                    } => errors.push(Error::invalid(
                        object,
                        share_field,
                        format!("{message} (request {name})"),
                    )),
                    other => errors.push(Error::invalid(object, field.clone(), other.to_string())),
                }
            }
        };
        match (&request.exactly, &request.first_available) {
            (Some(ex), None) => check(
                request.name.clone(),
                format!("{field}.exactly"),
                &ex.device_class_name,
                ex.selectors.as_ref(),
                ex.count,
                ex.allocation_mode.as_deref(),
                ex.capacity.as_ref(),
            ),
            (None, Some(subs)) => {
                for (j, sub) in subs.iter().enumerate() {
                    check(
                        format!("{}/{}", request.name, sub.name),
                        format!("{field}.firstAvailable[{j}]"),
                        &sub.device_class_name,
                        sub.selectors.as_ref(),
                        sub.count,
                        sub.allocation_mode.as_deref(),
                        sub.capacity.as_ref(),
                    );
                }
            }
            _ => errors.push(Error::invalid(
                object,
                field,
                "exactly one of exactly and firstAvailable must be set",
            )),
        }
    }
    // The claim limit, once per claim, unless a request's own count already said it.
    if !errors.iter().any(
        |e| matches!(e, Error::Invalid { field, .. } if field.rsplit('.').next() == Some("count")),
    ) && let Err((field, message)) = check_claim_device_limit(devices)
    {
        errors.push(Error::invalid(object, field, message));
    }
    errors
}

/// Capacity requests that do not parse or are negative, one error per value naming the
/// request (`name`) and its field under `field` (e.g. `spec.devices.requests[0].exactly`).
/// The API server accepts a negative request; Tessera refuses it (it would "free" capacity).
fn capacity_quantity_errors(
    object: &str,
    name: &str,
    field: &str,
    capacity: Option<&res::CapacityRequirements>,
) -> Vec<Error> {
    let mut errors = Vec::new();
    for (qname, q) in capacity
        .and_then(|c| c.requests.as_ref())
        .into_iter()
        .flatten()
    {
        let message = match Quantity::from_k8s(q) {
            Ok(v) if v.is_negative() => {
                format!("{} is negative; capacity requests must be at least 0", q.0)
            }
            Ok(_) => continue,
            Err(e) => e.to_string(),
        };
        errors.push(Error::invalid(
            object,
            format!("{field}.capacity.requests.{qname}"),
            format!("{message} (request {name})"),
        ));
    }
    errors
}

/// The capacity requests of a claim's spec that Tessera refuses as input: quantities that do
/// not parse or are negative, in every request and `firstAvailable` subrequest. `tessera
/// allocate` refuses such a claim (exit 2) instead of explaining why it does not fit.
pub fn capacity_request_errors(object: &str, spec: &res::ResourceClaimSpec) -> Vec<Error> {
    let mut errors = Vec::new();
    for (i, request) in spec
        .devices
        .iter()
        .flat_map(|d| d.requests.iter().flatten())
        .enumerate()
    {
        let field = format!("spec.devices.requests[{i}]");
        if let Some(ex) = &request.exactly {
            errors.extend(capacity_quantity_errors(
                object,
                &request.name,
                &format!("{field}.exactly"),
                ex.capacity.as_ref(),
            ));
        }
        for (j, sub) in request.first_available.iter().flatten().enumerate() {
            errors.extend(capacity_quantity_errors(
                object,
                &format!("{}/{}", request.name, sub.name),
                &format!("{field}.firstAvailable[{j}]"),
                sub.capacity.as_ref(),
            ));
        }
    }
    errors
}

/// kube-scheduler's limit on the devices one claim can be allocated
/// (`AllocationResultsMaxSize`, 32): each request's count (`All` counts none) and, for
/// `firstAvailable`, its smallest subrequest, added up. `Err` holds the field and the message
/// the allocator gives such a claim.
fn check_claim_device_limit(devices: &res::DeviceClaim) -> Result<(), (String, String)> {
    let max = crate::rules::limits::MAX_REQUESTS;
    let needed = |mode: Option<&str>, count: Option<i64>| -> u64 {
        if mode == Some("All") {
            0
        } else {
            count.map_or(1, |c| u64::try_from(c).unwrap_or(0))
        }
    };
    let requests = devices.requests.as_deref().unwrap_or_default();
    let minimum = requests
        .iter()
        .map(|r| match (&r.exactly, &r.first_available) {
            (Some(ex), _) => needed(ex.allocation_mode.as_deref(), ex.count),
            (None, Some(subs)) => subs
                .iter()
                .map(|s| needed(s.allocation_mode.as_deref(), s.count))
                .min()
                .unwrap_or(0),
            (None, None) => 0,
        })
        .fold(0u64, u64::saturating_add);
    if minimum <= max as u64 {
        return Ok(());
    }
    let field = if requests.len() == 1 {
        "spec.devices.requests[0]"
    } else {
        "spec.devices.requests"
    };
    Err((
        field.to_owned(),
        format!("{minimum} devices requested exceed the claim limit of {max} devices"),
    ))
}

/// Where the request policies of Tessera's shared GPUs change what a claim's native
/// `capacity.requests` ask (a value rounded up to a step or the minimum, a default filled in),
/// one line per change, for admission warnings: kube-scheduler allocates such claims, so they
/// are never refused for it. Requests in classes other than `share_classes` are not shares.
pub fn capacity_rounding_warnings(
    object: &str,
    spec: &res::ResourceClaimSpec,
    share_classes: &[&str],
) -> Vec<String> {
    let mut warnings = Vec::new();
    let Some(devices) = &spec.devices else {
        return warnings;
    };
    for (i, request) in devices.requests.iter().flatten().enumerate() {
        let mut one = |field: String, class: &str, capacity: Option<&res::CapacityRequirements>| {
            let Some(requests) = capacity.and_then(|c| c.requests.as_ref()) else {
                return;
            };
            if requests.is_empty() || !share_classes.contains(&class) {
                return;
            }
            let parsed: Option<std::collections::BTreeMap<String, Quantity>> = requests
                .iter()
                .map(|(k, q)| Quantity::from_k8s(q).ok().map(|v| (k.clone(), v)))
                .collect();
            let field = format!("{field}.capacity.requests");
            if let Some(rounded) =
                parsed.and_then(|p| crate::rules::share::round_capacity_requests(&p, &field).ok())
            {
                warnings.extend(
                    rounded
                        .notes
                        .into_iter()
                        .map(|n| format!("{object}: {field}: {n}")),
                );
            }
        };
        let field = format!("spec.devices.requests[{i}]");
        if let Some(ex) = &request.exactly {
            one(
                format!("{field}.exactly"),
                &ex.device_class_name,
                ex.capacity.as_ref(),
            );
        }
        for (j, sub) in request.first_available.iter().flatten().enumerate() {
            one(
                format!("{field}.firstAvailable[{j}]"),
                &sub.device_class_name,
                sub.capacity.as_ref(),
            );
        }
    }
    warnings
}

/// The classes whose requests with `capacity.requests` are Tessera shares: the built-in shared
/// class and every class annotated [`crate::names::ANNOTATION_SHARE_CLASS`]` = "true"`.
pub fn share_classes(classes: &[res::DeviceClass]) -> Vec<String> {
    let mut names = vec![crate::names::CLASS_SHARED_GPU.to_owned()];
    for class in classes {
        let marked = class
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(crate::names::ANNOTATION_SHARE_CLASS))
            .is_some_and(|v| v == "true");
        if let (true, Some(name)) = (marked, &class.metadata.name)
            && !names.contains(name)
        {
            names.push(name.clone());
        }
    }
    names
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::names;
    use serde_json::json;

    #[test]
    fn a_config_that_does_not_decode_is_reported_once() {
        let spec: res::ResourceClaimSpec = serde_json::from_value(json!({"devices": {
            "requests": [
                {"name": "a", "exactly": {"deviceClassName": "shared.gpu.tessera.dev"}},
                {"name": "b", "exactly": {"deviceClassName": "shared.gpu.tessera.dev"}}],
            "config": [{"opaque": {"driver": names::DEFAULT_DRIVER_NAME, "parameters": {
                "apiVersion": names::CONFIG_API_VERSION, "kind": names::GPU_SHARE_KIND,
                "memory": "5Gx"}}}]}}))
        .unwrap();
        let errors: Vec<String> = validate_claim_spec(
            "ResourceClaim ml/c",
            &spec,
            names::DEFAULT_DRIVER_NAME,
            &["shared.gpu.tessera.dev"],
            &|_| None,
            &CelCache::new(),
        )
        .iter()
        .map(ToString::to_string)
        .collect();
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0].starts_with(
                "ResourceClaim ml/c: spec.devices.config[0].opaque.parameters: quantity \"5Gx\""
            ),
            "{errors:?}"
        );
    }

    /// What kube-scheduler allocates from native capacity requests (issue 31, 8 to 10), the
    /// webhook and `tessera validate` let through: capacity requests on a dedicated GPU take it
    /// whole, `All` takes a share of each shared GPU, and another capacity a GPU declares is
    /// booked by its own policy.
    #[test]
    fn native_capacity_requests_pass_as_kube_scheduler_allocates_them() {
        let check = |exactly: serde_json::Value| -> Vec<String> {
            let spec: res::ResourceClaimSpec = serde_json::from_value(json!({"devices": {
                "requests": [{"name": "gpu", "exactly": exactly}]}}))
            .unwrap();
            validate_claim_spec(
                "ResourceClaim ml/c",
                &spec,
                names::DEFAULT_DRIVER_NAME,
                &["shared.gpu.tessera.dev"],
                &|_| None,
                &CelCache::new(),
            )
            .iter()
            .map(ToString::to_string)
            .collect()
        };
        let dedicated = check(json!({"deviceClassName": "gpu.tessera.dev",
            "capacity": {"requests": {"memory": "10Gi", "compute": "50"}}}));
        assert!(dedicated.is_empty(), "{dedicated:?}");
        let all = check(json!({"deviceClassName": "shared.gpu.tessera.dev",
            "allocationMode": "All", "capacity": {"requests": {"memory": "10Gi"}}}));
        assert!(all.is_empty(), "{all:?}");
        let other = check(json!({"deviceClassName": "shared.gpu.tessera.dev",
            "capacity": {"requests": {"memory": "10Gi", "multiprocessors": "40"}}}));
        assert!(other.is_empty(), "{other:?}");
        let over = check(json!({"deviceClassName": "shared.gpu.tessera.dev",
            "capacity": {"requests": {"memory": "10Gi", "compute": "101"}}}));
        assert_eq!(over.len(), 1, "{over:?}");
        assert!(over[0].contains("maximum of 100"), "{over:?}");
    }
}
