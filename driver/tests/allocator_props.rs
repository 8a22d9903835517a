//! Property tests of the allocator's invariants over random clusters and claim streams.

use std::collections::{BTreeMap, HashMap};

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1 as res;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity as K8sQuantity;
use proptest::prelude::*;
use serde_json::json;
use tessera_driver::Quantity;
use tessera_driver::placement::allocator::{Allocator, AllocatorOptions, Policy, Snapshot};
use tessera_driver::testing::{
    self, exact_request, gpu_device, k8s_node, opaque_config, sharing_class,
};

const D: &str = "gpu.tessera.dev";
const GIB: u64 = 1 << 30;

#[derive(Debug, Clone)]
struct Gpu {
    shared: bool,
    multi: bool,
    island: u8,
    memory_gib: u64,
}

#[derive(Debug, Clone)]
enum Ask {
    Whole {
        count: i64,
        same_island: bool,
    },
    Share {
        memory_gib: u64,
        compute: i64,
        count: i64,
    },
    Native {
        memory_gib: u64,
    },
}

fn device(i: usize, g: &Gpu) -> res::Device {
    gpu_device(
        &format!("gpu-{i}"),
        &[
            ("sharing", if g.shared { "shared" } else { "exclusive" }),
            ("nvlinkDomain", &format!("island-{}", g.island)),
        ],
        &format!("{}Gi", g.memory_gib),
        g.shared && g.multi,
    )
}

fn claim(i: usize, ask: &Ask) -> res::ResourceClaim {
    let mut devices = res::DeviceClaim::default();
    match ask {
        Ask::Whole { count, same_island } => {
            devices.requests = Some(vec![exact_request("gpus", "gpu", *count)]);
            if *same_island {
                devices.constraints = Some(vec![res::DeviceConstraint {
                    match_attribute: Some(format!("{D}/nvlinkDomain")),
                    ..Default::default()
                }]);
            }
        }
        Ask::Share {
            memory_gib,
            compute,
            count,
        } => {
            devices.requests = Some(vec![exact_request("share", "shared", *count)]);
            let mut p = json!({"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuShare", "memory": format!("{}Gi", memory_gib * u64::try_from(*count).expect("positive count"))});
            if *compute > 0 {
                p["compute"] = json!(compute * count);
            }
            devices.config = Some(vec![opaque_config(p)]);
        }
        Ask::Native { memory_gib } => {
            let mut native = exact_request("native", "shared", 1);
            if let Some(x) = native.exactly.as_mut() {
                x.capacity = Some(res::CapacityRequirements {
                    requests: Some(
                        [("memory".to_owned(), K8sQuantity(format!("{memory_gib}Gi")))].into(),
                    ),
                });
            }
            devices.requests = Some(vec![native]);
        }
    }
    testing::claim("default", &format!("c{i}"), &format!("uid-{i}"), devices)
}

fn gpu_strategy() -> impl Strategy<Value = Gpu> {
    (
        any::<bool>(),
        any::<bool>(),
        0..2u8,
        prop_oneof![Just(16u64), Just(40), Just(80)],
    )
        .prop_map(|(shared, multi, island, memory_gib)| Gpu {
            shared,
            multi,
            island,
            memory_gib,
        })
}

fn ask_strategy() -> impl Strategy<Value = Ask> {
    prop_oneof![
        (1..4i64, any::<bool>()).prop_map(|(count, same_island)| Ask::Whole { count, same_island }),
        (
            1..24u64,
            prop_oneof![Just(0i64), Just(25), Just(50)],
            1..3i64
        )
            .prop_map(|(memory_gib, compute, count)| Ask::Share {
                memory_gib,
                compute,
                count
            }),
        (1..30u64).prop_map(|memory_gib| Ask::Native { memory_gib }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn committed_streams_never_overbook(
        nodes in prop::collection::vec(prop::collection::vec(gpu_strategy(), 1..5), 1..4),
        asks in prop::collection::vec(ask_strategy(), 1..25),
        policy in prop_oneof![Just(Policy::FirstFit), Just(Policy::Binpack), Just(Policy::Spread)],
    ) {
        let slices: Vec<res::ResourceSlice> = nodes.iter().enumerate().map(|(n, gpus)| {
            testing::slice(&format!("node-{n}-slice"), &format!("node-{n}"), gpus.iter().enumerate().map(|(i, g)| device(i, g)).collect())
        }).collect();
        let gpu_of = |pool: &str, dev: &str| -> Gpu {
            let n: usize = pool.trim_start_matches("node-").parse().unwrap();
            let i: usize = dev.trim_start_matches("gpu-").parse().unwrap();
            nodes[n][i].clone()
        };
        let candidates: Vec<Node> = (0..nodes.len()).map(|n| k8s_node(&format!("node-{n}"))).collect();
        let classes = [sharing_class("gpu", "exclusive"), sharing_class("shared", "shared")];
        let mut snap = Snapshot::new(&slices, &classes, &[]).unwrap();
        let allocator = Allocator::new(AllocatorOptions { policy, ..AllocatorOptions::default() });
        let mut exclusive: HashMap<(String, String), u32> = HashMap::new();
        let mut memory: HashMap<(String, String), u64> = HashMap::new();
        let mut compute: HashMap<(String, String), i64> = HashMap::new();
        for (i, ask) in asks.iter().enumerate() {
            let c = claim(i, ask);
            let Ok(placement) = allocator.allocate(&snap, &[&c], &candidates) else { continue };
            let allocation = &placement.allocations[0];
            snap.commit(&c, allocation);
            let devices = allocation.devices.as_ref().unwrap();
            let results = devices.results.clone().unwrap();
            let records: BTreeMap<String, (u64, i64)> = devices.config.iter().flatten()
                .filter_map(|cfg| cfg.opaque.as_ref())
                .filter(|o| o.parameters.0["kind"] == "AllocatedShares")
                .flat_map(|o| o.parameters.0["devices"].as_array().unwrap().clone())
                .map(|d| {
                    let mem = Quantity::parse(d["memory"].as_str().unwrap()).unwrap().as_units().unwrap();
                    (d["device"].as_str().unwrap().to_owned(), (u64::try_from(mem).unwrap(), d["compute"].as_i64().unwrap()))
                })
                .collect();
            let mut islands = Vec::new();
            let mut seen = Vec::new();
            for r in &results {
                prop_assert_eq!(&r.pool, &placement.node, "every device of a claim is on the chosen node");
                let g = gpu_of(&r.pool, &r.device);
                let key = (r.pool.clone(), r.device.clone());
                islands.push(g.island);
                match ask {
                    Ask::Whole { .. } => {
                        prop_assert!(!g.shared, "whole GPUs come from the exclusive class");
                        *exclusive.entry(key.clone()).or_default() += 1;
                    }
                    // Capacity requests on a GPU that does not allow multiple allocations
                    // take it whole, as kube-scheduler allocates them.
                    Ask::Native { .. } if !g.multi => {
                        prop_assert!(g.shared, "the shared class selects shared GPUs");
                        prop_assert!(!records.contains_key(&r.device), "no share record");
                        prop_assert!(r.share_id.is_none() && r.consumed_capacity.is_none());
                        *exclusive.entry(key.clone()).or_default() += 1;
                    }
                    Ask::Share { .. } | Ask::Native { .. } => {
                        prop_assert!(g.shared, "shares land on shared GPUs");
                        prop_assert!(!seen.contains(&key), "a share's cards are distinct GPUs");
                        let (m, c) = records[&r.device];
                        if g.multi {
                            let cc = r.consumed_capacity.as_ref().unwrap();
                            prop_assert!(r.share_id.is_some());
                            let consumed = Quantity::parse(&cc["memory"].0).unwrap().as_units().unwrap();
                            prop_assert!(u64::try_from(consumed).unwrap() >= m);
                        }
                        *memory.entry(key.clone()).or_default() += m;
                        *compute.entry(key.clone()).or_default() += c;
                        prop_assert!(memory[&key] <= g.memory_gib * GIB, "memory of {:?} overbooked", key);
                        prop_assert!(compute[&key] <= 100, "compute of {:?} overbooked", key);
                    }
                }
                seen.push(key);
            }
            if let Ask::Whole { same_island: true, .. } = ask {
                prop_assert!(islands.windows(2).all(|w| w[0] == w[1]), "matchAttribute holds");
            }
        }
        for (key, n) in &exclusive {
            prop_assert!(*n <= 1, "{:?} allocated whole {} times", key, n);
            prop_assert!(!memory.contains_key(key), "{:?} both whole and shared", key);
        }
    }
}
