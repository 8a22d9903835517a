use serde_json::{Value, json};

use super::*;
use crate::node::inventory::mig_minors::MIG_MINORS_PATH;
use crate::node::inventory::{MigIds, MigMinors};
use crate::rules::share::GIB;

const DRIVER: &str = "gpu.tessera.dev";

fn node() -> NodeInventory {
    crate::testing::node_inventory(
        "nodes:\n- name: node-a\n  gpus:\n  - model: a100-80g\n    mode: shared\n  - model: a100-80g\n",
    )
}

fn record(memory: &str, compute: i64) -> Value {
    json!({
        "source": "FromClaim",
        "requests": ["gpu"],
        "opaque": {"driver": DRIVER, "parameters": {
            "apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "AllocatedShares",
            "devices": [{"request": "gpu", "pool": "node-a", "device": "gpu-0", "memory": memory, "compute": compute}]
        }}
    })
}

fn gpu_share(source: &str, memory: &str, compute: i64) -> Value {
    json!({
        "source": source,
        "requests": ["gpu"],
        "opaque": {"driver": DRIVER, "parameters": {
            "apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuShare", "memory": memory, "compute": compute
        }}
    })
}

/// A claim for request `gpu`, allocated gpu-0 of node-a with `consumed` (if any), the claim's
/// own `spec_config` and the allocation's `alloc_config`.
fn claim(
    consumed: Option<Value>,
    spec_config: &[Value],
    alloc_config: &[Value],
) -> res::ResourceClaim {
    let spec_config: Vec<Value> = spec_config
        .iter()
        .map(|c| {
            let mut c = c.clone();
            c.as_object_mut().unwrap().remove("source");
            c
        })
        .collect();
    let mut result = json!({
        "request": "gpu", "driver": DRIVER, "pool": "node-a", "device": "gpu-0",
        "shareID": "7f9b3a52-0d4c-4c8e-9a51-2b3c4d5e6f70"
    });
    if let Some(c) = consumed {
        result["consumedCapacity"] = c;
    }
    serde_json::from_value(json!({
        "metadata": {"namespace": "ns", "name": "c", "uid": "uid-1"},
        "spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": "shared.gpu.tessera.dev"}}],
            "config": spec_config
        }},
        "status": {"allocation": {"devices": {"results": [result], "config": alloc_config}}}
    }))
    .unwrap()
}

fn prepare(claim: &res::ResourceClaim) -> Result<PreparedClaim> {
    prepare_on_node(claim, DRIVER, &node())
}

fn refused(claim: &res::ResourceClaim) -> String {
    let err = prepare(claim).unwrap_err();
    assert!(matches!(err, Error::Prepare { .. }), "{err}");
    err.to_string()
}

fn share(claim: &res::ResourceClaim) -> Option<PerDeviceShare> {
    prepare(claim).unwrap().devices[0].share
}

#[test]
fn a_claim_allocated_to_another_node_is_refused_naming_that_node() {
    let mut elsewhere = claim(None, &[], &[]);
    let results = elsewhere
        .status
        .as_mut()
        .unwrap()
        .allocation
        .as_mut()
        .unwrap();
    results.devices.as_mut().unwrap().results.as_mut().unwrap()[0].pool = "node-b".to_owned();
    let message = refused(&elsewhere);
    assert!(
        message.contains("allocated to node node-b, not to this node node-a"),
        "{message}"
    );
}

#[test]
fn a_record_the_user_wrote_into_the_claim_is_refused() {
    // kube-scheduler booked the policy defaults and copied the user's record into the
    // allocation: the record must not become the limits.
    let user_record = record("80Gi", 100);
    let c = claim(
        Some(json!({"memory": "1Gi", "compute": "5"})),
        std::slice::from_ref(&user_record),
        std::slice::from_ref(&user_record),
    );
    let msg = refused(&c);
    assert!(msg.contains("spec.devices.config[0]"), "{msg}");
    assert!(msg.contains("AllocatedShares"), "{msg}");
}

#[test]
fn a_record_larger_than_what_was_booked_is_refused_naming_both() {
    let c = claim(
        Some(json!({"memory": "1Gi", "compute": "5"})),
        &[],
        &[record("80Gi", 100)],
    );
    let msg = refused(&c);
    assert!(
        msg.contains(&format!("memory {} bytes, compute 100", 80 * GIB)),
        "{msg}"
    );
    assert!(
        msg.contains(&format!("memory {GIB} bytes, compute 5")),
        "{msg}"
    );
}

#[test]
fn a_record_that_does_not_decode_is_refused() {
    let c = claim(None, &[], &[record("1e30", 50)]);
    let msg = refused(&c);
    assert!(
        msg.contains("does not decode") && msg.contains("1e30"),
        "{msg}"
    );
    let mut bad = record("10Gi", 50);
    bad["opaque"]["parameters"]["devices"][0]["memroy"] = json!("10Gi");
    let msg = refused(&claim(None, &[], &[bad]));
    assert!(msg.contains("does not decode"), "{msg}");
}

#[test]
fn a_gpu_share_that_kube_scheduler_placed_with_the_policy_defaults_is_refused() {
    let share = gpu_share("FromClaim", "10Gi", 50);
    let c = claim(
        Some(json!({"memory": "1Gi", "compute": "0"})),
        std::slice::from_ref(&share),
        std::slice::from_ref(&share),
    );
    let msg = refused(&c);
    assert!(msg.contains("not gated by Tessera's admission"), "{msg}");
    assert!(msg.contains("delete the pod"), "{msg}");
}

#[test]
fn a_class_gpu_share_without_a_record_is_refused_too() {
    let c = claim(None, &[], &[gpu_share("FromClass", "10Gi", 50)]);
    assert!(refused(&c).contains("GpuShare"));
}

#[test]
fn a_record_from_a_class_is_refused() {
    let mut from_class = record("10Gi", 50);
    from_class["source"] = json!("FromClass");
    let msg = refused(&claim(None, &[], &[from_class]));
    assert!(msg.contains("FromClass"), "{msg}");
}

#[test]
fn a_capacity_requests_share_kube_scheduler_booked_is_prepared_from_consumed_capacity() {
    let c = claim(Some(json!({"memory": "10Gi", "compute": "50"})), &[], &[]);
    assert_eq!(
        share(&c),
        Some(PerDeviceShare {
            memory_bytes: 10 * GIB,
            compute_percent: 50
        })
    );
}

#[test]
fn the_controllers_record_within_its_booking_sets_the_limits() {
    // memoryPercent 33 of an 80 GiB card: the record is exact, the booking rounds up to the
    // policy's step.
    let exact = 33 * 80 * GIB / 100;
    let c = claim(
        Some(json!({"memory": "27Gi", "compute": "25"})),
        &[gpu_share("FromClaim", "10Gi", 25)],
        &[
            gpu_share("FromClaim", "10Gi", 25),
            record(&exact.to_string(), 25),
        ],
    );
    assert_eq!(
        share(&c),
        Some(PerDeviceShare {
            memory_bytes: exact,
            compute_percent: 25
        })
    );
    // Without consumable capacity (1.32, 1.33) the record alone is the share.
    let c = claim(None, &[], &[record("10Gi", 0)]);
    assert_eq!(share(&c).unwrap().memory_bytes, 10 * GIB);
}

#[test]
fn an_unisolated_record_under_a_compute_booking_is_refused() {
    let c = claim(
        Some(json!({"memory": "10Gi", "compute": "50"})),
        &[],
        &[record("10Gi", 0)],
    );
    assert!(refused(&c).contains("disagrees"));
}

#[test]
fn a_record_naming_a_device_outside_the_allocation_is_refused() {
    let mut stray = record("10Gi", 50);
    stray["opaque"]["parameters"]["devices"][0]["device"] = json!("gpu-1");
    let msg = refused(&claim(None, &[], &[stray]));
    assert!(msg.contains("node-a/gpu-1"), "{msg}");
}

#[test]
fn a_whole_device_without_a_share_request_is_prepared_whole_with_its_share_id() {
    let c = claim(None, &[], &[]);
    let prepared = prepare(&c).unwrap();
    assert_eq!(prepared.devices[0].share, None);
    assert_eq!(
        prepared.devices[0].share_id.as_deref(),
        Some("7f9b3a52-0d4c-4c8e-9a51-2b3c4d5e6f70")
    );
}

fn with_tier(mut record: Value, tier: &str) -> Value {
    record["opaque"]["parameters"]["devices"][0]["tier"] = json!(tier);
    record
}

fn tier_policy(source: &str, tier: &str, allow_online: Option<bool>) -> Value {
    let mut v = json!({
        "source": source,
        "requests": ["gpu"],
        "opaque": {"driver": DRIVER, "parameters": {
            "apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "TierPolicy", "tier": tier
        }}
    });
    if let Some(a) = allow_online {
        v["opaque"]["parameters"]["allowOnline"] = json!(a);
    }
    v
}

fn tier(claim: &res::ResourceClaim) -> Tier {
    prepare(claim).unwrap().devices[0].tier
}

#[test]
fn the_tier_comes_from_the_record_and_an_old_record_is_online() {
    assert_eq!(tier(&claim(None, &[], &[record("10Gi", 50)])), Tier::Online);
    assert_eq!(
        tier(&claim(None, &[], &[with_tier(record("10Gi", 50), "batch")])),
        Tier::Batch
    );
    assert_eq!(
        tier(&claim(
            None,
            &[],
            &[with_tier(record("10Gi", 50), "online")]
        )),
        Tier::Online
    );
}

#[test]
fn a_record_whose_tier_does_not_decode_is_refused() {
    let msg = refused(&claim(
        None,
        &[],
        &[with_tier(record("10Gi", 50), "platinum")],
    ));
    assert!(
        msg.contains("does not decode") && msg.contains("platinum"),
        "{msg}"
    );
}

#[test]
fn a_claim_cannot_raise_its_tier_with_its_own_config() {
    // A user's TierPolicy, copied by kube-scheduler as FromClaim, never changes the tier: the
    // booked share stays online by default and a FromClaim policy is no class policy.
    let user = tier_policy("FromClaim", "online", Some(true));
    let c = claim(
        Some(json!({"memory": "10Gi", "compute": "50"})),
        &[],
        &[tier_policy("FromClass", "batch", None), user],
    );
    assert_eq!(tier(&c), Tier::Batch);
}

#[test]
fn a_share_kube_scheduler_booked_takes_the_class_tier() {
    let booked = Some(json!({"memory": "10Gi", "compute": "50"}));
    assert_eq!(tier(&claim(booked.clone(), &[], &[])), Tier::Online);
    let c = claim(
        booked,
        &[],
        &[tier_policy("FromClass", "batch", Some(false))],
    );
    assert_eq!(tier(&c), Tier::Batch);
}

#[test]
fn an_online_record_under_a_class_that_forbids_online_is_refused() {
    let c = claim(
        None,
        &[],
        &[
            tier_policy("FromClass", "batch", Some(false)),
            record("10Gi", 50),
        ],
    );
    let msg = refused(&c);
    assert!(msg.contains("allowOnline: false"), "{msg}");
    // The record that says batch is prepared.
    let c = claim(
        None,
        &[],
        &[
            tier_policy("FromClass", "batch", Some(false)),
            with_tier(record("10Gi", 50), "batch"),
        ],
    );
    assert_eq!(tier(&c), Tier::Batch);
}

#[test]
fn a_whole_device_is_online_whatever_its_class_says() {
    let c = claim(None, &[], &[tier_policy("FromClass", "batch", None)]);
    let prepared = prepare(&c).unwrap();
    assert_eq!(prepared.devices[0].share, None);
    assert_eq!(prepared.devices[0].tier, Tier::Online);
}

fn guaranteed(mut record: Value, memory: Option<&str>, compute: Option<i64>) -> Value {
    let d = &mut record["opaque"]["parameters"]["devices"][0];
    if let Some(m) = memory {
        d["guaranteedMemory"] = json!(m);
    }
    if let Some(c) = compute {
        d["guaranteedCompute"] = json!(c);
    }
    record
}

#[test]
fn an_over_committed_batch_share_is_booked_at_its_guarantee_and_limited_at_what_it_may_use() {
    // Booked (consumedCapacity) 40 of compute, recorded 80 that it may use when idle.
    let rec = guaranteed(with_tier(record("10Gi", 80), "batch"), None, Some(40));
    let c = claim(
        Some(json!({"memory": "10Gi", "compute": "40"})),
        &[gpu_share("FromClaim", "10Gi", 80)],
        &[gpu_share("FromClaim", "10Gi", 80), rec],
    );
    let prepared = prepare(&c).unwrap();
    let d = &prepared.devices[0];
    assert_eq!(d.share.unwrap().compute_percent, 80);
    assert!(!d.memory_overcommitted);
    // A guarantee above what was booked is refused.
    let rec = guaranteed(with_tier(record("10Gi", 80), "batch"), None, Some(60));
    let c = claim(
        Some(json!({"memory": "10Gi", "compute": "40"})),
        &[],
        &[rec],
    );
    assert!(refused(&c).contains("guaranteed memory"), "{}", refused(&c));
    // Over-committed memory is flagged for the CDI builder (which needs hami-core).
    let rec = guaranteed(with_tier(record("10Gi", 0), "batch"), Some("4Gi"), None);
    let c = claim(Some(json!({"memory": "4Gi"})), &[], &[rec]);
    assert!(prepare(&c).unwrap().devices[0].memory_overcommitted);
}

#[test]
fn an_online_record_that_claims_over_commit_or_a_guarantee_above_its_share_is_refused() {
    let c = claim(None, &[], &[guaranteed(record("10Gi", 80), None, Some(40))]);
    assert!(
        refused(&c).contains("online shares are never"),
        "{}",
        refused(&c)
    );
    let c = claim(
        None,
        &[],
        &[guaranteed(
            with_tier(record("10Gi", 40), "batch"),
            None,
            Some(80),
        )],
    );
    assert!(refused(&c).contains("guaranteedCompute"), "{}", refused(&c));
}

/// A claim allocated `results` (request, device, consumedCapacity) on node-a, with the
/// allocator's record of `shares` (request, device, memory, compute).
fn claim_with(
    results: &[(&str, &str, Option<Value>)],
    shares: &[(&str, &str, &str, i64)],
) -> res::ResourceClaim {
    let results: Vec<Value> = results
        .iter()
        .enumerate()
        .map(|(i, (request, device, consumed))| {
            let mut r = json!({
                "request": request, "driver": DRIVER, "pool": "node-a", "device": device,
                "shareID": format!("7f9b3a52-0d4c-4c8e-9a51-2b3c4d5e6f7{i}")
            });
            if let Some(c) = consumed {
                r["consumedCapacity"] = c.clone();
            }
            r
        })
        .collect();
    let devices: Vec<Value> = shares
        .iter()
        .map(|(request, device, memory, compute)| {
            json!({"request": request, "pool": "node-a", "device": device, "memory": memory, "compute": compute})
        })
        .collect();
    let config = if devices.is_empty() {
        json!([])
    } else {
        json!([{
            "source": "FromClaim",
            "opaque": {"driver": DRIVER, "parameters": {
                "apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "AllocatedShares", "devices": devices
            }}
        }])
    };
    serde_json::from_value(json!({
        "metadata": {"namespace": "ns", "name": "c", "uid": "uid-1"},
        "spec": {"devices": {"requests": [
            {"name": "a", "exactly": {"deviceClassName": "shared.gpu.tessera.dev"}},
            {"name": "b", "exactly": {"deviceClassName": "shared.gpu.tessera.dev"}}
        ]}},
        "status": {"allocation": {"devices": {"results": results, "config": config}}}
    }))
    .unwrap()
}

#[test]
fn a_share_larger_than_the_card_is_refused_naming_the_card() {
    // Issue 23: a 200Gi share on an 80 GiB card was prepared with a 204800m limit.
    let booked = Some(json!({"memory": "200Gi", "compute": "50"}));
    let c = claim_with(&[("a", "gpu-0", booked)], &[("a", "gpu-0", "200Gi", 50)]);
    let msg = refused(&c);
    assert!(msg.contains("device gpu-0"), "{msg}");
    assert!(msg.contains("memory 200Gi"), "{msg}");
    assert!(msg.contains("the card's 80Gi"), "{msg}");
    // kube-scheduler's own booking, without a record, is checked the same way.
    let c = claim_with(
        &[(
            "a",
            "gpu-0",
            Some(json!({"memory": "81Gi", "compute": "5"})),
        )],
        &[],
    );
    assert!(refused(&c).contains("the card's 80Gi"));
    // The whole card is fine.
    let c = claim_with(
        &[(
            "a",
            "gpu-0",
            Some(json!({"memory": "80Gi", "compute": "100"})),
        )],
        &[("a", "gpu-0", "80Gi", 100)],
    );
    assert_eq!(
        prepare(&c).unwrap().devices[0].share.unwrap().memory_bytes,
        80 * GIB
    );
}

#[test]
fn two_shares_of_one_claim_on_one_card_must_fit_the_card_together() {
    // Issue 23: two 50Gi shares of one claim on one 80 GiB card got a 102400m limit.
    let booked = || Some(json!({"memory": "50Gi", "compute": "20"}));
    let c = claim_with(
        &[("a", "gpu-0", booked()), ("b", "gpu-0", booked())],
        &[("a", "gpu-0", "50Gi", 20), ("b", "gpu-0", "50Gi", 20)],
    );
    let msg = refused(&c);
    assert!(msg.contains("requests a, b together"), "{msg}");
    assert!(msg.contains("memory 100Gi"), "{msg}");
    let booked = || Some(json!({"memory": "10Gi", "compute": "60"}));
    let c = claim_with(
        &[("a", "gpu-0", booked()), ("b", "gpu-0", booked())],
        &[("a", "gpu-0", "10Gi", 60), ("b", "gpu-0", "10Gi", 60)],
    );
    assert!(refused(&c).contains("compute 120 is more than 100"));
    let booked = || Some(json!({"memory": "40Gi", "compute": "50"}));
    let c = claim_with(
        &[("a", "gpu-0", booked()), ("b", "gpu-0", booked())],
        &[("a", "gpu-0", "40Gi", 50), ("b", "gpu-0", "40Gi", 50)],
    );
    assert_eq!(prepare(&c).unwrap().devices.len(), 2);
}

#[test]
fn an_over_committed_share_is_checked_at_what_it_may_use() {
    // Guaranteed 40Gi (booked), may use 90Gi: the limit the container gets passes the card.
    let mut c = claim_with(
        &[(
            "a",
            "gpu-0",
            Some(json!({"memory": "40Gi", "compute": "10"})),
        )],
        &[("a", "gpu-0", "90Gi", 10)],
    );
    let record = c.status.as_mut().unwrap().allocation.as_mut().unwrap();
    let config = &mut record.devices.as_mut().unwrap().config.as_mut().unwrap()[0];
    let params = &mut config.opaque.as_mut().unwrap().parameters.0;
    params["devices"][0]["guaranteedMemory"] = json!("40Gi");
    params["devices"][0]["tier"] = json!("batch");
    assert!(refused(&c).contains("memory 90Gi"), "{}", refused(&c));
}

#[test]
fn a_share_on_an_exclusive_gpu_or_a_mig_instance_is_refused() {
    // Issue 23: two share claims on a GPU published as exclusive were both prepared.
    let booked = || Some(json!({"memory": "10Gi", "compute": "50"}));
    let c = claim_with(&[("a", "gpu-1", booked())], &[("a", "gpu-1", "10Gi", 50)]);
    let msg = refused(&c);
    assert!(msg.contains("device gpu-1"), "{msg}");
    assert!(msg.contains("an exclusive GPU"), "{msg}");
    // consumedCapacity alone (kube-scheduler), or a record alone, is a share too.
    let c = claim_with(&[("a", "gpu-1", booked())], &[]);
    assert!(refused(&c).contains("an exclusive GPU"));
    let c = claim_with(&[("a", "gpu-1", None)], &[("a", "gpu-1", "10Gi", 50)]);
    assert!(refused(&c).contains("an exclusive GPU"));
    // The exclusive GPU whole is fine.
    let c = claim_with(&[("a", "gpu-1", None)], &[]);
    assert_eq!(prepare(&c).unwrap().devices[0].share, None);

    let mig = Inventory::from_yaml(
        "nodes:\n- name: node-a\n  gpus:\n  - model: a100-80g\n    mig:\n    - profile: 1g.10gb\n      count: 1\n",
    )
    .unwrap()
    .nodes
    .remove(0);
    let device = mig.gpus[0].mig_instances[0].device_name(0);
    let c = claim_with(&[("a", &device, booked())], &[]);
    let msg = prepare_on_node(&c, DRIVER, &mig).unwrap_err().to_string();
    assert!(msg.contains("a MIG instance"), "{msg}");
    let c = claim_with(&[("a", &device, None)], &[]);
    assert!(prepare_on_node(&c, DRIVER, &mig).is_ok());
}

#[test]
fn a_share_on_a_gpu_whose_isolation_is_unverified_is_refused() {
    let c = claim(
        Some(json!({"memory": "10Gi", "compute": "50"})),
        &[],
        &[record("10Gi", 50)],
    );
    let mut unverified = node();
    unverified.gpus[0].isolation = crate::node::inventory::Isolation::Unverified;
    let msg = prepare_on_node(&c, DRIVER, &unverified)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("GPU gpu-0 offers no shares: its isolation is unverified"),
        "{msg}"
    );
    assert!(msg.contains("--accept-unverified-isolation"), "{msg}");
    // Accepted by the admin, or verified: prepared.
    for ok in [
        crate::node::inventory::Isolation::Accepted,
        crate::node::inventory::Isolation::Verified,
    ] {
        let mut n = node();
        n.gpus[0].isolation = ok;
        assert!(prepare_on_node(&c, DRIVER, &n).is_ok(), "{ok}");
    }
}

/// The allocation results of claim `c`, to add another driver's result to.
fn results_mut(c: &mut res::ResourceClaim) -> &mut Vec<res::DeviceRequestAllocationResult> {
    c.status
        .as_mut()
        .and_then(|s| s.allocation.as_mut())
        .and_then(|a| a.devices.as_mut())
        .and_then(|d| d.results.as_mut())
        .expect("an allocated claim")
}

#[test]
fn a_claim_that_also_holds_another_drivers_node_a_gpu_1_prepares_only_its_own_device() {
    // Another driver's device in this node's pool, named like a Tessera GPU, is not ours.
    let mut c = claim_with(&[("a", "gpu-0", None)], &[]);
    results_mut(&mut c).push(
        serde_json::from_value(json!({
            "request": "b", "driver": "gpu.other.example", "pool": "node-a", "device": "gpu-1"
        }))
        .unwrap(),
    );
    let prepared = prepare(&c).unwrap();
    let names: Vec<&str> = prepared.devices.iter().map(|d| d.device.as_str()).collect();
    assert_eq!(names, ["gpu-0"]);
}

#[test]
fn a_claim_is_prepared_on_the_node_of_its_own_drivers_devices_not_anothers() {
    // The first result is another driver's, in a pool no Tessera node has: the node is the
    // pool of this driver's result.
    let mut c = claim_with(&[("a", "gpu-0", None)], &[]);
    results_mut(&mut c).insert(
        0,
        serde_json::from_value(json!({
            "request": "b", "driver": "gpu.other.example", "pool": "elsewhere", "device": "x"
        }))
        .unwrap(),
    );
    let inventory = Inventory {
        nodes: vec![node()],
    };
    let prepared = prepared_claim(&c, DRIVER, &inventory).unwrap();
    let names: Vec<&str> = prepared.devices.iter().map(|d| d.device.as_str()).collect();
    assert_eq!(names, ["gpu-0"]);
    let err = prepared_claim(&c, "gpu.none.example", &inventory).unwrap_err();
    assert!(err.to_string().contains("no device of driver"), "{err}");
}

#[test]
fn a_record_with_more_memory_than_was_booked_is_refused_even_when_compute_agrees() {
    let c = claim(
        Some(json!({"memory": "1Gi", "compute": "50"})),
        &[],
        &[record("10Gi", 50)],
    );
    let msg = refused(&c);
    assert!(
        msg.contains(&format!("memory {} bytes, compute 50", 10 * GIB)),
        "{msg}"
    );
}

#[test]
fn memory_over_commit_on_a_gpu_whose_isolation_was_only_accepted_is_refused() {
    let rec = guaranteed(with_tier(record("10Gi", 0), "batch"), Some("4Gi"), None);
    let c = claim(Some(json!({"memory": "4Gi"})), &[], &[rec]);
    let mut accepted = node();
    accepted.gpus[0].isolation = crate::node::inventory::Isolation::Accepted;
    let msg = prepare_on_node(&c, DRIVER, &accepted)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("over-commits memory, which needs isolation proven on GPU gpu-0"),
        "{msg}"
    );
    // The same share without over-commit is prepared there.
    let c = claim(
        Some(json!({"memory": "10Gi"})),
        &[],
        &[with_tier(record("10Gi", 0), "batch")],
    );
    assert!(prepare_on_node(&c, DRIVER, &accepted).is_ok());
}

/// `claim`, with its one result allocated for subrequest `gpu/small` (a firstAvailable
/// request) instead of `gpu`; a record in `alloc_config` is moved along with it.
fn subrequest(mut c: res::ResourceClaim) -> res::ResourceClaim {
    let devices = c
        .status
        .as_mut()
        .unwrap()
        .allocation
        .as_mut()
        .unwrap()
        .devices
        .as_mut()
        .unwrap();
    devices.results.as_mut().unwrap()[0].request = "gpu/small".to_owned();
    for cfg in devices.config.iter_mut().flatten() {
        let params = &mut cfg.opaque.as_mut().unwrap().parameters.0;
        if let Some(records) = params.get_mut("devices") {
            records[0]["request"] = json!("gpu/small");
        }
    }
    c
}

#[test]
fn a_subrequest_result_is_held_to_its_parents_gpu_share_and_tier_policy() {
    // A GpuShare naming `gpu` needs a record for `gpu/small` too.
    let c = subrequest(claim(
        Some(json!({"memory": "1Gi", "compute": "5"})),
        &[],
        &[gpu_share("FromClaim", "10Gi", 50)],
    ));
    let msg = refused(&c);
    assert!(msg.contains("no AllocatedShares record"), "{msg}");
    // A class's allowOnline: false naming `gpu` refuses an online record for `gpu/small`.
    let c = subrequest(claim(
        None,
        &[],
        &[
            tier_policy("FromClass", "batch", Some(false)),
            record("10Gi", 50),
        ],
    ));
    let msg = refused(&c);
    assert!(msg.contains("allowOnline: false"), "{msg}");
    // And its batch tier applies to a share kube-scheduler booked for `gpu/small`.
    let c = subrequest(claim(
        Some(json!({"memory": "10Gi", "compute": "50"})),
        &[],
        &[tier_policy("FromClass", "batch", None)],
    ));
    assert_eq!(tier(&c), Tier::Batch);
}

/// `c` with `cfg` added to its allocation's configs, naming `requests`.
fn with_config(mut c: res::ResourceClaim, mut cfg: Value, requests: &[&str]) -> res::ResourceClaim {
    cfg["requests"] = json!(requests);
    let devices = c
        .status
        .as_mut()
        .unwrap()
        .allocation
        .as_mut()
        .unwrap()
        .devices
        .as_mut()
        .unwrap();
    devices
        .config
        .get_or_insert_with(Vec::new)
        .push(serde_json::from_value(cfg).unwrap());
    c
}

#[test]
fn a_config_naming_one_of_two_requests_holds_only_that_one_and_requests_empty_holds_both() {
    let booked = || Some(json!({"memory": "10Gi", "compute": "20"}));
    let two = || claim_with(&[("a", "gpu-0", booked()), ("b", "gpu-0", booked())], &[]);
    let share = gpu_share("FromClaim", "10Gi", 20);
    // A GpuShare naming `b` refuses b's booking without a record, not a's.
    let msg = refused(&with_config(two(), share.clone(), &["b"]));
    assert!(msg.contains("(request b)"), "{msg}");
    assert!(msg.contains("no AllocatedShares record"), "{msg}");
    let c = with_config(
        claim_with(&[("a", "gpu-0", booked())], &[]),
        share.clone(),
        &["b"],
    );
    assert!(prepare(&c).is_ok());
    // `requests: []` names every request: both are held to it.
    let msg = refused(&with_config(two(), share, &[]));
    assert!(msg.contains("(request a)"), "{msg}");
    let policy = tier_policy("FromClass", "batch", None);
    let prepared = prepare(&with_config(two(), policy.clone(), &[])).unwrap();
    assert!(prepared.devices.iter().all(|d| d.tier == Tier::Batch));
    // A class policy naming `b` only leaves `a` online.
    let prepared = prepare(&with_config(two(), policy, &["b"])).unwrap();
    let tiers: Vec<Tier> = prepared.devices.iter().map(|d| d.tier).collect();
    assert_eq!(tiers, [Tier::Online, Tier::Batch]);
}

/// node-a with an exclusive GPU 0 and GPU 1 split into two `1g.10gb` instances.
fn mig_node() -> NodeInventory {
    crate::testing::node_inventory(
        "nodes:\n- name: node-a\n  gpus:\n  - model: a100-80g\n  - model: a100-80g\n    mig:\n    - profile: 1g.10gb\n      count: 2\n",
    )
}

/// The one device `claim` prepares on `node`, or the error.
fn prepare_mig(node: &NodeInventory, device: &str) -> Result<PreparedDevice> {
    let c = claim_with(&[("a", device, None)], &[]);
    prepare_on_node(&c, DRIVER, node).map(|mut p| p.devices.remove(0))
}

fn table(text: &str) -> MigMinors {
    MigMinors::parse(text).unwrap()
}

#[test]
fn a_second_mig_instance_on_gpu_1_gets_the_capability_minors_nvmls_ids_give() {
    let mut node = mig_node();
    // NVML numbers the second instance GPU instance 9, compute instance 1: not its position.
    node.gpus[1].mig_instances[1].ids = Some(MigIds {
        gpu_instance: 9,
        compute_instance: 1,
    });
    node.mig_minors = Some(table(
        "gpu1/gi0/access 138\ngpu1/gi0/ci0/access 139\ngpu1/gi1/access 147\n\
         gpu1/gi1/ci0/access 148\ngpu1/gi9/access 219\ngpu1/gi9/ci1/access 221\n",
    ));
    let device = node.gpus[1].mig_instances[1].device_name(1);
    let mig = prepare_mig(&node, &device).unwrap().mig.unwrap();
    assert_eq!((mig.gpu_instance, mig.compute_instance), (9, 1));
    assert_eq!(
        (mig.gpu_instance_cap_minor, mig.compute_instance_cap_minor),
        (219, 221)
    );
    assert_eq!(mig.uuid, node.gpus[1].mig_instances[1].uuid);
}

#[test]
fn the_gpus_device_node_minor_not_its_index_names_the_gpu_and_keys_its_mig_minors() {
    let mut node = mig_node();
    node.gpus[1].minor = 6;
    node.mig_minors = Some(table("gpu6/gi0/access 813\ngpu6/gi0/ci0/access 814\n"));
    let device = node.gpus[1].mig_instances[0].device_name(1);
    let prepared = prepare_mig(&node, &device).unwrap();
    assert_eq!(prepared.gpu.minor, 6);
    assert_eq!(prepared.gpu.index, 1);
    let mig = prepared.mig.unwrap();
    assert_eq!(
        (mig.gpu_instance_cap_minor, mig.compute_instance_cap_minor),
        (813, 814)
    );
    // A whole GPU is named by its minor too.
    node.gpus[0].minor = 3;
    assert_eq!(prepare_mig(&node, "gpu-0").unwrap().gpu.minor, 3);
}

#[test]
fn a_mig_device_whose_minors_the_caps_table_lacks_is_refused() {
    let mut node = mig_node();
    let device = node.gpus[1].mig_instances[1].device_name(1);
    // The table lists GPU 1's instance 1 but not its compute instance 0, then not at all.
    for text in [
        "gpu1/gi1/access 147\n",
        "gpu1/gi0/access 138\ngpu1/gi0/ci0/access 139\n",
    ] {
        node.mig_minors = Some(table(text));
        let msg = prepare_mig(&node, &device).unwrap_err().to_string();
        assert!(msg.contains(&format!("device {device}")), "{msg}");
        assert!(
            msg.contains("lists no access minors for gpu1/gi1/ci0"),
            "{msg}"
        );
    }
}

#[test]
fn without_the_caps_table_no_mig_device_is_prepared_but_whole_gpus_are() {
    let mut node = mig_node();
    node.mig_minors = None;
    let device = node.gpus[1].mig_instances[0].device_name(1);
    let msg = prepare_mig(&node, &device).unwrap_err().to_string();
    assert!(msg.contains("no MIG capability table"), "{msg}");
    assert!(msg.contains(MIG_MINORS_PATH), "{msg}");
    assert!(prepare_mig(&node, "gpu-0").is_ok());
}

#[test]
fn a_mig_device_without_nvmls_instance_ids_is_refused() {
    let mut node = mig_node();
    node.gpus[1].mig_instances[0].ids = None;
    let device = node.gpus[1].mig_instances[0].device_name(1);
    let msg = prepare_mig(&node, &device).unwrap_err().to_string();
    assert!(
        msg.contains("did not report the GPU and compute instance ids"),
        "{msg}"
    );
    // The other instance, whose ids NVML gave, is still prepared.
    let other = node.gpus[1].mig_instances[1].device_name(1);
    assert!(prepare_mig(&node, &other).is_ok());
}

#[test]
fn a_simulated_mig_gpu_gets_the_drivers_layout_for_its_placement_ordered_instances() {
    let node = mig_node();
    let device = node.gpus[1].mig_instances[1].device_name(1);
    let mig = prepare_mig(&node, &device).unwrap().mig.unwrap();
    // GPU minor 1, GPU instance 1, compute instance 0: 1 * 135 + 1 * 9 + 3 and the next.
    assert_eq!(
        (mig.gpu_instance_cap_minor, mig.compute_instance_cap_minor),
        (147, 148)
    );
}

// Whatever kube-scheduler 1.36.2 allocates on Tessera's GPUs from a claim that uses only
// Kubernetes features, the node prepares (issue 31): these allocations are written as
// kube-scheduler writes them, without Tessera's record.

/// Node `node-a` with two shared GPUs and one exclusive GPU.
fn two_shared_one_exclusive() -> NodeInventory {
    crate::testing::node_inventory(
        "nodes:\n- name: node-a\n  gpus:\n  - model: a100-80g\n    mode: shared\n  - model: a100-80g\n    mode: shared\n  - model: a100-80g\n",
    )
}

/// Claim `ns/c` whose one request `gpu` (of `class`, in allocation `mode`, with
/// `capacity.requests`) was allocated `results` by kube-scheduler.
fn kube_allocated(
    class: &str,
    mode: &str,
    capacity: &Value,
    results: &Value,
) -> res::ResourceClaim {
    serde_json::from_value(json!({
        "metadata": {"namespace": "ns", "name": "c", "uid": "uid-1"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": class, "allocationMode": mode,
            "capacity": {"requests": capacity}}}]}},
        "status": {"allocation": {"devices": {"results": results}}}
    }))
    .unwrap()
}

fn shares_of(prepared: &PreparedClaim) -> Vec<(String, Option<PerDeviceShare>)> {
    prepared
        .devices
        .iter()
        .map(|d| (d.device.clone(), d.share))
        .collect()
}

#[test]
fn an_exclusive_gpu_kube_scheduler_gave_to_capacity_requests_is_prepared_whole() {
    // Issue 31, 8: `consumedCapacity` and `shareID` are written for multi-allocatable devices
    // only, so the result is the whole GPU.
    let c = kube_allocated(
        "gpu.tessera.dev",
        "ExactCount",
        &json!({"memory": "10Gi"}),
        &json!([{"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": "gpu-2"}]),
    );
    let prepared = prepare_on_node(&c, DRIVER, &two_shared_one_exclusive()).unwrap();
    assert_eq!(shares_of(&prepared), [("gpu-2".to_owned(), None)]);
}

#[test]
fn all_shared_gpus_kube_scheduler_gave_to_capacity_requests_are_prepared_as_shares() {
    // Issue 31, 9: `allocationMode: All` with capacity requests books a share of each GPU.
    let result = |device: &str, id: &str| {
        json!({"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": device,
               "shareID": id, "consumedCapacity": {"memory": "10Gi", "compute": "20"}})
    };
    let c = kube_allocated(
        "shared.gpu.tessera.dev",
        "All",
        &json!({"memory": "10Gi", "compute": "20"}),
        &json!([
            result("gpu-0", "7f9b3a52-0d4c-4c8e-9a51-2b3c4d5e6f70"),
            result("gpu-1", "1c2d3e4f-5a6b-4c7d-8e9f-0a1b2c3d4e5f")
        ]),
    );
    let prepared = prepare_on_node(&c, DRIVER, &two_shared_one_exclusive()).unwrap();
    let each = Some(PerDeviceShare {
        memory_bytes: 10 * GIB,
        compute_percent: 20,
    });
    assert_eq!(
        shares_of(&prepared),
        [("gpu-0".to_owned(), each), ("gpu-1".to_owned(), each)]
    );
}

#[test]
fn a_share_that_booked_another_capacity_too_is_prepared_with_its_memory_and_compute() {
    // Issue 31, 10: a GPU that declares more capacities books each; the node enforces memory
    // and compute, the rest is kube-scheduler's accounting.
    let c = claim(
        Some(json!({"memory": "10Gi", "compute": "0", "multiprocessors": "40"})),
        &[],
        &[],
    );
    assert_eq!(
        share(&c),
        Some(PerDeviceShare {
            memory_bytes: 10 * GIB,
            compute_percent: 0
        })
    );
}

#[test]
fn a_share_kept_as_asked_without_a_step_is_prepared_to_the_byte() {
    // Issue 31, 6: a range without a step keeps 1500Mi as asked.
    let c = claim(Some(json!({"memory": "1500Mi", "compute": "0"})), &[], &[]);
    assert_eq!(share(&c).unwrap().memory_bytes, 1500 << 20);
}

#[test]
fn two_requests_sharing_one_gpu_are_prepared_together() {
    // Issue 31, 1: one request never takes a GPU twice, but two requests of a claim may each
    // take a share of it; the node gives the claim their sum.
    let result = |request: &str, id: &str| {
        json!({"request": request, "driver": DRIVER, "pool": "node-a", "device": "gpu-0",
               "shareID": id, "consumedCapacity": {"memory": "10Gi", "compute": "25"}})
    };
    let c: res::ResourceClaim = serde_json::from_value(json!({
        "metadata": {"namespace": "ns", "name": "c", "uid": "uid-1"},
        "spec": {"devices": {"requests": [
            {"name": "a", "exactly": {"deviceClassName": "shared.gpu.tessera.dev"}},
            {"name": "b", "exactly": {"deviceClassName": "shared.gpu.tessera.dev"}}]}},
        "status": {"allocation": {"devices": {"results": [
            result("a", "7f9b3a52-0d4c-4c8e-9a51-2b3c4d5e6f70"),
            result("b", "1c2d3e4f-5a6b-4c7d-8e9f-0a1b2c3d4e5f")]}}}
    }))
    .unwrap();
    let prepared = prepare(&c).unwrap();
    assert_eq!(prepared.devices.len(), 2);
    assert!(prepared.devices.iter().all(|d| d.share.is_some()));
}

#[test]
fn a_refusal_names_the_claim_by_namespace_and_name() {
    let msg = refused(&claim_with(&[("a", "gpu-9", None)], &[]));
    assert!(msg.starts_with("claim ns/c cannot be prepared: "), "{msg}");
    assert!(
        msg.contains("device node-a/gpu-9 is not on node node-a"),
        "{msg}"
    );
}
