//! What a request maps to: the claims ([`MappedClaim`], [`Mapping`]) and the builder every
//! vendor dialect writes its requests and shares into, which checks the share rules and names
//! the template after the claim's shape.

use std::collections::BTreeSet;

use k8s_openapi::api::resource::v1 as res;
use serde_json::{Value, json};

use crate::error::{Error, Result};
use crate::names;
use crate::rules::config::GpuShare;
use crate::rules::quantity::Quantity;
use crate::rules::share::{GIB, ShareRequest};

/// One claim the mapping asks for: an entry of the pod's `spec.resourceClaims`, made from the
/// ResourceClaimTemplate [`MappedClaim::template`].
#[derive(Debug, Clone, PartialEq)]
pub struct MappedClaim {
    /// The entry's name in the pod (`tessera-<container>`, or [`super::POD_ENTRY`]).
    pub entry: String,
    /// The containers using it: indices into [`super::DevicePluginRequest::containers`].
    pub containers: Vec<usize>,
    /// The template's name: `tessera-` and a hash of the spec, so one shape is one template
    /// per namespace.
    pub template: String,
    /// The device-plugin forms it stands for (`nvidia`, `mig`, `time-slicing`, `baidu`,
    /// `aliyun`, `hami`).
    pub forms: Vec<&'static str>,
    /// The claim spec.
    pub spec: res::ResourceClaimSpec,
}

/// What a request maps to.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Mapping {
    /// The claims, containers' first, the pod's Aliyun claim last.
    pub claims: Vec<MappedClaim>,
    /// What the user should know (roundings, defaults).
    pub warnings: Vec<String>,
}

/// The requests and configs of one claim, as it is being built.
#[derive(Default)]
pub(super) struct Builder {
    requests: Vec<Value>,
    configs: Vec<Value>,
    shares: Vec<(String, GpuShare, u32)>,
    forms: BTreeSet<&'static str>,
}

impl Builder {
    /// Adds a request of `count` devices of `class`, standing for the device-plugin `form`.
    pub(super) fn request(
        &mut self,
        form: &'static str,
        name: &str,
        class: &str,
        count: u64,
        selector: Option<String>,
    ) {
        let mut exactly = json!({
            "deviceClassName": class,
            "allocationMode": "ExactCount",
            "count": count,
        });
        if let Some(expression) = selector {
            exactly["selectors"] = json!([{ "cel": { "expression": expression } }]);
        }
        self.requests
            .push(json!({ "name": name, "exactly": exactly }));
        self.forms.insert(form);
    }

    /// Makes request `name` a share of `count` cards for `driver`.
    pub(super) fn share(&mut self, name: &str, driver: &str, share: GpuShare, count: u32) {
        self.configs.push(json!({
            "requests": [name],
            "opaque": { "driver": driver, "parameters": share },
        }));
        self.shares.push((name.to_owned(), share, count));
    }

    /// Whether no request was added.
    pub(super) fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    fn spec(&self, object: &str) -> Result<res::ResourceClaimSpec> {
        let mut devices = json!({ "requests": self.requests });
        if !self.configs.is_empty() {
            devices["config"] = json!(self.configs);
        }
        serde_json::from_value(json!({ "devices": devices })).map_err(|e| Error::Decode {
            context: format!("{object}: the claim mapped from device-plugin names"),
            message: e.to_string(),
        })
    }

    /// The claim built, used by `containers` under the pod entry `entry`, once its shares
    /// pass the share rules (errors name `field` and `container`).
    pub(super) fn claim(
        self,
        object: &str,
        (field, container): (&str, &str),
        entry: String,
        containers: Vec<usize>,
    ) -> Result<MappedClaim> {
        self.check_shares(object, field, container)?;
        let spec = self.spec(object)?;
        Ok(MappedClaim {
            entry,
            containers,
            template: template_name(&spec),
            forms: self.forms.into_iter().collect(),
            spec,
        })
    }

    /// The share rules of `GpuShare`, applied to what the mapping built: a safety net under
    /// the dialects' checks, which name the resource.
    fn check_shares(&self, object: &str, field: &str, container: &str) -> Result<()> {
        for (name, share, count) in &self.shares {
            ShareRequest::from_gpu_share(share, *count, name).map_err(|e| {
                Error::invalid(
                    object,
                    field,
                    format!("container {container}: the share it maps to breaks a share rule: {e}"),
                )
            })?;
        }
        Ok(())
    }
}

/// A `GpuShare` of `memory_gib` GiB or `memory_percent` of a card, and `compute` percent.
pub(super) fn gpu_share(
    memory_gib: Option<u64>,
    memory_percent: Option<u64>,
    compute: Option<u64>,
) -> GpuShare {
    GpuShare {
        tier: None,
        patience: None,
        api_version: names::CONFIG_API_VERSION.to_owned(),
        kind: names::GPU_SHARE_KIND.to_owned(),
        memory: memory_gib.map(|g| Quantity::from_bytes(g.saturating_mul(GIB))),
        memory_percent: memory_percent.and_then(|p| i64::try_from(p).ok()),
        compute: compute.and_then(|c| i64::try_from(c).ok()),
    }
}

/// `tessera-` and the first 12 hex digits of a name-based UUID of the spec's JSON.
pub(super) fn template_name(spec: &res::ResourceClaimSpec) -> String {
    let bytes = serde_json::to_vec(spec).unwrap_or_default();
    let id = uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, &bytes);
    let hex = id.simple().to_string();
    format!("tessera-{}", &hex[..12])
}
