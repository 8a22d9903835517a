//! A property test: random slices and claims within the Kubernetes feature set (devices that
//! allow multiple allocations or not, capacities with and without request policies, shared
//! counters, counts, `All`, capacity requests, `matchAttribute`/`distinctAttribute`), placed
//! one claim after another, and every answer checked against the invariants of kube-scheduler's
//! structured allocator:
//!
//! * no device twice in one request;
//! * every requested capacity declared by the device it landed on;
//! * `consumedCapacity` on exactly the devices that allow multiple allocations (with a
//!   `shareID`), each declared capacity consumed as the request policy says;
//! * capacities, shared counters and devices held whole never over-committed, over all claims;
//! * constraints kept.
//!
//! The expected consumption is worked out here from the policy rules, independently of the
//! allocator's own arithmetic.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1 as res;
use proptest::prelude::*;
use serde_json::{Value, json};

use super::super::*;
use crate::testing;

const D: &str = "gpu.tessera.dev";
/// Capacity names devices may declare; requests may also name `bogus`, which none declares.
const CAPACITIES: [&str; 3] = ["memory", "compute", "slots"];

/// A request policy, in whole units.
#[derive(Debug, Clone)]
enum Policy {
    None,
    Default(i64),
    Range {
        default: Option<i64>,
        min: i64,
        max: Option<i64>,
        step: Option<i64>,
    },
    Values(Vec<i64>),
}

#[derive(Debug, Clone)]
struct Cap {
    value: i64,
    policy: Policy,
}

#[derive(Debug, Clone)]
struct Dev {
    multi: bool,
    island: &'static str,
    caps: BTreeMap<&'static str, Cap>,
    consumes_counter: Option<i64>,
}

#[derive(Debug, Clone)]
struct Req {
    all: bool,
    count: i64,
    capacity: BTreeMap<&'static str, i64>,
}

#[derive(Debug, Clone)]
struct ClaimShape {
    requests: Vec<Req>,
    constraint: Option<bool>,
}

fn policy(value: i64) -> impl Strategy<Value = Policy> {
    prop_oneof![
        Just(Policy::None),
        (0..=value).prop_map(Policy::Default),
        (
            0..=value,
            prop::option::of(1..=value.max(1)),
            prop::option::of(1..=4_i64)
        )
            .prop_map(move |(min, max, step)| {
                let max = max.map(|m| m.max(min));
                Policy::Range {
                    // A default the range accepts: its minimum.
                    default: Some(min),
                    min,
                    max,
                    step,
                }
            }),
        (0..=value, prop::option::of(1..=4_i64)).prop_map(|(min, step)| Policy::Range {
            // The API requires a default with a range: its minimum.
            default: Some(min),
            min,
            max: None,
            step,
        }),
        prop::collection::btree_set(0..=value, 1..=3)
            .prop_map(|v| Policy::Values(v.into_iter().collect())),
    ]
}

fn capacity(multi: bool) -> impl Strategy<Value = Cap> {
    (1..=12_i64).prop_flat_map(move |value| {
        let p = if multi {
            policy(value).boxed()
        } else {
            // The API allows a request policy only on multi-allocatable devices.
            Just(Policy::None).boxed()
        };
        p.prop_map(move |policy| Cap { value, policy })
    })
}

fn device() -> impl Strategy<Value = Dev> {
    any::<bool>().prop_flat_map(|multi| {
        (
            prop::collection::btree_map(
                prop::sample::select(CAPACITIES.to_vec()),
                capacity(multi),
                0..=3,
            ),
            prop::sample::select(vec!["x", "y"]),
            prop::option::of(1..=2_i64),
        )
            .prop_map(move |(caps, island, consumes_counter)| Dev {
                multi,
                island,
                caps,
                consumes_counter,
            })
    })
}

fn request() -> impl Strategy<Value = Req> {
    (
        prop::bool::weighted(0.15),
        1..=3_i64,
        prop::collection::btree_map(
            prop::sample::select(vec!["memory", "compute", "slots", "bogus"]),
            0..=8_i64,
            0..=2,
        ),
    )
        .prop_map(|(all, count, capacity)| Req {
            all,
            count,
            capacity,
        })
}

fn claim_shape() -> impl Strategy<Value = ClaimShape> {
    (
        prop::collection::vec(request(), 1..=2),
        prop::option::of(any::<bool>()),
    )
        .prop_map(|(requests, constraint)| ClaimShape {
            requests,
            constraint,
        })
}

fn policy_json(p: &Policy) -> Option<Value> {
    match p {
        Policy::None => None,
        Policy::Default(d) => Some(json!({"default": d.to_string()})),
        Policy::Range {
            default,
            min,
            max,
            step,
        } => {
            let mut range = json!({"min": min.to_string()});
            if let Some(m) = max {
                range["max"] = json!(m.to_string());
            }
            if let Some(s) = step {
                range["step"] = json!(s.to_string());
            }
            let mut v = json!({"validRange": range});
            if let Some(d) = default {
                v["default"] = json!(d.to_string());
            }
            Some(v)
        }
        Policy::Values(values) => Some(json!({
            "default": values[0].to_string(),
            "validValues": values.iter().map(ToString::to_string).collect::<Vec<_>>(),
        })),
    }
}

fn slice_of(node: &str, devices: &[Dev], counter: i64) -> res::ResourceSlice {
    let devices: Vec<res::Device> = devices
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let mut capacity = serde_json::Map::new();
            for (name, cap) in &d.caps {
                let mut c = json!({"value": cap.value.to_string()});
                if let Some(p) = policy_json(&cap.policy) {
                    c["requestPolicy"] = p;
                }
                capacity.insert((*name).to_owned(), c);
            }
            let mut v = json!({
                "name": format!("dev-{i}"),
                "attributes": {"island": {"string": d.island}},
                "capacity": capacity,
            });
            if d.multi {
                v["allowMultipleAllocations"] = json!(true);
            }
            if let Some(n) = d.consumes_counter {
                v["consumesCounters"] =
                    json!([{"counterSet": "set", "counters": {"c": {"value": n.to_string()}}}]);
            }
            serde_json::from_value(v).unwrap()
        })
        .collect();
    let mut s = testing::slice(&format!("{node}-0"), node, devices);
    s.spec.shared_counters = Some(vec![
        serde_json::from_value(
            json!({"name": "set", "counters": {"c": {"value": counter.to_string()}}}),
        )
        .unwrap(),
    ]);
    s
}

fn claim_of(i: usize, shape: &ClaimShape) -> res::ResourceClaim {
    let requests: Vec<Value> = shape
        .requests
        .iter()
        .enumerate()
        .map(|(j, r)| {
            let mut exactly = json!({"deviceClassName": "all"});
            if r.all {
                exactly["allocationMode"] = json!("All");
            } else {
                exactly["count"] = json!(r.count);
            }
            if !r.capacity.is_empty() {
                let reqs: BTreeMap<&str, String> = r
                    .capacity
                    .iter()
                    .map(|(k, v)| (*k, v.to_string()))
                    .collect();
                exactly["capacity"] = json!({"requests": reqs});
            }
            json!({"name": format!("r{j}"), "exactly": exactly})
        })
        .collect();
    let mut devices = json!({"requests": requests});
    if let Some(distinct) = shape.constraint {
        let key = if distinct {
            "distinctAttribute"
        } else {
            "matchAttribute"
        };
        devices["constraints"] = json!([{ key: format!("{D}/island") }]);
    }
    testing::claim(
        "default",
        &format!("c{i}"),
        &format!("uid-c{i}"),
        serde_json::from_value(devices).unwrap(),
    )
}

/// What one allocation consumes of `cap` when `requested` (or nothing) is asked, by the policy
/// rules: the request rounded up to the range's step (raised to its minimum) or to the next
/// listed value, else the default, else the whole capacity; `None` when that amount breaks the
/// policy (past the maximum, off the step, not a listed value) and is not its default.
fn expected_consumption(requested: Option<i64>, cap: &Cap) -> Option<i64> {
    let default = match &cap.policy {
        Policy::Default(d)
        | Policy::Range {
            default: Some(d), ..
        } => Some(*d),
        Policy::Values(v) => v.first().copied(),
        _ => None,
    };
    let x = match (requested, &cap.policy) {
        (None, _) => default.unwrap_or(cap.value),
        (Some(req), Policy::Range { min, step, .. }) if req > *min => {
            step.map_or(req, |s| min + (req - min + s - 1) / s * s)
        }
        (Some(_), Policy::Range { min, .. }) => *min,
        (Some(req), Policy::Values(v)) => v.iter().copied().find(|&x| x >= req).unwrap_or(req),
        (Some(req), _) => req,
    };
    let broken = match &cap.policy {
        Policy::Range { min, max, step, .. } => {
            max.is_some_and(|m| x > m) || step.is_some_and(|s| (x - min) % s != 0)
        }
        Policy::Values(v) => !v.contains(&x),
        _ => false,
    };
    (!broken || default == Some(x)).then_some(x)
}

fn units(q: &k8s_openapi::apimachinery::pkg::api::resource::Quantity) -> i64 {
    crate::rules::quantity::Quantity::from_k8s(q)
        .unwrap()
        .as_units()
        .unwrap()
}

/// Per device of an allocation: what it consumed (`Some`, multi-allocatable) or that it was
/// held whole (`None`).
type Held = Vec<(String, Option<BTreeMap<String, i64>>)>;

/// Checks one allocation of claim `shape` on devices `nodes[node]`; returns per device what
/// it consumed (multi-allocatable) or that it was held whole.
#[allow(clippy::too_many_lines)] // Reason: one invariant after another, read top to bottom.
fn check(
    shape: &ClaimShape,
    a: &res::AllocationResult,
    nodes: &BTreeMap<String, Vec<Dev>>,
    node: &str,
) -> Result<Held, TestCaseError> {
    let devs = &nodes[node];
    let mut out = Vec::new();
    let mut per_request: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    let mut islands = Vec::new();
    for r in testing::results(a) {
        prop_assert_eq!(&r.pool, node, "one node per pod");
        let idx: usize = r.device.trim_start_matches("dev-").parse().unwrap();
        let dev = &devs[idx];
        prop_assert!(
            per_request
                .entry(r.request.as_str())
                .or_default()
                .insert(r.device.as_str()),
            "{} took {} twice",
            r.request,
            r.device
        );
        islands.push(dev.island);
        let j: usize = r.request.trim_start_matches('r').parse().unwrap();
        let req = &shape.requests[j];
        for name in req.capacity.keys() {
            prop_assert!(
                dev.caps.contains_key(name),
                "{} asks {name}, which {} does not declare",
                r.request,
                r.device
            );
        }
        if dev.multi {
            prop_assert!(r.share_id.is_some(), "a share has its shareID");
            let got: BTreeMap<String, i64> = r
                .consumed_capacity
                .iter()
                .flatten()
                .map(|(k, v)| (k.clone(), units(v)))
                .collect();
            let mut want = BTreeMap::new();
            for (name, cap) in &dev.caps {
                let x = expected_consumption(req.capacity.get(name).copied(), cap);
                prop_assert!(x.is_some(), "{name} of {} breaks its policy", r.device);
                want.insert((*name).to_owned(), x.unwrap_or_default());
            }
            prop_assert_eq!(&got, &want, "consumedCapacity of {}", r.device);
            out.push((r.device.clone(), Some(got)));
        } else {
            prop_assert!(r.share_id.is_none() && r.consumed_capacity.is_none());
            for (name, v) in &req.capacity {
                prop_assert!(*v <= dev.caps[name].value, "{name} {v} fits {}", r.device);
            }
            out.push((r.device.clone(), None));
        }
    }
    if let Some(distinct) = shape.constraint {
        let set: BTreeSet<_> = islands.iter().collect();
        if distinct {
            prop_assert_eq!(set.len(), islands.len(), "distinct islands");
        } else {
            prop_assert!(set.len() <= 1, "one island");
        }
    }
    Ok(out)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, ..ProptestConfig::default() })]

    #[test]
    fn random_claims_keep_the_allocators_invariants(
        a in prop::collection::vec(device(), 1..=4),
        b in prop::collection::vec(device(), 0..=3),
        counter in 1..=3_i64,
        claims in prop::collection::vec(claim_shape(), 1..=3),
    ) {
        let mut nodes = BTreeMap::new();
        nodes.insert("a".to_owned(), a);
        nodes.insert("b".to_owned(), b);
        let slices: Vec<res::ResourceSlice> = nodes
            .iter()
            .filter(|(_, d)| !d.is_empty())
            .map(|(n, d)| slice_of(n, d, counter))
            .collect();
        let class = testing::cel_class("all", &format!(r#"device.driver == "{D}""#));
        let mut snap = Snapshot::new(&slices, &[class], &[]).unwrap();
        let allocator = Allocator::new(AllocatorOptions::default());
        let candidates = [testing::k8s_node("a"), testing::k8s_node("b")];
        // Per node and device: what shares consumed, and how often it is held whole.
        let mut consumed: BTreeMap<(String, String), BTreeMap<String, i64>> = BTreeMap::new();
        let mut whole: BTreeMap<(String, String), u32> = BTreeMap::new();
        let mut held: BTreeSet<(String, String)> = BTreeSet::new();
        for (i, shape) in claims.iter().enumerate() {
            let c = claim_of(i, shape);
            let Ok(p) = allocator.allocate(&snap, &[&c], &candidates) else {
                continue;
            };
            let a = &p.allocations[0];
            for (device, amounts) in check(shape, a, &nodes, &p.node)? {
                let key = (p.node.clone(), device);
                held.insert(key.clone());
                match amounts {
                    Some(x) => {
                        let slot = consumed.entry(key).or_default();
                        for (k, v) in x {
                            *slot.entry(k).or_default() += v;
                        }
                    }
                    None => *whole.entry(key).or_default() += 1,
                }
            }
            snap.commit(&c, a);
        }
        for ((node, device), n) in &whole {
            prop_assert_eq!(*n, 1, "{}/{} is held whole once", node, device);
        }
        for ((node, device), x) in &consumed {
            let idx: usize = device.trim_start_matches("dev-").parse().unwrap();
            for (name, used) in x {
                let cap = nodes[node][idx].caps[name.as_str()].value;
                prop_assert!(*used <= cap, "{node}/{device} {name}: {used} of {cap}");
            }
        }
        for (node, devs) in &nodes {
            let used: i64 = devs
                .iter()
                .enumerate()
                .filter(|(i, _)| held.contains(&(node.clone(), format!("dev-{i}"))))
                .filter_map(|(_, d)| d.consumes_counter)
                .sum();
            prop_assert!(used <= counter, "{node}: counters {used} of {counter}");
        }
    }
}
