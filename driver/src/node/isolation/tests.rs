use super::*;
use crate::node::inventory::Inventory;

fn node() -> NodeInventory {
    Inventory::from_yaml(
        "nodes:\n- name: n\n  driverVersion: 580.159.04\n  gpus:\n  - model: h200-141g\n    mode: shared\n    count: 2\n  - model: h200-141g\n",
    )
    .unwrap()
    .nodes
    .remove(0)
}

fn record(backend: &str, driver: &str, outcome: ProbeOutcome) -> ProbeRecord {
    ProbeRecord {
        backend: backend.to_owned(),
        driver_version: driver.to_owned(),
        outcome,
        at: Duration::ZERO,
        failed_runs: 0,
    }
}

fn report(past: Allocation, under: Allocation) -> ProbeReport {
    let (past_bytes, under_bytes) = ProbeReport::sizes(PROBE_LIMIT_BYTES);
    ProbeReport {
        limit_bytes: PROBE_LIMIT_BYTES,
        past_bytes,
        past,
        under_bytes,
        under,
    }
}

const OOM: &str = "CUDA_ERROR_OUT_OF_MEMORY";

#[test]
fn a_probe_holds_only_when_refused_past_the_limit_and_served_under_it() {
    let refused = || Allocation::Refused(OOM.to_owned());
    assert_eq!(
        judge(&report(refused(), Allocation::Served)),
        ProbeOutcome::Held
    );
    // HAMi-core on driver 580 / CUDA 13: the allocation past the limit was served.
    let ProbeOutcome::Failed { code, message: why } =
        judge(&report(Allocation::Served, Allocation::Served))
    else {
        panic!("a served allocation past the limit must fail the probe");
    };
    assert!(
        why.contains("1536 MiB past the 1024 MiB limit was served"),
        "{why}"
    );
    assert_eq!(code, REASON_LIMIT_NOT_ENFORCED);
    let ProbeOutcome::Failed { code, message: why } = judge(&report(refused(), refused())) else {
        panic!("a refused allocation under the limit must fail the probe");
    };
    assert!(
        why.contains("512 MiB under the 1024 MiB limit was refused"),
        "{why}"
    );
    assert_eq!(code, REASON_UNDER_LIMIT_REFUSED);
}

#[test]
fn the_report_reads_as_the_child_writes_it() {
    let text = r#"{"limitBytes":1073741824,"pastBytes":1610612736,"past":{"result":"refused","error":"CUDA_ERROR_OUT_OF_MEMORY"},"underBytes":536870912,"under":{"result":"served"}}"#;
    let parsed: ProbeReport = serde_json::from_str(text).unwrap();
    assert_eq!(
        parsed,
        report(Allocation::Refused(OOM.to_owned()), Allocation::Served)
    );
    assert_eq!(serde_json::to_string(&parsed).unwrap(), text);
}

#[test]
fn every_shared_gpu_is_probed_at_start_under_a_limiting_backend() {
    let node = node();
    let records = BTreeMap::new();
    let due: Vec<u32> = due(&node, "mps", &records, Duration::ZERO)
        .iter()
        .map(|g| g.index)
        .collect();
    assert_eq!(due, [0, 1], "the exclusive GPU needs no probe");
    assert!(due_of(&node, "hami-core", &records).len() == 2);
    assert!(
        due_of(&node, "none", &records).is_empty(),
        "none limits nothing to probe"
    );
}

fn due_of(
    node: &NodeInventory,
    backend: &str,
    records: &BTreeMap<String, ProbeRecord>,
) -> Vec<u32> {
    due(node, backend, records, Duration::ZERO)
        .iter()
        .map(|g| g.index)
        .collect()
}

#[test]
fn a_new_driver_version_or_backend_calls_for_a_new_probe() {
    let node = node();
    let uuid = node.gpus[0].uuid.clone();
    let mut records = BTreeMap::new();
    records.insert(
        uuid.clone(),
        record("mps", "580.159.04", ProbeOutcome::Held),
    );
    assert_eq!(due_of(&node, "mps", &records), [1]);
    assert_eq!(
        due_of(&node, "hami-core", &records),
        [0, 1],
        "backend changed"
    );
    records.insert(uuid, record("mps", "570.86.15", ProbeOutcome::Held));
    assert_eq!(due_of(&node, "mps", &records), [0, 1], "driver changed");
    // A probe that ran and saw the limit fail is not repeated on the same driver and backend.
    let mut failed = BTreeMap::new();
    failed.insert(
        node.gpus[0].uuid.clone(),
        record(
            "mps",
            "580.159.04",
            ProbeOutcome::failed(REASON_LIMIT_NOT_ENFORCED, "served past the limit"),
        ),
    );
    assert_eq!(due_of(&node, "mps", &failed), [1]);
}

#[test]
fn a_probe_that_could_not_run_is_tried_again_later_and_later() {
    let node = node();
    let gpu = &node.gpus[0];
    let timed_out = || ProbeOutcome::failed(REASON_TIMED_OUT, "timed out");
    let minute = Duration::from_mins(1);
    let first = ProbeRecord::new(gpu, "mps", timed_out(), minute, None);
    assert_eq!(first.failed_runs, 1);
    assert_eq!(
        first.retry_at(),
        Some(2 * minute),
        "a minute after the first failure"
    );
    let mut records = BTreeMap::from([(gpu.uuid.clone(), first.clone())]);
    let due_at = |records: &BTreeMap<String, ProbeRecord>, now| -> Vec<u32> {
        due(&node, "mps", records, now)
            .iter()
            .map(|g| g.index)
            .collect()
    };
    assert_eq!(due_at(&records, minute + minute / 2), [1], "not yet");
    assert_eq!(due_at(&records, 2 * minute), [0, 1]);
    // Each failure in a row doubles the wait, up to an hour.
    let not_run = ProbeOutcome::failed(REASON_DID_NOT_RUN, "no libcuda.so.1");
    let second = ProbeRecord::new(gpu, "mps", not_run.clone(), 2 * minute, Some(&first));
    assert_eq!(second.failed_runs, 2);
    assert_eq!(second.retry_at(), Some(4 * minute));
    let mut last = second;
    for _ in 0..10 {
        last = ProbeRecord::new(gpu, "mps", not_run.clone(), last.at, Some(&last));
    }
    assert_eq!(last.retry_at(), Some(last.at + RETRY_MAX));
    // A probe that ran ends the run: held, or saw the limit fail, nothing is repeated.
    for outcome in [
        ProbeOutcome::Held,
        ProbeOutcome::failed(REASON_LIMIT_NOT_ENFORCED, "served past the limit"),
    ] {
        let ran = ProbeRecord::new(gpu, "mps", outcome, 3 * minute, Some(&last));
        assert_eq!((ran.failed_runs, ran.retry_at()), (0, None));
        records.insert(gpu.uuid.clone(), ran);
        assert_eq!(due_at(&records, RETRY_MAX * 100), [1]);
    }
    // A failure under another backend or driver starts a new run.
    let other = ProbeRecord::new(gpu, "hami-core", timed_out(), minute, Some(&last));
    assert_eq!(other.failed_runs, 1);
}

#[test]
fn a_gpu_is_verified_only_by_a_current_probe_that_held() {
    let node = node();
    let gpu = &node.gpus[0];
    let held = record("mps", "580.159.04", ProbeOutcome::Held);
    let v = verdict(gpu, "mps", Some(&held), false).unwrap();
    assert_eq!(v.isolation, Isolation::Verified);
    assert!(
        v.reason.contains("refused past a 1024 MiB limit"),
        "{}",
        v.reason
    );

    let v = verdict(gpu, "mps", None, false).unwrap();
    assert_eq!(v.isolation, Isolation::Unverified);
    assert!(
        v.reason
            .contains("not probed yet with mps on driver 580.159.04"),
        "{}",
        v.reason
    );

    let stale = record("mps", "570.86.15", ProbeOutcome::Held);
    assert_eq!(
        verdict(gpu, "mps", Some(&stale), false).unwrap().isolation,
        Isolation::Unverified,
        "a probe on another driver proves nothing"
    );
    let other = record("hami-core", "580.159.04", ProbeOutcome::Held);
    assert_eq!(
        verdict(gpu, "mps", Some(&other), false).unwrap().isolation,
        Isolation::Unverified,
        "a probe of another backend proves nothing"
    );

    let failed = record(
        "hami-core",
        "580.159.04",
        ProbeOutcome::failed(
            REASON_LIMIT_NOT_ENFORCED,
            "an allocation of 1536 MiB past the 1024 MiB limit was served",
        ),
    );
    let v = verdict(gpu, "hami-core", Some(&failed), false).unwrap();
    assert_eq!(v.isolation, Isolation::Unverified);
    assert!(
        v.reason
            .contains("the hami-core probe on driver 580.159.04 failed: an allocation"),
        "{}",
        v.reason
    );
    assert!(v.reason.ends_with("no shares are offered"), "{}", v.reason);
    assert_eq!(v.code, REASON_LIMIT_NOT_ENFORCED);
}

#[test]
fn unverified_isolation_is_accepted_only_when_the_admin_says_so() {
    let node = node();
    let gpu = &node.gpus[0];
    let failed = record(
        "hami-core",
        "580.159.04",
        ProbeOutcome::failed(REASON_LIMIT_NOT_ENFORCED, "leaks"),
    );
    let v = verdict(gpu, "hami-core", Some(&failed), true).unwrap();
    assert_eq!(v.isolation, Isolation::Accepted);
    assert!(v.reason.contains("accepted by the admin"), "{}", v.reason);
    assert!(v.isolation.offers_shares());
    assert!(!Isolation::Unverified.offers_shares());
    // Accepting never downgrades a verified GPU.
    let held = record("hami-core", "580.159.04", ProbeOutcome::Held);
    assert_eq!(
        verdict(gpu, "hami-core", Some(&held), true)
            .unwrap()
            .isolation,
        Isolation::Verified
    );
}

#[test]
fn enforcement_none_is_never_verified() {
    let node = node();
    let v = verdict(&node.gpus[0], "none", None, false).unwrap();
    assert_eq!(v.isolation, Isolation::Unverified);
    assert!(v.reason.contains("limits nothing"), "{}", v.reason);
    assert_eq!(
        verdict(&node.gpus[0], "none", None, true)
            .unwrap()
            .isolation,
        Isolation::Accepted
    );
}

#[test]
fn whole_gpus_have_no_verdict_and_apply_sets_the_shared_ones() {
    let mut node = node();
    assert!(verdict(&node.gpus[2], "mps", None, false).is_none());
    let mut records = BTreeMap::new();
    records.insert(
        node.gpus[0].uuid.clone(),
        record("mps", "580.159.04", ProbeOutcome::Held),
    );
    let verdicts = apply(&mut node, "mps", &records, false);
    assert_eq!(verdicts.keys().collect::<Vec<_>>(), ["gpu-0", "gpu-1"]);
    assert_eq!(node.gpus[0].isolation, Isolation::Verified);
    assert_eq!(node.gpus[1].isolation, Isolation::Unverified);
    assert_eq!(node.gpus[0].isolation_reason, REASON_PROBE_HELD);
    assert_eq!(node.gpus[1].isolation_reason, REASON_NOT_PROBED);
}

#[test]
fn the_probe_runs_in_the_cdi_environment_of_a_one_gib_share() {
    let node = node();
    let claim = probe_claim("n", &node.gpus[1]);
    let spec = crate::node::cdi::build_spec(
        &claim,
        &crate::node::cdi::Enforcement::Mps {
            pipe_dir_root: "/run/tessera/mps".into(),
            log_dir_root: "/var/log/tessera/mps".into(),
        },
    )
    .unwrap();
    let env = spec.container_edits.unwrap().env;
    assert!(
        env.contains(&"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1024M".to_owned()),
        "{env:?}"
    );
    assert!(
        env.contains(&"TESSERA_GPU_MEMORY_LIMIT_BYTES=1073741824".to_owned()),
        "{env:?}"
    );
    assert!(env.contains(&format!("NVIDIA_VISIBLE_DEVICES={}", node.gpus[1].uuid)));
    assert!(claim.uid.starts_with(PROBE_CLAIM_PREFIX));
}

#[test]
fn isolation_reads_its_published_values_only() {
    for i in [
        Isolation::Verified,
        Isolation::Unverified,
        Isolation::Accepted,
    ] {
        assert_eq!(i.as_str().parse::<Isolation>().unwrap(), i);
    }
    let err = "maybe".parse::<Isolation>().unwrap_err().to_string();
    assert!(err.contains("unknown isolation \"maybe\""), "{err}");
}

#[test]
fn a_spec_that_mounts_nothing_is_probed_without_the_namespace_launcher() {
    // Nothing to bind: the probe runs as the program itself, so it needs no mount namespace
    // (and no CAP_SYS_ADMIN), and the spec's LD_PRELOAD stays LD_PRELOAD.
    let edits = ContainerEdits {
        env: vec![
            "LD_PRELOAD=/lib/x.so".to_owned(),
            "CUDA_MPS_PIPE_DIRECTORY=/p".to_owned(),
        ],
        ..ContainerEdits::default()
    };
    let args = vec!["isolation-probe".to_owned()];
    let cmd = probe_command(&edits, "/probe", &args, &[], Some("/plugin"));
    assert_eq!(cmd.program, "/probe");
    assert_eq!(cmd.args, args);
    assert!(
        cmd.env
            .contains(&("LD_PRELOAD".to_owned(), "/lib/x.so".to_owned()))
    );
}

#[test]
fn the_probe_command_applies_the_specs_mounts_and_exactly_its_environment() {
    let node = node();
    let claim = probe_claim("n", &node.gpus[0]);
    let rendered = crate::node::cdi::render(
        &claim,
        &crate::node::cdi::Enforcement::HamiCore {
            library_path: "/usr/local/vgpu/libvgpu.so".into(),
            cache_dir: "/run/tessera/hami".into(),
        },
    )
    .unwrap();
    let edits = rendered.spec.container_edits.clone().unwrap();
    let inherited = vec![
        ("PATH".to_owned(), "/usr/bin".to_owned()),
        ("HOME".to_owned(), "/root".to_owned()),
        ("LD_PRELOAD".to_owned(), "/evil.so".to_owned()),
    ];
    let args = vec!["isolation-probe".to_owned()];
    let cmd = probe_command(&edits, "/plugin", &args, &inherited, Some("/plugin"));
    // The plugin's own binary applies the mounts: no shell, `unshare` or `mount`.
    assert_eq!(cmd.program, "/plugin");
    assert_eq!(cmd.args[0], PROBE_SUBCOMMAND);
    let at = |s: &str| cmd.args.iter().position(|a| a == s).unwrap();
    // The library is bind-mounted read-only where LD_PRELOAD names it, each path an argument
    // of its own; then the probe runs.
    let lib = at("/usr/local/vgpu/libvgpu.so");
    assert_eq!(cmd.args[lib - 1], namespace::BIND);
    assert_eq!(cmd.args[lib + 1], "/usr/local/tessera/hami/libvgpu.so");
    assert_eq!(cmd.args[lib + 2], "ro,nosuid,nodev,bind");
    assert_eq!(
        &cmd.args[cmd.args.len() - 3..],
        ["--", "/plugin", "isolation-probe"]
    );
    // The child reads back exactly the spec's mounts and the probe's command.
    let namespace::Invocation::Contained { binds, command } =
        namespace::parse(&cmd.args[1..]).unwrap()
    else {
        panic!("the mounts are applied before the probe runs");
    };
    assert_eq!(binds, edits.mounts);
    assert_eq!(command, ["/plugin", "isolation-probe"]);
    let env: BTreeMap<_, _> = cmd.env.iter().cloned().collect();
    // The spec's preload, not the plugin's, handed on to the probe the launcher execs after the
    // mounts (before them the library is not there).
    assert_eq!(
        env[PRELOAD_HANDOFF_ENV], "/usr/local/tessera/hami/libvgpu.so",
        "the spec's, not the plugin's"
    );
    assert!(
        !env.contains_key("LD_PRELOAD"),
        "not for the launcher itself"
    );
    assert_eq!(env["CUDA_DEVICE_MEMORY_LIMIT_0"], "1024m");
    assert_eq!(env["TESSERA_GPU_MEMORY_LIMIT_BYTES"], "1073741824");
    assert_eq!(env["PATH"], "/usr/bin");
    assert!(
        !env.contains_key("HOME"),
        "nothing else of the plugin's environment"
    );
    // Without a launcher: the program itself, the same environment.
    let plain = probe_command(&edits, "/plugin", &args, &inherited, None);
    assert_eq!(plain.program, "/plugin");
    assert_eq!(plain.args, args);
    let plain_env: BTreeMap<_, _> = plain.env.iter().cloned().collect();
    assert_eq!(plain_env["LD_PRELOAD"], env[PRELOAD_HANDOFF_ENV]);
    assert_eq!(plain_env.len(), env.len());
}

#[test]
fn the_probe_of_a_gpu_whose_minor_is_not_its_index_opens_the_gpus_own_device_node() {
    let mut node = node();
    node.gpus[1].minor = 7;
    let claim = probe_claim("n", &node.gpus[1]);
    assert_eq!(claim.devices[0].gpu.minor, 7);
    assert_eq!(claim.devices[0].gpu.index, node.gpus[1].index);
}
