//! The `tessera` command as a user runs it: real binary, real files, exit codes.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Output;

mod support;
use support::{
    allocate, assert_success, printed, repo, simulate, success_json, tessera, write_temp,
};

/// Runs `tessera validate` on the shipped device classes and `file`.
fn validate_with_classes(file: &Path) -> Output {
    tessera(&[
        "validate",
        "-f",
        "deviceclasses",
        "-f",
        file.to_str().unwrap(),
    ])
}

const SLICE: &str = r"
apiVersion: resource.k8s.io/v1
kind: ResourceSlice
metadata:
  name: node-1-gpus
spec:
  driver: gpu.tessera.dev
  nodeName: node-1
  pool: {name: node-1, generation: 1, resourceSliceCount: 1}
  devices:
  - name: gpu-0
    attributes:
      type: {string: gpu}
      sharing: {string: exclusive}
      model: {string: a100-80g}
    capacity:
      memory: {value: 80Gi}
";

const CLASS: &str = r#"
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata:
  name: gpu.tessera.dev
spec:
  selectors:
  - cel:
      expression: device.driver == "gpu.tessera.dev"
"#;

fn claim(name: &str) -> String {
    format!(
        r"
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata:
  name: {name}
  namespace: default
spec:
  devices:
    requests:
    - name: gpu
      exactly:
        deviceClassName: gpu.tessera.dev
"
    )
}

#[test]
fn allocate_prints_the_documented_json_shape() {
    let file = write_temp(
        "one-gpu.yaml",
        &format!(
            "{SLICE}---{CLASS}---{}---{}",
            claim("first"),
            claim("second")
        ),
    );
    let json = success_json(&allocate(&[&file], "json"));
    let results = json["results"].as_array().unwrap();
    assert_eq!(results.len(), 2);
    assert_eq!(results[0]["name"], "first");
    assert_eq!(results[0]["allocated"], true);
    assert_eq!(
        results[0]["allocation"]["devices"]["results"][0]["device"],
        "gpu-0"
    );
    assert_eq!(
        results[1]["allocated"], false,
        "the only GPU is taken: {json}"
    );
    assert!(
        results[1]["reason"].as_str().unwrap().contains("second"),
        "{json}"
    );
}

#[test]
fn unsatisfiable_claims_are_results_not_errors() {
    let file = write_temp("no-slices.yaml", &format!("{CLASS}---{}", claim("lonely")));
    let out = allocate(&[&file], "json");
    assert_eq!(out.status.code(), Some(0));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["results"][0]["allocated"], false);
}

#[test]
fn malformed_input_exits_2_naming_file_object_and_field() {
    let bad = CLASS.replace(
        "name: gpu.tessera.dev\nspec:",
        "name: gpu.tessera.dev\nspec:\n  selectors: 5\n  x:",
    );
    let file = write_temp("bad-class.yaml", &bad);
    let out = tessera(&["allocate", "-f", file.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    // The error is in the output with the results (none here), as `kubectl apply -f` lists it.
    let err = printed(&out);
    assert!(err.contains("bad-class.yaml"), "{err}");
    assert!(err.contains("selectors"), "{err}");

    let not_yaml = write_temp("not-yaml.yaml", "kind: [unclosed");
    let out = tessera(&["allocate", "-f", not_yaml.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));

    let missing = tessera(&["allocate", "-f", "/nonexistent/file.yaml"]);
    assert_eq!(missing.status.code(), Some(2));
}

#[test]
fn validate_accepts_the_shipped_classes_and_examples() {
    let out = tessera(&["validate", "-f", "deviceclasses", "-f", "examples/claims"]);
    assert_success(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("ok:"), "{text}");
}

/// Issue 31, items 8 to 10: what kube-scheduler allocates from native capacity requests on
/// Tessera's GPUs (and the node prepares), `tessera validate` admits as the webhook does:
/// capacity requests on a dedicated GPU, `allocationMode: All` with capacity requests, and a
/// share asking another capacity its GPU may declare.
#[test]
fn validate_admits_native_capacity_requests_kube_scheduler_allocates() {
    let claim = |name: &str, exactly: &str| {
        format!(
            "---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  devices:\n    requests:\n    - name: gpu\n      exactly: {exactly}\n"
        )
    };
    let text = [
        claim(
            "dedicated",
            "{deviceClassName: gpu.tessera.dev, capacity: {requests: {memory: 10Gi}}}",
        ),
        claim(
            "every-shared-gpu",
            "{deviceClassName: shared.gpu.tessera.dev, allocationMode: All, capacity: {requests: {memory: 10Gi, compute: '20'}}}",
        ),
        claim(
            "multiprocessors",
            "{deviceClassName: shared.gpu.tessera.dev, capacity: {requests: {memory: 10Gi, multiprocessors: '40'}}}",
        ),
    ]
    .concat();
    let file = write_temp("native-capacity.yaml", &text);
    let out = validate_with_classes(&file);
    assert_success(&out);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.starts_with("ok:"), "{stdout}");
}

#[test]
fn validate_reports_every_broken_share_rule_with_its_field() {
    let bad = r#"
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: bad-share, namespace: default}
spec:
  devices:
    requests:
    - name: gpus
      exactly:
        deviceClassName: shared.gpu.tessera.dev
        count: 3
        selectors:
        - cel: {expression: 'device.attributes["gpu.tessera.dev"].model =='}
    config:
    - requests: [gpus]
      opaque:
        driver: gpu.tessera.dev
        parameters: {apiVersion: gpu.tessera.dev/v1alpha1, kind: GpuShare, memory: 10Gi}
"#;
    let file = write_temp("bad-share.yaml", bad);
    let out = tessera(&["validate", "-f", file.to_str().unwrap()]);
    // The CEL syntax error is one the API server refuses: malformed input.
    assert_eq!(out.status.code(), Some(2));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("ResourceClaim default/bad-share"), "{text}");
    assert!(
        text.contains("memory 10Gi over 3 cards is not a whole number of GiB per card"),
        "{text}"
    );
    assert!(
        text.contains("spec.devices.requests[0].exactly.selectors[0].cel.expression"),
        "{text}"
    );
}

#[test]
fn validate_refuses_a_claim_that_raises_itself_above_its_class_tier() {
    let online = r"
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: pushy, namespace: default}
spec:
  devices:
    requests:
    - name: gpu
      exactly: {deviceClassName: batch.gpu.tessera.dev}
    config:
    - requests: [gpu]
      opaque:
        driver: gpu.tessera.dev
        parameters: {apiVersion: gpu.tessera.dev/v1alpha1, kind: GpuShare, memory: 4Gi, tier: online}
";
    let file = write_temp("pushy.yaml", online);
    let out = validate_with_classes(&file);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("ResourceClaim default/pushy"), "{text}");
    assert!(
        text.contains("spec.devices.config[0].opaque.parameters.tier"),
        "{text}"
    );
    assert!(text.contains("allowOnline: false"), "{text}");
}

#[test]
fn validate_refuses_a_patience_that_is_not_a_bounded_duration() {
    let claim = |patience: &str| {
        format!(
            r"
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {{name: patient, namespace: default}}
spec:
  devices:
    requests:
    - name: gpu
      exactly: {{deviceClassName: batch.gpu.tessera.dev}}
    config:
    - requests: [gpu]
      opaque:
        driver: gpu.tessera.dev
        parameters: {{apiVersion: gpu.tessera.dev/v1alpha1, kind: GpuShare, memory: 4Gi, patience: {patience}}}
"
        )
    };
    for (name, patience, rule) in [
        ("forever.yaml", "forever", "not a duration"),
        (
            "two-days.yaml",
            "48h",
            "longer than the longest patience, 24h",
        ),
    ] {
        let file = write_temp(name, &claim(patience));
        let out = validate_with_classes(&file);
        assert_eq!(out.status.code(), Some(1), "{patience}");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("ResourceClaim default/patient"), "{text}");
        assert!(
            text.contains("spec.devices.config[0].opaque.parameters"),
            "{text}"
        );
        assert!(text.contains(rule), "{text}");
    }
    let file = write_temp("ten-minutes.yaml", &claim("10m"));
    assert_success(&validate_with_classes(&file));
}

#[test]
fn demo_reports_every_example_claim() {
    let out = tessera(&["demo"]);
    assert_success(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    for entry in std::fs::read_dir(repo().join("examples/claims")).unwrap() {
        let yaml = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        let name = yaml
            .lines()
            .find_map(|l| l.trim().strip_prefix("name: "))
            .unwrap();
        assert!(
            text.contains(name),
            "demo report does not mention claim {name}:\n{text}"
        );
    }
    assert!(
        text.contains("cdiVersion"),
        "the report shows a CDI spec:\n{text}"
    );
}

#[test]
fn allocate_reads_v1beta1_objects_as_a_1_32_cluster_writes_them() {
    let old = r#"
apiVersion: resource.k8s.io/v1beta1
kind: ResourceSlice
metadata: {name: node-1-gpus}
spec:
  driver: gpu.tessera.dev
  nodeName: node-1
  pool: {name: node-1, generation: 1, resourceSliceCount: 1}
  devices:
  - name: gpu-0
    basic:
      attributes:
        type: {string: gpu}
        sharing: {string: exclusive}
      capacity:
        memory: {value: 80Gi}
---
apiVersion: resource.k8s.io/v1beta1
kind: DeviceClass
metadata: {name: gpu.tessera.dev}
spec:
  selectors:
  - cel: {expression: 'device.attributes["gpu.tessera.dev"].type == "gpu"'}
---
apiVersion: resource.k8s.io/v1beta1
kind: ResourceClaim
metadata: {name: old-style, namespace: default}
spec:
  devices:
    requests:
    - name: gpu
      deviceClassName: gpu.tessera.dev
      count: 1
"#;
    let file = write_temp("v1beta1.yaml", old);
    let json = success_json(&allocate(&[&file], "json"));
    assert_eq!(json["results"][0]["allocated"], true, "{json}");
    assert_eq!(
        json["results"][0]["allocation"]["devices"]["results"][0]["device"],
        "gpu-0"
    );
}

#[test]
fn allocate_places_a_pods_claims_together_or_not_at_all() {
    // Two claims of one pod need two GPUs on one node; each node has one, so neither is placed,
    // and a later single claim still gets a GPU.
    let second = SLICE.replace("node-1", "node-2");
    let pod = r"
apiVersion: v1
kind: Pod
metadata: {name: trainer, namespace: default}
spec:
  containers: [{name: main, image: busybox}]
  resourceClaims:
  - {name: a, resourceClaimName: first}
  - {name: b, resourceClaimName: second}
";
    let text = format!(
        "{SLICE}---{second}---{CLASS}---{}---{}---{}---{pod}",
        claim("first"),
        claim("second"),
        claim("third")
    );
    let file = write_temp("pod.yaml", &text);
    let json = success_json(&allocate(&[&file], "json"));
    let results = json["results"].as_array().unwrap();
    assert_eq!(results[0]["allocated"], false, "{json}");
    assert_eq!(results[1]["allocated"], false, "{json}");
    assert_eq!(results[2]["allocated"], true, "{json}");
}

#[test]
fn allocate_counts_the_cpu_of_pods_placed_earlier_in_the_batch() {
    // Each node has two GPUs but CPU for only one of the two pods: first-fit would put both on
    // node-1 if the batch forgot what the first pod took.
    let two_gpus = |node: &str| {
        SLICE.replace("node-1", node).replace(
            "  - name: gpu-0\n",
            "  - name: gpu-1\n    attributes: {type: {string: gpu}, sharing: {string: exclusive}}\n    capacity: {memory: {value: 80Gi}}\n  - name: gpu-0\n",
        )
    };
    let node = |name: &str| {
        format!(
            "apiVersion: v1\nkind: Node\nmetadata: {{name: {name}, labels: {{kubernetes.io/hostname: {name}}}}}\nstatus: {{allocatable: {{cpu: '4', memory: 16Gi, pods: '110'}}}}\n"
        )
    };
    let pod = |name: &str, claim: &str| {
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  containers: [{{name: main, image: busybox, resources: {{requests: {{cpu: '3'}}}}}}]\n  resourceClaims: [{{name: gpu, resourceClaimName: {claim}}}]\n"
        )
    };
    let text = [
        two_gpus("node-1"),
        two_gpus("node-2"),
        node("node-1"),
        node("node-2"),
        CLASS.to_owned(),
        claim("first"),
        claim("second"),
        pod("a", "first"),
        pod("b", "second"),
    ]
    .join("---\n");
    let file = write_temp("cpu.yaml", &text);
    let json = success_json(&tessera(&[
        "allocate",
        "-f",
        file.to_str().unwrap(),
        "--policy",
        "first-fit",
        "-o",
        "json",
    ]));
    let results = json["results"].as_array().unwrap();
    let pool = |i: usize| results[i]["allocation"]["devices"]["results"][0]["pool"].clone();
    assert_eq!(pool(0), "node-1", "{json}");
    assert_eq!(pool(1), "node-2", "{json}");
}

const TRACE_NODES: &str = "\
sn,cpu_milli,memory_mib,gpu,model
node-a,32000,131072,2,G2
node-b,16000,65536,1,T4
";

const TRACE_PODS: &str = "\
name,cpu_milli,memory_mib,num_gpu,gpu_milli
p0,4000,8192,1,500
p1,4000,8192,1,1000
p2,2000,4096,0,0
p3,4000,8192,2,1000
";

#[test]
fn simulate_reports_unallocated_gpu_per_seed_and_mean_as_json() {
    let nodes = write_temp("nodes.csv", TRACE_NODES);
    let pods = write_temp("pods.csv", TRACE_PODS);
    let json = success_json(&simulate(
        &nodes,
        &pods,
        &["--seeds", "1..3", "--policy", "fgd", "-o", "json"],
    ));
    assert_eq!(json["policy"], "fgd");
    assert_eq!(json["gpus"], 3);
    let seeds = json["seeds"].as_array().unwrap();
    assert_eq!(seeds.len(), 3);
    assert!(seeds.iter().all(|s| s["unallocated_pct_at_100"].is_f64()));
    assert!(json["unallocated_pct_at_100"].is_f64());
    assert_eq!(json["allocation_curve"].as_array().unwrap().len(), 131);
}

#[test]
fn simulate_defaults_to_the_best_policy_and_prints_a_table() {
    let nodes = write_temp("nodes2.csv", TRACE_NODES);
    let pods = write_temp("pods2.csv", TRACE_PODS);
    let out = simulate(&nodes, &pods, &["--seed", "42"]);
    assert_success(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("policy demand-fgd"), "{text}");
    assert!(
        text.contains("UNALLOC@100") && text.contains("mean"),
        "{text}"
    );
}

#[test]
fn simulate_mixing_reports_online_and_batch_apart_and_refuses_bad_factors() {
    let nodes = write_temp("nodes-mix.csv", TRACE_NODES);
    let pods = write_temp(
        "pods-mix.csv",
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos\n\
         p0,4000,8192,1,500,,LS\np1,4000,8192,1,600,,BE\np2,4000,8192,1,700,,BE\n\
         p3,4000,8192,1,1000,,Burstable\n",
    );
    let mixing = |extra: &[&str]| {
        let mut args = vec!["--seeds", "1..2", "--mixing"];
        args.extend_from_slice(extra);
        simulate(&nodes, &pods, &args)
    };
    let json = success_json(&mixing(&["--batch-memory-overcommit", "2", "-o", "json"]));
    let mean = &json["mixing"];
    assert!(mean["online_placed_pct_at_100"].is_f64(), "{json}");
    assert!(mean["batch_overcommitted_pct_at_100"].is_f64(), "{json}");
    let seed = &json["seeds"][0]["mixing"];
    assert!(seed["online_gpu_tasks"].as_u64().unwrap() > 0, "{json}");
    // Without --mixing the JSON has no mixing figures.
    let plain = success_json(&simulate(&nodes, &pods, &["--seed", "1", "-o", "json"]));
    assert!(plain.get("mixing").is_none(), "{plain}");
    // A factor out of range, or one without --mixing, is a usage error.
    let out = mixing(&["--batch-overcommit", "0.5"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("1.0..=10.0"));
    let out = simulate(&nodes, &pods, &["--batch-overcommit", "2"]);
    assert_eq!(out.status.code(), Some(2));
    // A pod list without qos cannot be mixed.
    let bare = write_temp("pods-bare.csv", TRACE_PODS);
    let out = simulate(&nodes, &bare, &["--seed", "1", "--mixing"]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("qos"));
}

#[test]
fn simulate_names_the_file_line_and_column_of_a_bad_value() {
    let nodes = write_temp("nodes3.csv", TRACE_NODES);
    let pods = write_temp(
        "pods3.csv",
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,1,2000\n",
    );
    let out = simulate(&nodes, &pods, &["--seed", "1"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("pods3.csv line 2") && err.contains("gpu_milli"),
        "{err}"
    );
    let reversed = simulate(&nodes, &pods, &["--seeds", "9..3"]);
    assert_eq!(reversed.status.code(), Some(2));
}

/// A snapshot (as `tessera allocate` reads it) where a 60Gi share fits nowhere: node `a`'s two
/// GPUs each hold a 50Gi batch share, node `c`'s one GPU 30Gi online; every pod is a
/// `ReplicaSet`'s.
fn fragmented_snapshot() -> String {
    use k8s_openapi::api::resource::v1 as res;
    use tessera_driver::apiversion::{self, ApiVersion};
    use tessera_driver::node::slices::{self, RenderOptions};
    use tessera_driver::placement::allocator::{Allocator, AllocatorOptions, Snapshot};
    use tessera_driver::testing;

    let inventory = testing::inventory(
        "nodes:\n- name: a\n  mode: shared\n  gpus:\n  - model: a100-80g\n    count: 2\n\
         - name: c\n  mode: shared\n  gpus:\n  - model: a100-80g\n    count: 1\n",
    );
    let rendered: Vec<res::ResourceSlice> = inventory
        .nodes
        .iter()
        .flat_map(|n| slices::render(n, &RenderOptions::default()).unwrap())
        .collect();
    let classes: Vec<res::DeviceClass> = [testing::SHARED_CLASS_YAML, testing::BATCH_CLASS_YAML]
        .into_iter()
        .map(testing::class_from_yaml)
        .collect();
    let mut snapshot = Snapshot::new(&rendered, &classes, &[]).unwrap();
    let allocator = Allocator::new(AllocatorOptions::default());
    let mut docs: Vec<serde_json::Value> = rendered
        .iter()
        .map(|s| apiversion::encode_slice(s, ApiVersion::V1).unwrap())
        .collect();
    let pod = |name: &str| {
        serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "uid": format!("pod-{name}"),
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                              "name": "rs", "uid": "rs", "controller": true}]},
            "spec": {"containers": [{"name": "c", "image": "x"}],
                     "resourceClaims": [{"name": "gpu", "resourceClaimName": name}]},
        })
    };
    for (name, class, gib, on) in [
        ("a0", "batch.gpu.tessera.dev", 50, "a"),
        ("a1", "batch.gpu.tessera.dev", 50, "a"),
        ("c0", "shared.gpu.tessera.dev", 30, "c"),
    ] {
        let mut claim =
            testing::gpu_claim(name, class, Some(testing::gpu_share(&format!("{gib}Gi"))));
        let placed = allocator
            .allocate(&snapshot, &[&claim], &[testing::k8s_node(on)])
            .unwrap();
        snapshot.commit(&claim, &placed.allocations[0]);
        claim.status = Some(res::ResourceClaimStatus {
            allocation: Some(placed.allocations[0].clone()),
            ..Default::default()
        });
        let mut value = serde_json::to_value(&claim).unwrap();
        value["apiVersion"] = serde_json::json!("resource.k8s.io/v1");
        value["kind"] = serde_json::json!("ResourceClaim");
        docs.push(value);
        docs.push(pod(name));
    }
    let mut big = serde_json::to_value(testing::gpu_claim(
        "big",
        "shared.gpu.tessera.dev",
        Some(testing::gpu_share("60Gi")),
    ))
    .unwrap();
    big["apiVersion"] = serde_json::json!("resource.k8s.io/v1");
    big["kind"] = serde_json::json!("ResourceClaim");
    docs.push(big);
    docs.push(pod("big"));
    docs.iter()
        .map(|d| serde_yaml::to_string(d).unwrap())
        .collect::<Vec<_>>()
        .join("---\n")
}

#[test]
fn defrag_prints_the_move_that_makes_room_with_its_reason() {
    let file = write_temp("defrag-snapshot.yaml", &fragmented_snapshot());
    let out = tessera(&[
        "defrag",
        "-f",
        "deviceclasses",
        "-f",
        file.to_str().unwrap(),
    ]);
    assert_success(&out);
    let text = printed(&out);
    assert!(
        text.contains("default/big: fits on a after 1 move(s):"),
        "{text}"
    );
    assert!(
        text.contains(
            "move default/a0  a -> c  because default/a0 holds 50.0Gi of batch GPU memory on a"
        ),
        "{text}"
    );
    let off = tessera(&[
        "defrag",
        "--budget",
        "0",
        "-f",
        "deviceclasses",
        "-f",
        file.to_str().unwrap(),
    ]);
    assert_success(&off);
    assert!(
        printed(&off).contains("default/big: no plan"),
        "{}",
        printed(&off)
    );
}

#[test]
fn simulate_time_compares_a_static_split_with_the_schedule_and_never_evicts_online_pods() {
    let nodes = write_temp(
        "nodes-time.csv",
        "sn,cpu_milli,memory_mib,gpu,model\n\
         node-a,32000,131072,1,T4\nnode-b,32000,131072,1,T4\nnode-c,32000,131072,1,T4\n\
         node-d,32000,131072,1,T4\n",
    );
    // From 15:00 UTC: online work by day, batch work that fills every batch GPU for a day.
    let mut pods = String::from(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n",
    );
    pods.extend((0..6).map(|i| format!("b{i},1000,1024,1,1000,,BE,Running,0,43200,0\n")));
    pods.push_str("o0,1000,1024,1,500,,LS,Running,0,86400,0\n");
    pods.push_str("o1,1000,1024,1,1000,,Guaranteed,Running,3600,7200,3600\n");
    pods.push_str("c0,1000,1024,0,0,,Burstable,Running,0,600,0\n");
    let pods = write_temp("pods-time.csv", &pods);
    let schedule = repo().join("examples/schedules/day-night.yaml");
    let args = [
        "--time",
        "--schedule",
        schedule.to_str().unwrap(),
        "--defrag-evictions-per-hour",
        "2",
        "--batch-nodes",
        "25",
        "--tidal-nodes",
        "50",
    ];
    let mut json_args = args.to_vec();
    json_args.extend(["-o", "json"]);
    let json = success_json(&simulate(&nodes, &pods, &json_args));
    let scenarios = json["scenarios"].as_array().unwrap();
    let names: Vec<&str> = scenarios
        .iter()
        .map(|s| s["scenario"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["static", "static+defrag", "tidal", "tidal+defrag"],
        "{json}"
    );
    for s in scenarios {
        assert_eq!(s["online_evicted"], 0, "{s}");
        assert_eq!(s["tasks_by_qos"]["Guaranteed"], 1, "{s}");
    }
    // The night gives batch the tidal nodes: more batch GPU-hours than the static split.
    let batch = |i: usize| scenarios[i]["batch_gpu_hours"].as_f64().unwrap();
    assert!(batch(2) > batch(0), "{json}");
    let table = simulate(&nodes, &pods, &args);
    assert_success(&table);
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(
        text.contains("BATCH-GPUh") && text.contains("tidal+defrag") && text.contains("ONLINE-EV"),
        "{text}"
    );
}

#[test]
fn simulate_time_refuses_a_pod_list_without_time_columns_naming_file_and_column() {
    let nodes = write_temp("nodes-time2.csv", TRACE_NODES);
    let pods = write_temp("multigpu-like.csv", TRACE_PODS);
    let out = simulate(&nodes, &pods, &["--time"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("multigpu-like.csv") && err.contains("qos") && err.contains("column"),
        "{err}"
    );
    let out = simulate(&nodes, &pods, &["--schedule", "x.yaml"]);
    assert_eq!(out.status.code(), Some(2), "--schedule needs --time");
}
