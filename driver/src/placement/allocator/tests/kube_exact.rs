//! Where a claim uses only Kubernetes features, the allocator decides as kube-scheduler 1.36.2
//! does (`k8s.io/dynamic-resource-allocation/structured/internal/experimental`, with every DRA
//! feature on). Each test states one rule and names the upstream function it mirrors; the
//! first ten are the disagreements of issue 31, the rest rules a fixed list of cases misses.

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1 as res;
use serde_json::{Value, json};

use super::super::*;
use crate::testing::{self, k8s_node as node};

const D: &str = "gpu.tessera.dev";

/// A device of Tessera's driver from its JSON (`name`, `attributes`, `capacity`, ...).
fn device(v: Value) -> res::Device {
    serde_json::from_value(v).unwrap()
}

/// The one slice of pool `node` on `node`, that pool being `count` slices long.
fn pool(node: &str, count: i64, devices: Vec<res::Device>) -> res::ResourceSlice {
    let mut s = testing::slice(&format!("{node}-0"), node, devices);
    s.spec.pool.resource_slice_count = count;
    s
}

/// A GPU with string attributes, memory and compute without request policies.
fn exclusive_gpu(name: &str, attributes: &Value) -> res::Device {
    device(json!({
        "name": name,
        "attributes": attributes,
        "capacity": {"memory": {"value": "80Gi"}, "compute": {"value": "100"}},
    }))
}

/// A GPU that allows multiple allocations, with the capacities given.
fn multi_gpu(name: &str, capacity: &Value) -> res::Device {
    device(json!({
        "name": name,
        "attributes": {"type": {"string": "gpu"}, "sharing": {"string": "shared"}},
        "allowMultipleAllocations": true,
        "capacity": capacity,
    }))
}

/// Memory with Tessera's shipped policy (default 1Gi, from 1Gi in steps of 1Gi) and compute
/// from 0 in steps of 5 (default 0): a shared GPU as the plugin publishes it.
fn shipped_capacity(memory: &str) -> Value {
    json!({
        "memory": {"value": memory, "requestPolicy": {
            "default": "1Gi", "validRange": {"min": "1Gi", "step": "1Gi"}}},
        "compute": {"value": "100", "requestPolicy": {
            "default": "0", "validRange": {"min": "0", "max": "100", "step": "5"}}},
    })
}

fn class(name: &str, expression: &str) -> res::DeviceClass {
    testing::cel_class(name, expression)
}

/// `gpus`: every device of Tessera's driver.
fn gpus_class() -> res::DeviceClass {
    class("gpus", &format!(r#"device.driver == "{D}""#))
}

fn request(name: &str, exactly: &Value) -> res::DeviceRequest {
    serde_json::from_value(json!({"name": name, "exactly": exactly})).unwrap()
}

fn claim(name: &str, requests: &[res::DeviceRequest], extra: Value) -> res::ResourceClaim {
    let mut devices = json!({"requests": requests});
    if let Value::Object(more) = extra {
        for (k, v) in more {
            devices[k] = v;
        }
    }
    testing::claim(
        "default",
        name,
        &format!("uid-{name}"),
        serde_json::from_value(devices).unwrap(),
    )
}

fn first_fit() -> Allocator {
    Allocator::new(AllocatorOptions::default())
}

fn allocate(
    slices: &[res::ResourceSlice],
    classes: &[res::DeviceClass],
    claims: &[&res::ResourceClaim],
    nodes: &[Node],
) -> Result<Placement, Unsatisfiable> {
    let snap = Snapshot::new(slices, classes, &[]).unwrap();
    first_fit().allocate(&snap, claims, nodes)
}

fn results(a: &res::AllocationResult) -> &[res::DeviceRequestAllocationResult] {
    testing::results(a)
}

fn devices(a: &res::AllocationResult) -> Vec<String> {
    results(a)
        .iter()
        .map(|r| format!("{}/{}", r.request, r.device))
        .collect()
}

fn consumed(r: &res::DeviceRequestAllocationResult) -> Vec<(String, String)> {
    r.consumed_capacity
        .iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.0.clone()))
        .collect()
}

fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// The `AllocatedShares` record's devices, or none.
fn recorded(a: &res::AllocationResult) -> Vec<Value> {
    a.devices
        .as_ref()
        .and_then(|d| d.config.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|c| c.opaque.as_ref())
        .filter(|o| o.parameters.0["kind"] == "AllocatedShares")
        .flat_map(|o| {
            o.parameters.0["devices"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect()
}

fn aborted_on(err: &Unsatisfiable) -> Option<(&str, &str)> {
    err.failures.iter().find_map(|f| match &f.kind {
        FailureKind::Aborted { node, error } => Some((node.as_str(), error.as_str())),
        _ => None,
    })
}

// --- Tessera allocated what kube-scheduler refuses ---------------------------------------

/// Issue 31, item 1: One request never gets one device twice, even a device that allows multiple
/// allocations: `allocateOne` looks for a request's next device only after the one it took
/// last (its `startLocation`). Two requests of one claim may each take a share of it.
#[test]
fn one_request_never_takes_a_multi_allocatable_gpu_twice() {
    let slices = [pool("a", 1, vec![multi_gpu("gpu-0", &json!({}))])];
    let classes = [gpus_class()];
    let two = claim(
        "two",
        &[request(
            "gpu",
            &json!({"deviceClassName": "gpus", "count": 2}),
        )],
        json!({}),
    );
    let err = allocate(&slices, &classes, &[&two], &[node("a")]).unwrap_err();
    assert!(
        err.to_string()
            .contains("needs 2 free devices that match, found 1"),
        "{err}"
    );
    let each = claim(
        "each",
        &[
            request("one", &json!({"deviceClassName": "gpus"})),
            request("other", &json!({"deviceClassName": "gpus"})),
        ],
        json!({}),
    );
    let p = allocate(&slices, &classes, &[&each], &[node("a")]).unwrap();
    assert_eq!(devices(&p.allocations[0]), ["one/gpu-0", "other/gpu-0"]);
    let ids: std::collections::BTreeSet<_> = results(&p.allocations[0])
        .iter()
        .map(|r| r.share_id.clone().unwrap())
        .collect();
    assert_eq!(ids.len(), 2, "each share has its own shareID");
}

/// Issue 31, item 2: A device that does not declare every capacity a request asks for does not fit it:
/// `CmpRequestOverCapacity` refuses it ("some requested capacity has not been defined") and
/// `allocateOne` goes on to the next device; it is not an error.
#[test]
fn a_gpu_that_lacks_a_requested_capacity_does_not_fit() {
    let memory_only = multi_gpu(
        "gpu-0",
        &json!({"memory": {"value": "80Gi", "requestPolicy": {
            "default": "1Gi", "validRange": {"min": "1Gi", "step": "1Gi"}}}}),
    );
    let both = multi_gpu("gpu-1", &shipped_capacity("80Gi"));
    let ask = claim(
        "c",
        &[request(
            "gpu",
            &json!({"deviceClassName": "gpus",
                   "capacity": {"requests": {"memory": "10Gi", "compute": "50"}}}),
        )],
        json!({}),
    );
    let classes = [gpus_class()];
    let p = allocate(
        &[pool("a", 1, vec![memory_only.clone(), both])],
        &classes,
        &[&ask],
        &[node("a")],
    )
    .unwrap();
    assert_eq!(devices(&p.allocations[0]), ["gpu/gpu-1"]);
    let err = allocate(
        &[pool("a", 1, vec![memory_only])],
        &classes,
        &[&ask],
        &[node("a")],
    )
    .unwrap_err();
    assert!(aborted_on(&err).is_none(), "{err}");
    assert!(
        err.to_string()
            .contains("1 without a capacity the request asks for"),
        "{err}"
    );
    assert!(!err.to_string().contains("too full"), "{err}");
}

/// Issue 31, item 3: A capacity the request does not name, without a request policy default, is consumed
/// whole: `calculateConsumedCapacity` falls back to `fillEmptyRequest`, which returns the
/// capacity's value. A second request of the same claim then finds none of it left.
#[test]
fn an_unrequested_capacity_without_a_default_is_consumed_whole() {
    let gpu = multi_gpu(
        "gpu-0",
        &json!({
            "memory": {"value": "80Gi", "requestPolicy": {
                "default": "1Gi", "validRange": {"min": "1Gi", "step": "1Gi"}}},
            "compute": {"value": "100"},
        }),
    );
    let slices = [pool("a", 1, vec![gpu])];
    let classes = [gpus_class()];
    let memory = |name: &str| {
        request(
            name,
            &json!({"deviceClassName": "gpus", "capacity": {"requests": {"memory": "10Gi"}}}),
        )
    };
    let one = claim("one", &[memory("gpu")], json!({}));
    let p = allocate(&slices, &classes, &[&one], &[node("a")]).unwrap();
    assert_eq!(
        consumed(&results(&p.allocations[0])[0]),
        pairs(&[("compute", "100"), ("memory", "10Gi")])
    );
    let two = claim("two", &[memory("first"), memory("second")], json!({}));
    assert!(allocate(&slices, &classes, &[&two], &[node("a")]).is_err());
}

/// Issue 31, item 4: A request for all devices errors on a node where one of its pools is being updated
/// (`validateDeviceRequest`), and such an error is not `ErrFailedAllocationOnNode`: it aborts
/// the pod's whole scheduling attempt, so the pod is placed on no other node and retried.
#[test]
fn all_devices_with_a_pool_being_updated_on_any_node_abort_the_attempt() {
    let slices = [
        pool("a", 1, vec![exclusive_gpu("gpu-0", &json!({}))]),
        pool("b", 2, vec![exclusive_gpu("gpu-0", &json!({}))]),
    ];
    let all = claim(
        "all",
        &[request(
            "gpus",
            &json!({"deviceClassName": "gpus", "allocationMode": "All"}),
        )],
        json!({}),
    );
    let classes = [gpus_class()];
    let err = allocate(&slices, &classes, &[&all], &[node("a"), node("b")]).unwrap_err();
    let (at, why) = aborted_on(&err).expect("the attempt is aborted");
    assert_eq!(at, "b");
    assert!(why.contains("currently being updated"), "{why}");
    assert!(err.to_string().contains("retried"), "{err}");
    // Without node b among the candidates, node a takes it.
    let p = allocate(&slices, &classes, &[&all], &[node("a")]).unwrap();
    assert_eq!(p.node, "a");
}

/// Issue 31, item 5: A CEL runtime error on any node aborts the attempt: `selectorsMatch` returns the error,
/// `Allocate` passes it up, and kube-scheduler's Filter runs on every node, so the first node
/// fitting does not save the pod.
#[test]
fn a_cel_runtime_error_on_any_node_aborts_the_attempt() {
    let slices = [
        pool(
            "a",
            1,
            vec![exclusive_gpu(
                "gpu-0",
                &json!({"model": {"string": "h100"}}),
            )],
        ),
        pool("b", 1, vec![exclusive_gpu("gpu-0", &json!({}))]),
    ];
    let reads_model = |selector: &str| {
        claim(
            "c",
            &[request(
                "gpu",
                &json!({"deviceClassName": "gpus",
                       "selectors": [{"cel": {"expression": selector}}]}),
            )],
            json!({}),
        )
    };
    let classes = [gpus_class()];
    let unguarded = reads_model(&format!(r#"device.attributes["{D}"].model == "h100""#));
    let err = allocate(&slices, &classes, &[&unguarded], &[node("a"), node("b")]).unwrap_err();
    let (at, why) = aborted_on(&err).expect("the attempt is aborted");
    assert_eq!(at, "b");
    assert!(why.contains("No such key: model"), "{why}");
    let guarded = reads_model(&format!(
        r#"has(device.attributes["{D}"].model) && device.attributes["{D}"].model == "h100""#
    ));
    let p = allocate(&slices, &classes, &[&guarded], &[node("a"), node("b")]).unwrap();
    assert_eq!(p.node, "a");
}

// --- Tessera refused what kube-scheduler allocates ---------------------------------------

/// Issue 31, item 6: A valid range without a step keeps a request at or above its minimum as asked:
/// `roundUpRange` rounds only to a step, so two requests of 1500Mi fit a 3Gi GPU.
#[test]
fn a_range_without_a_step_keeps_the_request_as_asked() {
    let gpu = multi_gpu(
        "gpu-0",
        &json!({
            "memory": {"value": "3Gi", "requestPolicy": {
                "default": "1Gi", "validRange": {"min": "1Gi"}}},
            "compute": {"value": "100", "requestPolicy": {
                "default": "0", "validRange": {"min": "0", "max": "100", "step": "5"}}},
        }),
    );
    let half = |name: &str| {
        request(
            name,
            &json!({"deviceClassName": "gpus", "capacity": {"requests": {"memory": "1500Mi"}}}),
        )
    };
    let c = claim("c", &[half("first"), half("second")], json!({}));
    let p = allocate(
        &[pool("a", 1, vec![gpu])],
        &[gpus_class()],
        &[&c],
        &[node("a")],
    )
    .unwrap();
    for r in results(&p.allocations[0]) {
        assert_eq!(
            consumed(r),
            pairs(&[("compute", "0"), ("memory", "1500Mi")])
        );
    }
    let record = recorded(&p.allocations[0]);
    assert_eq!(record.len(), 2);
    assert_eq!(record[0]["memory"], "1500Mi");
}

/// Issue 31, item 7: A device the search already holds is skipped before any selector is evaluated on it:
/// `allocateOne` checks `deviceInUse` first and `isSelectable` (CEL) after, so a selector that
/// would fail on the held device is never run there.
#[test]
fn a_device_in_use_is_skipped_before_its_selectors_run() {
    let slices = [pool(
        "a",
        1,
        vec![
            exclusive_gpu("gpu-0", &json!({})),
            exclusive_gpu("gpu-1", &json!({"model": {"string": "h100"}})),
        ],
    )];
    let c = claim(
        "c",
        &[
            request("any", &json!({"deviceClassName": "gpus"})),
            request(
                "h100",
                &json!({"deviceClassName": "gpus", "selectors": [{"cel": {
                    "expression": format!(r#"device.attributes["{D}"].model == "h100""#)}}]}),
            ),
        ],
        json!({}),
    );
    let p = allocate(&slices, &[gpus_class()], &[&c], &[node("a")]).unwrap();
    assert_eq!(devices(&p.allocations[0]), ["any/gpu-0", "h100/gpu-1"]);
}

/// Issue 31, item 8: Capacity requests on a device that does not allow multiple allocations allocate it
/// whole: `CmpRequestOverCapacity` only checks that each request fits the capacity, and
/// `allocateDevice` writes `consumedCapacity` and a `shareID` only for multi-allocatable
/// devices. No share record: the node prepares the whole GPU.
#[test]
fn capacity_requests_on_an_exclusive_gpu_take_it_whole() {
    let slices = [pool(
        "a",
        1,
        vec![exclusive_gpu(
            "gpu-0",
            &json!({"sharing": {"string": "exclusive"}}),
        )],
    )];
    let c = claim(
        "c",
        &[request(
            "gpu",
            &json!({"deviceClassName": "gpus", "capacity": {"requests": {"memory": "10Gi"}}}),
        )],
        json!({}),
    );
    let p = allocate(&slices, &[gpus_class()], &[&c], &[node("a")]).unwrap();
    let r = &results(&p.allocations[0])[0];
    assert_eq!(r.device, "gpu-0");
    assert!(r.share_id.is_none() && r.consumed_capacity.is_none());
    assert!(recorded(&p.allocations[0]).is_empty());
    let too_much = claim(
        "big",
        &[request(
            "gpu",
            &json!({"deviceClassName": "gpus", "capacity": {"requests": {"memory": "81Gi"}}}),
        )],
        json!({}),
    );
    assert!(allocate(&slices, &[gpus_class()], &[&too_much], &[node("a")]).is_err());
}

/// Issue 31, item 9: `allocationMode: All` with capacity requests takes every matching device with room:
/// `validateDeviceRequest` lists each selectable device whose capacity fits and
/// `allocateDevice` books the request on each; on a shared GPU each is a share.
#[test]
fn all_devices_with_capacity_requests_take_a_share_of_each() {
    let slices = [pool(
        "a",
        1,
        vec![
            multi_gpu("gpu-0", &shipped_capacity("80Gi")),
            multi_gpu("gpu-1", &shipped_capacity("80Gi")),
        ],
    )];
    let c = claim(
        "c",
        &[request(
            "gpu",
            &json!({"deviceClassName": "gpus", "allocationMode": "All",
                   "capacity": {"requests": {"memory": "10Gi", "compute": "20"}}}),
        )],
        json!({}),
    );
    let p = allocate(&slices, &[gpus_class()], &[&c], &[node("a")]).unwrap();
    assert_eq!(devices(&p.allocations[0]), ["gpu/gpu-0", "gpu/gpu-1"]);
    for r in results(&p.allocations[0]) {
        assert!(r.share_id.is_some());
        assert_eq!(consumed(r), pairs(&[("compute", "20"), ("memory", "10Gi")]));
    }
    let record = recorded(&p.allocations[0]);
    assert_eq!(record.len(), 2);
    assert_eq!(
        (
            &record[1]["device"],
            &record[1]["memory"],
            &record[1]["compute"]
        ),
        (&json!("gpu-1"), &json!("10Gi"), &json!(20))
    );
}

/// Issue 31, item 10: A share may request any capacity its GPU declares: `GetConsumedCapacityFromRequest`
/// books each declared capacity by its policy. The record keeps memory and compute, which the
/// node enforces; the rest is booked in `consumedCapacity` only.
#[test]
fn a_share_may_request_another_capacity_its_gpu_declares() {
    let mut capacity = shipped_capacity("80Gi");
    capacity["multiprocessors"] = json!({"value": "132", "requestPolicy": {
        "default": "0", "validRange": {"min": "0", "step": "1"}}});
    let slices = [pool("a", 1, vec![multi_gpu("gpu-0", &capacity)])];
    let c = claim(
        "c",
        &[request(
            "gpu",
            &json!({"deviceClassName": "gpus",
                   "capacity": {"requests": {"memory": "10Gi", "multiprocessors": "40"}}}),
        )],
        json!({}),
    );
    let p = allocate(&slices, &[gpus_class()], &[&c], &[node("a")]).unwrap();
    assert_eq!(
        consumed(&results(&p.allocations[0])[0]),
        pairs(&[
            ("compute", "0"),
            ("memory", "10Gi"),
            ("multiprocessors", "40")
        ])
    );
    let record = recorded(&p.allocations[0]);
    assert_eq!(
        (&record[0]["memory"], &record[0]["compute"]),
        (&json!("10Gi"), &json!(0))
    );
}

// --- Rules a fixed list misses -----------------------------------------------------------

/// A device of an "all devices" request that a claim constraint refuses is an error, not a
/// misfit: `allocateDevice` is called with `must` set and returns "cannot add device ...
/// because a claim constraint would not be satisfied", which aborts the attempt.
#[test]
fn all_devices_that_break_a_constraint_abort_the_attempt() {
    let slices = [pool(
        "a",
        1,
        vec![
            exclusive_gpu("gpu-0", &json!({"island": {"string": "x"}})),
            exclusive_gpu("gpu-1", &json!({"island": {"string": "y"}})),
        ],
    )];
    let c = claim(
        "c",
        &[request(
            "gpus",
            &json!({"deviceClassName": "gpus", "allocationMode": "All"}),
        )],
        json!({"constraints": [{"matchAttribute": format!("{D}/island")}]}),
    );
    let err = allocate(&slices, &[gpus_class()], &[&c], &[node("a")]).unwrap_err();
    let (at, why) = aborted_on(&err).expect("the attempt is aborted");
    assert_eq!(at, "a");
    assert!(why.contains("constraint"), "{why}");
}

/// A node whose matching devices are all in use raises no CEL error: the in-use check comes
/// first on every node (`allocateOne`), so a selector that would fail there is never run and
/// the pod is placed elsewhere.
#[test]
fn a_node_with_every_device_in_use_raises_no_cel_error() {
    let slices = [
        pool(
            "a",
            1,
            vec![exclusive_gpu(
                "gpu-0",
                &json!({"model": {"string": "h100"}}),
            )],
        ),
        pool("b", 1, vec![exclusive_gpu("gpu-0", &json!({}))]),
    ];
    let classes = [gpus_class()];
    let mut held = claim(
        "held",
        &[request("gpu", &json!({"deviceClassName": "gpus"}))],
        json!({}),
    );
    let on_b = first_fit()
        .allocate(
            &Snapshot::new(&slices, &classes, &[]).unwrap(),
            &[&held],
            &[node("b")],
        )
        .unwrap();
    held.status = Some(res::ResourceClaimStatus {
        allocation: Some(on_b.allocations[0].clone()),
        ..Default::default()
    });
    let snap = Snapshot::new(&slices, &classes, &[held]).unwrap();
    let c = claim(
        "c",
        &[request(
            "gpu",
            &json!({"deviceClassName": "gpus", "selectors": [{"cel": {
                "expression": format!(r#"device.attributes["{D}"].model == "h100""#)}}]}),
        )],
        json!({}),
    );
    let p = first_fit()
        .allocate(&snap, &[&c], &[node("a"), node("b")])
        .unwrap();
    assert_eq!(p.node, "a");
}

/// A node that the filters before `DynamicResources` turn away (here: too little CPU) is never
/// searched, so an error its devices would raise does not abort the attempt.
#[test]
fn a_node_without_room_for_the_pod_raises_no_cel_error() {
    use crate::placement::fragmentation::HostResources;
    let slices = [
        pool(
            "a",
            1,
            vec![exclusive_gpu(
                "gpu-0",
                &json!({"model": {"string": "h100"}}),
            )],
        ),
        pool("b", 1, vec![exclusive_gpu("gpu-0", &json!({}))]),
    ];
    let mut snap = Snapshot::new(&slices, &[gpus_class()], &[]).unwrap();
    let cpu = |cpu_milli: u64| HostResources {
        cpu_milli,
        memory_bytes: 1 << 30,
    };
    snap.set_host("a", cpu(8000), HostResources::default());
    snap.set_host("b", cpu(100), HostResources::default());
    let c = claim(
        "c",
        &[request(
            "gpu",
            &json!({"deviceClassName": "gpus", "selectors": [{"cel": {
                "expression": format!(r#"device.attributes["{D}"].model == "h100""#)}}]}),
        )],
        json!({}),
    );
    let pod = HostResources {
        cpu_milli: 1000,
        memory_bytes: 0,
    };
    let p = first_fit()
        .allocate_pod(&snap, &[&c], &[node("a"), node("b")], &pod)
        .unwrap();
    assert_eq!(p.node, "a");
}

/// An invalid pool (two devices of one name) makes allocation fail on its node only:
/// `Allocate` wraps "invalid resource pools were encountered" in `ErrFailedAllocationOnNode`,
/// which kube-scheduler reads as "this node does not fit", so another node may take the pod.
#[test]
fn an_invalid_pool_fails_its_node_only() {
    let mut broken = pool(
        "a",
        1,
        vec![
            exclusive_gpu("gpu-0", &json!({})),
            exclusive_gpu("gpu-0", &json!({})),
        ],
    );
    broken.metadata.name = Some("a-0".into());
    let slices = [
        broken,
        pool("b", 1, vec![exclusive_gpu("gpu-0", &json!({}))]),
    ];
    let c = claim(
        "c",
        &[request("gpu", &json!({"deviceClassName": "gpus"}))],
        json!({}),
    );
    let p = allocate(&slices, &[gpus_class()], &[&c], &[node("a"), node("b")]).unwrap();
    assert_eq!(p.node, "b");
}

/// "All devices" counts a tainted device among them and then cannot take it: the taint is
/// checked in `allocateDevice`, after `validateDeviceRequest` listed the device, so the
/// request does not fit (no error) until the taint is tolerated.
#[test]
fn all_devices_include_a_tainted_one_and_then_do_not_fit() {
    let mut tainted = exclusive_gpu("gpu-1", &json!({}));
    tainted.taints = Some(vec![res::DeviceTaint {
        key: "maintenance".into(),
        effect: "NoSchedule".into(),
        value: None,
        time_added: None,
    }]);
    let slices = [pool(
        "a",
        1,
        vec![exclusive_gpu("gpu-0", &json!({})), tainted],
    )];
    let all = |tolerations: Value| {
        claim(
            "c",
            &[request(
                "gpus",
                &json!({"deviceClassName": "gpus", "allocationMode": "All",
                       "tolerations": tolerations}),
            )],
            json!({}),
        )
    };
    let err = allocate(&slices, &[gpus_class()], &[&all(json!([]))], &[node("a")]).unwrap_err();
    assert!(aborted_on(&err).is_none(), "{err}");
    let p = allocate(
        &slices,
        &[gpus_class()],
        &[&all(json!([{"key": "maintenance", "operator": "Exists"}]))],
        &[node("a")],
    )
    .unwrap();
    assert_eq!(devices(&p.allocations[0]), ["gpus/gpu-0", "gpus/gpu-1"]);
}

/// "All devices" with capacity requests leaves out a device without room for them, judged on
/// what earlier claims hold (`validateDeviceRequest` skips it); the others are taken.
#[test]
fn all_devices_leave_out_a_gpu_without_room() {
    let slices = [pool(
        "a",
        1,
        vec![
            multi_gpu("gpu-0", &shipped_capacity("20Gi")),
            multi_gpu("gpu-1", &shipped_capacity("20Gi")),
        ],
    )];
    let classes = [gpus_class()];
    let big = |name: &str, mode: Value| {
        let mut exactly = json!({"deviceClassName": "gpus",
                                 "capacity": {"requests": {"memory": "15Gi"}}});
        if let Value::Object(m) = mode {
            for (k, v) in m {
                exactly[k] = v;
            }
        }
        claim(name, &[request("gpu", &exactly)], json!({}))
    };
    let mut held = big("held", json!({}));
    let p = allocate(&slices, &classes, &[&held], &[node("a")]).unwrap();
    assert_eq!(devices(&p.allocations[0]), ["gpu/gpu-0"]);
    held.status = Some(res::ResourceClaimStatus {
        allocation: Some(p.allocations[0].clone()),
        ..Default::default()
    });
    let snap = Snapshot::new(&slices, &classes, &[held]).unwrap();
    let all = big("all", json!({"allocationMode": "All"}));
    let p = first_fit().allocate(&snap, &[&all], &[node("a")]).unwrap();
    assert_eq!(devices(&p.allocations[0]), ["gpu/gpu-1"]);
}

/// A request between two listed valid values consumes the next one up, and a request above
/// every listed value breaks the policy: `roundUpValidValues`, then `violatesPolicy`.
#[test]
fn valid_values_round_up_to_the_next_listed_value() {
    let gpu = multi_gpu(
        "gpu-0",
        &json!({"slots": {"value": "10", "requestPolicy": {
            "default": "2", "validValues": ["2", "5", "10"]}}}),
    );
    let slices = [pool("a", 1, vec![gpu])];
    let ask = |n: &str| {
        claim(
            "c",
            &[request(
                "gpu",
                &json!({"deviceClassName": "gpus", "capacity": {"requests": {"slots": n}}}),
            )],
            json!({}),
        )
    };
    let p = allocate(&slices, &[gpus_class()], &[&ask("3")], &[node("a")]).unwrap();
    assert_eq!(
        consumed(&results(&p.allocations[0])[0]),
        pairs(&[("slots", "5")])
    );
    assert!(allocate(&slices, &[gpus_class()], &[&ask("11")], &[node("a")]).is_err());
}

/// Capacity names are matched as spelled: 1.36's `requestsContainNonExistCapacity` and
/// `calculateConsumedCapacity` look a request's names up in the device's capacity map as they
/// are written, so `gpu.tessera.dev/memory` is not the `memory` a device declares.
#[test]
fn capacity_names_are_matched_as_spelled() {
    let plain = multi_gpu("gpu-0", &shipped_capacity("80Gi"));
    let spelled = multi_gpu("gpu-1", &json!({format!("{D}/memory"): {"value": "80Gi"}}));
    let ask = claim(
        "c",
        &[request(
            "gpu",
            &json!({"deviceClassName": "gpus",
                   "capacity": {"requests": {format!("{D}/memory"): "10Gi"}}}),
        )],
        json!({}),
    );
    let p = allocate(
        &[pool("a", 1, vec![plain, spelled])],
        &[gpus_class()],
        &[&ask],
        &[node("a")],
    )
    .unwrap();
    assert_eq!(devices(&p.allocations[0]), ["gpu/gpu-1"]);
    assert_eq!(
        consumed(&results(&p.allocations[0])[0]),
        pairs(&[(format!("{D}/memory").as_str(), "10Gi")])
    );
}

/// A range's step rounds in whole units: `roundUpRange` reads the request, the minimum and the
/// step with `Value()`, which rounds each up, so 1200m in steps of 500m from 0 consumes 2 (not
/// 1.5), and `violatesPolicy` checks the step the same way.
#[test]
fn a_step_rounds_in_whole_units() {
    let gpu = multi_gpu(
        "gpu-0",
        &json!({"slots": {"value": "4", "requestPolicy": {
            "default": "0", "validRange": {"min": "0", "step": "500m"}}}}),
    );
    let c = claim(
        "c",
        &[request(
            "gpu",
            &json!({"deviceClassName": "gpus", "capacity": {"requests": {"slots": "1200m"}}}),
        )],
        json!({}),
    );
    let p = allocate(
        &[pool("a", 1, vec![gpu])],
        &[gpus_class()],
        &[&c],
        &[node("a")],
    )
    .unwrap();
    assert_eq!(
        consumed(&results(&p.allocations[0])[0]),
        pairs(&[("slots", "2")])
    );
}

/// The shared counters of a device that allows multiple allocations are consumed by its first
/// share only: `allocateDevice` skips the counter check while the device's capacity is in use
/// (`deviceCapacityInUse`), so a second share on it needs no counters of its own.
#[test]
fn a_shared_devices_counters_are_consumed_once() {
    let mut gpu = multi_gpu("gpu-0", &shipped_capacity("80Gi"));
    gpu.consumes_counters = Some(vec![res::DeviceCounterConsumption {
        counter_set: "card".into(),
        counters: [(
            "slices".to_owned(),
            res::Counter {
                value: testing::quantity("1"),
            },
        )]
        .into(),
    }]);
    let mut s = pool("a", 1, vec![gpu]);
    s.spec.shared_counters = Some(vec![res::CounterSet {
        name: "card".into(),
        counters: [(
            "slices".to_owned(),
            res::Counter {
                value: testing::quantity("1"),
            },
        )]
        .into(),
    }]);
    let share = |name: &str| {
        request(
            name,
            &json!({"deviceClassName": "gpus", "capacity": {"requests": {"memory": "10Gi"}}}),
        )
    };
    let c = claim("c", &[share("first"), share("second")], json!({}));
    let p = allocate(&[s], &[gpus_class()], &[&c], &[node("a")]).unwrap();
    assert_eq!(devices(&p.allocations[0]), ["first/gpu-0", "second/gpu-0"]);
}

/// An admin-access pick holds a device that does not allow multiple allocations for the rest
/// of the attempt: `allocateDevice` marks it allocating for the claim whatever the access, and
/// `deviceInUse` then turns the claim's other requests away from it.
#[test]
fn an_admin_access_pick_holds_its_device_for_the_rest_of_the_attempt() {
    let c = claim(
        "c",
        &[
            request(
                "admin",
                &json!({"deviceClassName": "gpus", "adminAccess": true}),
            ),
            request("plain", &json!({"deviceClassName": "gpus"})),
        ],
        json!({}),
    );
    let one = [pool("a", 1, vec![exclusive_gpu("gpu-0", &json!({}))])];
    assert!(allocate(&one, &[gpus_class()], &[&c], &[node("a")]).is_err());
    let two = [pool(
        "a",
        1,
        vec![
            exclusive_gpu("gpu-0", &json!({})),
            exclusive_gpu("gpu-1", &json!({})),
        ],
    )];
    let p = allocate(&two, &[gpus_class()], &[&c], &[node("a")]).unwrap();
    assert_eq!(devices(&p.allocations[0]), ["admin/gpu-0", "plain/gpu-1"]);
}
