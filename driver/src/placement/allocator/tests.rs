//! Unit tests of the allocator, one per semantic.

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1 as res;
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
use serde_json::json;

use super::*;
use crate::testing;

const D: &str = "gpu.tessera.dev";

use crate::testing::{
    cel_class as class, exact_request as exact, k8s_node as node, quantity as q, slice,
    string_attr as attr_s,
};

fn gpu(name: &str, sharing: &str, island: &str, multi: bool) -> res::Device {
    testing::gpu_device(
        name,
        &[
            ("sharing", sharing),
            ("nvlinkDomain", island),
            ("model", "a100-80g"),
        ],
        "80Gi",
        multi,
    )
}

/// Node `a` with two shared GPUs that allow multiple allocations, `gpu-0` and `gpu-1`.
fn two_shared_gpus() -> Vec<res::ResourceSlice> {
    vec![slice(
        "a-0",
        "a",
        vec![
            gpu("gpu-0", "shared", "x", true),
            gpu("gpu-1", "shared", "x", true),
        ],
    )]
}

fn classes() -> Vec<res::DeviceClass> {
    vec![
        class(
            "gpu.tessera.dev",
            r#"device.driver == "gpu.tessera.dev" && device.attributes["gpu.tessera.dev"].sharing == "exclusive""#,
        ),
        class(
            "shared.gpu.tessera.dev",
            r#"device.driver == "gpu.tessera.dev" && device.attributes["gpu.tessera.dev"].sharing == "shared""#,
        ),
        class(
            "broken",
            r#"device.attributes["gpu.tessera.dev"].nope == "x""#,
        ),
    ]
}

fn claim(name: &str, requests: Vec<res::DeviceRequest>) -> res::ResourceClaim {
    testing::claim(
        "default",
        name,
        &format!("uid-{name}"),
        res::DeviceClaim {
            requests: Some(requests),
            ..Default::default()
        },
    )
}

fn share_config(memory: &str, compute: Option<i64>) -> res::DeviceClaimConfiguration {
    let mut p = testing::gpu_share(memory);
    if let Some(c) = compute {
        p["compute"] = json!(c);
    }
    testing::opaque_config(p)
}

fn with_config(
    mut c: res::ResourceClaim,
    cfg: res::DeviceClaimConfiguration,
) -> res::ResourceClaim {
    c.spec
        .devices
        .as_mut()
        .unwrap()
        .config
        .get_or_insert_with(Vec::new)
        .push(cfg);
    c
}

fn exclusive_cluster() -> Vec<res::ResourceSlice> {
    vec![
        slice(
            "a-0",
            "a",
            vec![
                gpu("gpu-0", "exclusive", "x", false),
                gpu("gpu-1", "exclusive", "y", false),
                gpu("gpu-2", "exclusive", "x", false),
            ],
        ),
        slice(
            "b-0",
            "b",
            vec![
                gpu("gpu-0", "exclusive", "x", false),
                gpu("gpu-1", "exclusive", "x", false),
            ],
        ),
    ]
}

fn alloc(policy: Policy) -> Allocator {
    Allocator::new(AllocatorOptions {
        policy,
        ..AllocatorOptions::default()
    })
}

fn devices_of(a: &res::AllocationResult) -> Vec<String> {
    a.devices
        .as_ref()
        .unwrap()
        .results
        .iter()
        .flatten()
        .map(|r| format!("{}/{}", r.pool, r.device))
        .collect()
}

fn place(
    snap: &mut Snapshot,
    a: &Allocator,
    c: &res::ResourceClaim,
    nodes: &[Node],
) -> Result<Placement, Unsatisfiable> {
    let p = a.allocate(snap, &[c], nodes)?;
    snap.commit(c, &p.allocations[0]);
    Ok(p)
}

#[test]
fn first_fit_takes_devices_in_kube_scheduler_order_and_never_twice() {
    let mut snap = Snapshot::new(&exclusive_cluster(), &classes(), &[]).unwrap();
    let a = alloc(Policy::FirstFit);
    let nodes = [node("a"), node("b")];
    let mut got = Vec::new();
    for i in 0..5 {
        let p = place(
            &mut snap,
            &a,
            &claim(&format!("c{i}"), vec![exact("gpu", "gpu.tessera.dev", 1)]),
            &nodes,
        )
        .unwrap();
        got.extend(devices_of(&p.allocations[0]));
    }
    assert_eq!(got, ["a/gpu-0", "a/gpu-1", "a/gpu-2", "b/gpu-0", "b/gpu-1"]);
    let err = a
        .allocate(
            &snap,
            &[&claim("c5", vec![exact("gpu", "gpu.tessera.dev", 1)])],
            &nodes,
        )
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "claim default/c5 request gpu: no free device that matches: 5 devices matched the class, 5 in use"
    );
}

#[test]
fn node_local_results_select_their_node() {
    let snap = Snapshot::new(&exclusive_cluster(), &classes(), &[]).unwrap();
    let p = alloc(Policy::FirstFit)
        .allocate(
            &snap,
            &[&claim("c", vec![exact("gpu", "gpu.tessera.dev", 1)])],
            &[node("b")],
        )
        .unwrap();
    assert_eq!(p.node, "b");
    let sel = p.allocations[0].node_selector.as_ref().unwrap();
    let field = &sel.node_selector_terms[0].match_fields.as_ref().unwrap()[0];
    assert_eq!(
        (
            field.key.as_str(),
            field.values.as_ref().unwrap()[0].as_str()
        ),
        ("metadata.name", "b")
    );
    assert!(p.allocations[0].allocation_timestamp.is_none());
}

#[test]
fn only_the_newest_complete_generation_of_a_pool_counts() {
    let mut old = slice("a-old", "a", vec![gpu("gpu-9", "exclusive", "x", false)]);
    old.spec.pool.generation = 0;
    let mut partial = slice("b-0", "b", vec![gpu("gpu-0", "exclusive", "x", false)]);
    partial.spec.pool.resource_slice_count = 2;
    let slices = vec![
        old,
        slice("a-new", "a", vec![gpu("gpu-0", "exclusive", "x", false)]),
        partial,
    ];
    let snap = Snapshot::new(&slices, &classes(), &[]).unwrap();
    assert_eq!(snap.device_count(), 1);
    assert_eq!(snap.unusable_pools().len(), 1);
    let a = alloc(Policy::FirstFit);
    let p = a
        .allocate(
            &snap,
            &[&claim("c", vec![exact("gpu", "gpu.tessera.dev", 1)])],
            &[node("b"), node("a")],
        )
        .unwrap();
    assert_eq!(devices_of(&p.allocations[0]), ["a/gpu-0"]);
    let err = a
        .allocate(
            &snap,
            &[&claim("c", vec![exact("gpu", "gpu.tessera.dev", 1)])],
            &[node("b")],
        )
        .unwrap_err();
    assert!(err.to_string().contains("being updated"), "{err}");
}

#[test]
fn tainted_devices_need_a_toleration() {
    let mut d = gpu("gpu-0", "exclusive", "x", false);
    d.taints = Some(vec![res::DeviceTaint {
        key: "broken".into(),
        effect: "NoSchedule".into(),
        value: None,
        time_added: None,
    }]);
    let snap = Snapshot::new(&[slice("a-0", "a", vec![d])], &classes(), &[]).unwrap();
    let a = alloc(Policy::FirstFit);
    let plain = claim("c", vec![exact("gpu", "gpu.tessera.dev", 1)]);
    let err = a.allocate(&snap, &[&plain], &[node("a")]).unwrap_err();
    assert!(err.to_string().contains("1 tainted"), "{err}");
    let mut tolerant = exact("gpu", "gpu.tessera.dev", 1);
    tolerant.exactly.as_mut().unwrap().tolerations = Some(vec![res::DeviceToleration {
        key: Some("broken".into()),
        operator: Some("Exists".into()),
        ..Default::default()
    }]);
    let p = a
        .allocate(&snap, &[&claim("c", vec![tolerant])], &[node("a")])
        .unwrap();
    assert!(testing::results(&p.allocations[0])[0].tolerations.is_some());
}

#[test]
fn a_draining_gpu_takes_no_new_shares_unless_tolerated() {
    let mut draining = gpu("gpu-0", "shared", "x", false);
    draining.taints = Some(vec![res::DeviceTaint {
        key: crate::names::TAINT_DRAINING.into(),
        value: Some("exclusive".into()),
        effect: crate::names::TAINT_EFFECT_NO_SCHEDULE.into(),
        time_added: None,
    }]);
    let slices = vec![slice(
        "a-0",
        "a",
        vec![draining, gpu("gpu-1", "shared", "x", false)],
    )];
    let mut snap = Snapshot::new(&slices, &classes(), &[]).unwrap();
    let a = alloc(Policy::FirstFit);
    let share = |n: &str, request: res::DeviceRequest| {
        with_config(claim(n, vec![request]), share_config("40Gi", Some(50)))
    };
    let plain = || exact("gpu", "shared.gpu.tessera.dev", 1);
    // First fit would take gpu-0; its taint sends both shares to gpu-1.
    for name in ["s1", "s2"] {
        let p = place(&mut snap, &a, &share(name, plain()), &[node("a")]).unwrap();
        assert_eq!(devices_of(&p.allocations[0]), ["a/gpu-1"]);
    }
    let err = a
        .allocate(&snap, &[&share("s3", plain())], &[node("a")])
        .unwrap_err();
    assert!(err.to_string().contains("1 too full, 1 tainted"), "{err}");
    // As with kube-scheduler, a toleration of the key (any value) lets a claim in.
    let mut tolerant = plain();
    tolerant.exactly.as_mut().unwrap().tolerations = Some(vec![res::DeviceToleration {
        key: Some(crate::names::TAINT_DRAINING.into()),
        operator: Some("Exists".into()),
        effect: Some("NoSchedule".into()),
        ..Default::default()
    }]);
    let p = place(&mut snap, &a, &share("s4", tolerant), &[node("a")]).unwrap();
    assert_eq!(devices_of(&p.allocations[0]), ["a/gpu-0"]);
}

#[test]
fn first_available_falls_back_and_names_the_subrequest() {
    let snap = Snapshot::new(&exclusive_cluster(), &classes(), &[]).unwrap();
    let sub = |name: &str, class: &str, count| res::DeviceSubRequest {
        name: name.into(),
        device_class_name: class.into(),
        count: Some(count),
        ..Default::default()
    };
    let req = res::DeviceRequest {
        name: "gpus".into(),
        first_available: Some(vec![
            sub("eight", "gpu.tessera.dev", 8),
            sub("two", "gpu.tessera.dev", 2),
        ]),
        ..Default::default()
    };
    let p = alloc(Policy::FirstFit)
        .allocate(&snap, &[&claim("c", vec![req])], &[node("a")])
        .unwrap();
    let results = testing::results(&p.allocations[0]).to_vec();
    assert_eq!(results.len(), 2);
    assert!(results.iter().all(|r| r.request == "gpus/two"));
}

#[test]
fn match_attribute_keeps_devices_on_one_island_and_backtracks() {
    let snap = Snapshot::new(&exclusive_cluster(), &classes(), &[]).unwrap();
    let mut c = claim("c", vec![exact("gpus", "gpu.tessera.dev", 2)]);
    c.spec.devices.as_mut().unwrap().constraints = Some(vec![res::DeviceConstraint {
        match_attribute: Some("gpu.tessera.dev/nvlinkDomain".into()),
        ..Default::default()
    }]);
    let p = alloc(Policy::FirstFit)
        .allocate(&snap, &[&c], &[node("a")])
        .unwrap();
    assert_eq!(devices_of(&p.allocations[0]), ["a/gpu-0", "a/gpu-2"]);
    let mut d = claim("d", vec![exact("gpus", "gpu.tessera.dev", 2)]);
    d.spec.devices.as_mut().unwrap().constraints = Some(vec![res::DeviceConstraint {
        distinct_attribute: Some("gpu.tessera.dev/nvlinkDomain".into()),
        ..Default::default()
    }]);
    let p = alloc(Policy::FirstFit)
        .allocate(&snap, &[&d], &[node("a")])
        .unwrap();
    assert_eq!(devices_of(&p.allocations[0]), ["a/gpu-0", "a/gpu-1"]);
}

#[test]
fn an_unmeetable_constraint_is_named_in_the_reason() {
    let snap = Snapshot::new(&exclusive_cluster(), &classes(), &[]).unwrap();
    let mut c = claim("c", vec![exact("gpus", "gpu.tessera.dev", 3)]);
    c.spec.devices.as_mut().unwrap().constraints = Some(vec![res::DeviceConstraint {
        match_attribute: Some("gpu.tessera.dev/nvlinkDomain".into()),
        ..Default::default()
    }]);
    let err = alloc(Policy::FirstFit)
        .allocate(&snap, &[&c], &[node("a"), node("b")])
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "claim default/c request gpus: no 3 devices share one nvlinkDomain (at most 2 on one node)"
    );
    let short = alloc(Policy::FirstFit)
        .allocate(
            &snap,
            &[&claim("d", vec![exact("gpus", "gpu.tessera.dev", 4)])],
            &[node("a")],
        )
        .unwrap_err();
    assert_eq!(
        short.to_string(),
        "claim default/d request gpus: needs 4 free devices that match, found 3: 3 devices matched the class"
    );
}

#[test]
fn a_changed_candidate_list_is_never_read_through_a_stale_cache() {
    let snap = Snapshot::new(&exclusive_cluster(), &classes(), &[]).unwrap();
    for policy in Policy::ALL {
        let a = alloc(policy);
        // A failure makes the allocator remember the candidate list.
        a.allocate(
            &snap,
            &[&claim("big", vec![exact("gpus", "gpu.tessera.dev", 9)])],
            &[node("a"), node("b")],
        )
        .unwrap_err();
        let one = claim("one", vec![exact("gpu", "gpu.tessera.dev", 1)]);
        let p = a.allocate(&snap, &[&one], &[node("b")]).unwrap();
        assert_eq!(p.node, "b", "{policy}");
        let p = a
            .allocate(&snap, &[&one], &[node("none"), node("a")])
            .unwrap();
        assert_eq!(p.node, "a", "{policy}");
    }
}

#[test]
fn all_mode_takes_every_matching_device_or_nothing() {
    let mut snap = Snapshot::new(&exclusive_cluster(), &classes(), &[]).unwrap();
    let a = alloc(Policy::FirstFit);
    let mut all = exact("gpus", "gpu.tessera.dev", 1);
    all.exactly.as_mut().unwrap().allocation_mode = Some("All".into());
    all.exactly.as_mut().unwrap().count = None;
    let p = a
        .allocate(&snap, &[&claim("c", vec![all.clone()])], &[node("a")])
        .unwrap();
    assert_eq!(devices_of(&p.allocations[0]).len(), 3);
    place(
        &mut snap,
        &a,
        &claim("one", vec![exact("gpu", "gpu.tessera.dev", 1)]),
        &[node("a")],
    )
    .unwrap();
    assert!(
        a.allocate(&snap, &[&claim("c", vec![all])], &[node("a")])
            .is_err()
    );
}

#[test]
fn admin_access_consumes_nothing() {
    let mut snap = Snapshot::new(&exclusive_cluster(), &classes(), &[]).unwrap();
    let a = alloc(Policy::FirstFit);
    let mut admin = exact("gpu", "gpu.tessera.dev", 1);
    admin.exactly.as_mut().unwrap().admin_access = Some(true);
    let p = place(&mut snap, &a, &claim("admin", vec![admin]), &[node("b")]).unwrap();
    assert_eq!(
        testing::results(&p.allocations[0])[0].admin_access,
        Some(true)
    );
    let p = place(
        &mut snap,
        &a,
        &claim("c", vec![exact("gpu", "gpu.tessera.dev", 2)]),
        &[node("b")],
    )
    .unwrap();
    assert_eq!(devices_of(&p.allocations[0]), ["b/gpu-0", "b/gpu-1"]);
}

#[test]
fn class_then_claim_config_is_propagated() {
    let mut cls = classes();
    cls[0].spec.config = Some(vec![res::DeviceClassConfiguration {
        opaque: Some(res::OpaqueDeviceConfiguration {
            driver: "other".into(),
            parameters: RawExtension(json!({"a": 1})),
        }),
    }]);
    let snap = Snapshot::new(&exclusive_cluster(), &cls, &[]).unwrap();
    let cfg = res::DeviceClaimConfiguration {
        requests: Some(vec!["y".into()]),
        opaque: Some(res::OpaqueDeviceConfiguration {
            driver: "other".into(),
            parameters: RawExtension(json!({"b": 2})),
        }),
    };
    let c = with_config(
        claim(
            "c",
            vec![
                exact("x", "gpu.tessera.dev", 1),
                exact("y", "gpu.tessera.dev", 1),
            ],
        ),
        cfg,
    );
    let p = alloc(Policy::FirstFit)
        .allocate(&snap, &[&c], &[node("a")])
        .unwrap();
    let config = p.allocations[0]
        .devices
        .as_ref()
        .unwrap()
        .config
        .clone()
        .unwrap();
    assert_eq!(config.len(), 2);
    assert_eq!(
        (
            config[0].source.as_str(),
            config[0].requests.clone().unwrap()
        ),
        ("FromClass", vec!["x".to_owned(), "y".to_owned()])
    );
    assert_eq!(
        (
            config[1].source.as_str(),
            config[1].requests.clone().unwrap()
        ),
        ("FromClaim", vec!["y".to_owned()])
    );
}

#[test]
fn opaque_shares_pack_a_shared_gpu_without_consumable_capacity() {
    let slices = vec![slice("a-0", "a", vec![gpu("gpu-0", "shared", "x", false)])];
    let mut snap = Snapshot::new(&slices, &classes(), &[]).unwrap();
    let a = alloc(Policy::FirstFit);
    let share = |n: &str, mem: &str| {
        with_config(
            claim(n, vec![exact("gpu", "shared.gpu.tessera.dev", 1)]),
            share_config(mem, Some(50)),
        )
    };
    let p = place(&mut snap, &a, &share("s1", "30Gi"), &[node("a")]).unwrap();
    let result = &p.allocations[0].devices.as_ref().unwrap();
    assert!(result.results.as_ref().unwrap()[0].share_id.is_none());
    let record = result.config.as_ref().unwrap().last().unwrap();
    assert_eq!(record.source, "FromClaim");
    assert_eq!(record.requests.as_deref(), Some(&["gpu".to_owned()][..]));
    let params = &record.opaque.as_ref().unwrap().parameters.0;
    assert_eq!(params["kind"], "AllocatedShares");
    assert_eq!(params["devices"][0]["memory"], "30Gi");
    place(&mut snap, &a, &share("s2", "40Gi"), &[node("a")]).unwrap();
    let err = a
        .allocate(&snap, &[&share("s3", "20Gi")], &[node("a")])
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "claim default/s3 request gpu: no GPU with 20Gi free and 50% compute: 1 GPU matched the class, 1 too full"
    );
    snap.release("uid-s1");
    place(&mut snap, &a, &share("s3", "20Gi"), &[node("a")]).unwrap();
}

#[test]
fn native_capacity_shares_record_consumed_capacity_and_share_id() {
    let slices = two_shared_gpus();
    let mut snap = Snapshot::new(&slices, &classes(), &[]).unwrap();
    let a = alloc(Policy::FirstFit);
    let mut req = exact("gpu", "shared.gpu.tessera.dev", 1);
    req.exactly.as_mut().unwrap().capacity = Some(res::CapacityRequirements {
        requests: Some(
            [
                ("memory".to_owned(), q("50Gi")),
                ("compute".to_owned(), q("30")),
            ]
            .into(),
        ),
    });
    let p = place(&mut snap, &a, &claim("s1", vec![req.clone()]), &[node("a")]).unwrap();
    let r = &testing::results(&p.allocations[0])[0];
    assert!(r.share_id.is_some());
    let cc = r.consumed_capacity.as_ref().unwrap();
    assert_eq!(
        (cc["memory"].0.as_str(), cc["compute"].0.as_str()),
        ("50Gi", "30")
    );
    let p = place(&mut snap, &a, &claim("s2", vec![req.clone()]), &[node("a")]).unwrap();
    assert_eq!(
        devices_of(&p.allocations[0]),
        ["a/gpu-1"],
        "gpu-0 has only 30Gi left"
    );
    // Binpack puts a small share on the fuller GPU.
    req.exactly.as_mut().unwrap().capacity = Some(res::CapacityRequirements {
        requests: Some([("memory".to_owned(), q("10Gi"))].into()),
    });
    let p = alloc(Policy::Binpack)
        .allocate(&snap, &[&claim("s3", vec![req])], &[node("a")])
        .unwrap();
    assert_eq!(devices_of(&p.allocations[0]).len(), 1);
    let bad = with_config(
        claim("bad", vec![exact("gpu", "shared.gpu.tessera.dev", 3)]),
        share_config("10Gi", None),
    );
    let err = a.allocate(&snap, &[&bad], &[node("a")]).unwrap_err();
    assert!(
        err.to_string()
            .contains("not a whole number of GiB per card"),
        "{err}"
    );
}

#[test]
fn multi_card_shares_use_distinct_gpus_on_one_node() {
    let slices = vec![slice(
        "a-0",
        "a",
        vec![
            gpu("gpu-0", "shared", "x", false),
            gpu("gpu-1", "shared", "x", false),
        ],
    )];
    let snap = Snapshot::new(&slices, &classes(), &[]).unwrap();
    let c = with_config(
        claim("c", vec![exact("gpu", "shared.gpu.tessera.dev", 2)]),
        share_config("20Gi", Some(100)),
    );
    let p = alloc(Policy::FirstFit)
        .allocate(&snap, &[&c], &[node("a")])
        .unwrap();
    assert_eq!(devices_of(&p.allocations[0]), ["a/gpu-0", "a/gpu-1"]);
    let params = &p.allocations[0]
        .devices
        .as_ref()
        .unwrap()
        .config
        .as_ref()
        .unwrap()
        .last()
        .unwrap()
        .opaque
        .as_ref()
        .unwrap()
        .parameters
        .0;
    assert_eq!(params["devices"][1]["memory"], "10Gi");
    assert_eq!(params["devices"][1]["compute"], 50);
    let c3 = with_config(
        claim("c", vec![exact("gpu", "shared.gpu.tessera.dev", 3)]),
        share_config("3Gi", None),
    );
    assert!(
        alloc(Policy::FirstFit)
            .allocate(&snap, &[&c3], &[node("a")])
            .is_err()
    );
}

#[test]
fn binpack_and_spread_choose_opposite_nodes() {
    let slices = vec![
        slice(
            "a-0",
            "a",
            vec![
                gpu("gpu-0", "exclusive", "x", false),
                gpu("gpu-1", "exclusive", "x", false),
            ],
        ),
        slice(
            "b-0",
            "b",
            vec![
                gpu("gpu-0", "exclusive", "x", false),
                gpu("gpu-1", "exclusive", "x", false),
            ],
        ),
    ];
    let mut snap = Snapshot::new(&slices, &classes(), &[]).unwrap();
    let nodes = [node("a"), node("b")];
    place(
        &mut snap,
        &alloc(Policy::FirstFit),
        &claim("first", vec![exact("gpu", "gpu.tessera.dev", 1)]),
        &[node("b")],
    )
    .unwrap();
    let c = claim("c", vec![exact("gpu", "gpu.tessera.dev", 1)]);
    assert_eq!(
        alloc(Policy::Binpack)
            .allocate(&snap, &[&c], &nodes)
            .unwrap()
            .node,
        "b"
    );
    assert_eq!(
        alloc(Policy::Spread)
            .allocate(&snap, &[&c], &nodes)
            .unwrap()
            .node,
        "a"
    );
    assert_eq!(
        alloc(Policy::FirstFit)
            .allocate(&snap, &[&c], &nodes)
            .unwrap()
            .node,
        "a"
    );
}

#[test]
fn a_pods_claims_land_on_one_node() {
    let snap = Snapshot::new(&exclusive_cluster(), &classes(), &[]).unwrap();
    let c1 = claim("c1", vec![exact("gpu", "gpu.tessera.dev", 2)]);
    let c2 = claim("c2", vec![exact("gpu", "gpu.tessera.dev", 2)]);
    let err = alloc(Policy::FirstFit)
        .allocate(&snap, &[&c1, &c2], &[node("a"), node("b")])
        .unwrap_err();
    assert!(
        matches!(err.failures[0].kind, FailureKind::NotTogether),
        "{err}"
    );
    let c2 = claim("c2", vec![exact("gpu", "gpu.tessera.dev", 1)]);
    let p = alloc(Policy::FirstFit)
        .allocate(&snap, &[&c1, &c2], &[node("b"), node("a")])
        .unwrap();
    assert_eq!(p.node, "a");
    assert_eq!(p.allocations.len(), 2);
}

#[test]
fn cel_runtime_errors_and_missing_classes_are_reasons_not_panics() {
    let snap = Snapshot::new(&exclusive_cluster(), &classes(), &[]).unwrap();
    let a = alloc(Policy::FirstFit);
    let err = a
        .allocate(
            &snap,
            &[&claim("c", vec![exact("gpu", "broken", 1)])],
            &[node("a")],
        )
        .unwrap_err();
    // As in kube-scheduler, a selector's runtime error aborts the attempt (the pod is
    // retried); it is never read as "does not match".
    assert!(
        matches!(&err.failures[0].kind, FailureKind::Aborted { node, error }
            if node == "a" && error.contains("nope")),
        "{err}"
    );
    let err = a
        .allocate(
            &snap,
            &[&claim("c", vec![exact("gpu", "nope", 1)])],
            &[node("a")],
        )
        .unwrap_err();
    assert!(
        err.to_string().contains("device class nope not found"),
        "{err}"
    );
}

#[test]
fn allocated_claims_count_as_used_and_release_frees_them() {
    let a = alloc(Policy::FirstFit);
    let snap = Snapshot::new(&exclusive_cluster(), &classes(), &[]).unwrap();
    let mut c = claim("held", vec![exact("gpu", "gpu.tessera.dev", 3)]);
    let p = a.allocate(&snap, &[&c], &[node("a")]).unwrap();
    c.status = Some(res::ResourceClaimStatus {
        allocation: Some(p.allocations[0].clone()),
        ..Default::default()
    });
    let mut snap = Snapshot::new(&exclusive_cluster(), &classes(), &[c]).unwrap();
    let one = claim("one", vec![exact("gpu", "gpu.tessera.dev", 1)]);
    assert!(a.allocate(&snap, &[&one], &[node("a")]).is_err());
    snap.release("uid-held");
    assert!(a.allocate(&snap, &[&one], &[node("a")]).is_ok());
}

#[test]
fn shared_counters_are_never_exceeded() {
    let mut s = slice("a-0", "a", vec![]);
    s.spec.shared_counters = Some(vec![res::CounterSet {
        name: "gpu-0".into(),
        counters: [("memory".to_owned(), res::Counter { value: q("80Gi") })].into(),
    }]);
    let part = |name: &str, mem: &str| {
        let mut d = gpu(name, "exclusive", "x", false);
        d.consumes_counters = Some(vec![res::DeviceCounterConsumption {
            counter_set: "gpu-0".into(),
            counters: [("memory".to_owned(), res::Counter { value: q(mem) })].into(),
        }]);
        d
    };
    s.spec.devices = Some(vec![
        part("whole", "80Gi"),
        part("half-0", "40Gi"),
        part("half-1", "40Gi"),
    ]);
    let mut snap = Snapshot::new(&[s], &classes(), &[]).unwrap();
    let a = alloc(Policy::FirstFit);
    let p = place(
        &mut snap,
        &a,
        &claim("c1", vec![exact("gpu", "gpu.tessera.dev", 1)]),
        &[node("a")],
    )
    .unwrap();
    assert_eq!(devices_of(&p.allocations[0]), ["a/whole"]);
    let err = a
        .allocate(
            &snap,
            &[&claim("c2", vec![exact("gpu", "gpu.tessera.dev", 1)])],
            &[node("a")],
        )
        .unwrap_err();
    assert!(err.to_string().contains("out of shared counters"), "{err}");
    snap.release("uid-c1");
    let p = a
        .allocate(
            &snap,
            &[&claim("c2", vec![exact("gpu", "gpu.tessera.dev", 2)])],
            &[node("a")],
        )
        .unwrap();
    assert_eq!(devices_of(&p.allocations[0]), ["a/half-0", "a/half-1"]);
}

#[test]
fn a_tiny_step_budget_is_a_search_limit_reason() {
    let snap = Snapshot::new(&exclusive_cluster(), &classes(), &[]).unwrap();
    let a = Allocator::new(AllocatorOptions {
        max_steps: 2,
        ..AllocatorOptions::default()
    });
    let err = a
        .allocate(
            &snap,
            &[&claim("c", vec![exact("gpu", "gpu.tessera.dev", 3)])],
            &[node("a")],
        )
        .unwrap_err();
    assert!(err.to_string().contains("search limit"), "{err}");
}

#[test]
fn validation_and_allocation_apply_the_same_share_rule() {
    let c = with_config(
        claim("c", vec![exact("gpu", "shared.gpu.tessera.dev", 3)]),
        share_config("10Gi", None),
    );
    let known = classes();
    let lookup = |name: &str| {
        known
            .iter()
            .find(|k| k.metadata.name.as_deref() == Some(name))
            .cloned()
    };
    let errors = crate::rules::validation::validate_claim_spec(
        "ResourceClaim default/c",
        &c.spec,
        D,
        &[names::CLASS_SHARED_GPU],
        &lookup,
        &crate::rules::cel::CelCache::new(),
    );
    assert_eq!(errors.len(), 1);
    assert!(
        errors[0].to_string().contains("memory 10Gi over 3 cards"),
        "{}",
        errors[0]
    );
    let snap = Snapshot::new(&[], &known, &[]).unwrap();
    let err = Allocator::new(AllocatorOptions::default())
        .allocate(&snap, &[&c], &[node("a")])
        .unwrap_err();
    assert!(
        err.to_string().contains("memory 10Gi over 3 cards"),
        "{err}"
    );
}

/// The `AllocatedShares` record of an allocation: its devices' JSON.
fn recorded_devices(a: &res::AllocationResult) -> Vec<serde_json::Value> {
    let configs = a.devices.as_ref().unwrap().config.as_ref().unwrap();
    let record = configs
        .iter()
        .find(|c| c.opaque.as_ref().unwrap().parameters.0["kind"] == "AllocatedShares")
        .unwrap();
    record.opaque.as_ref().unwrap().parameters.0["devices"]
        .as_array()
        .unwrap()
        .clone()
}

#[test]
fn the_record_carries_the_tier_from_the_claim_or_the_class() {
    let slices = vec![slice(
        "a-0",
        "a",
        vec![
            gpu("gpu-0", "shared", "x", false),
            gpu("gpu-1", "shared", "x", true),
        ],
    )];
    let mut batch_class = class(
        "batch.gpu.tessera.dev",
        r#"device.driver == "gpu.tessera.dev" && device.attributes["gpu.tessera.dev"].sharing == "shared""#,
    );
    batch_class.spec.config = Some(vec![res::DeviceClassConfiguration {
        opaque: Some(res::OpaqueDeviceConfiguration {
            driver: D.into(),
            parameters: RawExtension(json!({
                "apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "TierPolicy",
                "tier": "batch", "allowOnline": false
            })),
        }),
    }]);
    let mut all = classes();
    all.push(batch_class);
    let snap = Snapshot::new(&slices, &all, &[]).unwrap();
    let a = alloc(Policy::FirstFit);
    let tiered = |class: &str, tier: Option<&str>| {
        let mut cfg = share_config("4Gi", Some(10));
        if let Some(t) = tier {
            cfg.opaque.as_mut().unwrap().parameters.0["tier"] = json!(t);
        }
        with_config(claim("c", vec![exact("gpu", class, 1)]), cfg)
    };
    let tier_of = |c: &res::ResourceClaim| {
        let p = a.allocate(&snap, &[c], &[node("a")]).unwrap();
        recorded_devices(&p.allocations[0])[0].get("tier").cloned()
    };
    // Online is the default and is left out of the record, as before tiers.
    assert_eq!(tier_of(&tiered("shared.gpu.tessera.dev", None)), None);
    assert_eq!(
        tier_of(&tiered("shared.gpu.tessera.dev", Some("batch"))),
        Some(json!("batch"))
    );
    assert_eq!(
        tier_of(&tiered("batch.gpu.tessera.dev", None)),
        Some(json!("batch"))
    );
    // The class forbids online: the claim cannot raise itself.
    let err = a
        .allocate(
            &snap,
            &[&tiered("batch.gpu.tessera.dev", Some("online"))],
            &[node("a")],
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("allowOnline: false"), "{err}");
    // A capacity.requests share of the batch class is batch too. (On gpu-0, which does not
    // allow multiple allocations, capacity requests take the whole GPU, as kube-scheduler
    // allocates them: the share is looked for on gpu-1 alone.)
    let snap = Snapshot::new(
        &[slice("a-1", "a", vec![gpu("gpu-1", "shared", "x", true)])],
        &all,
        &[],
    )
    .unwrap();
    let mut req = exact("gpu", "batch.gpu.tessera.dev", 1);
    req.exactly.as_mut().unwrap().capacity = Some(res::CapacityRequirements {
        requests: Some([("memory".to_owned(), q("4Gi"))].into()),
    });
    let p = a
        .allocate(&snap, &[&claim("cap", vec![req])], &[node("a")])
        .unwrap();
    let rec = recorded_devices(&p.allocations[0]);
    assert_eq!(rec[0]["tier"], "batch");
}

#[test]
fn a_device_that_allows_multiple_allocations_is_shareable_without_the_sharing_attribute() {
    let bare = |name: &str| {
        let mut d = gpu(name, "", "x", true);
        d.attributes.as_mut().unwrap().remove("sharing");
        d
    };
    let slices = vec![slice("a-0", "a", vec![bare("gpu-0")])];
    let classes = vec![class("any", r#"device.driver == "gpu.tessera.dev""#)];
    let mut snap = Snapshot::new(&slices, &classes, &[]).unwrap();
    let a = alloc(Policy::FirstFit);
    // A GpuShare (Tessera's own form) and a native capacity request both share the GPU.
    let opaque = with_config(
        claim("s1", vec![exact("gpu", "any", 1)]),
        share_config("20Gi", Some(30)),
    );
    let p = place(&mut snap, &a, &opaque, &[node("a")]).unwrap();
    assert_eq!(devices_of(&p.allocations[0]), ["a/gpu-0"]);
    let mut req = exact("gpu", "any", 1);
    req.exactly.as_mut().unwrap().capacity = Some(res::CapacityRequirements {
        requests: Some([("memory".to_owned(), q("40Gi"))].into()),
    });
    let p = place(&mut snap, &a, &claim("s2", vec![req]), &[node("a")]).unwrap();
    assert_eq!(devices_of(&p.allocations[0]), ["a/gpu-0"]);
    // 60Gi of 80Gi are booked: a 30Gi share no longer fits, for lack of room, not of sharing.
    let err = a
        .allocate(
            &snap,
            &[&with_config(
                claim("s3", vec![exact("gpu", "any", 1)]),
                share_config("30Gi", None),
            )],
            &[node("a")],
        )
        .unwrap_err();
    assert!(err.to_string().contains("1 too full"), "{err}");
}

/// An 8 x A100 node: NVLink islands gpu-0..3 and gpu-4..7, NUMA nodes 0 and 1 likewise.
fn eight_gpu_node() -> Vec<res::ResourceSlice> {
    let devices = (0..8)
        .map(|i| {
            let half = if i < 4 { "0" } else { "1" };
            let mut d = gpu(
                &format!("gpu-{i}"),
                "exclusive",
                &format!("island-{half}"),
                false,
            );
            let attrs = d.attributes.as_mut().unwrap();
            attrs.insert("numaNode".to_owned(), attr_s(half));
            attrs.insert(
                "index".to_owned(),
                res::DeviceAttribute {
                    int: Some(i),
                    ..Default::default()
                },
            );
            d
        })
        .collect();
    vec![slice("a-0", "a", devices)]
}

#[test]
fn a_multi_gpu_claim_prefers_one_island_of_free_gpus_under_every_policy() {
    for policy in Policy::ALL {
        let mut snap = Snapshot::new(&eight_gpu_node(), &classes(), &[]).unwrap();
        let a = alloc(policy);
        let busy = place(
            &mut snap,
            &alloc(Policy::FirstFit),
            &claim("busy", vec![exact("gpu", "gpu.tessera.dev", 3)]),
            &[node("a")],
        )
        .unwrap();
        assert_eq!(
            devices_of(&busy.allocations[0]),
            ["a/gpu-0", "a/gpu-1", "a/gpu-2"]
        );
        let p = a
            .allocate(
                &snap,
                &[&claim("two", vec![exact("gpu", "gpu.tessera.dev", 2)])],
                &[node("a")],
            )
            .unwrap();
        let got = devices_of(&p.allocations[0]);
        if policy == Policy::FirstFit {
            // first-fit is kube-scheduler's device order, device for device.
            assert_eq!(got, ["a/gpu-3", "a/gpu-4"]);
        } else {
            let island: Vec<bool> = got
                .iter()
                .map(|d| ["a/gpu-4", "a/gpu-5", "a/gpu-6", "a/gpu-7"].contains(&d.as_str()))
                .collect();
            assert_eq!(island, [true, true], "{policy:?} picked {got:?}");
        }
    }
}

#[test]
fn without_an_island_a_multi_gpu_claim_prefers_one_numa_node() {
    // Islands of two (0-1, 2-3, 4-5, 6-7); gpu-0, gpu-2 and gpu-4 busy: no island has two free
    // GPUs but NUMA node 1 (gpu-5, gpu-6, gpu-7) does.
    let mut slices = eight_gpu_node();
    for (i, d) in slices[0]
        .spec
        .devices
        .as_mut()
        .unwrap()
        .iter_mut()
        .enumerate()
    {
        d.attributes.as_mut().unwrap().insert(
            "nvlinkDomain".to_owned(),
            attr_s(&format!("pair-{}", i / 2)),
        );
    }
    for policy in Policy::ALL.into_iter().filter(|p| *p != Policy::FirstFit) {
        let mut snap = Snapshot::new(&slices, &classes(), &[]).unwrap();
        for (n, dev) in [0, 2, 4].into_iter().enumerate() {
            let mut c = claim(
                &format!("busy{n}"),
                vec![exact("gpu", "gpu.tessera.dev", 1)],
            );
            c.spec.devices.as_mut().unwrap().requests.as_mut().unwrap()[0]
                .exactly
                .as_mut()
                .unwrap()
                .selectors = Some(vec![res::DeviceSelector {
                cel: Some(res::CELDeviceSelector {
                    expression: format!(r#"device.attributes["gpu.tessera.dev"].index == {dev}"#),
                }),
            }]);
            let one = place(&mut snap, &alloc(Policy::FirstFit), &c, &[node("a")]).unwrap();
            assert_eq!(devices_of(&one.allocations[0]), [format!("a/gpu-{dev}")]);
        }
        let p = alloc(policy)
            .allocate(
                &snap,
                &[&claim("two", vec![exact("gpu", "gpu.tessera.dev", 2)])],
                &[node("a")],
            )
            .unwrap();
        let got = devices_of(&p.allocations[0]);
        let numa1 = got
            .iter()
            .all(|d| ["a/gpu-5", "a/gpu-6", "a/gpu-7"].contains(&d.as_str()));
        assert!(numa1, "{policy:?} picked {got:?}");
    }
}

mod invariants;
mod kube_exact;
mod overcommit;

#[test]
fn a_multi_allocatable_device_without_capacities_takes_every_claim_each_with_its_share() {
    // As kube-scheduler 1.36: each allocation gets its own shareID and consumes nothing.
    let device = res::Device {
        name: "nic-0".into(),
        allow_multiple_allocations: Some(true),
        ..Default::default()
    };
    // Another driver's device: Tessera's own GPUs record their shares in their config.
    let mut nics = slice("nics", "a", vec![device]);
    nics.spec.driver = "nic.example.com".into();
    let nics = vec![nics];
    let class = class("nic", r#"device.driver == "nic.example.com""#);
    let a = alloc(Policy::FirstFit);
    let mut snap = Snapshot::new(&nics, std::slice::from_ref(&class), &[]).unwrap();
    let mut shares = std::collections::BTreeSet::new();
    for name in ["one", "two", "three"] {
        let c = claim(name, vec![exact("nic", "nic", 1)]);
        let p = place(&mut snap, &a, &c, &[node("a")]).unwrap();
        let result = &p.allocations[0]
            .devices
            .as_ref()
            .unwrap()
            .results
            .as_ref()
            .unwrap()[0];
        assert_eq!(result.device, "nic-0");
        shares.insert(result.share_id.clone().unwrap());
    }
    assert_eq!(shares.len(), 3);
}
