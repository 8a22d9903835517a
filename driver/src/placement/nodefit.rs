//! Whether a pod can run on a node, checked the way kube-scheduler's filters check it, so that
//! a node the controller picks is one the scheduler will bind the pod to.
//!
//! Covered: `spec.nodeName`, `spec.nodeSelector`, required node affinity, taints with effect
//! `NoSchedule`/`NoExecute` against the pod's tolerations, unschedulable (cordoned) nodes, and
//! free CPU, memory and pod slots (`status.allocatable` minus what assigned pods request). A pod
//! asks for what its containers request, or what its largest init container requests if more
//! (sidecar init containers, `restartPolicy: Always`, count with the containers), plus
//! `spec.overhead`. Preferred affinity and inter-pod affinity only rank nodes for the scheduler;
//! they are not filters and are not checked.

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::core::v1::{Node, Pod, ResourceRequirements, Taint, Toleration};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity as K8sQuantity;

use crate::error::{Error, Result};
use crate::placement::fragmentation::HostResources;
use crate::rules::nodeselect::selector_matches;
use crate::rules::quantity::Quantity;

/// Taint kube-controller-manager puts on cordoned nodes; tolerating it allows unschedulable nodes.
pub const TAINT_UNSCHEDULABLE: &str = "node.kubernetes.io/unschedulable";

/// What a pod needs of a node, or what a node has: CPU and memory in nano-units (so `100m` CPU
/// is exact), and pod slots.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Resources {
    /// CPU in nano-cores.
    pub cpu_nanos: i128,
    /// Memory in nano-bytes.
    pub memory_nanos: i128,
    /// Pod slots.
    pub pods: i64,
}

impl Resources {
    /// The sum of two amounts.
    #[must_use]
    pub fn plus(self, other: Self) -> Self {
        Self {
            cpu_nanos: self.cpu_nanos.saturating_add(other.cpu_nanos),
            memory_nanos: self.memory_nanos.saturating_add(other.memory_nanos),
            pods: self.pods.saturating_add(other.pods),
        }
    }

    /// The difference of two amounts.
    #[must_use]
    pub fn minus(self, other: Self) -> Self {
        Self {
            cpu_nanos: self.cpu_nanos.saturating_sub(other.cpu_nanos),
            memory_nanos: self.memory_nanos.saturating_sub(other.memory_nanos),
            pods: self.pods.saturating_sub(other.pods),
        }
    }

    /// CPU (milli-cores) and memory (bytes) as placement policies see them, below a milli-core
    /// or a byte dropped (scores only rank nodes; fitting is [`check`]'s); `None` when either is
    /// unlimited (a node that reports no allocatable amounts).
    pub fn host(self) -> Option<HostResources> {
        let milli = |nanos: i128, per: i128| -> Option<u64> {
            (nanos < i128::MAX).then(|| u64::try_from(nanos.max(0) / per).unwrap_or(u64::MAX))
        };
        Some(HostResources {
            cpu_milli: milli(self.cpu_nanos, 1_000_000)?,
            memory_bytes: milli(self.memory_nanos, 1_000_000_000)?,
        })
    }

    fn max(self, other: Self) -> Self {
        Self {
            cpu_nanos: self.cpu_nanos.max(other.cpu_nanos),
            memory_nanos: self.memory_nanos.max(other.memory_nanos),
            pods: self.pods.max(other.pods),
        }
    }
}

/// Why a node cannot take a pod: one of kube-scheduler's filters said no.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Misfit {
    /// The pod names another node in `spec.nodeName`.
    NodeName,
    /// The node's labels do not match `spec.nodeSelector` or the required node affinity.
    Affinity,
    /// The node is cordoned (`spec.unschedulable`) and the pod does not tolerate it.
    Unschedulable,
    /// A `NoSchedule`/`NoExecute` taint the pod does not tolerate (its `key=value:effect`).
    Taint(String),
    /// Not enough CPU left.
    Cpu,
    /// Not enough memory left.
    Memory,
    /// No pod slot left.
    Pods,
}

impl fmt::Display for Misfit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NodeName => f.write_str("didn't match the pod's spec.nodeName"),
            Self::Affinity => f.write_str("didn't match the pod's node affinity/selector"),
            Self::Unschedulable => f.write_str("were unschedulable"),
            Self::Taint(t) => write!(f, "had untolerated taint {{{t}}}"),
            Self::Cpu => f.write_str("had insufficient cpu"),
            Self::Memory => f.write_str("had insufficient memory"),
            Self::Pods => f.write_str("had too many pods"),
        }
    }
}

fn parse(object: &str, field: &str, q: &K8sQuantity) -> Result<i128> {
    let value = Quantity::from_k8s(q).map_err(|e| Error::invalid(object, field, e.to_string()))?;
    if value.is_negative() {
        return Err(Error::invalid(
            object,
            field,
            format!("{:?} is negative; requests must be zero or more", q.0),
        ));
    }
    Ok(value.nanos())
}

fn amounts(
    object: &str,
    field: &str,
    list: Option<&BTreeMap<String, K8sQuantity>>,
) -> Result<Resources> {
    let mut out = Resources::default();
    for (name, q) in list.into_iter().flatten() {
        match name.as_str() {
            "cpu" => out.cpu_nanos = parse(object, &format!("{field}.cpu"), q)?,
            "memory" => out.memory_nanos = parse(object, &format!("{field}.memory"), q)?,
            _ => {}
        }
    }
    Ok(out)
}

fn container_requests(
    object: &str,
    field: &str,
    resources: Option<&ResourceRequirements>,
) -> Result<Resources> {
    amounts(
        object,
        &format!("{field}.resources.requests"),
        resources.and_then(|r| r.requests.as_ref()),
    )
}

fn pod_object(pod: &Pod) -> String {
    format!(
        "Pod {}/{}",
        pod.metadata.namespace.as_deref().unwrap_or("default"),
        pod.metadata.name.as_deref().unwrap_or_default()
    )
}

/// What `pod` asks of a node, as kube-scheduler's resource filter computes it. A quantity that
/// does not parse, or is negative, is an error naming the pod and the field.
pub fn pod_requests(pod: &Pod) -> Result<Resources> {
    let object = pod_object(pod);
    let Some(spec) = &pod.spec else {
        return Ok(Resources {
            pods: 1,
            ..Resources::default()
        });
    };
    let mut running = Resources::default();
    for (i, c) in spec.containers.iter().enumerate() {
        running = running.plus(container_requests(
            &object,
            &format!("spec.containers[{i}]"),
            c.resources.as_ref(),
        )?);
    }
    // Init containers run one at a time before the containers; sidecars keep running and add
    // to everything after them.
    let mut sidecars = Resources::default();
    let mut init_peak = Resources::default();
    for (i, c) in spec.init_containers.iter().flatten().enumerate() {
        let r = container_requests(
            &object,
            &format!("spec.initContainers[{i}]"),
            c.resources.as_ref(),
        )?;
        if c.restart_policy.as_deref() == Some("Always") {
            sidecars = sidecars.plus(r);
            init_peak = init_peak.max(sidecars);
        } else {
            init_peak = init_peak.max(sidecars.plus(r));
        }
    }
    let overhead = amounts(&object, "spec.overhead", spec.overhead.as_ref())?;
    Ok(running
        .plus(sidecars)
        .max(init_peak)
        .plus(overhead)
        .plus(Resources {
            pods: 1,
            ..Resources::default()
        }))
}

/// What pods already take of every node: bound pods where they run, and unbound pods whose
/// claims are allocated on the node their allocation names (kube-scheduler will bind them
/// there, so they count before they do). Finished and deleted pods take nothing. `allocated`
/// answers the allocation of a claim by namespace and name, when it has one; `requests` a
/// pod's [`pod_requests`] (callers that see the same pods often keep them), `None` for a pod
/// whose requests do not parse (it is skipped here and refused where it is placed).
pub fn node_usage<'a>(
    pods: impl IntoIterator<Item = &'a Pod>,
    allocated: impl Fn(&str, &str) -> Option<&'a k8s_openapi::api::resource::v1::AllocationResult>,
    requests: impl Fn(&Pod) -> Option<Resources>,
) -> BTreeMap<String, Resources> {
    let mut usage: BTreeMap<String, Resources> = BTreeMap::new();
    for pod in pods {
        if crate::placement::gate::is_done(pod) {
            continue;
        }
        // Borrowed for a bound pod (most of them): this runs for every pod on every pass.
        let bound = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_deref())
            .filter(|n| !n.is_empty())
            .map(std::borrow::Cow::Borrowed);
        let node = bound.or_else(|| {
            let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
            crate::placement::gate::claim_names(pod)
                .ok()?
                .iter()
                .find_map(|n| {
                    allocated(namespace, n).and_then(crate::placement::gate::allocation_node)
                })
                .map(std::borrow::Cow::Owned)
        });
        let Some(node) = node else { continue };
        if let Some(r) = requests(pod) {
            match usage.get_mut(node.as_ref()) {
                Some(entry) => *entry = entry.plus(r),
                None => {
                    usage.insert(node.into_owned(), Resources::default().plus(r));
                }
            }
        }
    }
    usage
}

/// What a node offers pods: `status.allocatable` (cpu, memory, pods). A node that reports no
/// allocatable amounts (as in offline input) is treated as unlimited.
pub fn node_allocatable(node: &Node) -> Resources {
    let Some(allocatable) = node.status.as_ref().and_then(|s| s.allocatable.as_ref()) else {
        return Resources {
            cpu_nanos: i128::MAX,
            memory_nanos: i128::MAX,
            pods: i64::MAX,
        };
    };
    let get = |name: &str| {
        allocatable
            .get(name)
            .and_then(|q| Quantity::from_k8s(q).ok())
            .map(Quantity::nanos)
    };
    Resources {
        cpu_nanos: get("cpu").unwrap_or(i128::MAX),
        memory_nanos: get("memory").unwrap_or(i128::MAX),
        pods: get("pods")
            .and_then(|n| i64::try_from(n / 1_000_000_000).ok())
            .unwrap_or(i64::MAX),
    }
}

/// Whether `toleration` tolerates `taint`, by the Kubernetes rules: an empty key with `Exists`
/// tolerates everything; an empty effect matches every effect; `Equal` (the default) compares
/// values.
pub fn tolerates(toleration: &Toleration, taint: &Taint) -> bool {
    if let Some(effect) = toleration.effect.as_deref().filter(|e| !e.is_empty())
        && effect != taint.effect
    {
        return false;
    }
    let key = toleration.key.as_deref().unwrap_or_default();
    match toleration.operator.as_deref().unwrap_or("Equal") {
        "Exists" => key.is_empty() || key == taint.key,
        "Equal" => {
            key == taint.key
                && toleration.value.as_deref().unwrap_or_default()
                    == taint.value.as_deref().unwrap_or_default()
        }
        _ => false,
    }
}

fn taint_text(t: &Taint) -> String {
    match t.value.as_deref().filter(|v| !v.is_empty()) {
        Some(v) => format!("{}={v}:{}", t.key, t.effect),
        None => format!("{}:{}", t.key, t.effect),
    }
}

/// Whether `pod`, needing `requests`, fits `node`, on which assigned pods already use `used`.
/// Returns the first filter that fails, in kube-scheduler's filter order.
pub fn check(pod: &Pod, requests: Resources, node: &Node, used: Resources) -> Result<(), Misfit> {
    check_on(pod, requests, node, node_allocatable(node), used)
}

/// [`check`] with the node's [`node_allocatable`] already worked out, for callers that check
/// many pods against the same nodes (parsing the node's quantities once, not once per pod).
pub fn check_on(
    pod: &Pod,
    requests: Resources,
    node: &Node,
    allocatable: Resources,
    used: Resources,
) -> Result<(), Misfit> {
    let spec = pod.spec.as_ref();
    let tolerations = spec
        .and_then(|s| s.tolerations.as_deref())
        .unwrap_or_default();
    if let Some(name) = spec
        .and_then(|s| s.node_name.as_ref())
        .filter(|n| !n.is_empty())
        && node.metadata.name.as_ref() != Some(name)
    {
        return Err(Misfit::NodeName);
    }
    if node.spec.as_ref().and_then(|s| s.unschedulable) == Some(true) {
        let cordon = Taint {
            key: TAINT_UNSCHEDULABLE.to_owned(),
            effect: "NoSchedule".to_owned(),
            ..Taint::default()
        };
        if !tolerations.iter().any(|t| tolerates(t, &cordon)) {
            return Err(Misfit::Unschedulable);
        }
    }
    let labels = node.metadata.labels.as_ref();
    let selector_ok = spec
        .and_then(|s| s.node_selector.as_ref())
        .into_iter()
        .flatten()
        .all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v));
    let affinity_ok = spec
        .and_then(|s| s.affinity.as_ref())
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|a| {
            a.required_during_scheduling_ignored_during_execution
                .as_ref()
        })
        .is_none_or(|selector| selector_matches(selector, node));
    if !selector_ok || !affinity_ok {
        return Err(Misfit::Affinity);
    }
    let taints = node.spec.as_ref().and_then(|s| s.taints.as_deref());
    for taint in taints.unwrap_or_default() {
        if matches!(taint.effect.as_str(), "NoSchedule" | "NoExecute")
            && !tolerations.iter().any(|t| tolerates(t, taint))
        {
            return Err(Misfit::Taint(taint_text(taint)));
        }
    }
    let free = allocatable.minus(used);
    if requests.pods > free.pods {
        return Err(Misfit::Pods);
    }
    if requests.cpu_nanos > free.cpu_nanos {
        return Err(Misfit::Cpu);
    }
    if requests.memory_nanos > free.memory_nanos {
        return Err(Misfit::Memory);
    }
    Ok(())
}

/// kube-scheduler's style of summary: `0/5 nodes fit the pod: 3 node(s) had insufficient cpu, ...`.
pub fn summarize(total: usize, misfits: &[Misfit]) -> String {
    let mut counts: BTreeMap<&Misfit, usize> = BTreeMap::new();
    for m in misfits {
        *counts.entry(m).or_default() += 1;
    }
    let parts: Vec<String> = counts
        .iter()
        .map(|(m, n)| format!("{n} node(s) {m}"))
        .collect();
    if parts.is_empty() {
        format!("0/{total} nodes are available")
    } else {
        format!(
            "{}/{total} nodes fit the pod: {}",
            total.saturating_sub(misfits.len()),
            parts.join(", ")
        )
    }
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::needless_pass_by_value,
        reason = "test fixtures built from json! literals"
    )]

    use super::*;
    use serde_json::json;

    fn pod(spec: serde_json::Value) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "p", "namespace": "ml"}, "spec": spec}))
            .unwrap()
    }

    fn node(value: serde_json::Value) -> Node {
        let mut base = json!({
            "metadata": {"name": "n1", "labels": {"zone": "a", "gpu": "h100"}},
            "status": {"allocatable": {"cpu": "4", "memory": "16Gi", "pods": "10"}},
        });
        if let (Some(b), Some(v)) = (base.as_object_mut(), value.as_object()) {
            for (k, x) in v {
                b.insert(k.clone(), x.clone());
            }
        }
        serde_json::from_value(base).unwrap()
    }

    fn container(cpu: &str, memory: &str) -> serde_json::Value {
        json!({"name": "c", "resources": {"requests": {"cpu": cpu, "memory": memory}}})
    }

    fn fits(p: &Pod, n: &Node) -> Result<(), Misfit> {
        check(p, pod_requests(p).unwrap(), n, Resources::default())
    }

    #[test]
    fn host_amounts_are_milli_cores_and_bytes_and_unlimited_nodes_have_none() {
        let alloc = node_allocatable(&node(json!({})));
        assert_eq!(
            alloc.host(),
            Some(HostResources {
                cpu_milli: 4000,
                memory_bytes: 16 << 30,
            })
        );
        let p = pod(json!({"containers": [container("250m", "1Mi")]}));
        assert_eq!(
            pod_requests(&p).unwrap().host(),
            Some(HostResources {
                cpu_milli: 250,
                memory_bytes: 1 << 20,
            })
        );
        let bare = node(json!({"status": {}}));
        assert_eq!(node_allocatable(&bare).host(), None);
    }

    #[test]
    fn requests_add_containers_and_overhead_and_take_the_larger_init_container() {
        let p = pod(json!({
            "containers": [container("500m", "1Gi"), container("250m", "1Gi")],
            "initContainers": [container("2", "512Mi")],
            "overhead": {"cpu": "100m"},
        }));
        let r = pod_requests(&p).unwrap();
        assert_eq!(r.cpu_nanos, 2_100_000_000);
        assert_eq!(r.memory_nanos, 2 * 1024 * 1024 * 1024 * 1_000_000_000);
        assert_eq!(r.pods, 1);
    }

    #[test]
    fn sidecars_count_with_the_containers() {
        let mut sidecar = container("1", "0");
        sidecar["restartPolicy"] = json!("Always");
        let p = pod(json!({"containers": [container("1", "0")], "initContainers": [sidecar]}));
        assert_eq!(pod_requests(&p).unwrap().cpu_nanos, 2_000_000_000);
    }

    #[test]
    fn a_negative_or_malformed_request_names_the_pod_and_field() {
        let err = pod_requests(&pod(json!({"containers": [container("-1", "1Gi")]}))).unwrap_err();
        assert!(
            err.to_string()
                .contains("Pod ml/p: spec.containers[0].resources.requests.cpu"),
            "{err}"
        );
        let err = pod_requests(&pod(json!({"containers": [container("1", "lots")]}))).unwrap_err();
        assert!(err.to_string().contains("requests.memory"), "{err}");
    }

    #[test]
    fn node_selector_and_required_affinity_filter_nodes() {
        let n = node(json!({}));
        assert_eq!(
            fits(
                &pod(json!({"containers": [], "nodeSelector": {"zone": "a"}})),
                &n
            ),
            Ok(())
        );
        assert_eq!(
            fits(
                &pod(json!({"containers": [], "nodeSelector": {"zone": "b"}})),
                &n
            ),
            Err(Misfit::Affinity)
        );
        let affinity = |op: &str, values: serde_json::Value| {
            pod(json!({"containers": [], "affinity": {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "gpu", "operator": op, "values": values}]}
            ]}}}}))
        };
        assert_eq!(fits(&affinity("In", json!(["h100", "a100"])), &n), Ok(()));
        assert_eq!(
            fits(&affinity("NotIn", json!(["h100"])), &n),
            Err(Misfit::Affinity)
        );
    }

    #[test]
    fn taints_need_tolerations_and_prefer_no_schedule_is_ignored() {
        let n = node(json!({"spec": {"taints": [
            {"key": "gpu", "value": "true", "effect": "NoSchedule"},
            {"key": "soft", "effect": "PreferNoSchedule"},
        ]}}));
        assert_eq!(
            fits(&pod(json!({"containers": []})), &n),
            Err(Misfit::Taint("gpu=true:NoSchedule".into()))
        );
        let tolerant = pod(json!({"containers": [], "tolerations": [
            {"key": "gpu", "operator": "Equal", "value": "true", "effect": "NoSchedule"}]}));
        assert_eq!(fits(&tolerant, &n), Ok(()));
        let wrong_value = pod(json!({"containers": [], "tolerations": [
            {"key": "gpu", "value": "false"}]}));
        assert!(fits(&wrong_value, &n).is_err());
        let everything = pod(json!({"containers": [], "tolerations": [{"operator": "Exists"}]}));
        assert_eq!(fits(&everything, &n), Ok(()));
    }

    #[test]
    fn cordoned_nodes_take_only_pods_that_tolerate_the_cordon() {
        let n = node(json!({"spec": {"unschedulable": true}}));
        assert_eq!(
            fits(&pod(json!({"containers": []})), &n),
            Err(Misfit::Unschedulable)
        );
        let tolerant = pod(json!({"containers": [], "tolerations": [
            {"key": TAINT_UNSCHEDULABLE, "operator": "Exists"}]}));
        assert_eq!(fits(&tolerant, &n), Ok(()));
    }

    #[test]
    fn cpu_memory_and_pod_slots_count_what_assigned_pods_use() {
        let n = node(json!({}));
        let p = pod(json!({"containers": [container("3", "8Gi")]}));
        let need = pod_requests(&p).unwrap();
        assert_eq!(check(&p, need, &n, Resources::default()), Ok(()));
        assert_eq!(check(&p, need, &n, need), Err(Misfit::Cpu));
        let small = pod(json!({"containers": [container("100m", "12Gi")]}));
        assert_eq!(
            check(&small, pod_requests(&small).unwrap(), &n, need),
            Err(Misfit::Memory)
        );
        let full = Resources {
            pods: 10,
            ..Resources::default()
        };
        assert_eq!(
            check(&small, pod_requests(&small).unwrap(), &n, full),
            Err(Misfit::Pods)
        );
    }

    #[test]
    fn a_pod_bound_elsewhere_does_not_fit() {
        let p = pod(json!({"containers": [], "nodeName": "n2"}));
        assert_eq!(fits(&p, &node(json!({}))), Err(Misfit::NodeName));
    }

    #[test]
    fn summaries_count_nodes_per_reason() {
        let text = summarize(5, &[Misfit::Cpu, Misfit::Cpu, Misfit::Affinity]);
        assert_eq!(
            text,
            "2/5 nodes fit the pod: 1 node(s) didn't match the pod's node affinity/selector, \
             2 node(s) had insufficient cpu"
        );
    }
}
