use super::*;

fn inventory_error(yaml: &str) -> (String, String) {
    match Inventory::from_yaml(yaml) {
        Err(Error::Inventory { field, message }) => (field, message),
        other => panic!("expected an inventory error, got {other:?}"),
    }
}

#[test]
fn demo_cluster_loads() {
    let inv = Inventory::from_yaml(include_str!(
        "../../../../examples/inventory/demo-cluster.yaml"
    ))
    .expect("demo cluster");
    let names: Vec<&str> = inv.nodes.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["a100-node", "t4-node", "mig-node", "h100-node"]);

    let a100 = inv.node("a100-node").expect("a100-node");
    assert_eq!(a100.gpus.len(), 8);
    for g in &a100.gpus {
        let island = g.index / 4;
        assert_eq!(
            g.nvlink_domain.as_deref(),
            Some(format!("a100-node-nvlink-{island}").as_str())
        );
        assert_eq!(g.numa_node, Some(island));
        assert_eq!(g.mode, GpuMode::Exclusive);
    }

    let t4 = inv.node("t4-node").expect("t4-node");
    assert!(
        t4.gpus
            .iter()
            .all(|g| g.mode == GpuMode::Shared && g.model == "t4-16g")
    );

    let mig = inv.node("mig-node").expect("mig-node");
    assert_eq!(mig.gpus[0].mig_instances.len(), 7);
    let second: Vec<(&str, u32)> = mig.gpus[1]
        .mig_instances
        .iter()
        .map(|m| (m.profile.as_str(), m.placement))
        .collect();
    // 2g.10gb may start only at 0, 2 or 4, so the 3g.20gb has to take the upper half.
    assert_eq!(second, [("2g.10gb", 0), ("2g.10gb", 2), ("3g.20gb", 4)]);

    let h100 = inv.node("h100-node").expect("h100-node");
    let numa: Vec<Option<u32>> = h100.gpus.iter().map(|g| g.numa_node).collect();
    assert_eq!(numa, [Some(0), Some(0), Some(1), Some(1)]);
    assert!(
        h100.gpus
            .iter()
            .all(|g| g.nvlink_domain.as_deref() == Some("h100-node-nvlink-0"))
    );
}

#[test]
fn model_and_count_are_enough() {
    let text = "nodes:\n- name: n1\n  gpus:\n  - model: a100-80g\n    count: 8\n";
    let inv = Inventory::from_yaml(text).expect("parses");
    let gpus = &inv.nodes[0].gpus;
    assert_eq!(gpus.len(), 8);
    let g = &gpus[3];
    assert_eq!(g.index, 3);
    assert_eq!(g.product_name, "NVIDIA A100-SXM4-80GB");
    assert_eq!(g.memory_bytes, 80 * 1024 * 1024 * 1024);
    assert_eq!(g.multiprocessors, 108);
    assert_eq!(g.compute_capability, "8.0");
    assert_eq!(g.pci_bus_id, "0000:38:00.0");
    assert_eq!(g.pcie_root, "pci0000:20");
    assert_eq!(g.numa_node, Some(0));
    assert_eq!(g.nvlink_domain, None);
    assert_eq!(g.driver_version, "550.54.15");
    assert_eq!(g.cuda_driver_version, "12.4");
    assert!(g.healthy && g.mig_capable);
    assert!(
        g.uuid.starts_with("GPU-") && g.uuid.len() == 40,
        "{}",
        g.uuid
    );
    let uuids: std::collections::BTreeSet<&str> = gpus.iter().map(|g| g.uuid.as_str()).collect();
    assert_eq!(uuids.len(), 8);
    // Deterministic: the same file gives the same UUIDs.
    assert_eq!(Inventory::from_yaml(text).expect("parses"), inv);
}

#[test]
fn aliases_and_product_names_resolve() {
    let inv = Inventory::from_yaml(
        "nodes:\n- name: n1\n  gpus:\n  - model: V100M32\n  - model: NVIDIA GeForce RTX 4090\n  - model: G2\n",
    )
    .expect("parses");
    let models: Vec<&str> = inv.nodes[0].gpus.iter().map(|g| g.model.as_str()).collect();
    assert_eq!(models, ["v100-32g", "rtx-4090", "a100-40g"]);
}

#[test]
fn unknown_model_lists_the_known_ones() {
    let (field, message) = inventory_error(
        "nodes:\n- name: a\n  gpus: [{model: t4}]\n- name: b\n  gpus:\n  - model: b200\n",
    );
    assert_eq!(field, "nodes[1].gpus[0].model");
    assert!(
        message.contains("\"b200\"") && message.contains("a100-80g"),
        "{message}"
    );
}

#[test]
fn mig_profile_must_exist_for_the_model() {
    let (field, message) = inventory_error(
        "nodes:\n- name: a\n  gpus:\n  - model: a100-40g\n    mig:\n    - profile: 1g.10gb\n    - profile: 1g.6gb\n",
    );
    assert_eq!(field, "nodes[0].gpus[0].mig[1].profile");
    assert!(message.contains("valid profiles: 1g.5gb"), "{message}");
}

#[test]
fn too_many_mig_slices_are_rejected() {
    let (field, message) = inventory_error(
        "nodes:\n- name: a\n  gpus:\n  - model: a100-80g\n    mig:\n    - profile: 4g.40gb\n    - profile: 2g.20gb\n      count: 2\n",
    );
    assert_eq!(field, "nodes[0].gpus[0].mig");
    assert!(message.contains("too many MIG slices"), "{message}");

    let (_, message) = inventory_error(
        "nodes:\n- name: a\n  gpus:\n  - model: a100-80g\n    mig:\n    - profile: 3g.40gb\n      placements: [0]\n    - profile: 4g.40gb\n",
    );
    assert!(message.contains("cannot all be placed"), "{message}");
}

#[test]
fn mig_needs_a_mig_capable_model_and_mode() {
    let (field, _) = inventory_error("nodes:\n- name: a\n  gpus:\n  - model: t4\n    mode: mig\n");
    assert_eq!(field, "nodes[0].gpus[0].mode");
    let (field, _) = inventory_error(
        "nodes:\n- name: a\n  gpus:\n  - model: a30\n    mode: shared\n    mig: [{profile: 1g.6gb}]\n",
    );
    assert_eq!(field, "nodes[0].gpus[0].mig");
    let (field, _) = inventory_error(
        "nodes:\n- name: a\n  gpus:\n  - model: a30\n    mig: [{profile: 2g.12gb, placements: [1]}]\n",
    );
    assert_eq!(field, "nodes[0].gpus[0].mig[0].placements[0]");
}

#[test]
fn typos_and_bad_values_name_their_field() {
    let (field, message) =
        inventory_error("nodes:\n- name: a\n  gpus:\n  - model: t4\n    cuont: 2\n");
    assert_eq!(field, "nodes[0].gpus[0].cuont");
    assert!(message.contains("cuont"), "{message}");
    let (field, _) =
        inventory_error("nodes:\n- name: a\n  gpus:\n  - model: t4\n    mode: split\n");
    assert_eq!(field, "nodes[0].gpus[0].mode");
    let (field, _) = inventory_error("nodes:\n- name: Bad_Name\n");
    assert_eq!(field, "nodes[0].name");
    let (field, _) = inventory_error("nodes:\n- name: a\n- name: a\n");
    assert_eq!(field, "nodes[1].name");
    let (field, _) = inventory_error(
        "nodes:\n- name: a\n  gpus:\n  - model: t4\n    count: 2\n    pciBusIds: [\"0000:01:00.0\"]\n",
    );
    assert_eq!(field, "nodes[0].gpus[0].pciBusIds");
    let (field, _) =
        inventory_error("nodes:\n- name: a\n  gpus:\n  - model: t4\n    pciBusIds: [\"zz\"]\n");
    assert_eq!(field, "nodes[0].gpus[0].pciBusIds[0]");
    let (field, _) =
        inventory_error("nodes:\n- name: a\n  gpus:\n  - model: t4\n    memory: lots\n");
    assert_eq!(field, "nodes[0].gpus[0].memory");
    let (field, _) =
        inventory_error("nodes:\n- name: a\n  gpus:\n  - model: t4\n    count: 5000\n");
    assert_eq!(field, "nodes[0].gpus");
    let (field, _) = inventory_error("- just a list\n");
    assert_eq!(field, "(document)");
}

#[test]
fn explicit_fields_override_defaults() {
    let inv = Inventory::from_yaml(
        "nodes:\n- name: n\n  gpus:\n  - model: t4\n    memory: 15Gi\n    pciBusIds: [\"00000000:3B:00.0\"]\n    uuids: [GPU-fixed]\n    healthy: false\n    nvlinkDomain: isl\n",
    )
    .expect("parses");
    let g = &inv.nodes[0].gpus[0];
    assert_eq!(g.memory_bytes, 15 * 1024 * 1024 * 1024);
    assert_eq!(g.pci_bus_id, "0000:3b:00.0");
    assert_eq!(g.pcie_root, "pci0000:20");
    assert_eq!(g.uuid, "GPU-fixed");
    assert!(!g.healthy);
    assert_eq!(g.nvlink_domain.as_deref(), Some("isl"));
}

#[test]
fn mig_compute_percent_rounds_down_to_steps_of_five() {
    assert_eq!(MigInstance::compute_percent_of(1, 7), 10);
    assert_eq!(MigInstance::compute_percent_of(2, 7), 25);
    assert_eq!(MigInstance::compute_percent_of(3, 7), 40);
    assert_eq!(MigInstance::compute_percent_of(4, 7), 55);
    assert_eq!(MigInstance::compute_percent_of(7, 7), 100);
    assert_eq!(MigInstance::compute_percent_of(1, 4), 25);
    assert_eq!(MigInstance::compute_percent_of(1, 0), 0);
}

#[test]
fn each_mode_parses_from_its_name_and_nothing_else_does() {
    for mode in GpuMode::ALL {
        assert_eq!(mode.as_str().parse::<GpuMode>().unwrap(), mode);
        assert_eq!(mode.to_string(), mode.as_str());
    }
    assert_eq!(
        "Shared".parse::<GpuMode>().unwrap_err(),
        Error::Inventory {
            field: "mode".into(),
            message: "unknown mode \"Shared\"; expected exclusive, shared or mig".into(),
        }
    );
}
