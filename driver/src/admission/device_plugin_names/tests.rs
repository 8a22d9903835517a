use k8s_openapi::api::core::v1 as core;
use serde_json::{Value, json};

use super::*;

const POD: &str = "Pod ns/p";

fn pod(limits: &Value) -> core::Pod {
    pod_with(
        &json!([{"name": "main", "image": "i", "resources": {"limits": limits}}]),
        None,
    )
}

fn pod_with(containers: &Value, labels: Option<&Value>) -> core::Pod {
    serde_json::from_value(json!({
        "metadata": {"name": "p", "namespace": "ns", "labels": labels},
        "spec": {"containers": containers},
    }))
    .unwrap()
}

fn map(pod: &core::Pod) -> Result<Mapping> {
    let request = DevicePluginRequest::from_pod(pod, POD)?.unwrap();
    map_request(&request, &Options::default(), POD)
}

fn one_request(mapping: &Mapping) -> Value {
    assert_eq!(mapping.claims.len(), 1, "{mapping:?}");
    let spec = serde_json::to_value(&mapping.claims[0].spec).unwrap();
    assert_eq!(spec["devices"]["requests"].as_array().unwrap().len(), 1);
    spec
}

fn err_text(pod: &core::Pod) -> String {
    map(pod).unwrap_err().to_string()
}

#[test]
fn a_pod_without_device_plugin_names_is_untouched() {
    let p = pod(&json!({"cpu": "1", "example.com/foo": "1"}));
    assert_eq!(DevicePluginRequest::from_pod(&p, POD).unwrap(), None);
    let p = pod(&json!({"nvidia.com/gpu": "0"}));
    assert_eq!(DevicePluginRequest::from_pod(&p, POD).unwrap(), None);
}

#[test]
fn nvidia_gpu_is_whole_gpus() {
    let m = map(&pod(&json!({"nvidia.com/gpu": "2"}))).unwrap();
    let spec = one_request(&m);
    let exactly = &spec["devices"]["requests"][0]["exactly"];
    assert_eq!(exactly["deviceClassName"], names::CLASS_GPU);
    assert_eq!(exactly["count"], 2);
    assert!(spec["devices"].get("config").is_none());
    assert_eq!(m.claims[0].entry, "tessera-main");
    assert_eq!(m.claims[0].forms, ["nvidia"]);
    assert!(m.claims[0].template.starts_with("tessera-"));
}

#[test]
fn mig_names_select_their_profile() {
    let m = map(&pod(&json!({"nvidia.com/mig-1g.10gb": "1"}))).unwrap();
    let spec = one_request(&m);
    let request = &spec["devices"]["requests"][0];
    assert_eq!(request["name"], "mig-1g-10gb");
    assert_eq!(request["exactly"]["deviceClassName"], names::CLASS_MIG_GPU);
    assert_eq!(
        request["exactly"]["selectors"][0]["cel"]["expression"],
        "device.attributes[\"gpu.tessera.dev\"].profile == \"1g.10gb\""
    );
    assert!(err_text(&pod(&json!({"nvidia.com/mig-bogus": "1"}))).contains("not a MIG profile"));
}

#[test]
fn time_sliced_replicas_are_a_percent_of_a_card_each() {
    let m = map(&pod(&json!({"nvidia.com/gpu.shared": "2"}))).unwrap();
    let spec = one_request(&m);
    assert_eq!(spec["devices"]["requests"][0]["exactly"]["count"], 2);
    let params = &spec["devices"]["config"][0]["opaque"]["parameters"];
    assert_eq!(params["memoryPercent"], 25);
    assert!(params.get("compute").is_none());
    let request = DevicePluginRequest::from_pod(&pod(&json!({"nvidia.com/gpu.shared": "1"})), POD)
        .unwrap()
        .unwrap();
    let options = Options {
        shared_replicas: 3,
        ..Options::default()
    };
    let m = map_request(&request, &options, POD).unwrap();
    let spec = serde_json::to_value(&m.claims[0].spec).unwrap();
    assert_eq!(
        spec["devices"]["config"][0]["opaque"]["parameters"]["memoryPercent"],
        33
    );
}

#[test]
fn baidu_cards_alone_are_whole_gpus_of_the_model() {
    let m = map(&pod(&json!({"baidu.com/v100_32g_cgpu": "2"}))).unwrap();
    let spec = one_request(&m);
    let exactly = &spec["devices"]["requests"][0]["exactly"];
    assert_eq!(exactly["deviceClassName"], names::CLASS_GPU);
    assert_eq!(exactly["count"], 2);
    assert_eq!(
        exactly["selectors"][0]["cel"]["expression"],
        "device.attributes[\"gpu.tessera.dev\"].model == \"v100-32g\""
    );
}

#[test]
fn baidu_share_totals_split_over_the_cards() {
    let m = map(&pod(&json!({
        "baidu.com/a10_24g_cgpu": "2",
        "baidu.com/a10_24g_cgpu_memory": "10",
        "baidu.com/a10_24g_cgpu_core": "50",
    })))
    .unwrap();
    let spec = one_request(&m);
    assert_eq!(
        spec["devices"]["requests"][0]["exactly"]["deviceClassName"],
        names::CLASS_SHARED_GPU
    );
    let params = &spec["devices"]["config"][0]["opaque"]["parameters"];
    assert_eq!(params["memory"], "10Gi");
    assert_eq!(params["compute"], 50);
    assert_eq!(params["kind"], "GpuShare");
}

#[test]
fn baidu_memory_percent_is_per_card() {
    let m = map(&pod(&json!({
        "baidu.com/l20_cgpu": "1",
        "baidu.com/l20_cgpu_memory_percent": "30",
    })))
    .unwrap();
    let spec = one_request(&m);
    assert_eq!(
        spec["devices"]["config"][0]["opaque"]["parameters"]["memoryPercent"],
        30
    );
    assert!(
        spec["devices"]["requests"][0]["exactly"]["selectors"][0]["cel"]["expression"]
            .as_str()
            .unwrap()
            .contains("l20-48g")
    );
}

#[test]
fn every_baidu_model_of_the_table_is_a_known_model() {
    for (baidu, id) in BAIDU_MODELS {
        assert_eq!(baidu_model(baidu).map(|m| m.id), Some(*id), "{baidu}");
    }
}

#[test]
fn baidu_rules_are_the_seeds() {
    let cases = [
        (
            json!({"baidu.com/p4_8g_cgpu": "1"}),
            "unknown GPU model \"p4_8g\"",
        ),
        (
            json!({"baidu.com/t4_16g_cgpu_memory": "4"}),
            "needs baidu.com/t4_16g_cgpu",
        ),
        (
            json!({"baidu.com/t4_16g_cgpu": "1", "baidu.com/t4_16g_cgpu_core": "50"}),
            "compute needs memory",
        ),
        (
            json!({"baidu.com/t4_16g_cgpu": "1", "baidu.com/t4_16g_cgpu_memory": "4", "baidu.com/t4_16g_cgpu_memory_percent": "20"}),
            "exclusive",
        ),
        (
            json!({"baidu.com/t4_16g_cgpu": "2", "baidu.com/t4_16g_cgpu_memory": "5"}),
            "not a whole number of GiB per card",
        ),
        (
            json!({"baidu.com/t4_16g_cgpu": "1", "baidu.com/t4_16g_cgpu_memory": "4", "baidu.com/t4_16g_cgpu_core": "33"}),
            "not a multiple of 5",
        ),
        (
            json!({"baidu.com/t4_16g_cgpu": "2", "baidu.com/t4_16g_cgpu_memory": "4", "baidu.com/t4_16g_cgpu_core": "15"}),
            "not a whole percent per card",
        ),
        (
            json!({"baidu.com/t4_16g_cgpu": "1", "baidu.com/t4_16g_cgpu_memory": "16"}),
            "a share never exceeds a card",
        ),
        (
            json!({"baidu.com/t4_16g_cgpu": "1", "baidu.com/v100_32g_cgpu": "1"}),
            "one container asks for one model",
        ),
        (json!({"baidu.com/t4_16g_cgpu": "1.5"}), "not a whole"),
    ];
    for (limits, want) in cases {
        let text = err_text(&pod(&limits));
        assert!(text.contains(want), "{limits}: {text}");
        assert!(text.contains("container main"), "{text}");
        assert!(
            text.starts_with("Pod ns/p: spec.containers[0].resources"),
            "{text}"
        );
    }
}

#[test]
fn requests_and_limits_must_agree() {
    let p = pod_with(
        &json!([{"name": "main", "image": "i", "resources": {
            "requests": {"nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "2"}}}]),
        None,
    );
    let text = DevicePluginRequest::from_pod(&p, POD)
        .unwrap_err()
        .to_string();
    assert!(
        text.contains("requests[nvidia.com/gpu]") && text.contains("differs"),
        "{text}"
    );
    let p = pod_with(
        &json!([{"name": "main", "image": "i", "resources": {"requests": {"nvidia.com/gpu": "1"}}}]),
        None,
    );
    let text = DevicePluginRequest::from_pod(&p, POD)
        .unwrap_err()
        .to_string();
    assert!(text.contains("without a limit"), "{text}");
}

#[test]
fn aliyun_memory_is_one_claim_per_pod_spread_over_the_labelled_cards() {
    let p = pod_with(
        &json!([
            {"name": "a", "image": "i", "resources": {"limits": {"aliyun.com/gpu-mem": "6"}}},
            {"name": "b", "image": "i", "resources": {"limits": {"aliyun.com/gpu-mem": "2"}}},
        ]),
        Some(&json!({"aliyun.com/gpu-count": "2"})),
    );
    let m = map(&p).unwrap();
    let spec = one_request(&m);
    assert_eq!(m.claims[0].entry, POD_ENTRY);
    assert_eq!(m.claims[0].containers, [0, 1]);
    assert_eq!(spec["devices"]["requests"][0]["exactly"]["count"], 2);
    assert_eq!(
        spec["devices"]["config"][0]["opaque"]["parameters"]["memory"],
        "8Gi"
    );

    let p = pod_with(
        &json!([{"name": "a", "image": "i", "resources": {"limits": {"aliyun.com/gpu-mem": "3"}}}]),
        Some(&json!({"aliyun.com/gpu-count": "2"})),
    );
    assert!(err_text(&p).contains("not a whole number of GiB per card"));
    let p = pod_with(
        &json!([{"name": "a", "image": "i", "resources": {"limits": {"aliyun.com/gpu-mem": "3"}}}]),
        Some(&json!({"aliyun.com/gpu-count": "two"})),
    );
    assert!(err_text(&p).contains("metadata.labels[aliyun.com/gpu-count]"));
}

#[test]
fn hami_sizes_are_per_card_and_rounded_up_with_a_warning() {
    let m = map(&pod(&json!({
        "nvidia.com/gpu": "2",
        "nvidia.com/gpumem": "3000",
        "nvidia.com/gpucores": "30",
    })))
    .unwrap();
    let spec = one_request(&m);
    assert_eq!(spec["devices"]["requests"][0]["exactly"]["count"], 2);
    let params = &spec["devices"]["config"][0]["opaque"]["parameters"];
    assert_eq!(params["memory"], "6Gi");
    assert_eq!(params["compute"], 60);
    assert_eq!(m.warnings.len(), 1, "{:?}", m.warnings);
    assert!(m.warnings[0].contains("rounded up to 3Gi"));

    let m = map(&pod(&json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "50", "nvidia.com/gpucores": "33"})))
        .unwrap();
    let spec = one_request(&m);
    let params = &spec["devices"]["config"][0]["opaque"]["parameters"];
    assert_eq!(params["memoryPercent"], 50);
    assert_eq!(params["compute"], 35);
    assert!(m.warnings[0].contains("rounded up to 35"));
}

#[test]
fn containers_get_separate_claims_and_one_shape_one_template() {
    let p = pod_with(
        &json!([
            {"name": "a", "image": "i", "resources": {"limits": {"nvidia.com/gpu": "1"}}},
            {"name": "b", "image": "i", "resources": {"limits": {"nvidia.com/gpu": "1"}}},
        ]),
        None,
    );
    let m = map(&p).unwrap();
    assert_eq!(m.claims.len(), 2);
    assert_eq!(m.claims[0].entry, "tessera-a");
    assert_eq!(m.claims[1].entry, "tessera-b");
    assert_eq!(m.claims[0].template, m.claims[1].template);
    let other = map(&pod(&json!({"nvidia.com/gpu": "2"}))).unwrap();
    assert_ne!(other.claims[0].template, m.claims[0].template);
}

#[test]
fn the_patch_rewrites_init_containers_records_the_request_and_gates_the_pod() {
    let p: core::Pod = serde_json::from_value(json!({
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {
            "initContainers": [{"name": "side", "image": "i", "restartPolicy": "Always",
                "resources": {"limits": {"nvidia.com/gpu": "1"}, "requests": {"nvidia.com/gpu": "1", "cpu": "1"}}}],
            "containers": [{"name": "main", "image": "i", "resources": {"limits": {"baidu.com/t4_16g_cgpu": "1", "baidu.com/t4_16g_cgpu_memory": "4"}}}],
            "resourceClaims": [{"name": "own", "resourceClaimName": "x"}],
        },
    }))
    .unwrap();
    let PodRewrite::Rewritten {
        patch,
        mapping,
        request,
    } = rewrite_pod(&p, &Options::default(), POD).unwrap()
    else {
        panic!("not rewritten");
    };
    assert_eq!(mapping.claims.len(), 2);
    let paths: Vec<(&str, &str)> = patch.iter().map(|o| (o.op, o.path.as_str())).collect();
    assert_eq!(
        paths,
        [
            (
                "remove",
                "/spec/initContainers/0/resources/limits/nvidia.com~1gpu"
            ),
            (
                "remove",
                "/spec/initContainers/0/resources/requests/nvidia.com~1gpu"
            ),
            (
                "remove",
                "/spec/containers/0/resources/limits/baidu.com~1t4_16g_cgpu"
            ),
            (
                "remove",
                "/spec/containers/0/resources/limits/baidu.com~1t4_16g_cgpu_memory"
            ),
            ("add", "/spec/initContainers/0/resources/claims"),
            ("add", "/spec/containers/0/resources/claims"),
            ("add", "/spec/resourceClaims/-"),
            ("add", "/spec/resourceClaims/-"),
            ("add", "/metadata/annotations"),
            ("add", "/spec/schedulingGates"),
        ]
    );
    let (rewritten, claims) = rewrite_offline(&p, &request, &mapping, POD).unwrap();
    let spec = rewritten.spec.unwrap();
    let init = &spec.init_containers.unwrap()[0];
    let resources = init.resources.as_ref().unwrap();
    assert!(!resources.limits.as_ref().unwrap().contains_key(NVIDIA_GPU));
    assert!(resources.requests.as_ref().unwrap().contains_key("cpu"));
    assert_eq!(resources.claims.as_ref().unwrap()[0].name, "tessera-side");
    let entries: Vec<_> = spec
        .resource_claims
        .unwrap()
        .into_iter()
        .map(|c| (c.name, c.resource_claim_name))
        .collect();
    assert_eq!(entries[0], ("own".to_owned(), Some("x".to_owned())));
    assert_eq!(
        entries[1],
        ("tessera-side".to_owned(), Some("p-tessera-side".to_owned()))
    );
    assert_eq!(claims.len(), 2);
    let recorded =
        rewritten.metadata.annotations.unwrap()[names::ANNOTATION_DEVICE_PLUGIN_REQUEST].clone();
    let decoded: DevicePluginRequest = serde_json::from_str(&recorded).unwrap();
    assert_eq!(decoded, request);
}

#[test]
fn a_pod_claim_named_like_ours_is_refused_and_a_node_name_skips_the_rewrite() {
    let p: core::Pod = serde_json::from_value(json!({
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {
            "containers": [{"name": "main", "image": "i", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
            "resourceClaims": [{"name": "tessera-main", "resourceClaimName": "x"}],
        },
    }))
    .unwrap();
    let text = rewrite_pod(&p, &Options::default(), POD)
        .unwrap_err()
        .to_string();
    assert!(
        text.contains("spec.resourceClaims") && text.contains("tessera-main"),
        "{text}"
    );
    let mut p = pod(&json!({"nvidia.com/gpu": "1"}));
    p.spec.as_mut().unwrap().node_name = Some("n".into());
    assert!(matches!(
        rewrite_pod(&p, &Options::default(), POD).unwrap(),
        PodRewrite::Skipped(_)
    ));
}

#[test]
fn a_template_carries_the_spec_the_labels_and_the_forms() {
    let m = map(&pod(&json!({"nvidia.com/gpu": "1"}))).unwrap();
    let t = template(&m.claims[0], "ns");
    assert_eq!(
        t.metadata.name.as_deref(),
        Some(m.claims[0].template.as_str())
    );
    assert_eq!(
        t.metadata.labels.as_ref().unwrap()[names::LABEL_DEVICE_PLUGIN_TEMPLATE],
        "true"
    );
    assert_eq!(
        t.spec.metadata.unwrap().annotations.unwrap()[names::ANNOTATION_DEVICE_PLUGIN_FORMS],
        "nvidia"
    );
    assert_eq!(t.spec.spec, m.claims[0].spec);
}

#[test]
fn the_controller_maps_the_recorded_request_to_the_templates_the_pod_refers_to() {
    let p = pod(&json!({"nvidia.com/gpu": "1", "nvidia.com/gpu.shared": "1"}));
    let PodRewrite::Rewritten {
        request, mapping, ..
    } = rewrite_pod(&p, &Options::default(), POD).unwrap()
    else {
        panic!("not rewritten");
    };
    let (rewritten, _) = rewrite_offline(&p, &request, &mapping, POD).unwrap();
    // rewrite_offline names claims directly; the webhook's pod names the template.
    let mut admitted = rewritten.clone();
    for entry in admitted
        .spec
        .as_mut()
        .unwrap()
        .resource_claims
        .as_mut()
        .unwrap()
    {
        entry.resource_claim_name = None;
        entry.resource_claim_template_name = Some(mapping.claims[0].template.clone());
    }
    let templates = templates_for_pod(&admitted, &Options::default()).unwrap();
    assert_eq!(templates.len(), 1);
    assert_eq!(templates[0].spec.spec, mapping.claims[0].spec);
    assert_eq!(templates[0].metadata.namespace.as_deref(), Some("ns"));
    assert!(
        templates_for_pod(&p, &Options::default())
            .unwrap()
            .is_empty()
    );

    let v1beta1 = template_document(&templates[0], crate::apiversion::ApiVersion::V1beta1).unwrap();
    let request = &v1beta1["spec"]["spec"]["devices"]["requests"][0];
    assert_eq!(request["deviceClassName"], names::CLASS_GPU);
    assert!(request.get("exactly").is_none());
    let decoded = crate::apiversion::decode_document(v1beta1, "t").unwrap();
    let crate::apiversion::Object::ResourceClaimTemplate(back) = decoded else {
        panic!("not a template");
    };
    assert_eq!(back.spec.spec, templates[0].spec.spec);
}

#[test]
fn a_pod_labelled_to_keep_its_names_is_untouched() {
    let p = pod_with(
        &json!([{"name": "main", "image": "i", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]),
        Some(&json!({names::LABEL_KEEP_DEVICE_PLUGIN_NAMES: "true"})),
    );
    assert_eq!(
        rewrite_pod(&p, &Options::default(), POD).unwrap(),
        PodRewrite::Untouched
    );
}
