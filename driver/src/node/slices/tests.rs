use super::*;

use crate::testing::node_inventory as node;

fn attr<'a>(d: &'a Device, name: &str) -> &'a DeviceAttribute {
    d.attributes
        .as_ref()
        .and_then(|a| a.get(name))
        .unwrap_or_else(|| panic!("{} has no attribute {name}", d.name))
}

fn devices(slices: &[ResourceSlice]) -> Vec<&Device> {
    slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .collect()
}

#[test]
fn exclusive_gpu_publishes_every_attribute_and_capacity() {
    let n = node("nodes:\n- name: n1\n  gpus:\n  - model: a100-80g\n    count: 2\n");
    let slices = render(&n, &RenderOptions::default()).expect("render");
    assert_eq!(slices.len(), 1);
    let s = &slices[0];
    assert_eq!(s.metadata.name.as_deref(), Some("n1-gpu-tessera-dev-0"));
    assert_eq!(s.spec.node_name.as_deref(), Some("n1"));
    assert_eq!(s.spec.pool.name, "n1");
    assert_eq!(s.spec.pool.resource_slice_count, 1);
    let d = devices(&slices);
    assert_eq!(d[0].name, "gpu-0");
    assert_eq!(attr(d[1], "index").int, Some(1));
    assert_eq!(attr(d[0], "model").string.as_deref(), Some("a100-80g"));
    assert_eq!(
        attr(d[0], "cudaDriverVersion").version.as_deref(),
        Some("12.4.0")
    );
    assert_eq!(
        attr(d[0], "cudaComputeCapability").version.as_deref(),
        Some("8.0.0")
    );
    assert_eq!(attr(d[0], "sharing").string.as_deref(), Some("exclusive"));
    assert_eq!(
        attr(d[0], "resource.kubernetes.io/pciBusID")
            .string
            .as_deref(),
        Some("0000:08:00.0")
    );
    assert!(
        d[0].attributes
            .as_ref()
            .is_some_and(|a| !a.contains_key("nvlinkDomain"))
    );
    let caps = d[0].capacity.as_ref().expect("capacity");
    assert_eq!(caps["memory"].value.0, "80Gi");
    assert_eq!(caps["compute"].value.0, "100");
    assert_eq!(caps["multiprocessors"].value.0, "108");
    assert!(d[0].allow_multiple_allocations.is_none());
}

#[test]
fn shared_gpu_with_consumable_capacity_has_policies_and_no_multiprocessors() {
    let n = node("nodes:\n- name: n1\n  mode: shared\n  gpus:\n  - model: t4\n");
    let opts = RenderOptions {
        consumable_capacity: true,
        ..RenderOptions::default()
    };
    let slices = render(&n, &opts).expect("render");
    let d = devices(&slices)[0];
    assert_eq!(d.allow_multiple_allocations, Some(true));
    let caps = d.capacity.as_ref().expect("capacity");
    assert!(!caps.contains_key("multiprocessors"));
    let mem = caps["memory"]
        .request_policy
        .as_ref()
        .expect("memory policy");
    assert_eq!(mem.default.as_ref().map(|q| q.0.as_str()), Some("1Gi"));
    let range = mem.valid_range.as_ref().expect("range");
    assert_eq!(range.min.0, "1Gi");
    assert_eq!(range.step.as_ref().map(|q| q.0.as_str()), Some("1Gi"));
    let compute = caps["compute"]
        .request_policy
        .as_ref()
        .expect("compute policy");
    assert_eq!(compute.default.as_ref().map(|q| q.0.as_str()), Some("0"));
    let range = compute.valid_range.as_ref().expect("range");
    assert_eq!(range.max.as_ref().map(|q| q.0.as_str()), Some("100"));
    assert_eq!(range.step.as_ref().map(|q| q.0.as_str()), Some("5"));

    // Without consumable capacity the same GPU is a plain device marked shared.
    let plain = render(&n, &RenderOptions::default()).expect("render");
    let d = devices(&plain)[0];
    assert!(d.allow_multiple_allocations.is_none());
    assert_eq!(attr(d, "sharing").string.as_deref(), Some("shared"));
    assert!(d.capacity.as_ref().is_some_and(
        |c| c.contains_key("multiprocessors") && c.values().all(|v| v.request_policy.is_none())
    ));
}

#[test]
fn the_enforcement_backend_is_published_on_shared_gpus_only() {
    let n = node(
        "nodes:\n- name: n1\n  gpus:\n  - {model: t4, mode: shared}\n  - {model: t4, mode: exclusive}\n",
    );
    let opts = RenderOptions {
        enforcement: Some("hami-core".to_owned()),
        ..RenderOptions::default()
    };
    let slices = render(&n, &opts).expect("render");
    let d = devices(&slices);
    assert_eq!(
        attr(d[0], "enforcement").string.as_deref(),
        Some("hami-core")
    );
    assert!(
        !d[1]
            .attributes
            .as_ref()
            .unwrap()
            .contains_key("enforcement")
    );
    // Without it (the default) nothing is published, so golden slices stay as they were.
    let plain = render(&n, &RenderOptions::default()).expect("render");
    assert!(
        !devices(&plain)[0]
            .attributes
            .as_ref()
            .unwrap()
            .contains_key("enforcement")
    );
}

#[test]
fn mig_gpu_publishes_its_instances_not_itself() {
    let n = node(
        "nodes:\n- name: n1\n  gpus:\n  - model: a100-40g\n    mig:\n    - profile: 3g.20gb\n    - profile: 1g.5gb\n      count: 2\n",
    );
    let slices = render(&n, &RenderOptions::default()).expect("render");
    let d = devices(&slices);
    let names: Vec<&str> = d.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(
        names,
        vec![
            "gpu-0-mig-3g-20gb-0",
            "gpu-0-mig-1g-5gb-4",
            "gpu-0-mig-1g-5gb-5"
        ]
    );
    assert_eq!(attr(d[0], "type").string.as_deref(), Some("mig"));
    assert_eq!(attr(d[0], "profile").string.as_deref(), Some("3g.20gb"));
    assert_eq!(attr(d[0], "parentIndex").int, Some(0));
    assert_eq!(
        attr(d[0], "parentUUID").string.as_deref(),
        Some(n.gpus[0].uuid.as_str())
    );
    let caps = d[0].capacity.as_ref().expect("capacity");
    assert_eq!(caps["compute"].value.0, "40");
    assert_eq!(caps["multiprocessors"].value.0, "42");
    assert_eq!(
        d[1].capacity.as_ref().expect("capacity")["compute"].value.0,
        "10"
    );
}

#[test]
fn a_mig_instance_the_node_cannot_name_is_not_published_and_says_why() {
    let text = "nodes:\n- name: n1\n  gpus:\n  - model: a100-40g\n    mig:\n    - profile: 3g.20gb\n    - profile: 1g.5gb\n      count: 2\n";
    let names = |n: &NodeInventory| -> Vec<String> {
        devices(&render(n, &RenderOptions::default()).expect("render"))
            .iter()
            .map(|d| d.name.clone())
            .collect()
    };
    let whole = node(text);
    assert!(unoffered(&whole).is_empty(), "every instance can be named");

    // NVML gave no ids for the second instance: it alone is left out.
    let mut no_ids = node(text);
    no_ids.gpus[0].mig_instances[1].ids = None;
    assert_eq!(
        names(&no_ids),
        ["gpu-0-mig-3g-20gb-0", "gpu-0-mig-1g-5gb-5"]
    );
    let why = unoffered(&no_ids);
    assert_eq!(why.len(), 1);
    assert_eq!(why[0].0, "gpu-0-mig-1g-5gb-4");
    assert!(why[0].1.contains("did not report"), "{}", why[0].1);

    // Without the driver's capability table no instance can be named.
    let mut no_table = node(text);
    no_table.mig_minors = None;
    assert!(names(&no_table).is_empty());
    assert_eq!(unoffered(&no_table).len(), 3);
    assert!(
        unoffered(&no_table)[0]
            .1
            .contains("no MIG capability table"),
        "{:?}",
        unoffered(&no_table)
    );

    // Ids the table does not list (another GPU's minor keys them) are not named either.
    let mut other_minor = node(text);
    other_minor.gpus[0].minor = 9;
    assert!(names(&other_minor).is_empty());
    assert!(
        unoffered(&other_minor)[0].1.contains("gpu9/gi"),
        "{:?}",
        unoffered(&other_minor)
    );
}

#[test]
fn unhealthy_gpu_is_tainted() {
    let n = node("nodes:\n- name: n1\n  gpus:\n  - model: t4\n    healthy: false\n  - model: t4\n");
    let slices = render(&n, &RenderOptions::default()).expect("render");
    let d = devices(&slices);
    let taints = d[0].taints.as_ref().expect("taints");
    assert_eq!(taints[0].key, names::TAINT_UNHEALTHY);
    assert_eq!(taints[0].effect, "NoSchedule");
    assert!(d[1].taints.is_none());
}

#[test]
fn a_draining_gpu_is_tainted_with_the_mode_it_switches_to() {
    let mut n = node(
        "nodes:\n- name: n1\n  gpus:\n  - model: t4\n    count: 100\n  - model: a100-40g\n    healthy: false\n    mig:\n    - profile: 3g.20gb\n      count: 2\n",
    );
    n.gpus[0].draining_to = Some(GpuMode::Shared);
    n.gpus[100].draining_to = Some(GpuMode::Exclusive);
    let slices = render(&n, &RenderOptions::default()).expect("render");
    // Tainted devices: 64 per slice at most.
    assert_eq!(slices[0].spec.devices.as_ref().map(Vec::len), Some(64));
    let d = devices(&slices);
    let draining = &d[0].taints.as_ref().expect("taints")[0];
    assert_eq!(draining.key, names::TAINT_DRAINING);
    assert_eq!(draining.value.as_deref(), Some("shared"));
    assert_eq!(draining.effect, names::TAINT_EFFECT_NO_SCHEDULE);
    // Its attributes still say what it is until it switches.
    assert_eq!(
        d[0].attributes.as_ref().expect("attributes")[names::ATTR_SHARING]
            .string
            .as_deref(),
        Some("exclusive")
    );
    assert!(d[1].taints.is_none());
    // Every MIG instance of a draining GPU carries it, beside the unhealthy taint.
    let mig: Vec<_> = d.iter().filter(|d| d.name.contains("-mig-")).collect();
    assert_eq!(mig.len(), 2);
    for device in mig {
        let keys: Vec<&str> = device
            .taints
            .iter()
            .flatten()
            .map(|t| t.key.as_str())
            .collect();
        assert_eq!(keys, [names::TAINT_UNHEALTHY, names::TAINT_DRAINING]);
    }
}

#[test]
fn two_hundred_gpus_split_over_two_slices() {
    let n = node("nodes:\n- name: big\n  gpus:\n  - model: t4\n    count: 200\n");
    let slices = render(&n, &RenderOptions::default()).expect("render");
    assert_eq!(slices.len(), 2);
    assert_eq!(slices[0].spec.devices.as_ref().map(Vec::len), Some(128));
    assert_eq!(slices[1].spec.devices.as_ref().map(Vec::len), Some(72));
    assert!(slices.iter().all(|s| s.spec.pool.resource_slice_count == 2));
    assert_eq!(
        slices[1].metadata.name.as_deref(),
        Some("big-gpu-tessera-dev-1")
    );
}

#[test]
fn taints_lower_the_per_slice_limit_to_64() {
    let n = node(
        "nodes:\n- name: big\n  gpus:\n  - model: t4\n    count: 100\n  - model: t4\n    healthy: false\n",
    );
    let slices = render(&n, &RenderOptions::default()).expect("render");
    assert_eq!(slices.len(), 2);
    assert_eq!(slices[0].spec.devices.as_ref().map(Vec::len), Some(64));
}

#[test]
fn node_without_devices_still_publishes_its_pool() {
    let n = node("nodes:\n- name: empty\n");
    let slices = render(&n, &RenderOptions::default()).expect("render");
    assert_eq!(slices.len(), 1);
    assert!(slices[0].spec.devices.is_none());
    assert_eq!(slices[0].spec.pool.resource_slice_count, 1);
}

#[test]
fn over_long_attribute_value_is_an_error() {
    let long = "x".repeat(65);
    let n = node(&format!(
        "nodes:\n- name: n1\n  gpus:\n  - model: t4\n    productName: {long}\n"
    ));
    let e = render(&n, &RenderOptions::default()).expect_err("too long");
    let Error::Invalid { field, message, .. } = e else {
        panic!("wrong error {e:?}");
    };
    assert_eq!(field, "spec.devices[gpu-0].attributes[productName]");
    assert!(message.contains("longer than 64"), "{message}");
}

#[test]
fn bad_versions_and_names_are_errors() {
    let n = node("nodes:\n- name: n1\n  driverVersion: banana\n  gpus:\n  - model: t4\n");
    let e = render(&n, &RenderOptions::default()).expect_err("bad version");
    assert!(e.to_string().contains("driverVersion"), "{e}");

    let n = node("nodes:\n- name: n1\n  gpus:\n  - model: t4\n");
    let opts = RenderOptions {
        driver_name: "Not_A_Domain".into(),
        ..RenderOptions::default()
    };
    assert!(render(&n, &opts).is_err());
}

#[test]
fn over_long_node_name_gets_a_hashed_slice_name() {
    let name = format!(
        "{}.{}.{}.{}",
        "a".repeat(63),
        "b".repeat(63),
        "c".repeat(63),
        "d".repeat(61)
    );
    assert_eq!(name.len(), 253);
    let got = slice_name(&name, "gpu.tessera.dev", 3);
    assert!(got.len() <= 253);
    assert!(limits::is_dns_subdomain(&got, 253), "{got}");
    assert!(got.ends_with("-3"));
    assert_eq!(got, slice_name(&name, "gpu.tessera.dev", 3));
}

#[test]
fn rendering_is_deterministic() {
    let text = "nodes:\n- name: n1\n  gpus:\n  - model: h100\n    count: 3\n";
    let a = render(&node(text), &RenderOptions::default()).expect("render");
    let b = render(&node(text), &RenderOptions::default()).expect("render");
    assert_eq!(a, b);
}
