//! The Helm chart's static parts, without a helm binary: the chart's DeviceClasses are the
//! repository's, every template is YAML once its actions are filled in from values.yaml, every
//! value a template names exists, the plugin's arguments parse with the plugin's own command
//! line, the webhook registration matches the hooks the controller serves, and the admission
//! policy that keeps each node's plugin to its own ResourceSlices decides example requests as
//! the API server would (its CEL evaluated with the `cel` crate).
#![allow(clippy::unwrap_used, missing_docs)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use clap::Parser as _;
use serde_yaml::Value;
use tessera_controller::webhook::Hook;
use tessera_driver::names;

#[path = "support/chart.rs"]
mod chart;
use chart::{
    NAMESPACE, RELEASE, actions, chart, documents, documents_with, find, lookup, on_node, repo,
    strings, values, with_driver_root,
};

/// Whether a (Cluster)Role grants `verb` on `resource` of `group`.
fn grants(role: &Value, group: &str, resource: &str, verb: &str) -> bool {
    role["rules"].as_sequence().unwrap().iter().any(|rule| {
        strings(&rule["apiGroups"]).iter().any(|g| g == group)
            && strings(&rule["resources"]).iter().any(|r| r == resource)
            && strings(&rule["verbs"]).iter().any(|v| v == verb)
    })
}

#[test]
fn the_charts_deviceclasses_are_the_repositorys() {
    let list = |dir: &Path| -> BTreeMap<String, Vec<u8>> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .map(|p| {
                (
                    p.file_name().unwrap().to_string_lossy().into_owned(),
                    std::fs::read(&p).unwrap(),
                )
            })
            .collect()
    };
    let source = list(&repo().join("deviceclasses"));
    let copy = list(&chart().join("deviceclasses"));
    assert_eq!(
        source.keys().collect::<Vec<_>>(),
        copy.keys().collect::<Vec<_>>(),
        "copy deviceclasses/ into deploy/helm/tessera/deviceclasses/"
    );
    for (name, bytes) in &source {
        assert!(
            copy[name] == *bytes,
            "deploy/helm/tessera/deviceclasses/{name} differs from deviceclasses/{name}: copy it again"
        );
    }
}

#[test]
fn chart_and_values_are_yaml_and_every_named_value_exists() {
    let chart_yaml: Value =
        serde_yaml::from_str(&std::fs::read_to_string(chart().join("Chart.yaml")).unwrap())
            .unwrap();
    assert_eq!(chart_yaml["apiVersion"], "v2");
    assert_eq!(chart_yaml["name"], "tessera");
    let values = values();
    for entry in std::fs::read_dir(chart().join("templates")).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        for (_, _, action) in actions(&text) {
            for word in action.split([' ', '(', ')', '|']) {
                if let Some(key) = word.strip_prefix(".Values.") {
                    assert!(
                        lookup(&values, key).is_some(),
                        "{}: .Values.{key} is not in values.yaml",
                        path.display()
                    );
                }
            }
        }
    }
    let docs = documents();
    assert!(docs.len() >= 15, "only {} documents", docs.len());
    for (file, doc) in &docs {
        assert!(
            doc["apiVersion"].is_string() && doc["kind"].is_string(),
            "{file}: a document without apiVersion or kind: {doc:?}"
        );
    }
}

#[test]
fn the_kubelet_plugin_daemonset_mounts_kubelets_directories_and_its_arguments_parse() {
    let docs = documents();
    let ds = find(&docs, "DaemonSet", "tessera-kubelet-plugin");
    let spec = &ds["spec"]["template"]["spec"];
    let host_paths: Vec<&str> = spec["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|v| v["hostPath"]["path"].as_str())
        .collect();
    let plugin_dir = format!(
        "{}/{}",
        names::DEFAULT_PLUGINS_DIR,
        names::DEFAULT_DRIVER_NAME
    );
    for path in [
        names::DEFAULT_REGISTRATION_DIR,
        plugin_dir.as_str(),
        names::DEFAULT_CDI_DIR,
        "/var/lib/tessera",
    ] {
        assert!(
            host_paths.contains(&path),
            "{path} not mounted: {host_paths:?}"
        );
    }
    let container = &spec["containers"][0];
    let env = container["env"].as_sequence().unwrap();
    assert!(
        env.iter().any(|e| e["name"] == "NODE_NAME"
            && e["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName")
    );
    let mut command_line = vec![
        "tessera-kubelet-plugin".to_owned(),
        "--node-name=n".to_owned(),
    ];
    command_line.extend(strings(&container["args"]));
    let args = tessera_kubelet_plugin::cli::args::Args::try_parse_from(&command_line)
        .unwrap_or_else(|e| {
            panic!("the chart's plugin arguments do not parse: {e}\n{command_line:?}")
        });
    assert_eq!(
        args.registration_dir,
        Path::new(names::DEFAULT_REGISTRATION_DIR)
    );
    assert_eq!(args.plugin_dir.as_deref(), Some(Path::new(&plugin_dir)));
    assert_eq!(args.cdi_dir, Path::new(names::DEFAULT_CDI_DIR));
    let mounts: Vec<&str> = container["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|m| m["mountPath"].as_str())
        .collect();
    for dir in [
        &args.registration_dir,
        args.plugin_dir.as_ref().unwrap(),
        &args.cdi_dir,
    ] {
        assert!(
            mounts.contains(&dir.to_str().unwrap()),
            "{dir:?} not mounted"
        );
    }
}

#[test]
fn rbac_grants_what_the_plugin_and_the_controller_need() {
    let docs = documents();
    let plugin = find(&docs, "ClusterRole", "tessera-kubelet-plugin");
    for verb in ["create", "update", "delete", "list", "watch"] {
        assert!(
            grants(plugin, "resource.k8s.io", "resourceslices", verb),
            "{verb}"
        );
    }
    assert!(grants(plugin, "resource.k8s.io", "resourceclaims", "get"));
    // The claims' status.devices entries of its own driver (docs/claim-status.md).
    for verb in ["update", "patch"] {
        assert!(grants(
            plugin,
            "resource.k8s.io",
            "resourceclaims/status",
            verb
        ));
        assert!(grants(
            plugin,
            "resource.k8s.io",
            "resourceclaims/driver",
            &format!("associated-node:{verb}")
        ));
    }
    assert!(grants(plugin, "", "nodes", "get"));
    for verb in ["create", "patch"] {
        assert!(grants(plugin, "events.k8s.io", "events", verb), "{verb}");
    }
    let controller = find(&docs, "ClusterRole", "tessera-controller");
    for (group, resource, verb) in [
        ("resource.k8s.io", "resourceclaims", "watch"),
        ("resource.k8s.io", "resourceclaims", "update"),
        ("resource.k8s.io", "resourceclaims/status", "update"),
        ("resource.k8s.io", "resourceclaims/binding", "update"),
        ("resource.k8s.io", "resourceslices", "watch"),
        ("resource.k8s.io", "deviceclasses", "get"),
        ("resource.k8s.io", "resourceclaimtemplates", "get"),
        ("resource.k8s.io", "resourceclaimtemplates", "list"),
        ("resource.k8s.io", "resourceclaimtemplates", "create"),
        ("resource.k8s.io", "resourceclaimtemplates", "delete"),
        ("", "pods", "patch"),
        ("", "pods/status", "patch"),
        ("", "pods/eviction", "create"),
        ("", "nodes", "list"),
        ("", "nodes", "patch"),
        ("gpu.tessera.dev", "gpuprofileschedules", "list"),
        ("policy", "poddisruptionbudgets", "list"),
        ("", "events", "create"),
        // kube-runtime's Recorder: events.k8s.io/v1, a repeat patched onto the first.
        ("events.k8s.io", "events", "create"),
        ("events.k8s.io", "events", "patch"),
    ] {
        assert!(
            grants(controller, group, resource, verb),
            "controller lacks {verb} on {group}/{resource}"
        );
    }
    let leases = find(&docs, "Role", "tessera-controller-leases");
    for verb in ["get", "create", "update"] {
        assert!(grants(leases, "coordination.k8s.io", "leases", verb));
    }
}

#[test]
fn the_controller_runs_two_replicas_with_the_webhook_certificate_mounted() {
    let docs = documents();
    let deployment = find(&docs, "Deployment", "tessera-controller");
    assert_eq!(deployment["spec"]["replicas"], 2);
    let spec = &deployment["spec"]["template"]["spec"];
    let container = &spec["containers"][0];
    let args = strings(&container["args"]);
    let cert_dir = args
        .iter()
        .find_map(|a| a.strip_prefix("--webhook-cert-dir="))
        .expect("--webhook-cert-dir");
    assert!(args.iter().any(|a| a.starts_with("--webhook-addr=")));
    let command_line = std::iter::once("tessera-controller".to_owned()).chain(args.iter().cloned());
    let parsed = <tessera_controller::args::Args as clap::Parser>::try_parse_from(command_line)
        .unwrap_or_else(|e| panic!("the chart's controller arguments do not parse: {e}\n{args:?}"));
    assert_eq!(
        parsed.shared_gpu_replicas,
        tessera_driver::admission::device_plugin_names::DEFAULT_SHARED_REPLICAS
    );
    assert!(!parsed.preemption, "preemption is opt-in");
    let mount = container["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == cert_dir)
        .expect("the certificate directory is mounted");
    let volume = spec["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    assert_eq!(volume["secret"]["secretName"], "tessera-webhook-tls");
    let service = find(&docs, "Service", "tessera-webhook");
    assert_eq!(service["spec"]["ports"][0]["targetPort"], "webhook");
}

#[test]
fn pods_fail_open_claims_fail_closed_and_the_paths_are_the_controllers() {
    let docs = documents();
    let mutating = find(&docs, "MutatingWebhookConfiguration", "tessera");
    let validating = find(&docs, "ValidatingWebhookConfiguration", "tessera");
    let hooks = |config: &Value| -> Vec<(String, String, String)> {
        config["webhooks"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|w| {
                assert_eq!(w["sideEffects"], "None");
                assert_eq!(strings(&w["admissionReviewVersions"]), ["v1"]);
                assert_eq!(w["clientConfig"]["service"]["name"], "tessera-webhook");
                (
                    w["clientConfig"]["service"]["path"]
                        .as_str()
                        .unwrap()
                        .to_owned(),
                    w["failurePolicy"].as_str().unwrap().to_owned(),
                    strings(&w["rules"][0]["resources"]).join(","),
                )
            })
            .collect()
    };
    assert_eq!(
        hooks(mutating),
        [
            (
                Hook::MutatePods.path().to_owned(),
                "Ignore".to_owned(),
                "pods".to_owned()
            ),
            (
                Hook::MutateClaims.path().to_owned(),
                "Ignore".to_owned(),
                "resourceclaims,resourceclaimtemplates".to_owned()
            ),
        ]
    );
    assert_eq!(
        hooks(validating),
        [
            (
                Hook::ValidateClaims.path().to_owned(),
                "Fail".to_owned(),
                "resourceclaims,resourceclaimtemplates".to_owned()
            ),
            (
                Hook::ValidateSchedules.path().to_owned(),
                "Fail".to_owned(),
                "gpuprofileschedules".to_owned()
            ),
        ]
    );
}

#[test]
fn the_image_builds_every_binary_the_chart_runs() {
    let dockerfile = std::fs::read_to_string(repo().join("deploy/Dockerfile")).unwrap();
    let docs = documents();
    let mut commands = Vec::new();
    for (_, doc) in &docs {
        let containers = &doc["spec"]["template"]["spec"]["containers"];
        for container in containers.as_sequence().into_iter().flatten() {
            commands.extend(strings(&container["command"]));
        }
    }
    assert!(commands.len() >= 2, "{commands:?}");
    for command in commands {
        assert!(
            dockerfile.contains(&format!("--bin {command}"))
                && dockerfile.contains(&format!("target/release/{command}")),
            "deploy/Dockerfile does not build {command}"
        );
    }
}

/// The plugin's service account, as the API server names its user.
fn plugin_user() -> String {
    format!("system:serviceaccount:{NAMESPACE}:{RELEASE}-kubelet-plugin")
}

/// What the policy's CEL sees of one admission request: `request`, `object`, `oldObject`.
struct Admission {
    request: serde_json::Value,
    object: serde_json::Value,
    old: serde_json::Value,
}

fn slice(node: &str, driver: &str) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": format!("{node}-slice")},
        "spec": {"driver": driver, "nodeName": node,
                 "pool": {"name": node, "generation": 1, "resourceSliceCount": 1}},
    })
}

/// A request of `user` (with a token bound to a pod on `node`, if any) doing `operation` on a
/// ResourceSlice, new `object` and stored `old`.
fn request(
    user: &str,
    node: Option<&str>,
    operation: &str,
    object: Option<serde_json::Value>,
    old: Option<serde_json::Value>,
) -> Admission {
    let mut user_info = serde_json::json!({"username": user, "groups": ["system:authenticated"]});
    if let Some(node) = node {
        user_info["extra"] = serde_json::json!({
            "authentication.kubernetes.io/node-name": [node],
            "authentication.kubernetes.io/pod-name": ["tessera-kubelet-plugin-x7k2p"],
        });
    }
    Admission {
        request: serde_json::json!({"operation": operation, "userInfo": user_info}),
        object: object.unwrap_or(serde_json::Value::Null),
        old: old.unwrap_or(serde_json::Value::Null),
    }
}

fn evaluate_cel(
    expression: &str,
    r: &Admission,
    variables: &std::collections::HashMap<String, cel::Value>,
) -> cel::Value {
    let program = cel::Program::compile(expression)
        .unwrap_or_else(|e| panic!("{expression}: does not compile: {e}"));
    let mut context = cel::Context::default();
    context.add_variable("request", &r.request).unwrap();
    context.add_variable("object", &r.object).unwrap();
    context.add_variable("oldObject", &r.old).unwrap();
    context.add_variable_from_value("variables", variables.clone());
    program
        .execute(&context)
        .unwrap_or_else(|e| panic!("{expression}: {e}"))
}

/// What the policy answers: `None` when it does not apply (the match condition is false),
/// else `Ok` or `Err(message)` of the first failed validation.
fn admit(policy: &Value, r: &Admission) -> Option<Result<(), String>> {
    let spec = &policy["spec"];
    let mut variables = std::collections::HashMap::new();
    for condition in spec["matchConditions"].as_sequence().unwrap() {
        let expression = condition["expression"].as_str().unwrap();
        if evaluate_cel(expression, r, &variables) != cel::Value::Bool(true) {
            return None;
        }
    }
    for variable in spec["variables"].as_sequence().unwrap() {
        let value = evaluate_cel(variable["expression"].as_str().unwrap(), r, &variables);
        variables.insert(variable["name"].as_str().unwrap().to_owned(), value);
    }
    for validation in spec["validations"].as_sequence().unwrap() {
        let expression = validation["expression"].as_str().unwrap();
        if evaluate_cel(expression, r, &variables) != cel::Value::Bool(true) {
            let message = match validation["messageExpression"].as_str() {
                Some(m) => match evaluate_cel(m, r, &variables) {
                    cel::Value::String(s) => s.to_string(),
                    other => panic!("{m}: not a string: {other:?}"),
                },
                None => validation["message"].as_str().unwrap().to_owned(),
            };
            return Some(Err(message));
        }
    }
    Some(Ok(()))
}

#[test]
fn each_nodes_plugin_may_write_only_its_own_nodes_resourceslices() {
    let docs = documents();
    let name = "tessera-kubelet-plugin-own-node-slices";
    let policy = find(&docs, "ValidatingAdmissionPolicy", name);
    let binding = find(&docs, "ValidatingAdmissionPolicyBinding", name);
    assert_eq!(policy["apiVersion"], "admissionregistration.k8s.io/v1");
    assert_eq!(policy["spec"]["failurePolicy"], "Fail");
    let rule = &policy["spec"]["matchConstraints"]["resourceRules"][0];
    assert_eq!(strings(&rule["apiGroups"]), ["resource.k8s.io"]);
    assert_eq!(strings(&rule["resources"]), ["resourceslices"]);
    assert_eq!(strings(&rule["operations"]), ["CREATE", "UPDATE", "DELETE"]);
    assert_eq!(binding["spec"]["policyName"], name);
    assert_eq!(strings(&binding["spec"]["validationActions"]), ["Deny"]);
    // The user the policy binds is the plugin DaemonSet's service account.
    let ds = find(&docs, "DaemonSet", "tessera-kubelet-plugin");
    let account = ds["spec"]["template"]["spec"]["serviceAccountName"]
        .as_str()
        .unwrap();
    assert_eq!(
        plugin_user(),
        format!("system:serviceaccount:{NAMESPACE}:{account}")
    );

    let ours = names::DEFAULT_DRIVER_NAME;
    let me = plugin_user();
    let own = || Some(slice("node-a", ours));
    let allowed = |r: Admission| assert_eq!(admit(policy, &r), Some(Ok(())));
    let denied = |r: Admission, why: &str| match admit(policy, &r) {
        Some(Err(message)) => assert!(message.contains(why), "{message}"),
        other => panic!("not denied: {other:?}"),
    };
    // Its own node's slices of this driver: create, update, delete.
    allowed(request(&me, Some("node-a"), "CREATE", own(), None));
    allowed(request(&me, Some("node-a"), "UPDATE", own(), own()));
    allowed(request(&me, Some("node-a"), "DELETE", None, own()));
    // Another node's, in any way.
    let other = || Some(slice("node-b", ours));
    let expected = "spec.nodeName node-a";
    denied(
        request(&me, Some("node-a"), "CREATE", other(), None),
        expected,
    );
    denied(
        request(&me, Some("node-a"), "UPDATE", other(), other()),
        expected,
    );
    denied(
        request(&me, Some("node-a"), "UPDATE", own(), other()),
        expected,
    );
    denied(
        request(&me, Some("node-a"), "UPDATE", other(), own()),
        expected,
    );
    denied(
        request(&me, Some("node-a"), "DELETE", None, other()),
        expected,
    );
    // Another driver's slice on its own node.
    let foreign = || Some(slice("node-a", "other.example.com"));
    denied(
        request(&me, Some("node-a"), "CREATE", foreign(), None),
        ours,
    );
    denied(
        request(&me, Some("node-a"), "DELETE", None, foreign()),
        ours,
    );
    // A slice without a node (a network-attached pool).
    let mut pool = slice("node-a", ours);
    pool["spec"].as_object_mut().unwrap().remove("nodeName");
    denied(
        request(&me, Some("node-a"), "CREATE", Some(pool), None),
        expected,
    );
    // A token that names no node (not bound to a pod) may do nothing.
    denied(request(&me, None, "CREATE", own(), None), "names no node");
    // Everyone else is left alone: kubelet wiping its node, an admin, another driver.
    for user in [
        "system:node:node-a",
        "kubernetes-admin",
        "system:serviceaccount:other:plugin",
    ] {
        assert_eq!(
            admit(policy, &request(user, None, "DELETE", None, other())),
            None
        );
        assert_eq!(
            admit(
                policy,
                &request(user, Some("node-a"), "CREATE", other(), None)
            ),
            None
        );
    }
}

/// A claim allocated to `node`, with `devices` as its status entries (driver, pool, device).
fn claim_on(node: &str, devices: &[(&str, &str, &str)]) -> serde_json::Value {
    let entries: Vec<serde_json::Value> = devices
        .iter()
        .map(|(driver, pool, device)| {
            serde_json::json!({"driver": driver, "pool": pool, "device": device,
                               "data": {"backend": "mps"}})
        })
        .collect();
    serde_json::json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "train", "namespace": "team"},
        "status": {
            "allocation": {"nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [node]}]}]}},
            "reservedFor": [{"resource": "pods", "name": "trainer", "uid": "u1"}],
            "devices": entries,
        },
    })
}

#[test]
fn each_nodes_plugin_may_write_only_its_own_drivers_entries_of_claims_on_its_own_node() {
    let docs = documents();
    let name = "tessera-kubelet-plugin-own-node-claims";
    let policy = find(&docs, "ValidatingAdmissionPolicy", name);
    let binding = find(&docs, "ValidatingAdmissionPolicyBinding", name);
    assert_eq!(policy["spec"]["failurePolicy"], "Fail");
    let rule = &policy["spec"]["matchConstraints"]["resourceRules"][0];
    assert_eq!(strings(&rule["resources"]), ["resourceclaims/status"]);
    assert_eq!(strings(&rule["operations"]), ["UPDATE"]);
    assert_eq!(strings(&binding["spec"]["validationActions"]), ["Deny"]);

    let ours = names::DEFAULT_DRIVER_NAME;
    let me = plugin_user();
    let nic = ("nic.example.com", "node-a", "eth1");
    let before = claim_on("node-a", &[nic]);
    let written = claim_on("node-a", &[nic, (ours, "node-a", "gpu-0")]);
    let update =
        |user: &str, node: Option<&str>, new: &serde_json::Value, old: &serde_json::Value| {
            admit(
                policy,
                &request(user, node, "UPDATE", Some(new.clone()), Some(old.clone())),
            )
        };
    let denied = |answer: Option<Result<(), String>>, why: &str| match answer {
        Some(Err(message)) => assert!(message.contains(why), "{message}"),
        other => panic!("not denied: {other:?}"),
    };
    // Its own entries on a claim allocated to its node, added and removed again.
    assert_eq!(update(&me, Some("node-a"), &written, &before), Some(Ok(())));
    assert_eq!(update(&me, Some("node-a"), &before, &written), Some(Ok(())));
    // A claim on another node.
    let elsewhere = claim_on("node-b", &[nic]);
    let elsewhere_written = claim_on("node-b", &[nic, (ours, "node-a", "gpu-0")]);
    denied(
        update(&me, Some("node-a"), &elsewhere_written, &elsewhere),
        "allocated to that node",
    );
    // Another driver's entry changed or dropped.
    denied(
        update(
            &me,
            Some("node-a"),
            &claim_on("node-a", &[(ours, "node-a", "gpu-0")]),
            &before,
        ),
        "another driver's",
    );
    // An entry for a device of another node's pool.
    denied(
        update(
            &me,
            Some("node-a"),
            &claim_on("node-a", &[nic, (ours, "node-b", "gpu-0")]),
            &before,
        ),
        "pool node-a",
    );
    // The allocation or the reservations changed.
    let mut unreserved = written.clone();
    unreserved["status"]
        .as_object_mut()
        .unwrap()
        .remove("reservedFor");
    denied(
        update(&me, Some("node-a"), &unreserved, &before),
        "allocation or reservations",
    );
    // A token that names no node.
    denied(update(&me, None, &written, &before), "names no node");
    // Everyone else is left alone (the scheduler, another driver's plugin, an admin).
    for user in [
        "system:kube-scheduler",
        "system:serviceaccount:other:plugin",
        "kubernetes-admin",
    ] {
        assert_eq!(update(user, None, &elsewhere_written, &elsewhere), None);
    }
}

#[test]
fn the_whole_gpu_class_carries_an_extended_resource_name_only_when_asked_and_only_on_v1() {
    let values = values();
    assert_eq!(
        lookup(&values, "deviceClasses.extendedResourceName").and_then(Value::as_str),
        Some(""),
        "off by default"
    );
    let template = std::fs::read_to_string(chart().join("templates/deviceclasses.yaml")).unwrap();
    assert!(template.contains("if eq $version \"resource.k8s.io/v1\""));
    assert!(template.contains("(eq (base $path) \"gpu.yaml\")"));
    assert!(template.contains("extendedResourceName: %s"));
    // The replacement finds its anchor in the class it edits.
    let class = std::fs::read_to_string(chart().join("deviceclasses/gpu.yaml")).unwrap();
    assert_eq!(class.matches("\nspec:\n").count(), 1);
}

/// A node with the NVIDIA driver's files installed under `root` (only NVML and the MPS
/// binaries, where Ubuntu puts them).
fn node_with_driver_at(root: &str) -> tempfile::TempDir {
    let node = tempfile::tempdir().unwrap();
    let driver = node.path().join(root.trim_start_matches('/'));
    for file in [
        "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
        "usr/bin/nvidia-cuda-mps-control",
        "usr/bin/nvidia-cuda-mps-server",
    ] {
        let path = driver.join(file);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, "").unwrap();
    }
    node
}

/// The plugin's NVML as the plugin looks for it, on a node with the driver at `driver_at`,
/// with the chart rendered for `value`.
fn plugin_nvml(value: &str, driver_at: &str) -> Result<PathBuf, String> {
    let docs = documents_with(&with_driver_root(value));
    let ds = find(&docs, "DaemonSet", "tessera-kubelet-plugin");
    let pod = &ds["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    let mut command_line = vec![
        "tessera-kubelet-plugin".to_owned(),
        "--node-name=n".to_owned(),
    ];
    command_line.extend(strings(&container["args"]));
    let mut args = tessera_kubelet_plugin::cli::args::Args::try_parse_from(&command_line).unwrap();
    let node = node_with_driver_at(driver_at);
    let root = args.launch.driver_root.display().to_string();
    args.launch.driver_root = on_node(pod, container, &root, node.path())
        .unwrap_or_else(|| panic!("the plugin's --driver-root {root} is not mounted"));
    let found = args.nvml_library_path().map_err(|e| e.to_string())?;
    Ok(found
        .strip_prefix(node.path())
        .map(|p| Path::new("/").join(p))
        .unwrap())
}

#[test]
fn the_plugin_finds_nvml_at_either_usual_driver_root_and_only_where_the_value_says() {
    assert_eq!(
        plugin_nvml("/", "/").unwrap(),
        Path::new("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1")
    );
    assert_eq!(
        plugin_nvml("/run/nvidia/driver", "/run/nvidia/driver").unwrap(),
        Path::new("/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1")
    );
    let err = plugin_nvml("/", "/run/nvidia/driver").unwrap_err();
    assert!(err.contains("nvidiaDriverRoot"), "{err}");
}

#[test]
fn the_mps_host_finds_the_mps_binaries_at_either_usual_driver_root_and_shares_the_plugins_paths() {
    use tessera_kubelet_plugin::cli::mps_cli::{Cli, Command};
    for root in ["/", "/run/nvidia/driver"] {
        let docs = documents_with(&with_driver_root(root));
        let host = find(&docs, "DaemonSet", "tessera-mps");
        assert_eq!(
            host["spec"]["updateStrategy"]["type"], "OnDelete",
            "a chart upgrade must not restart the daemons"
        );
        let pod = &host["spec"]["template"]["spec"];
        assert_eq!(pod["hostPID"], true);
        let container = &pod["containers"][0];
        assert_eq!(strings(&container["command"]), ["tessera-mps"]);
        let mut command_line = vec!["tessera-mps".to_owned()];
        command_line.extend(strings(&container["args"]));
        let cli = Cli::try_parse_from(&command_line)
            .unwrap_or_else(|e| panic!("the MPS host's arguments do not parse: {e}"));
        let Command::Host(mut args) = cli.command else {
            panic!("the MPS host runs `tessera-mps host`");
        };
        let node = node_with_driver_at(root);
        let inside = args.launch.driver_root.display().to_string();
        args.launch.driver_root = on_node(pod, container, &inside, node.path()).unwrap();
        args.launch.mps_exec_binary = Some(PathBuf::from("/usr/local/bin/tessera-mps"));
        let launch = args.launch.launch().unwrap();
        assert_eq!(launch.control_binary, "/usr/bin/nvidia-cuda-mps-control");
        let wrapper = launch.wrapper.unwrap();
        assert_eq!(
            Path::new(&wrapper.driver_root),
            node.path().join(root.trim_start_matches('/'))
        );

        // The host reads the plugin's checkpoint and makes the daemons' directories where the
        // plugin's claims point.
        let plugin_ds = find(&docs, "DaemonSet", "tessera-kubelet-plugin");
        let plugin_pod = &plugin_ds["spec"]["template"]["spec"];
        let plugin = &plugin_pod["containers"][0];
        let mut plugin_line = vec!["p".to_owned(), "--node-name=n".to_owned()];
        plugin_line.extend(strings(&plugin["args"]));
        let plugin_args =
            tessera_kubelet_plugin::cli::args::Args::try_parse_from(&plugin_line).unwrap();
        assert_eq!(
            plugin_args.mps_daemons,
            tessera_kubelet_plugin::cli::args::MpsDaemons::Host
        );
        assert_eq!(
            plugin_args.state_dir.as_deref(),
            Some(args.state_dir.as_path())
        );
        for dir in [
            plugin_args.mps_pipe_dir_root.clone(),
            plugin_args.mps_log_dir_root.clone(),
        ] {
            let probe = format!("{dir}/mps-x");
            let on_host = on_node(pod, container, &probe, node.path());
            assert!(on_host.is_some(), "the MPS host does not mount {dir}");
            if dir == plugin_args.mps_pipe_dir_root {
                assert_eq!(
                    on_host,
                    on_node(plugin_pod, plugin, &probe, node.path()),
                    "plugin and host see {dir} on the same host directory"
                );
            }
        }
        let state = on_node(
            pod,
            container,
            &args.state_dir.display().to_string(),
            node.path(),
        );
        assert_eq!(
            state,
            on_node(
                plugin_pod,
                plugin,
                &args.state_dir.display().to_string(),
                node.path()
            )
        );
    }
}

#[test]
fn only_the_api_server_may_reach_the_controllers_webhook_port() {
    let values = values();
    assert_eq!(
        lookup(&values, "webhook.networkPolicy.enabled"),
        Some(&Value::Bool(true)),
        "the policy is on by default"
    );
    let docs = documents();
    let policy = find(&docs, "NetworkPolicy", "tessera-webhook");
    let deployment = find(&docs, "Deployment", "tessera-controller");
    assert_eq!(
        policy["spec"]["podSelector"]["matchLabels"], deployment["spec"]["selector"]["matchLabels"],
        "the policy selects exactly the controller pods"
    );
    assert_eq!(strings(&policy["spec"]["policyTypes"]), ["Ingress"]);
    let rules = policy["spec"]["ingress"].as_sequence().unwrap();
    assert_eq!(rules.len(), 1, "one rule, for the webhook port: {rules:?}");
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    let webhook_port = container["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "webhook")
        .unwrap();
    assert_eq!(rules[0]["ports"][0]["port"], webhook_port["containerPort"]);
    assert_eq!(rules[0]["ports"][0]["protocol"], "TCP");
    // A rule without `from` would admit every source; the sources are the API server's.
    assert!(
        rules[0]["from"]
            .as_sequence()
            .is_some_and(|f| !f.is_empty()),
        "{:?}",
        rules[0]
    );
    // Without a known source the chart refuses to render rather than shut the API server out.
    let template =
        std::fs::read_to_string(chart().join("templates/webhook-network-policy.yaml")).unwrap();
    let refusal = actions(&template)
        .into_iter()
        .find(|(_, _, a)| a.starts_with("fail "))
        .expect("the template fails when no API server address is known");
    assert!(refusal.2.contains("webhook.networkPolicy.apiServerCIDRs"));
    assert!(
        template.contains(r#"lookup "discovery.k8s.io/v1" "EndpointSlice" "default" "kubernetes""#)
    );
}

#[test]
fn the_schedule_crd_serves_the_kind_the_controller_reads_with_a_schema() {
    let text = std::fs::read_to_string(chart().join("crds/gpuprofileschedules.yaml")).unwrap();
    let crd: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
    assert_eq!(crd["kind"].as_str(), Some("CustomResourceDefinition"));
    assert_eq!(crd["spec"]["group"].as_str(), Some(names::TESSERA_GROUP));
    assert_eq!(
        crd["spec"]["names"]["kind"].as_str(),
        Some(names::GPU_PROFILE_SCHEDULE.kind)
    );
    assert_eq!(
        crd["spec"]["names"]["plural"].as_str(),
        Some(names::GPU_PROFILE_SCHEDULE.plural)
    );
    assert_eq!(
        crd["metadata"]["name"].as_str().unwrap(),
        format!(
            "{}.{}",
            names::GPU_PROFILE_SCHEDULE.plural,
            names::TESSERA_GROUP
        )
    );
    let version = &crd["spec"]["versions"][0];
    assert_eq!(version["name"].as_str(), Some(names::TESSERA_VERSION));
    let spec = &version["schema"]["openAPIV3Schema"]["properties"]["spec"];
    for field in ["nodeSelector", "timeZone", "profiles", "windows"] {
        assert!(
            !spec["properties"][field].is_null(),
            "the schema lacks spec.{field}"
        );
    }
}
