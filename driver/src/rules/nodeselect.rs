//! Node selection: which nodes can reach a slice or a device.
//!
//! Implements the subset of `v1.NodeSelector` semantics that DRA uses: terms are or-ed, the
//! requirements of one term are and-ed, `matchExpressions` test node labels and `matchFields`
//! test `metadata.name` (the only field Kubernetes supports there). A term without any
//! requirement selects nothing, as in Kubernetes.

use k8s_openapi::api::core::v1::{Node, NodeSelector, NodeSelectorRequirement};

/// The field key Kubernetes allows in `matchFields`.
pub(crate) const FIELD_NODE_NAME: &str = "metadata.name";

/// Where a device can be used from.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum NodeScope {
    /// Only on the named node.
    Node(String),
    /// On every node.
    All,
    /// On the nodes a selector picks.
    Selector(NodeSelector),
    /// Nothing known was set: a future extension; the device is never used.
    Unknown,
}

impl NodeScope {
    /// The scope of `nodeName` / `allNodes` / `nodeSelector` as DRA sets them (first wins).
    pub(crate) fn from_fields(
        node_name: Option<&String>,
        all_nodes: Option<bool>,
        selector: Option<&NodeSelector>,
    ) -> Self {
        match (node_name, all_nodes, selector) {
            (Some(n), _, _) if !n.is_empty() => Self::Node(n.clone()),
            (_, Some(true), _) => Self::All,
            (_, _, Some(s)) => Self::Selector(s.clone()),
            _ => Self::Unknown,
        }
    }

    /// Whether `node` can use a device of this scope.
    pub(crate) fn matches(&self, node: &Node) -> bool {
        match self {
            Self::Node(name) => node.metadata.name.as_deref() == Some(name.as_str()),
            Self::All => true,
            Self::Selector(s) => selector_matches(s, node),
            Self::Unknown => false,
        }
    }
}

/// Whether `selector` picks `node`.
pub(crate) fn selector_matches(selector: &NodeSelector, node: &Node) -> bool {
    selector.node_selector_terms.iter().any(|term| {
        let exprs = term.match_expressions.as_deref().unwrap_or_default();
        let fields = term.match_fields.as_deref().unwrap_or_default();
        if exprs.is_empty() && fields.is_empty() {
            return false;
        }
        exprs.iter().all(|r| {
            let value = node
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(&r.key))
                .map(String::as_str);
            requirement_matches(r, value)
        }) && fields.iter().all(|r| {
            let value = if r.key == FIELD_NODE_NAME {
                node.metadata.name.as_deref()
            } else {
                None
            };
            // Kubernetes rejects other field keys; an unknown key never matches.
            r.key == FIELD_NODE_NAME && requirement_matches(r, value)
        })
    })
}

fn requirement_matches(r: &NodeSelectorRequirement, value: Option<&str>) -> bool {
    let values = r.values.as_deref().unwrap_or_default();
    let int = |s: &str| s.parse::<i64>().ok();
    match r.operator.as_str() {
        "In" => value.is_some_and(|v| values.iter().any(|x| x == v)),
        "NotIn" => value.is_none_or(|v| values.iter().all(|x| x != v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => {
            let (Some(v), [bound]) = (value.and_then(int), values) else {
                return false;
            };
            let Some(bound) = int(bound) else {
                return false;
            };
            if r.operator == "Gt" {
                v > bound
            } else {
                v < bound
            }
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::NodeSelectorTerm;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn node(name: &str, labels: &[(&str, &str)]) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some(
                    labels
                        .iter()
                        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                        .collect(),
                ),
                ..ObjectMeta::default()
            },
            ..Node::default()
        }
    }

    fn req(key: &str, op: &str, values: &[&str]) -> NodeSelectorRequirement {
        NodeSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: Some(values.iter().map(|v| (*v).to_owned()).collect()),
        }
    }

    fn selector(
        exprs: Vec<NodeSelectorRequirement>,
        fields: Vec<NodeSelectorRequirement>,
    ) -> NodeSelector {
        NodeSelector {
            node_selector_terms: vec![NodeSelectorTerm {
                match_expressions: Some(exprs),
                match_fields: Some(fields),
            }],
        }
    }

    #[test]
    fn labels_and_fields_are_anded_within_a_term() {
        let n = node("a", &[("zone", "z1"), ("gpus", "8")]);
        assert!(selector_matches(
            &selector(vec![req("zone", "In", &["z1"])], vec![]),
            &n
        ));
        assert!(!selector_matches(
            &selector(vec![req("zone", "NotIn", &["z1"])], vec![]),
            &n
        ));
        assert!(selector_matches(
            &selector(
                vec![req("gpus", "Gt", &["4"])],
                vec![req("metadata.name", "In", &["a"])]
            ),
            &n
        ));
        assert!(!selector_matches(
            &selector(vec![req("gpus", "Lt", &["4"])], vec![]),
            &n
        ));
        assert!(selector_matches(
            &selector(vec![req("x", "DoesNotExist", &[])], vec![]),
            &n
        ));
        assert!(
            !selector_matches(&selector(vec![], vec![]), &n),
            "an empty term selects nothing"
        );
    }

    #[test]
    fn scopes_follow_dra_precedence() {
        let n = node("a", &[]);
        assert!(NodeScope::from_fields(Some(&"a".to_owned()), None, None).matches(&n));
        assert!(!NodeScope::from_fields(Some(&"b".to_owned()), Some(true), None).matches(&n));
        assert!(NodeScope::from_fields(None, Some(true), None).matches(&n));
        assert!(!NodeScope::from_fields(None, None, None).matches(&n));
    }
}
