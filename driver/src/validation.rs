//! Static checks of DeviceClasses and claims, before anything is allocated.
//!
//! `tessera validate` and the admission webhook call these: every CEL expression compiles, every
//! Tessera opaque config decodes, and every share obeys the share rules. Each problem is an
//! [`Error`] naming the object, the field and the rule; a whole object is checked, so a user
//! sees all their mistakes at once.

use k8s_openapi::api::resource::v1 as res;

use crate::cel::CelCache;
use crate::config::{self, TesseraConfig};
use crate::error::Error;
use crate::quantity::Quantity;
use crate::share::ShareRequest;

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
        let parent = request.split_once('/').map_or(request, |(p, _)| p);
        self.requests.is_empty() || self.requests.iter().any(|r| r == request || r == parent)
    }
}

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

/// Decides whether a request is a Tessera share and validates it.
///
/// A request is a share when a [`config::GpuShare`] for `driver` applies to it (class configs
/// apply to every request of the class), or when it has `capacity.requests` and its class is
/// one of `share_classes`. `Ok(None)` means a plain request.
pub fn request_share(
    driver: &str,
    input: &ShareInput<'_>,
    class_name: &str,
    class_configs: &[AppliedConfig<'_>],
    claim_configs: &[AppliedConfig<'_>],
    share_classes: &[&str],
) -> Result<Option<ShareRequest>, Error> {
    let mut gpu_share = None;
    for cfg in class_configs
        .iter()
        .chain(claim_configs)
        .filter(|c| c.opaque.driver == driver)
    {
        if !cfg.applies_to(input.request) {
            continue;
        }
        let context = format!("{}.opaque.parameters", cfg.field);
        match config::decode(&cfg.opaque.parameters.0, &context)? {
            TesseraConfig::GpuShare(share) => gpu_share = Some((share, context)),
            TesseraConfig::AllocatedShares(_) => {
                return Err(Error::Share {
                    field: format!("{context}.kind"),
                    message: "AllocatedShares is written by the allocator only".to_owned(),
                });
            }
        }
    }
    let capacity = input
        .capacity
        .and_then(|c| c.requests.as_ref())
        .filter(|r| !r.is_empty());
    let is_share_class = share_classes.contains(&class_name);
    if gpu_share.is_none() && !(capacity.is_some() && is_share_class) {
        return Ok(None);
    }
    if input.allocation_mode.is_some_and(|m| m == "All") {
        return Err(Error::Share {
            field: format!("{}.allocationMode", input.field),
            message: "a share needs a fixed count; allocationMode All is not allowed".to_owned(),
        });
    }
    let count = input.count.unwrap_or(1);
    let count = u32::try_from(count)
        .ok()
        .filter(|c| *c >= 1)
        .ok_or_else(|| Error::Share {
            field: format!("{}.count", input.field),
            message: format!("count {count} must be at least 1"),
        })?;
    match (gpu_share, capacity) {
        (Some(_), Some(_)) => Err(Error::Share {
            field: format!("{}.capacity.requests", input.field),
            message:
                "a share is sized either by capacity.requests or by a GpuShare config, not both"
                    .to_owned(),
        }),
        (Some((share, context)), None) => {
            ShareRequest::from_gpu_share(&share, count, &context).map(Some)
        }
        (None, Some(requests)) => {
            let field = format!("{}.capacity.requests", input.field);
            let mut parsed = std::collections::BTreeMap::new();
            for (name, q) in requests {
                parsed.insert(name.clone(), Quantity::from_k8s(q)?);
            }
            ShareRequest::from_capacity_requests(&parsed, count, &field).map(Some)
        }
        (None, None) => Ok(None),
    }
}

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
                Ok(TesseraConfig::AllocatedShares(_)) => errors.push(Error::invalid(
                    &object,
                    format!("{field}.kind"),
                    "AllocatedShares is written by the allocator only",
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
    let claim_fields: Vec<String> = (0..devices.config.as_ref().map_or(0, Vec::len))
        .map(|i| format!("spec.devices.config[{i}]"))
        .collect();
    let claim_configs: Vec<AppliedConfig<'_>> = devices
        .config
        .iter()
        .flatten()
        .zip(&claim_fields)
        .filter_map(|(c, field)| {
            c.opaque.as_ref().map(|opaque| AppliedConfig {
                requests: c.requests.as_deref().unwrap_or_default(),
                opaque,
                field,
            })
        })
        .collect();
    for (field, cfg) in claim_fields.iter().zip(devices.config.iter().flatten()) {
        if let Some(opaque) = cfg.opaque.as_ref().filter(|o| o.driver == driver)
            && let Err(e) =
                config::decode(&opaque.parameters.0, &format!("{field}.opaque.parameters"))
        {
            errors.push(Error::invalid(object, field.clone(), e.to_string()));
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
            for (qname, q) in capacity
                .and_then(|c| c.requests.as_ref())
                .into_iter()
                .flatten()
            {
                match Quantity::from_k8s(q) {
                    Ok(v) if v.is_negative() => errors.push(Error::invalid(
                        object,
                        format!("{field}.capacity.requests.{qname}"),
                        format!("{} is negative; capacity requests must be at least 0", q.0),
                    )),
                    Ok(_) => {}
                    Err(e) => errors.push(Error::invalid(
                        object,
                        format!("{field}.capacity.requests.{qname}"),
                        e.to_string(),
                    )),
                }
            }
            let class = classes(class_name);
            let class_fields: Vec<String> = class
                .iter()
                .flat_map(|c| c.spec.config.iter().flatten())
                .enumerate()
                .map(|(k, _)| format!("DeviceClass {class_name} spec.config[{k}]"))
                .collect();
            let class_configs: Vec<AppliedConfig<'_>> = class
                .iter()
                .flat_map(|c| c.spec.config.iter().flatten())
                .zip(&class_fields)
                .filter_map(|(c, f)| {
                    c.opaque.as_ref().map(|opaque| AppliedConfig {
                        requests: &[],
                        opaque,
                        field: f,
                    })
                })
                .collect();
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
                share_classes,
            ) {
                errors.push(Error::invalid(object, field.clone(), e.to_string()));
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
    errors
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
