use super::*;
use crate::node::host_dir::HostDir;
use crate::node::mps::mps_daemon_id;
use crate::node::prepared::{GpuNode, MigNode};
use crate::rules::share::GIB;

const UID: &str = "0b7e2a64-1c0f-4a58-9d55-3f1f8e0c2a11";
const GPU0: &str = "GPU-8a0c4f7e-6f41-4b9e-9c51-1d2e3f405060";
const GPU1: &str = "GPU-1b2c3d4e-5f60-4a7b-8c9d-0e1f2a3b4c5d";
const MIG0: &str = "MIG-5d7a1c2e-3b4f-5a6b-9c8d-7e6f5a4b3c2d";

fn gpu(index: u32, uuid: &str) -> GpuNode {
    GpuNode {
        index,
        uuid: uuid.into(),
        minor: index,
    }
}

fn device(request: &str, name: &str, gpu: GpuNode, share: Option<(u64, i64)>) -> PreparedDevice {
    PreparedDevice {
        request: request.into(),
        pool: "node-a".into(),
        device: name.into(),
        gpu,
        mig: None,
        share: share.map(|(gib, compute)| PerDeviceShare {
            memory_bytes: gib * GIB,
            compute_percent: compute,
        }),
        tier: Tier::Online,
        memory_overcommitted: false,
        share_id: None,
    }
}

fn claim(devices: Vec<PreparedDevice>) -> PreparedClaim {
    PreparedClaim {
        uid: UID.into(),
        namespace: "team-a".into(),
        name: "train".into(),
        devices,
    }
}

fn mps() -> Enforcement {
    Enforcement::Mps {
        pipe_dir_root: "/run/tessera/mps".into(),
        log_dir_root: "/var/log/tessera/mps".into(),
    }
}

fn hami() -> Enforcement {
    Enforcement::HamiCore {
        library_path: "/usr/local/lib/hami/libvgpu.so".into(),
        cache_dir: "/var/lib/tessera/hami".into(),
    }
}

fn shared_claim() -> PreparedClaim {
    claim(vec![device("gpu", "gpu-0", gpu(0, GPU0), Some((10, 50)))])
}

fn env(spec: &CdiSpec) -> Vec<String> {
    spec.container_edits.clone().unwrap_or_default().env
}

fn has_env(spec: &CdiSpec, prefix: &str) -> bool {
    env(spec).iter().any(|e| e.starts_with(prefix))
}

fn nodes(edits: &ContainerEdits) -> Vec<&str> {
    edits.device_nodes.iter().map(|n| n.path.as_str()).collect()
}

fn err(c: &PreparedClaim, e: &Enforcement) -> String {
    build_spec(c, e).unwrap_err().to_string()
}

#[test]
fn whole_gpu_gets_its_node_and_no_enforcement() {
    let c = claim(vec![device("gpu", "gpu-3", gpu(3, GPU0), None)]);
    let spec = build_spec(&c, &mps()).unwrap();
    assert_eq!(spec.kind, "k8s.gpu.tessera.dev/claim");
    assert_eq!(spec.cdi_version, "1.1.0");
    assert_eq!(spec.devices.len(), 1);
    assert_eq!(spec.devices[0].name, format!("{UID}-gpu-3"));
    assert_eq!(nodes(&spec.devices[0].container_edits), ["/dev/nvidia3"]);
    let edits = spec.container_edits.clone().unwrap();
    assert_eq!(edits.env, [format!("NVIDIA_VISIBLE_DEVICES={GPU0}")]);
    assert_eq!(
        nodes(&edits),
        ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    );
    assert!(edits.mounts.is_empty());
    assert_eq!(spec, build_spec(&c, &hami()).unwrap());
    assert_eq!(render(&c, &mps()).unwrap().mps_daemon, None);
    assert!(render(&c, &hami()).unwrap().host_dirs.is_empty());
}

#[test]
fn mig_instance_gets_parent_and_capability_nodes() {
    let mut d = device("mig", "gpu-1-mig-1g.10gb-0", gpu(1, GPU0), None);
    d.mig = Some(MigNode {
        uuid: MIG0.into(),
        gpu_instance: 7,
        compute_instance: 0,
        gpu_instance_cap_minor: 66,
        compute_instance_cap_minor: 67,
    });
    let spec = build_spec(&claim(vec![d]), &mps()).unwrap();
    assert_eq!(spec.devices[0].name, format!("{UID}-gpu-1-mig-1g.10gb-0"));
    assert_eq!(
        nodes(&spec.devices[0].container_edits),
        [
            "/dev/nvidia1",
            "/dev/nvidia-caps/nvidia-cap66",
            "/dev/nvidia-caps/nvidia-cap67"
        ]
    );
    assert_eq!(env(&spec), [format!("NVIDIA_VISIBLE_DEVICES={MIG0}")]);
}

#[test]
fn mps_share_matches_the_golden_spec() {
    let spec = build_spec(&shared_claim(), &mps()).unwrap();
    let json = spec.to_json().unwrap();
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/golden/cdi-mps-share.json"
    );
    if std::env::var_os("TESSERA_UPDATE_GOLDEN").is_some() {
        std::fs::write(path, &json).unwrap();
    }
    assert_eq!(
        json,
        include_str!("../../../tests/golden/cdi-mps-share.json")
    );
    // The output is a pure function of the input.
    assert_eq!(
        json,
        build_spec(&shared_claim(), &mps())
            .unwrap()
            .to_json()
            .unwrap()
    );
    let back: CdiSpec = serde_json::from_str(&json).unwrap();
    assert_eq!(back, spec);
}

#[test]
fn mps_share_sets_client_limits_and_mounts_its_daemon() {
    let spec = build_spec(&shared_claim(), &mps()).unwrap();
    let daemon = render(&shared_claim(), &mps()).unwrap().mps_daemon.unwrap();
    assert_eq!(daemon.id, mps_daemon_id([GPU0]));
    assert_eq!(daemon.devices, [GPU0]);
    assert_eq!(
        daemon.pipe_dir,
        format!("/run/tessera/mps/{}/pipe", daemon.id)
    );
    assert_eq!(
        daemon.log_dir,
        format!("/var/log/tessera/mps/{}", daemon.id)
    );
    assert_eq!(
        env(&spec),
        [
            format!("NVIDIA_VISIBLE_DEVICES={GPU0}"),
            "TESSERA_GPU_MEMORY_LIMIT_BYTES=10737418240".to_owned(),
            "TESSERA_GPU_MEMORY_LIMIT_BYTES_0=10737418240".to_owned(),
            "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps".to_owned(),
            "CUDA_MPS_CLIENT_PRIORITY=0".to_owned(),
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50".to_owned(),
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M".to_owned(),
        ]
    );
    let mounts = spec.container_edits.unwrap().mounts;
    assert_eq!(mounts[0].host_path, daemon.pipe_dir);
    assert_eq!(mounts[0].container_path, "/tmp/nvidia-mps");
    assert_eq!(mounts[1].host_path, daemon.shm_dir);
    assert_eq!(mounts[1].container_path, "/dev/shm");
}

#[test]
fn mps_share_without_compute_sets_no_thread_percentage() {
    let c = claim(vec![device("gpu", "gpu-0", gpu(0, GPU0), Some((4, 0)))]);
    let spec = build_spec(&c, &mps()).unwrap();
    assert!(!has_env(&spec, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"));
    assert!(has_env(&spec, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4096M"));
}

#[test]
fn hami_core_share_preloads_the_library_and_sets_its_limits() {
    let spec = build_spec(&shared_claim(), &hami()).unwrap();
    assert_eq!(
        env(&spec),
        [
            format!("NVIDIA_VISIBLE_DEVICES={GPU0}"),
            "TESSERA_GPU_MEMORY_LIMIT_BYTES=10737418240".to_owned(),
            "TESSERA_GPU_MEMORY_LIMIT_BYTES_0=10737418240".to_owned(),
            format!("CUDA_VISIBLE_DEVICES={GPU0}"),
            "LD_PRELOAD=/usr/local/tessera/hami/libvgpu.so".to_owned(),
            "CUDA_DEVICE_MEMORY_SHARED_CACHE=/run/tessera/hami/vgpu.cache".to_owned(),
            "CUDA_TASK_PRIORITY=0".to_owned(),
            "CUDA_DEVICE_MEMORY_LIMIT_0=10240m".to_owned(),
            "CUDA_DEVICE_SM_LIMIT=50".to_owned(),
        ]
    );
    let mounts = spec.container_edits.unwrap().mounts;
    assert_eq!(mounts[0].host_path, "/usr/local/lib/hami/libvgpu.so");
    assert_eq!(mounts[0].options, ["ro", "nosuid", "nodev", "bind"]);
    let dirs = render(&shared_claim(), &hami()).unwrap().host_dirs;
    assert_eq!(
        dirs,
        [
            HostDir {
                root: "/var/lib/tessera/hami".to_owned(),
                path: format!("/var/lib/tessera/hami/{UID}"),
                mode: 0o755,
                owner: None
            },
            HostDir {
                root: "/var/lib/tessera/hami".to_owned(),
                path: format!("/var/lib/tessera/hami/{UID}/cache"),
                mode: 0o1777,
                owner: None
            },
            HostDir {
                root: "/var/lib/tessera/hami".to_owned(),
                path: format!("/var/lib/tessera/hami/{UID}/vgpulock"),
                mode: 0o1777,
                owner: None
            },
        ]
    );
    assert_eq!(mounts[1].host_path, dirs[1].path);
    assert_eq!(mounts[1].container_path, "/run/tessera/hami");
    assert_eq!(mounts[2].host_path, dirs[2].path);
    assert_eq!(mounts[2].container_path, "/tmp/vgpulock");
}

#[test]
fn a_hami_claims_two_writable_directories_lie_side_by_side_in_a_directory_no_container_sees() {
    // The lock directory once lay inside the cache directory: a tenant replaced it with a link
    // to `/` and the next container start bound the host's root read-write.
    let r = render(&shared_claim(), &hami()).unwrap();
    let mounts = r.spec.container_edits.unwrap().mounts;
    let (cache, lock) = (&mounts[1].host_path, &mounts[2].host_path);
    assert!(!binds::lies_within(lock, cache) && !binds::lies_within(cache, lock));
    let own = &r.host_dirs[0].path;
    assert!(binds::lies_within(cache, own) && binds::lies_within(lock, own));
    assert!(mounts.iter().all(|m| m.host_path != *own));
}

#[test]
fn none_enforcement_writes_no_limits_but_tells_the_workload_its_booking() {
    let spec = build_spec(&shared_claim(), &Enforcement::None).unwrap();
    assert_eq!(
        env(&spec),
        [
            format!("NVIDIA_VISIBLE_DEVICES={GPU0}"),
            "TESSERA_GPU_MEMORY_LIMIT_BYTES=10737418240".to_owned(),
            "TESSERA_GPU_MEMORY_LIMIT_BYTES_0=10737418240".to_owned(),
        ]
    );
    assert!(spec.container_edits.unwrap().mounts.is_empty());
    assert_eq!(
        render(&shared_claim(), &Enforcement::None)
            .unwrap()
            .mps_daemon,
        None
    );
}

#[test]
fn multi_gpu_share_uses_one_daemon_for_the_set_in_uuid_order() {
    // Allocation order differs from UUID order: ordinals follow the daemon's (sorted) order.
    let c = claim(vec![
        device("gpus", "gpu-0", gpu(0, GPU0), Some((8, 25))),
        device("gpus", "gpu-1", gpu(1, GPU1), Some((8, 25))),
    ]);
    let spec = build_spec(&c, &mps()).unwrap();
    assert_eq!(spec.devices.len(), 2);
    let daemon = render(&c, &mps()).unwrap().mps_daemon.unwrap();
    assert_eq!(daemon.devices, [GPU1, GPU0]);
    assert_eq!(daemon.id, mps_daemon_id([GPU0, GPU1]));
    assert_eq!(
        env(&spec),
        [
            format!("NVIDIA_VISIBLE_DEVICES={GPU1},{GPU0}"),
            "TESSERA_GPU_MEMORY_LIMIT_BYTES=8589934592".to_owned(),
            "TESSERA_GPU_MEMORY_LIMIT_BYTES_0=8589934592".to_owned(),
            "TESSERA_GPU_MEMORY_LIMIT_BYTES_1=8589934592".to_owned(),
            "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps".to_owned(),
            "CUDA_MPS_CLIENT_PRIORITY=0".to_owned(),
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25".to_owned(),
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M,1=8192M".to_owned(),
        ]
    );
    assert_eq!(
        device_ids(&c),
        [(
            "gpus".to_owned(),
            vec![
                format!("k8s.gpu.tessera.dev/claim={UID}-gpu-0"),
                format!("k8s.gpu.tessera.dev/claim={UID}-gpu-1"),
            ]
        )]
    );
}

#[test]
fn shares_of_one_gpu_in_two_requests_add_up_and_whole_gpus_join_the_daemon() {
    let c = claim(vec![
        device("a", "gpu-0", gpu(0, GPU0), Some((2, 10))),
        device("b", "gpu-0", gpu(0, GPU0), Some((3, 20))),
        device("c", "gpu-1", gpu(1, GPU1), None),
    ]);
    let spec = build_spec(&c, &mps()).unwrap();
    assert_eq!(spec.devices.len(), 2, "one CDI device per distinct device");
    // GPU1 (whole) sorts first: ordinal 0 has no memory limit, the shared GPU0 is ordinal 1.
    assert!(has_env(&spec, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=1=5120M"));
    assert!(has_env(&spec, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30"));
    // The workload is told the claim's limit of the shared ordinal only.
    assert!(has_env(&spec, "TESSERA_GPU_MEMORY_LIMIT_BYTES=5368709120"));
    assert!(has_env(
        &spec,
        "TESSERA_GPU_MEMORY_LIMIT_BYTES_1=5368709120"
    ));
    assert!(!has_env(&spec, "TESSERA_GPU_MEMORY_LIMIT_BYTES_0="));
    let ids = device_ids(&c);
    assert_eq!(ids.len(), 3);
    assert_eq!(ids[0].1, ids[1].1);
    let daemon = render(&c, &mps()).unwrap().mps_daemon.unwrap();
    assert_eq!(daemon.devices, [GPU1, GPU0]);
}

#[test]
fn spec_file_name_follows_the_transient_convention() {
    assert_eq!(
        spec_file_name(UID),
        format!("k8s.gpu.tessera.dev-claim_{UID}.json")
    );
    assert_eq!(spec_file_name("a/b"), "k8s.gpu.tessera.dev-claim_a_b.json");
}

#[test]
fn spec_annotations_name_the_claim() {
    let spec = build_spec(&shared_claim(), &mps()).unwrap();
    assert_eq!(spec.annotations[ANNOTATION_CLAIM], "team-a/train");
    assert_eq!(spec.annotations[ANNOTATION_CLAIM_UID], UID);
    assert_eq!(spec.minimum_version(), "0.6.0");
}

#[test]
fn out_of_range_shares_are_refused() {
    let c = claim(vec![device("gpu", "gpu-0", gpu(0, GPU0), Some((1, 105)))]);
    let e = err(&c, &mps());
    assert!(e.contains("claim team-a/train"), "{e}");
    assert!(e.contains("devices[0].share.compute 105"), "{e}");
    assert!(e.contains("0 (not isolated) to 100 in steps of 5"), "{e}");
    let mut c = shared_claim();
    c.devices[0].share = Some(PerDeviceShare {
        memory_bytes: 1000,
        compute_percent: 0,
    });
    assert!(err(&c, &mps()).contains("whole number of MiB"));
    let c = claim(vec![
        device("a", "gpu-0", gpu(0, GPU0), Some((2, 60))),
        device("b", "gpu-0", gpu(0, GPU0), Some((2, 60))),
    ]);
    assert!(err(&c, &mps()).contains("add up to compute 120, over 100"));
}

#[test]
fn relative_or_odd_enforcement_paths_are_refused() {
    let bad = [
        ("relative/dir", "must be an absolute path"),
        ("/", "below /"),
        ("/run/../etc", "normalised"),
        ("/run//mps", "normalised"),
        ("/run/mps/", "normalised"),
        ("/run/mps,ro", "only letters"),
        ("/run/mps dir", "only letters"),
    ];
    for (path, rule) in bad {
        let e = Enforcement::Mps {
            pipe_dir_root: path.into(),
            log_dir_root: "/var/log".into(),
        };
        let msg = err(&shared_claim(), &e);
        assert!(
            msg.contains("mps.pipeDirRoot") && msg.contains(rule),
            "{path}: {msg}"
        );
        let e = Enforcement::HamiCore {
            library_path: path.into(),
            cache_dir: "/var/lib/hami".into(),
        };
        assert!(err(&shared_claim(), &e).contains("hamiCore.libraryPath"));
    }
    // Checked even when the claim has no share, so a misconfigured node fails early.
    let c = claim(vec![device("gpu", "gpu-0", gpu(0, GPU0), None)]);
    let e = Enforcement::HamiCore {
        library_path: "/lib/libvgpu.so".into(),
        cache_dir: "cache".into(),
    };
    assert!(err(&c, &e).contains("hamiCore.cacheDir"));
}

#[test]
fn malformed_identities_are_refused() {
    let mut c = shared_claim();
    c.devices[0].gpu.uuid = String::new();
    assert!(err(&c, &mps()).contains("devices[0].gpu.uuid \"\" must be GPU- followed by"));
    let mut c = shared_claim();
    c.devices[0].gpu.uuid = "GPU-".into();
    assert!(err(&c, &mps()).contains("gpu.uuid"));
    let mut c = shared_claim();
    c.devices[0].gpu.uuid = format!("{GPU0}\nLD_PRELOAD=/x.so");
    assert!(err(&c, &mps()).contains("gpu.uuid"));
    let mut c = shared_claim();
    c.devices[0].device = "gpu-0;rm".into();
    assert!(err(&c, &mps()).contains("devices[0].device \"gpu-0;rm\""));
    let mut c = shared_claim();
    c.devices[0].device = "GPU_0".into();
    assert!(err(&c, &mps()).contains("[a-z0-9.-]"));
    let mut c = shared_claim();
    c.uid = "../../etc".into();
    assert!(err(&c, &mps()).contains("uid \"../../etc\""));
    let mut c = shared_claim();
    c.namespace = "Team A".into();
    let e = err(&c, &mps());
    assert!(
        e.contains("claim Team A/train") && e.contains("namespace"),
        "{e}"
    );
    let mut c = shared_claim();
    c.devices[0].request = "a/b/c".into();
    assert!(err(&c, &mps()).contains("request or request/subrequest"));
    let mut c = shared_claim();
    c.devices[0].gpu.minor = 255;
    assert!(err(&c, &mps()).contains("minor 255"));
    assert!(err(&claim(vec![]), &mps()).contains("no devices"));
}

#[test]
fn inconsistent_devices_are_refused() {
    let mut d = device("mig", "gpu-0-mig-1g.10gb-0", gpu(0, GPU0), Some((1, 0)));
    d.mig = Some(MigNode {
        uuid: MIG0.into(),
        gpu_instance: 1,
        compute_instance: 0,
        gpu_instance_cap_minor: 12,
        compute_instance_cap_minor: 13,
    });
    assert!(err(&claim(vec![d.clone()]), &mps()).contains("shares apply to whole GPUs only"));
    d.share = None;
    d.mig.as_mut().unwrap().compute_instance_cap_minor = 12;
    assert!(err(&claim(vec![d]), &mps()).contains("two different minors"));
    let c = claim(vec![
        device("a", "gpu-0", gpu(0, GPU0), None),
        device("b", "gpu-0", gpu(0, GPU1), None),
    ]);
    assert!(err(&c, &mps()).contains("appears twice"));
    let c = claim(vec![
        device("a", "gpu-0", gpu(0, GPU0), None),
        device("b", "gpu-1", gpu(0, GPU1), None),
    ]);
    assert!(err(&c, &mps()).contains("both use minor 0"));
    let c = claim(vec![
        device("a", "gpu-0", gpu(0, GPU0), None),
        device("b", "gpu-0", gpu(0, GPU0), Some((1, 0))),
    ]);
    assert!(err(&c, &mps()).contains("both whole and as a share"));
}

fn batch(mut d: PreparedDevice) -> PreparedDevice {
    d.tier = Tier::Batch;
    d
}

fn priority_env(spec: &CdiSpec) -> Vec<String> {
    env(spec)
        .into_iter()
        .filter(|e| {
            e.starts_with("CUDA_MPS_CLIENT_PRIORITY=") || e.starts_with("CUDA_TASK_PRIORITY=")
        })
        .collect()
}

/// The claim of [`shared_claim`], its share in the batch tier.
fn batch_claim() -> PreparedClaim {
    claim(vec![batch(device(
        "gpu",
        "gpu-0",
        gpu(0, GPU0),
        Some((10, 50)),
    ))])
}

/// Asserts that `c`'s spec sets priority `priority` (`0` or `1`) under MPS and under HAMi-core,
/// each through its own variable.
fn assert_priority(c: &PreparedClaim, priority: u8) {
    assert_eq!(
        priority_env(&build_spec(c, &mps()).unwrap()),
        [format!("CUDA_MPS_CLIENT_PRIORITY={priority}")]
    );
    assert_eq!(
        priority_env(&build_spec(c, &hami()).unwrap()),
        [format!("CUDA_TASK_PRIORITY={priority}")]
    );
}

#[test]
fn an_online_share_gets_the_higher_priority_of_each_backend() {
    assert_priority(&shared_claim(), 0);
}

#[test]
fn a_batch_share_gets_the_lower_priority_of_each_backend() {
    assert_priority(&batch_claim(), 1);
}

#[test]
fn none_enforcement_sets_no_priority_for_either_tier() {
    for c in [shared_claim(), batch_claim()] {
        assert!(priority_env(&build_spec(&c, &Enforcement::None).unwrap()).is_empty());
    }
}

#[test]
fn a_claim_with_any_batch_share_runs_at_the_lower_priority() {
    // Two requests on one GPU, one online and one batch: one process has one priority.
    let same_gpu = claim(vec![
        device("a", "gpu-0", gpu(0, GPU0), Some((4, 20))),
        batch(device("b", "gpu-0", gpu(0, GPU0), Some((4, 20)))),
    ]);
    // The same over two GPUs.
    let two_gpus = claim(vec![
        device("a", "gpu-0", gpu(0, GPU0), Some((4, 20))),
        batch(device("b", "gpu-1", gpu(1, GPU1), Some((4, 20)))),
    ]);
    for c in [same_gpu, two_gpus] {
        assert_priority(&c, 1);
    }
}

#[test]
fn whole_gpus_get_no_priority_whatever_their_tier_field_says() {
    let c = claim(vec![batch(device("gpu", "gpu-0", gpu(0, GPU0), None))]);
    assert!(priority_env(&build_spec(&c, &mps()).unwrap()).is_empty());
    assert!(priority_env(&build_spec(&c, &hami()).unwrap()).is_empty());
}

#[test]
fn an_over_committed_batch_share_gets_what_it_may_use_and_memory_over_commit_needs_hami_core() {
    // A batch share that may use 10 GiB and 50 % (its guarantee is smaller): the limits are
    // the may-use values on every backend, so it can use the GPU while others idle.
    let mut d = batch(device("gpu", "gpu-0", gpu(0, GPU0), Some((10, 50))));
    let compute_only = claim(vec![d.clone()]);
    let spec = build_spec(&compute_only, &mps()).unwrap();
    assert!(env(&spec).contains(&"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50".to_owned()));
    assert!(!has_env(&spec, "CUDA_OVERSUBSCRIBE"));
    d.memory_overcommitted = true;
    let memory = claim(vec![d]);
    for backend in [mps(), Enforcement::None] {
        let e = err(&memory, &backend);
        assert!(e.contains("hami-core"), "{e}");
    }
    let spec = build_spec(&memory, &hami()).unwrap();
    let env = env(&spec);
    assert!(
        env.contains(&"CUDA_OVERSUBSCRIBE=true".to_owned()),
        "{env:?}"
    );
    assert!(
        env.contains(&"CUDA_DEVICE_MEMORY_LIMIT_0=10240m".to_owned()),
        "{env:?}"
    );
    assert!(
        env.contains(&"CUDA_DEVICE_SM_LIMIT=50".to_owned()),
        "{env:?}"
    );
}

mod tenant_reach {
    use std::path::Path;

    use proptest::prelude::*;

    use super::*;

    const GPUS: [&str; 3] = [GPU0, GPU1, "GPU-0c1d2e3f-4a5b-4c6d-8e7f-9a0b1c2d3e4f"];

    fn root() -> impl Strategy<Value = String> {
        prop::collection::vec(
            prop::sample::select(vec!["run", "var", "lib", "tessera", "hami", "mps", "log"]),
            1..4,
        )
        .prop_map(|s| format!("/{}", s.join("/")))
    }

    fn enforcement() -> impl Strategy<Value = Enforcement> {
        prop_oneof![
            (root(), root()).prop_map(|(pipe_dir_root, log_dir_root)| Enforcement::Mps {
                pipe_dir_root,
                log_dir_root
            }),
            (root(), root()).prop_map(|(lib, cache_dir)| Enforcement::HamiCore {
                library_path: format!("{lib}/libvgpu.so"),
                cache_dir
            }),
            Just(Enforcement::None),
        ]
    }

    fn a_claim() -> impl Strategy<Value = PreparedClaim> {
        (
            "[a-f0-9]{8}-[a-f0-9]{4}",
            prop::collection::vec((0..GPUS.len(), prop::option::of(1..8u64)), 1..4),
        )
            .prop_map(|(uid, picks)| {
                let mut seen = Vec::new();
                let devices = picks
                    .into_iter()
                    .filter(|(g, _)| {
                        let fresh = !seen.contains(g);
                        seen.push(*g);
                        fresh
                    })
                    .map(|(g, gib)| {
                        let index = u32::try_from(g).unwrap();
                        device(
                            "gpu",
                            &format!("gpu-{g}"),
                            gpu(index, GPUS[g]),
                            gib.map(|gib| (gib, 10)),
                        )
                    })
                    .collect();
                PreparedClaim {
                    uid,
                    namespace: "team-a".into(),
                    name: "train".into(),
                    devices,
                }
            })
    }

    fn mounts(r: &Rendered) -> Vec<Mount> {
        r.spec
            .container_edits
            .iter()
            .chain(r.spec.devices.iter().map(|d| &d.container_edits))
            .flat_map(|e| e.mounts.clone())
            .collect()
    }

    /// Two roots that lie apart: the configurations an admin is expected to write.
    fn apart(e: &Enforcement) -> bool {
        let (a, b) = match e {
            Enforcement::Mps {
                pipe_dir_root,
                log_dir_root,
            } => (pipe_dir_root, log_dir_root),
            Enforcement::HamiCore {
                library_path,
                cache_dir,
            } => (library_path, cache_dir),
            Enforcement::None => return true,
        };
        !Path::new(a).starts_with(b) && !Path::new(b).starts_with(a)
    }

    proptest! {
        /// Whatever the claim and the node's paths, a rendered spec's mount sources lie apart
        /// (as the file system's component-wise ancestry judges it), and no directory the node
        /// keeps for itself lies inside one a container writes.
        #[test]
        fn no_rendered_source_lies_inside_another(c in a_claim(), e in enforcement()) {
            let Ok(r) = render(&c, &e) else {
                // Only a configuration whose roots nest may be refused.
                prop_assert!(!apart(&e));
                return Ok(());
            };
            let ms = mounts(&r);
            for (i, a) in ms.iter().enumerate() {
                for (j, b) in ms.iter().enumerate() {
                    prop_assert!(
                        i == j || !Path::new(&a.host_path).starts_with(&b.host_path),
                        "{} inside {}", a.host_path, b.host_path
                    );
                }
            }
            let mut node: Vec<String> = r
                .host_dirs
                .iter()
                .map(|d| d.path.clone())
                .filter(|p| ms.iter().all(|m| m.host_path != *p))
                .collect();
            node.extend(r.mps_daemon.iter().map(|d| d.log_dir.clone()));
            for n in &node {
                for m in ms.iter().filter(|m| binds::is_read_write(m)) {
                    prop_assert!(!Path::new(n).starts_with(&m.host_path));
                }
            }
        }

        /// Two claims on one node never reach into each other's writable directories: a
        /// source of one lies inside a read-write source of the other only where both mount
        /// the very same directory (the MPS daemon they share).
        #[test]
        fn claims_stay_out_of_each_others_writable_directories(
            a in a_claim(),
            b in a_claim(),
            e in enforcement(),
        ) {
            prop_assume!(a.uid != b.uid && apart(&e));
            let (ra, rb) = (render(&a, &e).unwrap(), render(&b, &e).unwrap());
            for (x, y) in [(&ra, &rb), (&rb, &ra)] {
                let theirs: Vec<Mount> =
                    mounts(y).into_iter().filter(binds::is_read_write).collect();
                let mut mine: Vec<String> = mounts(x).into_iter().map(|m| m.host_path).collect();
                mine.extend(x.host_dirs.iter().map(|d| d.path.clone()));
                for p in &mine {
                    for t in &theirs {
                        prop_assert!(
                            p == &t.host_path || !Path::new(p).starts_with(&t.host_path),
                            "{p} inside another claim's {}", t.host_path
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn an_mps_log_directory_inside_the_pipe_directory_is_refused() {
        let daemon = mps_daemon_id([GPU0]);
        let e = Enforcement::Mps {
            pipe_dir_root: "/run/tessera/mps".into(),
            log_dir_root: format!("/run/tessera/mps/{daemon}/pipe"),
        };
        let err = err(&shared_claim(), &e);
        assert!(err.contains("the node's path"), "{err}");
        assert!(err.contains("/pipe"), "{err}");
    }
}
