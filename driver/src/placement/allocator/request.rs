//! A claim's requests, read once per allocation: classes, compiled selectors, counts, shares.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1 as res;

use super::snapshot::{SelectorCache, Snapshot, claim_name};
use crate::error::Result;
use crate::rules::config::{self, Patience, Tier};
use crate::rules::overcommit::{self, Overcommit};
use crate::rules::patience;
use crate::rules::quantity::Quantity;
use crate::rules::share::ShareRequest;
use crate::rules::tier;
use crate::rules::validation::{CapacityShares, RequestShare, ShareInput, request_share};

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
    /// What `capacity.requests` come to under the request policies Tessera's shared GPUs
    /// publish, for placement scores and reasons only: the search sizes them on each device by
    /// that device's own policies, as kube-scheduler does.
    pub(crate) capacity_share: Option<ShareRequest>,
    /// The tier of the request's shares, as [`crate::rules::tier::request_tier`] resolves it.
    pub(crate) tier: Tier,
    /// The share's patience when it is delay-tolerant ([`crate::rules::patience::request_patience`]).
    pub(crate) patience: Option<Patience>,
    /// Whether this attempt places the share only on fragments ([`super::delay`]).
    pub(crate) fragments_only: bool,
    /// The class's over-commit factors when the tier is batch; none for online shares.
    pub(crate) overcommit: Overcommit,
}

/// The same claim with over-commit switched off: every share booked in full, as online.
pub(crate) fn without_overcommit(mut claim: ClaimSpec) -> ClaimSpec {
    for req in claim.requests.iter_mut().flatten() {
        req.overcommit = Overcommit::NONE;
    }
    claim
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

/// A request's share, decided by [`crate::rules::validation::request_share`] (the one rule), with
/// `capacity.requests` counted as a share on Tessera's devices.
fn share_of(
    driver: &str,
    class: &res::DeviceClass,
    claim: &res::DeviceClaim,
    full: &str,
    raw: &RawRequest<'_>,
    field: &str,
) -> Result<(RequestShare, Tier, Option<Patience>, Overcommit)> {
    let class_name = class.metadata.name.clone().unwrap_or_default();
    let class_fields = config::class_config_fields(&class_name, Some(class));
    let claim_fields = config::claim_config_fields(claim);
    let class_configs = config::class_configs(Some(class), &class_fields);
    let claim_configs = config::claim_configs(claim, &claim_fields);
    let input = ShareInput {
        request: full,
        count: raw.count,
        allocation_mode: raw.mode,
        capacity: raw.capacity,
        field,
    };
    let share = request_share(
        driver,
        &input,
        &class_name,
        &class_configs,
        &claim_configs,
        CapacityShares::OnTesseraDevices,
    )?;
    let tier = tier::request_tier(driver, full, &class_name, &class_configs, &claim_configs)?;
    // Only a share can wait for a fragment.
    let patience = match share {
        RequestShare::Plain => None,
        _ => patience::request_patience(driver, full, &class_configs, &claim_configs)?,
    };
    let overcommit = match tier {
        Tier::Online => Overcommit::NONE,
        Tier::Batch => overcommit::request_overcommit(driver, full, &class_configs)?,
    };
    Ok((share, tier, patience, overcommit))
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
                // The API server accepts it; Tessera refuses it as input (it would free
                // capacity), wherever the request lands.
                if q.is_negative() {
                    return Err(e(format!(
                        "{field}.capacity.requests.{name}: {q} is negative; capacity requests \
                         must be at least 0"
                    )));
                }
                out.insert(name.clone(), q);
            }
            Some(out)
        }
    };
    let (share, tier, patience, overcommit) =
        share_of(driver, class, claim, &full, raw, field).map_err(|err| e(err.to_string()))?;
    let (share, capacity_share) = match share {
        RequestShare::Plain => (None, None),
        RequestShare::Config(s) => (Some(s), None),
        RequestShare::Capacity(r) => (None, r.ok()),
    };
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
        tier,
        patience,
        fragments_only: false,
        overcommit,
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
    check_minimum(&requests)?;
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

/// Refuses a claim whose requests need more devices than one claim may hold, counting each
/// request's count and, for `firstAvailable`, its smallest alternative (as kube-scheduler does).
fn check_minimum(requests: &[Vec<ReqSpec>]) -> std::result::Result<(), SpecError> {
    let minimum = requests
        .iter()
        .map(|alts| {
            alts.iter()
                .map(|a| if a.all { 0 } else { a.count })
                .min()
                .unwrap_or(0)
        })
        .fold(0usize, usize::saturating_add);
    if minimum <= MAX_RESULTS {
        return Ok(());
    }
    let (request, field) = match requests {
        [alts] => (
            alts.first().map(|a| a.base.clone()),
            "spec.devices.requests[0]",
        ),
        _ => (None, "spec.devices.requests"),
    };
    Err(SpecError {
        request,
        message: format!(
            "{field}: {minimum} devices requested exceed the claim limit of {MAX_RESULTS} devices"
        ),
    })
}
