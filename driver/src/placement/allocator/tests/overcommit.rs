//! Over-commit bookkeeping ([`crate::rules::overcommit`]): online is never over-committed, batch is
//! over-committed only up to its class's factor, memory only where the class opts in and the
//! node's backend can back it, and kube-scheduler's view (`consumedCapacity`) never passes a
//! GPU's capacity.

use super::*;

const SHARED: &str = "shared.gpu.tessera.dev";
const BATCH2: &str = "batch2.gpu.tessera.dev";
const BATCH1: &str = "batch1.gpu.tessera.dev";
const BATCH_MEM: &str = "batchmem.gpu.tessera.dev";

/// A class of shared GPUs whose shares are batch, with the given `TierPolicy` extras.
fn batch_class(name: &str, extra: &serde_json::Value) -> res::DeviceClass {
    let mut c = class(
        name,
        r#"device.driver == "gpu.tessera.dev" && device.attributes["gpu.tessera.dev"].sharing == "shared""#,
    );
    let mut params =
        json!({"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "TierPolicy", "tier": "batch"});
    for (k, v) in extra.as_object().unwrap() {
        params[k] = v.clone();
    }
    c.spec.config = Some(vec![res::DeviceClassConfiguration {
        opaque: Some(res::OpaqueDeviceConfiguration {
            driver: D.into(),
            parameters: RawExtension(params),
        }),
    }]);
    c
}

fn all_classes() -> Vec<res::DeviceClass> {
    let mut all = classes();
    all.push(batch_class(BATCH2, &json!({"batchComputeOvercommit": 2})));
    all.push(batch_class(BATCH1, &json!({})));
    all.push(batch_class(
        BATCH_MEM,
        &json!({"batchComputeOvercommit": 2, "batchMemoryOvercommit": 1.5}),
    ));
    all
}

/// One shared GPU (80Gi, 100 compute) on node `a`; `hami` publishes `enforcement: hami-core`
/// with `isolation: verified` (the node's probe held).
fn one_gpu(multi: bool, hami: bool) -> Vec<res::ResourceSlice> {
    one_gpu_probed(multi, hami, "verified")
}

fn one_gpu_probed(multi: bool, hami: bool, isolation: &str) -> Vec<res::ResourceSlice> {
    let mut d = gpu("gpu-0", "shared", "x", multi);
    if hami {
        let attrs = d.attributes.as_mut().unwrap();
        attrs.insert("enforcement".to_owned(), attr_s("hami-core"));
        attrs.insert("isolation".to_owned(), attr_s(isolation));
    }
    vec![slice("a-0", "a", vec![d])]
}

fn share(name: &str, class: &str, memory: &str, compute: i64) -> res::ResourceClaim {
    with_config(
        claim(name, vec![exact("gpu", class, 1)]),
        share_config(memory, (compute > 0).then_some(compute)),
    )
}

/// Allocates `c` on `snap` and commits it; the allocation, or `None` when it does not fit.
fn place(snap: &mut Snapshot, c: &res::ResourceClaim) -> Option<res::AllocationResult> {
    let p = alloc(Policy::FirstFit)
        .allocate(snap, &[c], &[node("a")])
        .ok()?;
    snap.commit(c, &p.allocations[0]);
    Some(p.allocations[0].clone())
}

fn consumed(a: &res::AllocationResult, name: &str) -> Option<String> {
    testing::results(a)[0]
        .consumed_capacity
        .as_ref()
        .and_then(|c| c.get(name))
        .map(|q| q.0.clone())
}

#[test]
fn online_shares_are_never_over_committed() {
    for multi in [false, true] {
        let mut snap = Snapshot::new(&one_gpu(multi, true), &all_classes(), &[]).unwrap();
        assert!(place(&mut snap, &share("o1", SHARED, "10Gi", 60)).is_some());
        assert!(place(&mut snap, &share("o2", SHARED, "10Gi", 40)).is_some());
        // The GPU's compute is all online now: nothing online fits, whatever other classes say.
        assert!(place(&mut snap, &share("o3", SHARED, "10Gi", 5)).is_none());
        // Nor does batch compute, whatever its class's factor: beside online work the SM
        // percentages stay within 100 (MPS priority protects nothing, only SMs do).
        assert!(place(&mut snap, &share("b1", BATCH2, "10Gi", 50)).is_none());
        // A batch share without compute (not isolated) still fits.
        assert!(place(&mut snap, &share("b2", BATCH2, "10Gi", 0)).is_some());
    }
}

#[test]
fn beside_online_work_batch_compute_takes_only_what_online_leaves() {
    let mut snap = Snapshot::new(&one_gpu(true, false), &all_classes(), &[]).unwrap();
    place(&mut snap, &share("online", SHARED, "10Gi", 70)).unwrap();
    // 70 online + 35 batch would take SMs online was promised: refused.
    assert!(place(&mut snap, &share("b1", BATCH2, "10Gi", 35)).is_none());
    let b = place(&mut snap, &share("b2", BATCH2, "10Gi", 30)).unwrap();
    assert!(recorded_devices(&b)[0].get("guaranteedCompute").is_none());
    // And an online share does not join a GPU whose batch shares over-commit it.
    let mut batch_only = Snapshot::new(&one_gpu(true, false), &all_classes(), &[]).unwrap();
    place(&mut batch_only, &share("b1", BATCH2, "10Gi", 80)).unwrap();
    place(&mut batch_only, &share("b2", BATCH2, "10Gi", 60)).unwrap();
    assert!(place(&mut batch_only, &share("o", SHARED, "10Gi", 5)).is_none());
    // A rebuilt snapshot (a restarted controller) keeps the rule.
    let mut held = Vec::new();
    let mut rebuilt_from = Snapshot::new(&one_gpu(true, false), &all_classes(), &[]).unwrap();
    for (name, class, compute) in [("o", SHARED, 70), ("b", BATCH2, 30)] {
        let mut c = share(name, class, "10Gi", compute);
        let a = place(&mut rebuilt_from, &c).unwrap();
        c.status = Some(res::ResourceClaimStatus {
            allocation: Some(a),
            ..Default::default()
        });
        held.push(c);
    }
    let mut rebuilt = Snapshot::new(&one_gpu(true, false), &all_classes(), &held).unwrap();
    assert!(place(&mut rebuilt, &share("b3", BATCH2, "10Gi", 5)).is_none());
    // Once the online share is gone, batch over-commits among itself again.
    rebuilt.release(&claim_key(&held[0]));
    assert!(place(&mut rebuilt, &share("b3", BATCH2, "10Gi", 90)).is_some());
}

#[test]
fn batch_compute_is_over_committed_up_to_the_class_factor() {
    let mut snap = Snapshot::new(&one_gpu(true, false), &all_classes(), &[]).unwrap();
    place(&mut snap, &share("first", BATCH2, "10Gi", 60)).unwrap();
    let b1 = place(&mut snap, &share("b1", BATCH2, "10Gi", 80)).unwrap();
    // Guaranteed what the first left (40), the other 40 over-committed.
    let rec = &recorded_devices(&b1)[0];
    assert_eq!(rec["compute"], 80);
    assert_eq!(rec["guaranteedCompute"], 40);
    assert_eq!(rec["tier"], "batch");
    assert!(rec.get("guaranteedMemory").is_none(), "{rec}");
    // kube-scheduler sees only the guarantee: guaranteed batch = 100.
    assert_eq!(consumed(&b1, "compute").as_deref(), Some("40"));
    // 60 + 80 + 60 = 200 = 2 × 100: fits, all of it over-committed.
    let b2 = place(&mut snap, &share("b2", BATCH2, "10Gi", 60)).unwrap();
    assert_eq!(recorded_devices(&b2)[0]["guaranteedCompute"], 0);
    assert_eq!(consumed(&b2, "compute").as_deref(), Some("0"));
    // Beyond 2 × 100: refused.
    assert!(place(&mut snap, &share("b3", BATCH2, "10Gi", 5)).is_none());
    // A batch class without a factor over-commits nothing.
    let mut fresh = Snapshot::new(&one_gpu(true, false), &all_classes(), &[]).unwrap();
    place(&mut fresh, &share("first", BATCH2, "10Gi", 60)).unwrap();
    assert!(place(&mut fresh, &share("b1", BATCH1, "10Gi", 45)).is_none());
    let fits = place(&mut fresh, &share("b2", BATCH1, "10Gi", 40)).unwrap();
    assert!(
        recorded_devices(&fits)[0]
            .get("guaranteedCompute")
            .is_none()
    );
}

#[test]
fn a_claim_asking_batch_itself_gets_no_factor_from_a_class_without_one() {
    let mut snap = Snapshot::new(&one_gpu(true, false), &all_classes(), &[]).unwrap();
    place(&mut snap, &share("online", SHARED, "10Gi", 100)).unwrap();
    let mut c = share("self-batch", SHARED, "10Gi", 10);
    c.spec.devices.as_mut().unwrap().config.as_mut().unwrap()[0]
        .opaque
        .as_mut()
        .unwrap()
        .parameters
        .0["tier"] = json!("batch");
    assert!(place(&mut snap, &c).is_none());
    // And a claim cannot carry a factor of its own: GpuShare has no such field.
    let mut forged = share("forged", SHARED, "10Gi", 10);
    forged
        .spec
        .devices
        .as_mut()
        .unwrap()
        .config
        .as_mut()
        .unwrap()[0]
        .opaque
        .as_mut()
        .unwrap()
        .parameters
        .0["batchComputeOvercommit"] = json!(10);
    let err = alloc(Policy::FirstFit)
        .allocate(&snap, &[&forged], &[node("a")])
        .unwrap_err()
        .to_string();
    assert!(err.contains("batchComputeOvercommit"), "{err}");
}

#[test]
fn memory_is_over_committed_only_when_the_class_opts_in_and_the_node_backs_it() {
    // On hami-core whose probe did not hold (accepted or not), it does not apply either.
    for isolation in ["unverified", "unverified-accepted"] {
        let mut leaky =
            Snapshot::new(&one_gpu_probed(true, true, isolation), &all_classes(), &[]).unwrap();
        place(&mut leaky, &share("online", SHARED, "60Gi", 0)).unwrap();
        assert!(
            place(&mut leaky, &share("b", BATCH_MEM, "40Gi", 0)).is_none(),
            "{isolation}"
        );
    }
    // Without hami-core, the memory factor does not apply.
    let mut mps = Snapshot::new(&one_gpu(true, false), &all_classes(), &[]).unwrap();
    place(&mut mps, &share("online", SHARED, "60Gi", 0)).unwrap();
    assert!(place(&mut mps, &share("b", BATCH_MEM, "40Gi", 0)).is_none());
    // On hami-core, a class without a memory factor over-commits no memory.
    let mut hami = Snapshot::new(&one_gpu(true, true), &all_classes(), &[]).unwrap();
    place(&mut hami, &share("online", SHARED, "60Gi", 0)).unwrap();
    assert!(place(&mut hami, &share("b", BATCH2, "40Gi", 0)).is_none());
    // With both: guaranteed the free 20Gi, 20Gi over-committed, up to 1.5 × 80Gi = 120Gi.
    let b = place(&mut hami, &share("b", BATCH_MEM, "40Gi", 0)).unwrap();
    let rec = &recorded_devices(&b)[0];
    assert_eq!(rec["memory"], "40Gi");
    assert_eq!(rec["guaranteedMemory"], "20Gi");
    assert_eq!(consumed(&b, "memory").as_deref(), Some("20Gi"));
    assert!(place(&mut hami, &share("b2", BATCH_MEM, "21Gi", 0)).is_none());
    // The guarantee must be at least the policy's minimum (1Gi): a full GPU takes no more.
    let b2 = place(&mut hami, &share("b2", BATCH_MEM, "20Gi", 0));
    assert!(b2.is_none(), "nothing guaranteed is left: {b2:?}");
    // Online memory is never over-committed, even on hami-core.
    assert!(place(&mut hami, &share("o", SHARED, "1Gi", 0)).is_none());
}

#[test]
fn the_books_survive_a_rebuilt_snapshot_and_a_release() {
    let classes = all_classes();
    let mut snap = Snapshot::new(&one_gpu(true, false), &classes, &[]).unwrap();
    let mut held = Vec::new();
    for (name, class, compute) in [("o", BATCH2, 60), ("b1", BATCH2, 80), ("b2", BATCH2, 60)] {
        let mut c = share(name, class, "10Gi", compute);
        let a = place(&mut snap, &c).unwrap();
        c.status = Some(res::ResourceClaimStatus {
            allocation: Some(a),
            ..Default::default()
        });
        held.push(c);
    }
    // A controller that restarts reads the allocations back: the same books.
    let mut rebuilt = Snapshot::new(&one_gpu(true, false), &classes, &held).unwrap();
    assert!(place(&mut rebuilt, &share("b3", BATCH2, "10Gi", 5)).is_none());
    let usage = &rebuilt.device_usage()[0];
    assert_eq!(usage.compute_used, 100);
    assert_eq!(usage.compute_overcommitted, 100);
    // Releasing an over-committed share frees its over-commit.
    rebuilt.release(&claim_key(&held[2]));
    assert_eq!(rebuilt.device_usage()[0].compute_overcommitted, 40);
    assert!(place(&mut rebuilt, &share("b3", BATCH2, "10Gi", 60)).is_some());
    // What kube-scheduler sums (consumedCapacity) never passes the GPU's capacity.
    let sum: i64 = held
        .iter()
        .map(|c| {
            let a = c.status.as_ref().unwrap().allocation.as_ref().unwrap();
            consumed(a, "compute").unwrap().parse::<i64>().unwrap()
        })
        .sum();
    assert_eq!(sum, 100);
}

#[test]
fn two_batch_cards_of_one_pod_on_one_gpu_count_each_other() {
    // Two requests of one claim on the one GPU: the second sees the first's over-commit.
    let mut snap = Snapshot::new(&one_gpu(true, false), &all_classes(), &[]).unwrap();
    place(&mut snap, &share("first", BATCH2, "10Gi", 100)).unwrap();
    let mut c = claim("pair", vec![exact("a", BATCH2, 1), exact("b", BATCH2, 1)]);
    c = with_config(c, share_config("10Gi", Some(60)));
    assert!(
        place(&mut snap, &c).is_none(),
        "60 + 60 over-committed > 100"
    );
    let mut ok = claim("pair2", vec![exact("a", BATCH2, 1), exact("b", BATCH2, 1)]);
    ok = with_config(ok, share_config("10Gi", Some(50)));
    assert!(place(&mut snap, &ok).is_some());
}

#[test]
fn one_claims_shares_of_one_gpu_together_use_at_most_the_gpu() {
    // The node gives a claim one budget per GPU, the sum of its requests' shares there; a
    // factor of 3 leaves room for 60 + 60 in the GPU's books, but not in one budget of 100.
    const BATCH3: &str = "batch3.gpu.tessera.dev";
    let mut classes = all_classes();
    classes.push(batch_class(BATCH3, &json!({"batchComputeOvercommit": 3})));
    let pair = |name: &str, compute: i64| {
        with_config(
            claim(name, vec![exact("a", BATCH3, 1), exact("b", BATCH3, 1)]),
            share_config("10Gi", Some(compute)),
        )
    };
    let mut one = Snapshot::new(&one_gpu(true, false), &classes, &[]).unwrap();
    assert!(
        place(&mut one, &pair("over", 60)).is_none(),
        "60 + 60 > 100"
    );
    let fits = place(&mut one, &pair("within", 50)).unwrap();
    assert_eq!(devices_of(&fits), ["a/gpu-0", "a/gpu-0"]);
    // With a second GPU the two requests take one GPU each.
    let two = two_shared_gpus();
    let mut snap = Snapshot::new(&two, &classes, &[]).unwrap();
    let spread = place(&mut snap, &pair("over", 60)).unwrap();
    assert_eq!(devices_of(&spread), ["a/gpu-0", "a/gpu-1"]);
    // Memory likewise: two 50Gi shares of an 80Gi card are one 100Gi budget, even on
    // hami-core with a memory factor.
    let mut hami = Snapshot::new(&one_gpu(true, true), &classes, &[]).unwrap();
    let big = with_config(
        claim(
            "mem",
            vec![exact("a", BATCH_MEM, 1), exact("b", BATCH_MEM, 1)],
        ),
        share_config("50Gi", None),
    );
    assert!(place(&mut hami, &big).is_none(), "50Gi + 50Gi > 80Gi");
}

#[test]
fn batch_is_over_committed_only_where_it_fits_nowhere_without() {
    let slices = two_shared_gpus();
    let mut snap = Snapshot::new(&slices, &all_classes(), &[]).unwrap();
    let full = place(&mut snap, &share("first", BATCH2, "10Gi", 100)).unwrap();
    assert_eq!(devices_of(&full), ["a/gpu-0"]);
    // First-fit would take gpu-0 by over-committing it; the empty gpu-1 wins instead.
    let b = place(&mut snap, &share("b1", BATCH2, "10Gi", 100)).unwrap();
    assert_eq!(devices_of(&b), ["a/gpu-1"]);
    assert!(recorded_devices(&b)[0].get("guaranteedCompute").is_none());
    // Now nothing fits without over-commit: the next batch share over-commits.
    let b2 = place(&mut snap, &share("b2", BATCH2, "10Gi", 50)).unwrap();
    assert_eq!(recorded_devices(&b2)[0]["guaranteedCompute"], 0);
}
