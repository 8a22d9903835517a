//! Label selectors (`metav1.LabelSelector`: `matchLabels` and `matchExpressions` with `In`,
//! `NotIn`, `Exists` and `DoesNotExist`), as Deployments, `PodDisruptionBudgets` and Tessera's
//! profile schedules use them.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

/// A label selector (`matchLabels` and `matchExpressions`); an empty one selects everything.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Selector {
    labels: BTreeMap<String, String>,
    expressions: Vec<(String, Operator, BTreeSet<String>)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Operator {
    In,
    NotIn,
    Exists,
    DoesNotExist,
}

impl Selector {
    /// Reads `spec`, found at `at`; `Err((field, message))` names the broken rule.
    pub fn from_spec(spec: &LabelSelector, at: &str) -> Result<Self, (String, String)> {
        let invalid = |f: String, m: String| (f, m);
        let mut expressions = Vec::new();
        for (i, e) in spec.match_expressions.iter().flatten().enumerate() {
            let field = format!("{at}.matchExpressions[{i}]");
            let op = match e.operator.as_str() {
                "In" => Operator::In,
                "NotIn" => Operator::NotIn,
                "Exists" => Operator::Exists,
                "DoesNotExist" => Operator::DoesNotExist,
                other => {
                    return Err(invalid(
                        format!("{field}.operator"),
                        format!(
                            "{other:?} is not an operator; expected In, NotIn, Exists or DoesNotExist"
                        ),
                    ));
                }
            };
            let values: BTreeSet<String> = e.values.iter().flatten().cloned().collect();
            match op {
                Operator::In | Operator::NotIn if values.is_empty() => {
                    return Err(invalid(
                        format!("{field}.values"),
                        format!("{} needs at least one value", e.operator),
                    ));
                }
                Operator::Exists | Operator::DoesNotExist if !values.is_empty() => {
                    return Err(invalid(
                        format!("{field}.values"),
                        format!("{} takes no values", e.operator),
                    ));
                }
                _ => {}
            }
            if e.key.is_empty() {
                return Err(invalid(
                    format!("{field}.key"),
                    "must not be empty".to_owned(),
                ));
            }
            expressions.push((e.key.clone(), op, values));
        }
        Ok(Self {
            labels: spec.match_labels.clone().unwrap_or_default(),
            expressions,
        })
    }

    /// A selector of the nodes whose labels include all of `labels`.
    pub fn with_labels(labels: BTreeMap<String, String>) -> Self {
        Self {
            labels,
            expressions: Vec::new(),
        }
    }

    /// Whether a node with `labels` is selected.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.labels.iter().all(|(k, v)| labels.get(k) == Some(v))
            && self.expressions.iter().all(|(k, op, values)| {
                let value = labels.get(k);
                match op {
                    Operator::In => value.is_some_and(|v| values.contains(v)),
                    Operator::NotIn => value.is_none_or(|v| !values.contains(v)),
                    Operator::Exists => value.is_some(),
                    Operator::DoesNotExist => value.is_none(),
                }
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::string_map;

    fn selector(json: serde_json::Value) -> Selector {
        Selector::from_spec(&serde_json::from_value(json).unwrap(), "sel").unwrap()
    }

    #[test]
    fn labels_and_expressions_must_all_hold() {
        let s = selector(serde_json::json!({
            "matchLabels": {"pool": "inference"},
            "matchExpressions": [
                {"key": "zone", "operator": "In", "values": ["a", "b"]},
                {"key": "cordon", "operator": "DoesNotExist"},
            ],
        }));
        assert!(s.matches(&string_map(&[("pool", "inference"), ("zone", "a")])));
        assert!(!s.matches(&string_map(&[("pool", "inference"), ("zone", "c")])));
        assert!(!s.matches(&string_map(&[
            ("pool", "inference"),
            ("zone", "a"),
            ("cordon", "")
        ])));
        assert!(!s.matches(&string_map(&[("zone", "a")])));
        assert!(
            Selector::default().matches(&BTreeMap::new()),
            "an empty selector selects everything"
        );
    }

    #[test]
    fn malformed_expressions_name_the_field_and_rule() {
        for (json, field, says) in [
            (
                serde_json::json!({"matchExpressions": [{"key": "k", "operator": "Near"}]}),
                "sel.matchExpressions[0].operator",
                "not an operator",
            ),
            (
                serde_json::json!({"matchExpressions": [{"key": "k", "operator": "In"}]}),
                "sel.matchExpressions[0].values",
                "at least one value",
            ),
            (
                serde_json::json!({"matchExpressions": [{"key": "k", "operator": "Exists", "values": ["x"]}]}),
                "sel.matchExpressions[0].values",
                "takes no values",
            ),
        ] {
            let (f, m) =
                Selector::from_spec(&serde_json::from_value(json).unwrap(), "sel").unwrap_err();
            assert_eq!(f, field);
            assert!(m.contains(says), "{m}");
        }
    }
}
