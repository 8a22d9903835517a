//! Which gated pods take the fast path: those whose every placement constraint the controller
//! evaluates the way kube-scheduler's filters do ([`crate::placement::nodefit`] and the allocator). For
//! them the controller writes each claim's allocation with `reservedFor` naming the pod in the
//! same status write, so kube-scheduler, once the gate is gone, finds nothing to decide or
//! write but the binding to the one node the allocation names. Claims reserved for a pod tie
//! it to that node, so the fast path is kept to pods whose every constraint the controller
//! has checked there; any other pod gets unreserved claims, as before, and kube-scheduler
//! checks the rest and reserves them when it binds.
//!
//! A pod is kept off the fast path when it has any of: inter-pod affinity or anti-affinity, topology spread constraints, a volume other than `configMap`,
//! `secret`, `emptyDir`, `downwardAPI`, `projected` or `hostPath` (a PVC may still need
//! binding, and other kinds count against per-node volume limits), a container port with a
//! `hostPort`, a scheduler other than `default-scheduler`, pod-level `resources`, a container
//! request or limit other than `cpu` and `memory` (extended resources, `ephemeral-storage`,
//! hugepages are not filtered by the controller), another scheduling gate, or a deletion
//! under way. Everything else kube-scheduler's default filters check (node name, node
//! selector, required node affinity, taints, cordons, CPU, memory and pod slots, the claims)
//! the controller checks itself.

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, Volume};

use crate::placement::gate;

/// The scheduler name a pod without `schedulerName` gets.
pub const DEFAULT_SCHEDULER: &str = "default-scheduler";

/// Container resources the controller's node filter accounts for.
const FILTERED_RESOURCES: [&str; 2] = ["cpu", "memory"];

/// Why `pod` must stay off the fast path, or `None` when its claims may be reserved for it at once.
pub fn blocker(pod: &Pod) -> Option<String> {
    if pod.metadata.deletion_timestamp.is_some() {
        return Some("the pod is being deleted".to_owned());
    }
    let spec = pod.spec.as_ref()?;
    if !gate::gates_without_ours(pod).is_empty() {
        return Some("the pod carries other scheduling gates".to_owned());
    }
    if let Some(name) = spec
        .scheduler_name
        .as_deref()
        .filter(|n| *n != DEFAULT_SCHEDULER)
    {
        return Some(format!("the pod asks for scheduler {name:?}"));
    }
    if let Some(a) = &spec.affinity
        && (a.pod_affinity.is_some() || a.pod_anti_affinity.is_some())
    {
        return Some("the pod has inter-pod affinity or anti-affinity".to_owned());
    }
    if spec
        .topology_spread_constraints
        .as_ref()
        .is_some_and(|t| !t.is_empty())
    {
        return Some("the pod has topology spread constraints".to_owned());
    }
    if let Some(v) = blocking_volumes(spec.volumes.as_deref().unwrap_or_default()).first() {
        return Some(format!(
            "volume {:?} may need binding or count against a node's volume limits",
            v.name
        ));
    }
    if spec.resources.is_some() {
        return Some("the pod has pod-level resources".to_owned());
    }
    container_blocker(spec)
}

/// The part of [`blocker`] its containers decide: a host port, or a resource the controller
/// does not filter on (a holder that keeps pods without their containers keeps this).
pub fn container_blocker(spec: &PodSpec) -> Option<String> {
    for c in containers(spec) {
        if c.ports.iter().flatten().any(|p| p.host_port.is_some()) {
            return Some(format!("container {:?} asks for a host port", c.name));
        }
        if let Some(r) = unfiltered_resource(c) {
            return Some(format!(
                "container {:?} asks for {r:?}, which the controller does not filter on",
                c.name
            ));
        }
    }
    None
}

/// The volumes of a pod that keep it off the fast path: all but those that need nothing of
/// the scheduler (`configMap`, `secret`, `emptyDir`, `downwardAPI`, `projected`, `hostPath`).
pub fn blocking_volumes(volumes: &[Volume]) -> Vec<Volume> {
    volumes
        .iter()
        .filter(|v| {
            v.config_map.is_none()
                && v.secret.is_none()
                && v.empty_dir.is_none()
                && v.downward_api.is_none()
                && v.projected.is_none()
                && v.host_path.is_none()
        })
        .cloned()
        .collect()
}

/// What of a container [`blocker`] reads: its name, resources, restart policy, and its ports
/// that carry a `hostPort` (for a slimmed copy of a pod that still answers the same).
pub fn decision_fields(c: &Container) -> Container {
    let host_ports: Vec<_> = c
        .ports
        .iter()
        .flatten()
        .filter(|p| p.host_port.is_some())
        .cloned()
        .collect();
    Container {
        name: c.name.clone(),
        resources: c.resources.clone(),
        restart_policy: c.restart_policy.clone(),
        ports: (!host_ports.is_empty()).then_some(host_ports),
        ..Container::default()
    }
}

fn containers(spec: &PodSpec) -> impl Iterator<Item = &Container> {
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
}

fn unfiltered_resource(c: &Container) -> Option<String> {
    let r = c.resources.as_ref()?;
    r.requests
        .iter()
        .flatten()
        .chain(r.limits.iter().flatten())
        .map(|(name, _)| name)
        .find(|name| !FILTERED_RESOURCES.contains(&name.as_str()))
        .cloned()
}

#[cfg(test)]
mod tests {

    use serde_json::{Value, json};

    use super::*;
    use crate::names;

    fn pod(extra: &Value) -> Pod {
        let mut spec = json!({
            "schedulingGates": [{"name": names::SCHEDULING_GATE}],
            "containers": [{"name": "main", "image": "x",
                "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
                "ports": [{"containerPort": 80}]}],
            "volumes": [
                {"name": "token", "projected": {"sources": []}},
                {"name": "scratch", "emptyDir": {}},
                {"name": "conf", "configMap": {"name": "c"}}],
        });
        for (k, v) in extra.as_object().unwrap() {
            spec[k] = v.clone();
        }
        serde_json::from_value(json!({"metadata": {"name": "p"}, "spec": spec})).unwrap()
    }

    #[test]
    fn a_plain_pod_with_node_constraints_only_is_on_the_fast_path() {
        let p = pod(&json!({
            "nodeSelector": {"zone": "a"},
            "schedulerName": DEFAULT_SCHEDULER,
            "tolerations": [{"key": "gpu", "operator": "Exists"}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
                {"nodeSelectorTerms": [{"matchExpressions": [
                    {"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
        }));
        assert_eq!(blocker(&p), None);
    }

    #[test]
    fn every_constraint_the_controller_does_not_evaluate_keeps_the_gate_protocol() {
        let cases = [
            (
                json!({"affinity": {"podAntiAffinity": {}}}),
                "inter-pod affinity",
            ),
            (
                json!({"affinity": {"podAffinity": {}}}),
                "inter-pod affinity",
            ),
            (
                json!({"topologySpreadConstraints": [{"maxSkew": 1,
                    "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}]}),
                "topology spread",
            ),
            (
                json!({"volumes": [{"name": "data",
                    "persistentVolumeClaim": {"claimName": "data"}}]}),
                "volume \"data\"",
            ),
            (
                json!({"volumes": [{"name": "eph", "ephemeral": {}}]}),
                "volume \"eph\"",
            ),
            (
                json!({"containers": [{"name": "web", "image": "x",
                    "ports": [{"containerPort": 80, "hostPort": 8080}]}]}),
                "host port",
            ),
            (
                json!({"initContainers": [{"name": "init", "image": "x",
                    "ports": [{"containerPort": 80, "hostPort": 8080}]}]}),
                "host port",
            ),
            (json!({"schedulerName": "volcano"}), "scheduler \"volcano\""),
            (
                json!({"resources": {"requests": {"cpu": "1"}}}),
                "pod-level resources",
            ),
            (
                json!({"containers": [{"name": "c", "image": "x",
                    "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}),
                "\"nvidia.com/gpu\"",
            ),
            (
                json!({"containers": [{"name": "c", "image": "x",
                    "resources": {"requests": {"ephemeral-storage": "1Gi"}}}]}),
                "\"ephemeral-storage\"",
            ),
            (
                json!({"schedulingGates": [{"name": names::SCHEDULING_GATE},
                    {"name": "example.com/quota"}]}),
                "other scheduling gates",
            ),
        ];
        for (extra, why) in cases {
            let found = blocker(&pod(&extra)).unwrap_or_default();
            assert!(
                found.contains(why),
                "{extra}: {found:?} should mention {why}"
            );
        }
        let mut deleting = pod(&json!({}));
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        assert!(blocker(&deleting).is_some());
    }

    #[test]
    fn the_decision_fields_of_a_container_answer_the_same_as_the_container() {
        for extra in [
            json!({}),
            json!({"containers": [{"name": "web", "image": "x", "env": [{"name": "A"}],
                "ports": [{"containerPort": 80}, {"containerPort": 81, "hostPort": 81}]}]}),
        ] {
            let full = pod(&extra);
            let mut slim = full.clone();
            let spec = slim.spec.as_mut().unwrap();
            spec.containers = spec.containers.iter().map(decision_fields).collect();
            spec.volumes = Some(blocking_volumes(spec.volumes.as_deref().unwrap()));
            assert_eq!(blocker(&slim), blocker(&full), "{extra}");
        }
    }
}
