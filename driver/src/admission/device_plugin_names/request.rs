//! A pod's device-plugin request: which containers ask for which device-plugin names, read
//! from their limits ([`DevicePluginRequest::from_pod`]) and recorded on the rewritten pod.
//! The vendor dialects read it; nothing here knows what a name means beyond
//! [`super::is_device_plugin_name`].

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1 as core;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::rules::quantity::Quantity;

/// Aliyun gpushare: the pod label saying over how many cards the memory is spread.
pub const ALIYUN_GPU_COUNT_LABEL: &str = "aliyun.com/gpu-count";

/// One container's device-plugin ask, as recorded on the rewritten pod.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerAsk {
    /// The container's name.
    pub name: String,
    /// Whether it is an init container (sidecars included).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub init: bool,
    /// Its index in `spec.containers` or `spec.initContainers`.
    pub index: usize,
    /// Resource name → whole number, as the container asked (its limit).
    pub resources: BTreeMap<String, u64>,
}

impl ContainerAsk {
    fn list(&self) -> &'static str {
        if self.init {
            "initContainers"
        } else {
            "containers"
        }
    }

    /// The container's field path, e.g. `spec.initContainers[0]`.
    pub fn field(&self) -> String {
        format!("spec.{}[{}]", self.list(), self.index)
    }

    /// The field path of the container's limit of `name`.
    pub(super) fn limit_field(&self, name: &str) -> String {
        format!("{}.resources.limits[{name}]", self.field())
    }

    /// The container's JSON pointer, e.g. `/spec/initContainers/0`.
    pub(super) fn pointer(&self) -> String {
        format!("/spec/{}/{}", self.list(), self.index)
    }

    /// What the container asks of `name`, when it asks for more than zero.
    pub(super) fn get(&self, name: &str) -> Option<u64> {
        self.resources.get(name).copied().filter(|v| *v > 0)
    }

    /// The pod's claim entry for this container's claim.
    pub(super) fn entry(&self) -> String {
        let entry = format!("tessera-{}", self.name);
        if entry.len() <= 63 {
            entry
        } else {
            format!(
                "tessera-{}{}",
                if self.init { "init" } else { "c" },
                self.index
            )
        }
    }

    /// The error naming this container's limit of `name`.
    pub(super) fn error(&self, object: &str, name: &str, message: &str) -> Error {
        Error::invalid(
            object,
            self.limit_field(name),
            format!("container {}: {message}", self.name),
        )
    }

    /// `n` of `name` as a number of cards.
    pub(super) fn cards(&self, object: &str, name: &str, n: u64) -> Result<u32> {
        u32::try_from(n).map_err(|_| {
            self.error(
                object,
                name,
                &format!("{name}: {n} cards is more than any node has"),
            )
        })
    }
}

/// A pod's device-plugin request: what the pod webhook records on the pod (annotation
/// [`crate::names::ANNOTATION_DEVICE_PLUGIN_REQUEST`]) and the controller maps again.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DevicePluginRequest {
    /// The containers that ask, init containers first.
    pub containers: Vec<ContainerAsk>,
    /// The pod's `aliyun.com/gpu-count` label, when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_count_label: Option<String>,
}

fn whole(object: &str, field: &str, container: &str, name: &str, text: &str) -> Result<u64> {
    let q = Quantity::parse(text).map_err(|e| {
        Error::invalid(object, field, format!("container {container}: {name}: {e}"))
    })?;
    q.as_units()
        .and_then(|v| u64::try_from(v).ok())
        .ok_or_else(|| {
            Error::invalid(
                object,
                field,
                format!(
                    "container {container}: {name}: {text} is not a whole, non-negative number"
                ),
            )
        })
}

impl DevicePluginRequest {
    /// The device-plugin names `pod` asks for, or `None` when it asks for none (or only zero
    /// of them). `object` names the pod in errors (`Pod ns/name`).
    ///
    /// Each name is read from the container's limits (requests default to them); a request
    /// without a limit, or one that differs from it, is an error, as the API server has it
    /// for extended resources.
    pub fn from_pod(pod: &core::Pod, object: &str) -> Result<Option<Self>> {
        let Some(spec) = pod.spec.as_ref() else {
            return Ok(None);
        };
        let lists = [
            (true, spec.init_containers.as_deref().unwrap_or_default()),
            (false, spec.containers.as_slice()),
        ];
        let mut request = Self::default();
        for (init, containers) in lists {
            for (index, container) in containers.iter().enumerate() {
                let mut ask = ContainerAsk {
                    name: container.name.clone(),
                    init,
                    index,
                    resources: BTreeMap::new(),
                };
                let resources = container.resources.as_ref();
                let limits = resources.and_then(|r| r.limits.as_ref());
                let requests = resources.and_then(|r| r.requests.as_ref());
                let asked: BTreeSet<&String> = limits
                    .into_iter()
                    .chain(requests)
                    .flat_map(BTreeMap::keys)
                    .filter(|n| super::is_device_plugin_name(n))
                    .collect();
                for name in asked {
                    let limit = limits.and_then(|l| l.get(name));
                    let req = requests.and_then(|r| r.get(name));
                    let value = match (limit, req) {
                        (Some(l), Some(r)) => {
                            let field = ask.limit_field(name);
                            let l = whole(object, &field, &ask.name, name, &l.0)?;
                            let rfield = format!("{}.resources.requests[{name}]", ask.field());
                            if whole(object, &rfield, &ask.name, name, &r.0)? != l {
                                return Err(Error::invalid(
                                    object,
                                    rfield,
                                    format!(
                                        "container {}: {name}: the request differs from the limit; \
                                         extended resources must have equal requests and limits",
                                        ask.name
                                    ),
                                ));
                            }
                            l
                        }
                        (Some(l), None) => {
                            let field = ask.limit_field(name);
                            whole(object, &field, &ask.name, name, &l.0)?
                        }
                        (None, _) => {
                            return Err(Error::invalid(
                                object,
                                ask.limit_field(name),
                                format!(
                                    "container {}: {name} is requested without a limit; extended \
                                     resources must have equal requests and limits",
                                    ask.name
                                ),
                            ));
                        }
                    };
                    ask.resources.insert(name.clone(), value);
                }
                if !ask.resources.is_empty() {
                    request.containers.push(ask);
                }
            }
        }
        if request
            .containers
            .iter()
            .all(|c| c.resources.values().all(|v| *v == 0))
        {
            return Ok(None);
        }
        request.gpu_count_label = pod
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(ALIYUN_GPU_COUNT_LABEL))
            .cloned();
        Ok(Some(request))
    }
}
