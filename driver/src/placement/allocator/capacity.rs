//! Consumable capacity: how much of a shareable device one allocation consumes.
//!
//! The rules follow kube-scheduler 1.36's structured allocator: a request names capacities as
//! the device spells them (with or without the driver's domain: `memory` and
//! `<driver>/memory` are different names); every capacity the device declares is consumed (the request,
//! rounded up by the capacity's request policy, else the policy's default, else the whole
//! capacity); the rounded value must obey the policy and fit beside what is already used.
//! Amounts are kept exact (nano-units); rounding to a range's step is done in whole units
//! (each quantity's `Value()`, rounded up), as kube-scheduler 1.36 does it.

use std::collections::BTreeMap;

use crate::rules::published::PublishedDevice;

use crate::error::Result;
use crate::rules::quantity::{Format, Quantity};

/// A device capacity with its request policy, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Capacity {
    /// The total.
    pub(crate) value: Quantity,
    /// How requests are rounded and checked; `None` means "a request takes it all".
    pub(crate) policy: Option<RequestPolicy>,
}

/// A parsed `CapacityRequestPolicy`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RequestPolicy {
    pub(crate) default: Option<Quantity>,
    pub(crate) range: Option<Range>,
    pub(crate) values: Vec<Quantity>,
}

/// A parsed `CapacityRequestPolicyRange`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Range {
    pub(crate) min: Quantity,
    pub(crate) max: Option<Quantity>,
    pub(crate) step: Option<Quantity>,
}

/// A device's capacities by name as the device spells it, sorted: a device has a handful, and a
/// B-tree map of them would cost a node of eleven slots per device.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Capacities(Box<[(String, Capacity)]>);

impl Capacities {
    fn position(&self, name: &str) -> Option<usize> {
        self.0.binary_search_by(|(k, _)| k.as_str().cmp(name)).ok()
    }

    /// The capacity named `name` (as spelled).
    pub(crate) fn get(&self, name: &str) -> Option<&Capacity> {
        self.position(name).map(|i| &self.0[i].1)
    }

    /// Whether the device has capacity `name` (as spelled).
    pub(crate) fn contains_key(&self, name: &str) -> bool {
        self.position(name).is_some()
    }

    /// Whether the device declares no capacity.
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Every capacity, by name.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&String, &Capacity)> {
        self.0.iter().map(|(k, v)| (k, v))
    }
}

impl From<BTreeMap<String, Capacity>> for Capacities {
    fn from(map: BTreeMap<String, Capacity>) -> Self {
        Self(map.into_iter().collect())
    }
}

/// Consumed amounts keyed by capacity name as the device spells it.
pub(crate) type Amounts = BTreeMap<String, Quantity>;

/// The name under which a device of `driver` declares capacity `name` (e.g. `memory`):
/// as the device spells it, with or without the driver's domain; plain `name` when it
/// declares neither.
pub(crate) fn declared_name(capacity: &Capacities, name: &str, driver: &str) -> String {
    let qualified = format!("{driver}/{name}");
    if !capacity.contains_key(name) && capacity.contains_key(&qualified) {
        qualified
    } else {
        name.to_owned()
    }
}

/// Parses a device's capacities, keyed by their names as the device spells them:
/// kube-scheduler 1.36 looks capacity names up as spelled (`requestsContainNonExistCapacity`,
/// `calculateConsumedCapacity`), so `memory` and `<driver>/memory` are two capacities.
pub(crate) fn parse_device_capacity(device: &PublishedDevice, object: &str) -> Result<Capacities> {
    let mut out = BTreeMap::new();
    for (name, cap) in device.capacities() {
        let key = name.to_owned();
        let field = |f: &str| format!("{object}: capacity.{name}{f}");
        let q = |v: &k8s_openapi::apimachinery::pkg::api::resource::Quantity, f: &str| {
            Quantity::from_k8s(v).map_err(|e| crate::Error::invalid(field(""), f, e.to_string()))
        };
        let value = q(&cap.value, "value")?;
        let policy = match &cap.request_policy {
            None => None,
            Some(p) => Some(RequestPolicy {
                default: p
                    .default
                    .as_ref()
                    .map(|d| q(d, "requestPolicy.default"))
                    .transpose()?,
                range: p
                    .valid_range
                    .as_ref()
                    .map(|r| -> Result<Range> {
                        Ok(Range {
                            min: q(&r.min, "requestPolicy.validRange.min")?,
                            max: r
                                .max
                                .as_ref()
                                .map(|m| q(m, "requestPolicy.validRange.max"))
                                .transpose()?,
                            step: r
                                .step
                                .as_ref()
                                .map(|s| q(s, "requestPolicy.validRange.step"))
                                .transpose()?
                                .filter(|s| s.nanos() > 0),
                        })
                    })
                    .transpose()?,
                values: p
                    .valid_values
                    .iter()
                    .flatten()
                    .map(|v| q(v, "requestPolicy.validValues"))
                    .collect::<Result<_>>()?,
            }),
        };
        out.insert(key, Capacity { value, policy });
    }
    Ok(out.into())
}

/// A request's capacities against a device's, by name as spelled (kube-scheduler 1.36's
/// `requestsContainNonExistCapacity`); `None` when the device does not declare one of them:
/// the device does not fit (it is no error).
pub(crate) fn resolve_requests(
    requests: &BTreeMap<String, Quantity>,
    capacity: &Capacities,
) -> Option<Amounts> {
    requests
        .iter()
        .map(|(name, value)| capacity.contains_key(name).then(|| (name.clone(), *value)))
        .collect()
}

/// What one allocation consumes of one capacity.
pub(crate) fn consumed_quantity(requested: Option<Quantity>, cap: &Capacity) -> Quantity {
    let Some(req) = requested else {
        return cap
            .policy
            .as_ref()
            .and_then(|p| p.default)
            .unwrap_or(cap.value);
    };
    let Some(policy) = &cap.policy else {
        return req;
    };
    if let Some(range) = &policy.range {
        if req < range.min {
            return range.min;
        }
        let Some(step) = range.step else {
            return req;
        };
        // kube-scheduler 1.36 (`roundUpRange`) rounds in whole units: the request, the
        // minimum and the step each read with `Value()` (rounded up), the result written as
        // a BinarySI quantity.
        let whole = |q: Quantity| i128::from(q.ceil_units());
        let (min, step) = (whole(range.min), whole(step).max(1));
        let added = whole(req) - min;
        let units = min + step * (added / step + i128::from(added % step != 0));
        let units = i64::try_from(units).unwrap_or(i64::MAX);
        return Quantity::from_nanos(Quantity::from_units(units).nanos(), Format::BinarySi);
    }
    if !policy.values.is_empty() {
        return policy
            .values
            .iter()
            .copied()
            .find(|v| req <= *v)
            .unwrap_or(req);
    }
    req
}

/// The largest amount at most `value` that the capacity's policy accepts as consumed, so a
/// batch share's guarantee ([`crate::rules::overcommit`]) is always a valid `consumedCapacity`; `None`
/// when there is none (below the range's minimum or every listed value).
pub(crate) fn floor_to_policy(value: Quantity, cap: &Capacity) -> Option<Quantity> {
    let Some(policy) = &cap.policy else {
        return Some(value);
    };
    if let Some(range) = &policy.range {
        if value < range.min {
            return None;
        }
        let top = range.max.map_or(value, |m| m.min(value));
        let Some(step) = range.step else {
            return Some(top);
        };
        let steps = (top.nanos() - range.min.nanos()).div_euclid(step.nanos());
        return Some(Quantity::from_nanos(
            range.min.nanos() + steps * step.nanos(),
            step.format(),
        ));
    }
    if !policy.values.is_empty() {
        return policy.values.iter().copied().filter(|v| *v <= value).max();
    }
    Some(value)
}

/// Whether a consumed amount breaks the capacity's policy.
pub(crate) fn violates_policy(consumed: Quantity, policy: Option<&RequestPolicy>) -> bool {
    let Some(policy) = policy else {
        return false;
    };
    if policy.default == Some(consumed) {
        return false;
    }
    if let Some(range) = &policy.range {
        if range.max.is_some_and(|m| consumed > m) {
            return true;
        }
        if let Some(step) = range.step {
            // In whole units, as `violateValidRange` reads them.
            let whole = |q: Quantity| i128::from(q.ceil_units());
            return (whole(consumed) - whole(range.min)) % whole(step).max(1) != 0;
        }
        return false;
    }
    if !policy.values.is_empty() {
        return !policy.values.contains(&consumed);
    }
    false
}

/// The amounts one allocation would consume on a device, or `Ok(None)` when it does not fit
/// beside `used`. An error message means the request can never be honoured (negative).
pub(crate) fn try_consume(
    capacity: &Capacities,
    requests: &Amounts,
    used: &[&Amounts],
) -> std::result::Result<Option<Amounts>, String> {
    let mut consumed = Amounts::new();
    for (name, cap) in capacity.iter() {
        let q = consumed_quantity(requests.get(name).copied(), cap);
        if q.is_negative() {
            return Err(format!("capacity {name}: {q} is negative"));
        }
        consumed.insert(name.clone(), q);
    }
    for (name, cap) in capacity.iter() {
        let q = consumed[name];
        if violates_policy(q, cap.policy.as_ref()) {
            return Ok(None);
        }
        let mut total = q;
        for u in used {
            if let Some(x) = u.get(name) {
                total = total.saturating_add(*x);
            }
        }
        if total > cap.value {
            return Ok(None);
        }
    }
    Ok(Some(consumed))
}

/// Adds `b` into `a`.
pub(crate) fn add_into(a: &mut Amounts, b: &Amounts) {
    for (k, v) in b {
        let e = a.entry(k.clone()).or_insert(Quantity::ZERO);
        *e = e.saturating_add(*v);
    }
}

/// Subtracts `b` from `a`, dropping entries that reach zero.
pub(crate) fn sub_from(a: &mut Amounts, b: &Amounts) {
    for (k, v) in b {
        if let Some(e) = a.get_mut(k) {
            *e = e.saturating_sub(*v);
            if e.nanos() <= 0 {
                a.remove(k);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(s: &str) -> Quantity {
        Quantity::parse(s).unwrap()
    }

    fn memory_cap() -> Capacity {
        Capacity {
            value: q("80Gi"),
            policy: Some(RequestPolicy {
                default: Some(q("1Gi")),
                range: Some(Range {
                    min: q("1Gi"),
                    max: None,
                    step: Some(q("1Gi")),
                }),
                values: vec![],
            }),
        }
    }

    /// A capacity of 10 whose policy accepts only 2, 5 or 10.
    fn values_cap() -> Capacity {
        Capacity {
            value: q("10"),
            policy: Some(RequestPolicy {
                default: Some(q("2")),
                range: None,
                values: vec![q("2"), q("5"), q("10")],
            }),
        }
    }

    #[test]
    fn rounds_up_to_the_next_step_from_min() {
        let cap = memory_cap();
        assert_eq!(consumed_quantity(Some(q("3840Mi")), &cap), q("4Gi"));
        assert_eq!(consumed_quantity(Some(q("100Mi")), &cap), q("1Gi"));
        assert_eq!(consumed_quantity(None, &cap), q("1Gi"));
        let whole = Capacity {
            value: q("108"),
            policy: None,
        };
        assert_eq!(consumed_quantity(None, &whole), q("108"));
        let values = values_cap();
        assert_eq!(consumed_quantity(Some(q("3")), &values), q("5"));
        assert_eq!(consumed_quantity(Some(q("11")), &values), q("11"));
        assert!(violates_policy(q("11"), values.policy.as_ref()));
    }

    #[test]
    fn a_guarantee_floors_to_a_value_the_policy_accepts() {
        let cap = memory_cap();
        assert_eq!(floor_to_policy(q("3584Mi"), &cap), Some(q("3Gi")));
        assert_eq!(floor_to_policy(q("3Gi"), &cap), Some(q("3Gi")));
        assert_eq!(floor_to_policy(q("512Mi"), &cap), None);
        let values = values_cap();
        assert_eq!(floor_to_policy(q("7"), &values), Some(q("5")));
        assert_eq!(floor_to_policy(q("1"), &values), None);
        let plain = Capacity {
            value: q("100"),
            policy: None,
        };
        assert_eq!(floor_to_policy(q("37"), &plain), Some(q("37")));
        for x in ["0", "1Gi", "7Gi", "3584Mi"] {
            if let Some(f) = floor_to_policy(q(x), &cap) {
                assert!(!violates_policy(f, cap.policy.as_ref()), "{x} -> {f}");
                assert!(f <= q(x));
            }
        }
    }

    #[test]
    fn consumption_must_fit_beside_what_is_used() {
        let caps = Capacities::from(BTreeMap::from([("d/memory".to_owned(), memory_cap())]));
        let mut req = Amounts::new();
        req.insert("d/memory".to_owned(), q("40Gi"));
        let used: Amounts = [("d/memory".to_owned(), q("41Gi"))].into();
        assert!(try_consume(&caps, &req, &[&used]).unwrap().is_none());
        let used: Amounts = [("d/memory".to_owned(), q("40Gi"))].into();
        assert_eq!(
            try_consume(&caps, &req, &[&used]).unwrap().unwrap()["d/memory"],
            q("40Gi")
        );
        req.insert("d/memory".to_owned(), q("-1Gi"));
        // Below min rounds up to min, so a negative request consumes the minimum.
        assert_eq!(
            try_consume(&caps, &req, &[]).unwrap().unwrap()["d/memory"],
            q("1Gi")
        );
    }
}
