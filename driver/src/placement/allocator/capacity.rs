//! Consumable capacity: how much of a shareable device one allocation consumes.
//!
//! The rules follow Kubernetes' structured allocator: a request names capacities with or
//! without the driver's domain; every capacity the device declares is consumed (the request,
//! rounded up by the capacity's request policy, else the policy's default, else the whole
//! capacity); the rounded value must obey the policy and fit beside what is already used.
//! All arithmetic is exact (nano-units), so fractional ranges round exactly too.

use std::collections::BTreeMap;

use crate::rules::published::PublishedDevice;

use crate::error::Result;
use crate::rules::quantity::Quantity;

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

/// A device's capacities by fully qualified name, sorted: a device has a handful, and a
/// B-tree map of them would cost a node of eleven slots per device.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Capacities(Box<[(String, Capacity)]>);

impl Capacities {
    fn position(&self, name: &str) -> Option<usize> {
        self.0.binary_search_by(|(k, _)| k.as_str().cmp(name)).ok()
    }

    /// The capacity named `name` (fully qualified).
    pub(crate) fn get(&self, name: &str) -> Option<&Capacity> {
        self.position(name).map(|i| &self.0[i].1)
    }

    /// Whether the device has capacity `name` (fully qualified).
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

/// Consumed amounts keyed by fully qualified capacity name.
pub(crate) type Amounts = BTreeMap<String, Quantity>;

/// The fully qualified name of capacity `name` of a device published by `driver`.
pub(crate) fn qualify(name: &str, driver: &str) -> String {
    if name.contains('/') {
        name.to_owned()
    } else {
        format!("{driver}/{name}")
    }
}

/// Parses a device's capacities, keyed by fully qualified name. An entry spelled with the
/// driver's own domain wins over the same capacity spelled without one, as upstream.
pub(crate) fn parse_device_capacity(
    device: &PublishedDevice,
    driver: &str,
    object: &str,
) -> Result<Capacities> {
    let mut out = BTreeMap::new();
    let prefix = format!("{driver}/");
    let mut entries: Vec<_> = device.capacities().collect();
    // Qualified spellings first so they take precedence.
    entries.sort_by_key(|(name, _)| !name.starts_with(&prefix));
    for (name, cap) in entries {
        let key = qualify(name, driver);
        if out.contains_key(&key) {
            continue;
        }
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

/// Resolves a request's capacity names against a device of `driver`. Returns `Ok(None)` when
/// the device lacks a requested capacity (the device does not fit), and an error message when
/// the request names one capacity twice (the claim cannot be allocated anywhere).
pub(crate) fn resolve_requests(
    requests: &BTreeMap<String, Quantity>,
    driver: &str,
    capacity: &Capacities,
) -> std::result::Result<Option<Amounts>, String> {
    let mut out = Amounts::new();
    for (name, value) in requests {
        let key = qualify(name, driver);
        if !capacity.contains_key(&key) {
            return Ok(None);
        }
        if out.insert(key.clone(), *value).is_some() {
            return Err(format!("capacity {key} is requested twice"));
        }
    }
    Ok(Some(out))
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
        let added = req.nanos() - range.min.nanos();
        let steps =
            added.div_euclid(step.nanos()) + i128::from(added.rem_euclid(step.nanos()) != 0);
        let nanos = steps
            .checked_mul(step.nanos())
            .and_then(|n| n.checked_add(range.min.nanos()))
            .unwrap_or(i128::MAX);
        return Quantity::from_nanos(nanos, step.format());
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
            return (consumed.nanos() - range.min.nanos()).rem_euclid(step.nanos()) != 0;
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
