//! A claim's requests, read once per allocation: classes, compiled selectors, counts, shares.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1 as res;

use super::snapshot::{SelectorCache, Snapshot, claim_name};
use crate::config::{self, TesseraConfig};
use crate::error::{Error, Result};
use crate::quantity::Quantity;
use crate::share::ShareRequest;

/// Most devices one claim's allocation may hold (the API's limit on results).
pub(crate) const MAX_RESULTS: usize = 32;

/// One request, or one `firstAvailable` alternative of a request.
#[derive(Debug, Clone)]
pub(crate) struct ReqSpec {
    /// The request's own name.
    pub(crate) base: String,
    /// The subrequest's name, for `firstAvailable` alternatives.
    pub(crate) sub: Option<String>,
    /// `request` or `request/subrequest`, as results name it.
    pub(crate) full: String,
    pub(crate) class: String,
    /// Compiled class selectors, then the request's own.
    pub(crate) class_selectors: Vec<usize>,
    pub(crate) selectors: Vec<usize>,
    pub(crate) all: bool,
    pub(crate) count: usize,
    pub(crate) admin: bool,
    pub(crate) tolerations: Vec<res::DeviceToleration>,
    pub(crate) capacity: Option<BTreeMap<String, Quantity>>,
    /// A share from a Tessera `GpuShare` config.
    pub(crate) share: Option<ShareRequest>,
    /// A share from `capacity.requests`, applied on Tessera devices; `Err` holds the broken rule.
    pub(crate) capacity_share: Option<std::result::Result<ShareRequest, Error>>,
}

impl ReqSpec {
    /// The share this request asks of a device of Tessera (`tessera` true) or another driver.
    pub(crate) fn share_on(
        &self,
        tessera: bool,
    ) -> Option<std::result::Result<&ShareRequest, &Error>> {
        if let Some(s) = &self.share {
            return Some(Ok(s));
        }
        if tessera {
            return self
                .capacity_share
                .as_ref()
                .map(std::result::Result::as_ref);
        }
        None
    }
}

/// A `matchAttribute` or `distinctAttribute` constraint.
#[derive(Debug, Clone)]
pub(crate) struct ConstraintSpec {
    pub(crate) distinct: bool,
    pub(crate) attribute: String,
    pub(crate) requests: Vec<String>,
}

impl ConstraintSpec {
    /// Whether the constraint covers a device allocated for `base` (or `base/sub`).
    pub(crate) fn applies(&self, base: &str, full: &str) -> bool {
        self.requests.is_empty() || self.requests.iter().any(|r| r == base || r == full)
    }
}

/// A claim, ready to allocate.
#[derive(Debug, Clone)]
pub(crate) struct ClaimSpec {
    pub(crate) name: String,
    pub(crate) uid: String,
    /// Per request, its alternatives (one unless `firstAvailable`).
    pub(crate) requests: Vec<Vec<ReqSpec>>,
    pub(crate) first_available: Vec<bool>,
    pub(crate) constraints: Vec<ConstraintSpec>,
}

/// Why a claim cannot even be tried: names the request and the rule.
#[derive(Debug, Clone)]
pub(crate) struct SpecError {
    pub(crate) request: Option<String>,
    pub(crate) message: String,
}

fn spec_err(request: Option<&str>, message: impl Into<String>) -> SpecError {
    SpecError {
        request: request.map(str::to_owned),
        message: message.into(),
    }
}

/// The `GpuShare` that applies to a request, if any: class config first, then claim config,
/// the last one winning as with every DRA config.
fn gpu_share_for(
    driver: &str,
    class: &res::DeviceClass,
    claim: &res::DeviceClaim,
    base: &str,
    full: &str,
) -> std::result::Result<Option<(config::GpuShare, String)>, Error> {
    let mut found = None;
    let class_name = class.metadata.name.clone().unwrap_or_default();
    for (i, cfg) in class.spec.config.iter().flatten().enumerate() {
        if let Some(opaque) = cfg.opaque.as_ref().filter(|o| o.driver == driver) {
            let field = format!("DeviceClass {class_name}: spec.config[{i}].opaque.parameters");
            if let TesseraConfig::GpuShare(s) = config::decode(&opaque.parameters.0, &field)? {
                found = Some((s, field));
            }
        }
    }
    for (i, cfg) in claim.config.iter().flatten().enumerate() {
        let applies = cfg
            .requests
            .as_ref()
            .is_none_or(|r| r.is_empty() || r.iter().any(|n| n == base || n == full));
        if !applies {
            continue;
        }
        if let Some(opaque) = cfg.opaque.as_ref().filter(|o| o.driver == driver) {
            let field = format!("spec.devices.config[{i}].opaque.parameters");
            match config::decode(&opaque.parameters.0, &field)? {
                TesseraConfig::GpuShare(s) => found = Some((s, field)),
                TesseraConfig::AllocatedShares(_) => {
                    return Err(Error::Share {
                        field: format!("{field}.kind"),
                        message: "AllocatedShares is written by the allocator, not by claims"
                            .into(),
                    });
                }
            }
        }
    }
    Ok(found)
}

struct RawRequest<'a> {
    class: &'a str,
    selectors: Option<&'a Vec<res::DeviceSelector>>,
    mode: Option<&'a str>,
    count: Option<i64>,
    admin: bool,
    tolerations: Option<&'a Vec<res::DeviceToleration>>,
    capacity: Option<&'a res::CapacityRequirements>,
}

#[allow(clippy::too_many_arguments, clippy::too_many_lines)] // Reason: one call site; each part of a request is checked in order.
fn prepare_request(
    snap: &Snapshot,
    cache: &mut SelectorCache,
    driver: &str,
    claim: &res::DeviceClaim,
    base: &str,
    sub: Option<&str>,
    raw: &RawRequest<'_>,
    field: &str,
) -> std::result::Result<ReqSpec, SpecError> {
    let full = sub.map_or_else(|| base.to_owned(), |s| format!("{base}/{s}"));
    let e = |m: String| spec_err(Some(&full), m);
    let class = snap
        .classes
        .get(raw.class)
        .ok_or_else(|| e(format!("device class {} not found", raw.class)))?;
    let mut compile = |sels: Option<&Vec<res::DeviceSelector>>, what: &str| {
        let mut ids = Vec::new();
        for (i, s) in sels.into_iter().flatten().enumerate() {
            let cel = s.cel.as_ref().ok_or_else(|| {
                e(format!(
                    "{what} selector #{i}: CEL expression empty (unsupported selector type?)"
                ))
            })?;
            ids.push(
                snap.compile(cache, &cel.expression)
                    .map_err(|err| e(format!("{what} selector #{i}: {err}")))?,
            );
        }
        Ok(ids)
    };
    let class_selectors = compile(
        class.spec.selectors.as_ref(),
        &format!("class {}", raw.class),
    )?;
    let selectors = compile(raw.selectors, "request")?;
    let all = match raw.mode.unwrap_or("ExactCount") {
        "ExactCount" => false,
        "All" => true,
        other => {
            return Err(e(format!(
                "{field}.allocationMode: unsupported mode {other}"
            )));
        }
    };
    let count = if all {
        0
    } else {
        let c = raw.count.unwrap_or(1);
        if c < 1 {
            return Err(e(format!("{field}.count: {c} is not positive")));
        }
        // A subrequest may ask for more than one claim can hold: kube-scheduler then moves
        // on to the next alternative. The claim's minimum is checked in `prepare_claim`.
        usize::try_from(c).unwrap_or(usize::MAX)
    };
    let capacity = match raw.capacity.and_then(|c| c.requests.as_ref()) {
        None => None,
        Some(reqs) => {
            let mut out = BTreeMap::new();
            for (name, q) in reqs {
                let q = Quantity::from_k8s(q)
                    .map_err(|err| e(format!("{field}.capacity.requests.{name}: {err}")))?;
                out.insert(name.clone(), q);
            }
            Some(out)
        }
    };
    let share =
        gpu_share_for(driver, class, claim, base, &full).map_err(|err| e(err.to_string()))?;
    let cards = u32::try_from(count).unwrap_or(u32::MAX);
    let share = match share {
        None => None,
        Some((gs, cfg_field)) => {
            if all {
                return Err(e(format!(
                    "{field}.allocationMode: a share needs an exact count of cards, not All"
                )));
            }
            if capacity.is_some() {
                return Err(e(format!(
                    "{field}.capacity.requests: set either capacity.requests or a GpuShare config, not both"
                )));
            }
            Some(
                ShareRequest::from_gpu_share(&gs, cards, &cfg_field)
                    .map_err(|err| e(err.to_string()))?,
            )
        }
    };
    let capacity_share = capacity
        .as_ref()
        .filter(|_| share.is_none() && !all)
        .map(|c| {
            ShareRequest::from_capacity_requests(c, cards, &format!("{field}.capacity.requests"))
        });
    Ok(ReqSpec {
        base: base.to_owned(),
        sub: sub.map(str::to_owned),
        full,
        class: raw.class.to_owned(),
        class_selectors,
        selectors,
        all,
        count,
        admin: raw.admin,
        tolerations: raw.tolerations.cloned().unwrap_or_default(),
        capacity,
        share,
        capacity_share,
    })
}

/// Reads a claim for allocation.
pub(crate) fn prepare_claim(
    snap: &Snapshot,
    cache: &mut SelectorCache,
    driver: &str,
    claim: &res::ResourceClaim,
) -> std::result::Result<ClaimSpec, SpecError> {
    let empty = res::DeviceClaim::default();
    let devices = claim.spec.devices.as_ref().unwrap_or(&empty);
    let mut requests = Vec::new();
    let mut first_available = Vec::new();
    for (i, r) in devices.requests.iter().flatten().enumerate() {
        let field = format!("spec.devices.requests[{i}]");
        match (&r.exactly, &r.first_available) {
            (Some(x), None) => {
                let raw = RawRequest {
                    class: &x.device_class_name,
                    selectors: x.selectors.as_ref(),
                    mode: x.allocation_mode.as_deref(),
                    count: x.count,
                    admin: x.admin_access == Some(true),
                    tolerations: x.tolerations.as_ref(),
                    capacity: x.capacity.as_ref(),
                };
                requests.push(vec![prepare_request(
                    snap,
                    cache,
                    driver,
                    devices,
                    &r.name,
                    None,
                    &raw,
                    &format!("{field}.exactly"),
                )?]);
                first_available.push(false);
            }
            (None, Some(subs)) if !subs.is_empty() => {
                let mut alts = Vec::new();
                for (j, s) in subs.iter().enumerate() {
                    let raw = RawRequest {
                        class: &s.device_class_name,
                        selectors: s.selectors.as_ref(),
                        mode: s.allocation_mode.as_deref(),
                        count: s.count,
                        admin: false,
                        tolerations: s.tolerations.as_ref(),
                        capacity: s.capacity.as_ref(),
                    };
                    let f = format!("{field}.firstAvailable[{j}]");
                    alts.push(prepare_request(
                        snap,
                        cache,
                        driver,
                        devices,
                        &r.name,
                        Some(&s.name),
                        &raw,
                        &f,
                    )?);
                }
                requests.push(alts);
                first_available.push(true);
            }
            _ => {
                return Err(spec_err(
                    Some(&r.name),
                    format!("{field}: exactly one of exactly and firstAvailable must be set"),
                ));
            }
        }
    }
    // Devices the claim needs at least: each request's count, the smallest alternative's.
    let minimum = requests
        .iter()
        .map(|alts| {
            alts.iter()
                .map(|a| if a.all { 0 } else { a.count })
                .min()
                .unwrap_or(0)
        })
        .fold(0usize, usize::saturating_add);
    if minimum > MAX_RESULTS {
        let (request, field) = match requests.as_slice() {
            [alts] => (
                alts.first().map(|a| a.base.clone()),
                "spec.devices.requests[0]".to_owned(),
            ),
            _ => (None, "spec.devices.requests".to_owned()),
        };
        return Err(SpecError {
            request,
            message: format!(
                "{field}: {minimum} devices requested exceed the claim limit of {MAX_RESULTS} devices"
            ),
        });
    }
    let mut constraints = Vec::new();
    for (i, c) in devices.constraints.iter().flatten().enumerate() {
        let (distinct, attribute) = match (&c.match_attribute, &c.distinct_attribute) {
            (Some(a), None) => (false, a.clone()),
            (None, Some(a)) => (true, a.clone()),
            _ => {
                return Err(spec_err(
                    None,
                    format!(
                        "spec.devices.constraints[{i}]: set exactly one of matchAttribute and distinctAttribute"
                    ),
                ));
            }
        };
        constraints.push(ConstraintSpec {
            distinct,
            attribute,
            requests: c.requests.clone().unwrap_or_default(),
        });
    }
    Ok(ClaimSpec {
        name: claim_name(claim),
        uid: super::snapshot::claim_key(claim),
        requests,
        first_available,
        constraints,
    })
}

/// Checks every Tessera share rule of a claim without allocating it: the errors name the
/// field and the rule, as admission and `tessera validate` report them.
pub fn validate_shares(
    driver: &str,
    classes: &[res::DeviceClass],
    claim: &res::ResourceClaim,
) -> Vec<Error> {
    let object = format!("ResourceClaim {}", claim_name(claim));
    let empty = res::DeviceClaim::default();
    let devices = claim.spec.devices.as_ref().unwrap_or(&empty);
    let mut out = Vec::new();
    let mut check = |base: &str,
                     full: &str,
                     class: &str,
                     count: Option<i64>,
                     mode: Option<&str>,
                     cap: Option<&res::CapacityRequirements>,
                     field: String| {
        let count = u32::try_from(count.unwrap_or(1)).unwrap_or(0);
        let class = classes
            .iter()
            .find(|c| c.metadata.name.as_deref() == Some(class))
            .cloned()
            .unwrap_or_default();
        let wrap = |e: Error| Error::invalid(&object, &field, e.to_string());
        match gpu_share_for(driver, &class, devices, base, full) {
            Err(e) => out.push(wrap(e)),
            Ok(Some((gs, f))) => {
                if mode == Some("All") {
                    out.push(Error::invalid(
                        &object,
                        format!("{field}.allocationMode"),
                        "a share needs an exact count of cards, not All",
                    ));
                }
                if let Err(e) = ShareRequest::from_gpu_share(&gs, count, &f) {
                    out.push(wrap(e));
                }
            }
            Ok(None) => {
                if let Some(reqs) = cap.and_then(|c| c.requests.as_ref()) {
                    let prefix = format!("{driver}/");
                    let class_name = class.metadata.name.as_deref().unwrap_or_default();
                    let tessera_class =
                        class_name == driver || class_name.ends_with(&format!(".{driver}"));
                    let tessera_keys = reqs.keys().any(|k| k.starts_with(&prefix))
                        || (tessera_class && reqs.keys().all(|k| !k.contains('/')));
                    if tessera_keys {
                        let parsed: Result<BTreeMap<String, Quantity>> = reqs
                            .iter()
                            .map(|(k, v)| Ok((k.clone(), Quantity::from_k8s(v)?)))
                            .collect();
                        match parsed.and_then(|p| {
                            ShareRequest::from_capacity_requests(
                                &p,
                                count,
                                &format!("{field}.capacity.requests"),
                            )
                        }) {
                            Ok(_) => {}
                            Err(e) => out.push(wrap(e)),
                        }
                    }
                }
            }
        }
    };
    for (i, r) in devices.requests.iter().flatten().enumerate() {
        if let Some(x) = &r.exactly {
            check(
                &r.name,
                &r.name,
                &x.device_class_name,
                x.count,
                x.allocation_mode.as_deref(),
                x.capacity.as_ref(),
                format!("spec.devices.requests[{i}].exactly"),
            );
        }
        for (j, s) in r.first_available.iter().flatten().enumerate() {
            let full = format!("{}/{}", r.name, s.name);
            check(
                &r.name,
                &full,
                &s.device_class_name,
                s.count,
                s.allocation_mode.as_deref(),
                s.capacity.as_ref(),
                format!("spec.devices.requests[{i}].firstAvailable[{j}]"),
            );
        }
    }
    out
}
