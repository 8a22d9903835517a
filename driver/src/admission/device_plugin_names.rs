//! Pods written for the device-plugin world: extended-resource names turned into claims
//! (shared/DESIGN.md §7).
//!
//! ```text
//! let Some(request) = DevicePluginRequest::from_pod(&pod, "Pod ns/p")? else { return untouched };
//! let mapping = map_request(&request, &options, "Pod ns/p")?;   // claims, or a clear error
//! let patch = pod_patch(&pod, &request, &mapping)?;             // what the webhook returns
//! // the controller: templates(&mapping, ns), from the request recorded on the pod
//! // tessera allocate: rewrite_offline(&pod, &request, &mapping)
//! ```
//!
//! One function, [`map_request`], decides what every name means; the webhook, the controller
//! (which makes the ResourceClaimTemplates the rewritten pod refers to) and `tessera allocate`
//! all call it. The table:
//!
//! | names in one container | claim request |
//! |---|---|
//! | `nvidia.com/gpu: N` | `gpu`: N whole GPUs (class `gpu.tessera.dev`) |
//! | `nvidia.com/mig-<profile>: N` | `mig-<profile>`: N MIG devices with that `profile` |
//! | `nvidia.com/gpu.shared: N` | `shared`: N shares of 1/R of a card each (R: admin option) |
//! | `baidu.com/<model>_cgpu: M` | `baidu`: M whole GPUs of the model |
//! | ... + `_cgpu_memory: N` or `_cgpu_memory_percent: P`, optional `_cgpu_core: C` | `baidu`: `GpuShare{memory N Gi or memoryPercent P, compute C}` over M cards of the model |
//! | `nvidia.com/gpu: N` + `nvidia.com/gpumem` / `gpumem-percentage` / `gpucores` (HAMi) | `hami`: N shares, per-card sizes times N |
//!
//! and, once per pod, `aliyun.com/gpu-mem: N` (summed over the pod's containers) with the pod
//! label `aliyun.com/gpu-count: M` becomes the claim entry `tessera` shared by those containers:
//! `GpuShare{memory N Gi}` over M cards.
//!
//! The seed's share rules bind the Baidu and Aliyun forms exactly (whole GiB, compute in steps
//! of 5, totals over M cards divide evenly, compute needs memory, memory xor percent, a share
//! never exceeds a card). HAMi's per-card MiB and percent are rounded up to whole GiB and steps
//! of 5, each with a warning, never silently.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::resource::v1 as res;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::PatchOp;
use crate::error::{Error, Result};
use crate::names;
use crate::node::inventory::models;
use crate::rules::config::GpuShare;
use crate::rules::quantity::Quantity;
use crate::rules::share::{COMPUTE_STEP, GIB, ShareRequest};

/// NVIDIA device plugin: whole GPUs.
pub const NVIDIA_GPU: &str = "nvidia.com/gpu";
/// NVIDIA device plugin with time-slicing and `renameByDefault`: time-sliced replicas.
pub const NVIDIA_GPU_SHARED: &str = "nvidia.com/gpu.shared";
/// NVIDIA device plugin, MIG "mixed" strategy: `nvidia.com/mig-<profile>`.
pub const NVIDIA_MIG_PREFIX: &str = "nvidia.com/mig-";
/// HAMi: GPU memory per card, in MiB.
pub const HAMI_GPUMEM: &str = "nvidia.com/gpumem";
/// HAMi: GPU memory per card, in percent of the card.
pub const HAMI_GPUMEM_PERCENTAGE: &str = "nvidia.com/gpumem-percentage";
/// HAMi: compute per card, in percent.
pub const HAMI_GPUCORES: &str = "nvidia.com/gpucores";
/// Aliyun gpushare: GPU memory in GiB, total for the container.
pub const ALIYUN_GPU_MEM: &str = "aliyun.com/gpu-mem";
/// Aliyun gpushare: the pod label saying over how many cards the memory is spread.
pub const ALIYUN_GPU_COUNT_LABEL: &str = "aliyun.com/gpu-count";
/// Baidu CCE: `baidu.com/<model>_cgpu`, `_cgpu_memory`, `_cgpu_core`, `_cgpu_memory_percent`.
pub const BAIDU_PREFIX: &str = "baidu.com/";
/// Time-sliced replicas per GPU when the admin sets none.
pub const DEFAULT_SHARED_REPLICAS: u32 = 4;
/// The pod claim entry of the Aliyun form (one per pod).
pub const POD_ENTRY: &str = "tessera";

/// Baidu's model names and the Tessera models they are.
pub const BAIDU_MODELS: &[(&str, &str)] = &[
    ("v100_16g", "v100-16g"),
    ("v100_32g", "v100-32g"),
    ("t4_16g", "t4-16g"),
    ("a100_80g", "a100-80g"),
    ("a100_40g", "a100-40g"),
    ("a800_80g", "a800-80g"),
    ("a30_24g", "a30-24g"),
    ("a10_24g", "a10-24g"),
    ("rtx_3090", "rtx-3090"),
    ("rtx_4090", "rtx-4090"),
    ("h800_80g", "h800-80g"),
    ("l20", "l20-48g"),
    ("h20_96g", "h20-96g"),
    ("h20_141g", "h20-141g"),
    ("h20z_141g", "h20z-141g"),
];

/// The admin's settings of the mapping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// Tessera's DRA driver name (the domain of attributes in selectors, the opaque driver).
    pub driver: String,
    /// Time-sliced replicas per GPU: one `nvidia.com/gpu.shared` is 1/R of a card (1..=100).
    pub shared_replicas: u32,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            driver: names::DEFAULT_DRIVER_NAME.to_owned(),
            shared_replicas: DEFAULT_SHARED_REPLICAS,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum BaiduPart {
    Cards,
    Memory,
    Core,
    MemoryPercent,
}

/// `baidu.com/<model>_cgpu...`: the model and which part of the ask.
fn baidu_part(name: &str) -> Option<(&str, BaiduPart)> {
    let rest = name.strip_prefix(BAIDU_PREFIX)?;
    [
        ("_cgpu_memory_percent", BaiduPart::MemoryPercent),
        ("_cgpu_memory", BaiduPart::Memory),
        ("_cgpu_core", BaiduPart::Core),
        ("_cgpu", BaiduPart::Cards),
    ]
    .into_iter()
    .find_map(|(suffix, part)| {
        rest.strip_suffix(suffix)
            .filter(|m| !m.is_empty())
            .map(|m| (m, part))
    })
}

/// The Tessera model of a Baidu model name: the Baidu table first, then any model Tessera
/// knows under the name with `_` read as `-`.
pub fn baidu_model(name: &str) -> Option<&'static models::GpuModel> {
    BAIDU_MODELS
        .iter()
        .find(|(baidu, _)| *baidu == name)
        .and_then(|(_, id)| models::lookup(id))
        .or_else(|| models::lookup(&name.replace('_', "-")))
}

/// Whether `name` is one of the device-plugin resource names this module maps.
pub fn is_device_plugin_name(name: &str) -> bool {
    matches!(
        name,
        NVIDIA_GPU
            | NVIDIA_GPU_SHARED
            | HAMI_GPUMEM
            | HAMI_GPUMEM_PERCENTAGE
            | HAMI_GPUCORES
            | ALIYUN_GPU_MEM
    ) || name.starts_with(NVIDIA_MIG_PREFIX)
        || baidu_part(name).is_some()
}

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

    fn pointer(&self) -> String {
        format!("/spec/{}/{}", self.list(), self.index)
    }

    fn get(&self, name: &str) -> Option<u64> {
        self.resources.get(name).copied().filter(|v| *v > 0)
    }

    fn entry(&self) -> String {
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
}

/// A pod's device-plugin request: what the pod webhook records on the pod (annotation
/// [`names::ANNOTATION_DEVICE_PLUGIN_REQUEST`]) and the controller maps again.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DevicePluginRequest {
    /// The containers that ask, init containers first.
    pub containers: Vec<ContainerAsk>,
    /// The pod's `aliyun.com/gpu-count` label, when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_count_label: Option<String>,
}

fn invalid(object: &str, field: String, message: String) -> Error {
    Error::Invalid {
        object: object.to_owned(),
        field,
        message,
    }
}

fn whole(object: &str, field: &str, container: &str, name: &str, text: &str) -> Result<u64> {
    let q = Quantity::parse(text).map_err(|e| {
        invalid(
            object,
            field.to_owned(),
            format!("container {container}: {name}: {e}"),
        )
    })?;
    q.as_units()
        .and_then(|v| u64::try_from(v).ok())
        .ok_or_else(|| {
            invalid(
                object,
                field.to_owned(),
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
                    .filter(|n| is_device_plugin_name(n))
                    .collect();
                for name in asked {
                    let limit = limits.and_then(|l| l.get(name));
                    let req = requests.and_then(|r| r.get(name));
                    let value = match (limit, req) {
                        (Some(l), Some(r)) => {
                            let field = format!("{}.resources.limits[{name}]", ask.field());
                            let l = whole(object, &field, &ask.name, name, &l.0)?;
                            let rfield = format!("{}.resources.requests[{name}]", ask.field());
                            if whole(object, &rfield, &ask.name, name, &r.0)? != l {
                                return Err(invalid(
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
                            let field = format!("{}.resources.limits[{name}]", ask.field());
                            whole(object, &field, &ask.name, name, &l.0)?
                        }
                        (None, _) => {
                            return Err(invalid(
                                object,
                                format!("{}.resources.limits[{name}]", ask.field()),
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

/// One claim the mapping asks for: an entry of the pod's `spec.resourceClaims`, made from the
/// ResourceClaimTemplate [`MappedClaim::template`].
#[derive(Debug, Clone, PartialEq)]
pub struct MappedClaim {
    /// The entry's name in the pod (`tessera-<container>`, or [`POD_ENTRY`]).
    pub entry: String,
    /// The containers using it: indices into [`DevicePluginRequest::containers`].
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
struct Builder {
    requests: Vec<Value>,
    configs: Vec<Value>,
    shares: Vec<(String, GpuShare, u32)>,
    forms: BTreeSet<&'static str>,
}

impl Builder {
    fn request(&mut self, name: &str, class: &str, count: u64, selector: Option<String>) {
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
    }

    fn share(&mut self, name: &str, driver: &str, share: GpuShare, count: u32) {
        self.configs.push(json!({
            "requests": [name],
            "opaque": { "driver": driver, "parameters": share },
        }));
        self.shares.push((name.to_owned(), share, count));
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
}

fn gpu_share(
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

fn cards(object: &str, field: String, container: &str, name: &str, n: u64) -> Result<u32> {
    u32::try_from(n).map_err(|_| {
        invalid(
            object,
            field,
            format!("container {container}: {name}: {n} cards is more than any node has"),
        )
    })
}

fn model_selector(driver: &str, model: &str) -> String {
    format!(
        "device.attributes[\"{driver}\"].{} == \"{model}\"",
        names::ATTR_MODEL
    )
}

/// Whether a MIG profile name is well formed (`1g.10gb`, `1g.10gb+me`, `1c.2g.20gb`).
fn valid_mig_profile(profile: &str) -> bool {
    !profile.is_empty()
        && profile.len() <= 40
        && profile.contains("g.")
        && profile
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'+')
}

/// Maps a pod's device-plugin request to claims, or says which container, resource and rule
/// is wrong. `object` names the pod in errors.
#[allow(
    clippy::too_many_lines,
    reason = "the mapping table, one row after another, reads best in one place"
)]
pub fn map_request(
    request: &DevicePluginRequest,
    options: &Options,
    object: &str,
) -> Result<Mapping> {
    let driver = options.driver.as_str();
    let mut mapping = Mapping::default();
    for (i, ask) in request.containers.iter().enumerate() {
        let c = ask.name.as_str();
        let field = |name: &str| format!("{}.resources.limits[{name}]", ask.field());
        let err = |name: &str, message: String| {
            invalid(object, field(name), format!("container {c}: {message}"))
        };
        let mut b = Builder::default();

        // NVIDIA whole GPUs, or HAMi shares when HAMi's companions are there.
        let gpu = ask.get(NVIDIA_GPU);
        let (mem_mib, mem_pct, cores) = (
            ask.get(HAMI_GPUMEM),
            ask.get(HAMI_GPUMEM_PERCENTAGE),
            ask.get(HAMI_GPUCORES),
        );
        if mem_mib.is_some() || mem_pct.is_some() || cores.is_some() {
            let n = if let Some(n) = gpu {
                n
            } else {
                mapping.warnings.push(format!(
                    "container {c}: HAMi sizes without {NVIDIA_GPU}: one GPU, HAMi's default"
                ));
                1
            };
            let count = cards(object, field(NVIDIA_GPU), c, NVIDIA_GPU, n)?;
            if mem_mib.is_some() && mem_pct.is_some() {
                return Err(err(
                    HAMI_GPUMEM_PERCENTAGE,
                    format!("{HAMI_GPUMEM} and {HAMI_GPUMEM_PERCENTAGE} are exclusive: set one"),
                ));
            }
            let (memory, percent) = match (mem_mib, mem_pct) {
                (Some(mib), _) => {
                    let gib = mib.div_ceil(1024);
                    if !mib.is_multiple_of(1024) {
                        mapping.warnings.push(format!(
                            "container {c}: {HAMI_GPUMEM} {mib} (MiB) rounded up to {gib}Gi per card: \
                             Tessera shares memory in whole GiB"
                        ));
                    }
                    (Some(gib * n), None)
                }
                (None, Some(p)) => {
                    if p > 100 {
                        return Err(err(
                            HAMI_GPUMEM_PERCENTAGE,
                            format!("{HAMI_GPUMEM_PERCENTAGE} {p} is outside 1..100"),
                        ));
                    }
                    (None, Some(p))
                }
                (None, None) => {
                    mapping.warnings.push(format!(
                        "container {c}: {HAMI_GPUCORES} without a memory size: each card's whole \
                         memory, HAMi's default"
                    ));
                    (None, Some(100))
                }
            };
            let compute = match cores {
                Some(p) if p > 100 => {
                    return Err(err(
                        HAMI_GPUCORES,
                        format!("{HAMI_GPUCORES} {p} is more than a card's 100"),
                    ));
                }
                Some(p) => {
                    let step = COMPUTE_STEP.unsigned_abs();
                    let rounded = p.div_ceil(step) * step;
                    if rounded != p {
                        mapping.warnings.push(format!(
                            "container {c}: {HAMI_GPUCORES} {p} rounded up to {rounded} per card: \
                             Tessera isolates compute in steps of {step}"
                        ));
                    }
                    Some(rounded * n)
                }
                None => None,
            };
            b.request("hami", names::CLASS_SHARED_GPU, n, None);
            b.share("hami", driver, gpu_share(memory, percent, compute), count);
            b.forms.insert("hami");
        } else if let Some(n) = gpu {
            b.request("gpu", names::CLASS_GPU, n, None);
            b.forms.insert("nvidia");
        }

        // Time-sliced replicas.
        if let Some(n) = ask.get(NVIDIA_GPU_SHARED) {
            let count = cards(object, field(NVIDIA_GPU_SHARED), c, NVIDIA_GPU_SHARED, n)?;
            let replicas = options.shared_replicas.clamp(1, 100);
            let percent = 100 / u64::from(replicas);
            b.request("shared", names::CLASS_SHARED_GPU, n, None);
            b.share(
                "shared",
                driver,
                gpu_share(None, Some(percent), None),
                count,
            );
            b.forms.insert("time-slicing");
        }

        // MIG instances, one request per profile.
        for (name, n) in &ask.resources {
            let Some(profile) = name.strip_prefix(NVIDIA_MIG_PREFIX) else {
                continue;
            };
            if *n == 0 {
                continue;
            }
            if !valid_mig_profile(profile) {
                return Err(err(
                    name,
                    format!("{name}: {profile:?} is not a MIG profile name (like 1g.10gb)"),
                ));
            }
            let request = format!("mig-{}", profile.replace(['.', '+'], "-"));
            let selector = format!(
                "device.attributes[\"{driver}\"].{} == \"{profile}\"",
                names::ATTR_MIG_PROFILE
            );
            b.request(&request, names::CLASS_MIG_GPU, *n, Some(selector));
            b.forms.insert("mig");
        }

        // Baidu: one model per container.
        let mut baidu: BTreeMap<&str, BTreeMap<BaiduPart, (&str, u64)>> = BTreeMap::new();
        for (name, n) in &ask.resources {
            if let Some((model, part)) = baidu_part(name)
                && *n > 0
            {
                baidu
                    .entry(model)
                    .or_default()
                    .insert(part, (name.as_str(), *n));
            }
        }
        if baidu.len() > 1 {
            let models: Vec<&str> = baidu.keys().copied().collect();
            let first = baidu.values().next().and_then(|p| p.values().next());
            return Err(err(
                first.map_or(BAIDU_PREFIX, |(n, _)| n),
                format!(
                    "asks for Baidu models {}: one container asks for one model",
                    models.join(" and ")
                ),
            ));
        }
        if let Some((model_name, parts)) = baidu.into_iter().next() {
            let any = parts.values().next().map_or(BAIDU_PREFIX, |(n, _)| *n);
            let model = baidu_model(model_name).ok_or_else(|| {
                err(
                    any,
                    format!(
                        "unknown GPU model {model_name:?}: Tessera knows the Baidu models {} and \
                         its own ({})",
                        BAIDU_MODELS
                            .iter()
                            .map(|(b, _)| *b)
                            .collect::<Vec<_>>()
                            .join(", "),
                        models::known_ids()
                    ),
                )
            })?;
            let Some(&(cards_name, m)) = parts.get(&BaiduPart::Cards) else {
                return Err(err(
                    any,
                    format!(
                        "{any} needs {BAIDU_PREFIX}{model_name}_cgpu, the number of cards it spreads over"
                    ),
                ));
            };
            let count = cards(object, field(cards_name), c, cards_name, m)?;
            let memory = parts.get(&BaiduPart::Memory).copied();
            let percent = parts.get(&BaiduPart::MemoryPercent).copied();
            let core = parts.get(&BaiduPart::Core).copied();
            let selector = Some(model_selector(driver, model.id));
            if memory.is_none() && percent.is_none() {
                if let Some((core_name, _)) = core {
                    return Err(err(
                        core_name,
                        format!(
                            "{core_name}: compute needs memory: add {BAIDU_PREFIX}{model_name}_cgpu_memory \
                             or _cgpu_memory_percent"
                        ),
                    ));
                }
                b.request("baidu", names::CLASS_GPU, m, selector);
            } else {
                let over = if m > 1 {
                    format!(" over {m} cards")
                } else {
                    String::new()
                };
                if let (Some(_), Some((pct_name, _))) = (memory, percent) {
                    return Err(err(
                        pct_name,
                        format!(
                            "{BAIDU_PREFIX}{model_name}_cgpu_memory and _cgpu_memory_percent are \
                             exclusive: set one"
                        ),
                    ));
                }
                if let Some((mem_name, n)) = memory {
                    if !n.is_multiple_of(m) {
                        return Err(err(
                            mem_name,
                            format!(
                                "{mem_name}: {n} GiB{over} is not a whole number of GiB per card"
                            ),
                        ));
                    }
                    let per_card = n / m;
                    if per_card.saturating_mul(GIB) > model.memory_bytes {
                        #[allow(
                            clippy::cast_precision_loss,
                            reason = "a message: a card's memory in GiB, to one decimal"
                        )]
                        let card = model.memory_bytes as f64 / GIB as f64;
                        return Err(err(
                            mem_name,
                            format!(
                                "{mem_name}: {per_card} GiB per card is more than a {}'s {card:.1} GiB: \
                                 a share never exceeds a card",
                                model.id
                            ),
                        ));
                    }
                }
                if let Some((pct_name, p)) = percent
                    && p > 100
                {
                    return Err(err(
                        pct_name,
                        format!("{pct_name}: {p} is outside 1..100 percent of a card"),
                    ));
                }
                if let Some((core_name, total)) = core {
                    if !total.is_multiple_of(m) {
                        return Err(err(
                            core_name,
                            format!("{core_name}: {total}{over} is not a whole percent per card"),
                        ));
                    }
                    let per_card = total / m;
                    let step = COMPUTE_STEP.unsigned_abs();
                    if per_card > 100 || !per_card.is_multiple_of(step) {
                        return Err(err(
                            core_name,
                            format!(
                                "{core_name}: {per_card} per card is not a multiple of {step} in 5..100"
                            ),
                        ));
                    }
                }
                b.request("baidu", names::CLASS_SHARED_GPU, m, selector);
                b.share(
                    "baidu",
                    driver,
                    gpu_share(
                        memory.map(|(_, n)| n),
                        percent.map(|(_, p)| p),
                        core.map(|(_, c)| c),
                    ),
                    count,
                );
            }
            b.forms.insert("baidu");
        }

        if b.requests.is_empty() {
            continue;
        }
        check_shares(&b, object, &ask.field(), c)?;
        let spec = b.spec(object)?;
        mapping.claims.push(MappedClaim {
            entry: ask.entry(),
            containers: vec![i],
            template: template_name(&spec),
            forms: b.forms.into_iter().collect(),
            spec,
        });
    }

    // Aliyun: once per pod.
    let askers: Vec<usize> = request
        .containers
        .iter()
        .enumerate()
        .filter(|(_, a)| a.get(ALIYUN_GPU_MEM).is_some())
        .map(|(i, _)| i)
        .collect();
    if let Some(&first) = askers.first() {
        let total: u64 = askers
            .iter()
            .filter_map(|&i| request.containers[i].get(ALIYUN_GPU_MEM))
            .sum();
        let label_field = format!("metadata.labels[{ALIYUN_GPU_COUNT_LABEL}]");
        let m = match request.gpu_count_label.as_deref() {
            None => 1,
            Some(text) => text
                .trim()
                .parse::<u32>()
                .ok()
                .filter(|m| *m >= 1)
                .ok_or_else(|| {
                    invalid(
                        object,
                        label_field.clone(),
                        format!("{text:?} is not a number of cards (a whole number, at least 1)"),
                    )
                })?,
        };
        if !total.is_multiple_of(u64::from(m)) {
            let ask = &request.containers[first];
            return Err(invalid(
                object,
                format!("{}.resources.limits[{ALIYUN_GPU_MEM}]", ask.field()),
                format!(
                    "{ALIYUN_GPU_MEM}: {total} GiB for the pod over {m} cards ({ALIYUN_GPU_COUNT_LABEL}) \
                     is not a whole number of GiB per card"
                ),
            ));
        }
        let mut b = Builder::default();
        b.request("aliyun", names::CLASS_SHARED_GPU, u64::from(m), None);
        b.share("aliyun", driver, gpu_share(Some(total), None, None), m);
        b.forms.insert("aliyun");
        check_shares(&b, object, "metadata", "of the pod")?;
        let spec = b.spec(object)?;
        mapping.claims.push(MappedClaim {
            entry: POD_ENTRY.to_owned(),
            containers: askers,
            template: template_name(&spec),
            forms: b.forms.into_iter().collect(),
            spec,
        });
    }
    Ok(mapping)
}

/// The share rules of `GpuShare`, applied to what the mapping built: a safety net under the
/// checks above, which name the resource.
fn check_shares(b: &Builder, object: &str, field: &str, container: &str) -> Result<()> {
    for (name, share, count) in &b.shares {
        ShareRequest::from_gpu_share(share, *count, name).map_err(|e| {
            invalid(
                object,
                field.to_owned(),
                format!("container {container}: the share it maps to breaks a share rule: {e}"),
            )
        })?;
    }
    Ok(())
}

/// `tessera-` and the first 12 hex digits of a name-based UUID of the spec's JSON.
fn template_name(spec: &res::ResourceClaimSpec) -> String {
    let bytes = serde_json::to_vec(spec).unwrap_or_default();
    let id = uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, &bytes);
    let hex = id.simple().to_string();
    format!("tessera-{}", &hex[..12])
}

/// The ResourceClaimTemplate of one mapped claim, in `namespace`.
pub fn template(claim: &MappedClaim, namespace: &str) -> res::ResourceClaimTemplate {
    let labels = BTreeMap::from([
        (
            names::LABEL_MANAGED_BY.to_owned(),
            names::CONTROLLER_MANAGER.to_owned(),
        ),
        (
            names::LABEL_DEVICE_PLUGIN_TEMPLATE.to_owned(),
            "true".to_owned(),
        ),
    ]);
    let forms = BTreeMap::from([(
        names::ANNOTATION_DEVICE_PLUGIN_FORMS.to_owned(),
        claim.forms.join(","),
    )]);
    res::ResourceClaimTemplate {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some(claim.template.clone()),
            namespace: Some(namespace.to_owned()),
            labels: Some(labels),
            ..Default::default()
        },
        spec: res::ResourceClaimTemplateSpec {
            metadata: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                annotations: Some(forms),
                ..Default::default()
            }),
            spec: claim.spec.clone(),
        },
    }
}

/// The request the webhook recorded on a rewritten pod: `None` for a pod it did not rewrite.
pub fn recorded_request(pod: &core::Pod, object: &str) -> Option<Result<DevicePluginRequest>> {
    let text = pod
        .metadata
        .annotations
        .as_ref()?
        .get(names::ANNOTATION_DEVICE_PLUGIN_REQUEST)?;
    Some(serde_json::from_str(text).map_err(|e| {
        invalid(
            object,
            format!(
                "metadata.annotations[{}]",
                names::ANNOTATION_DEVICE_PLUGIN_REQUEST
            ),
            format!("not a device-plugin request Tessera wrote: {e}"),
        )
    }))
}

/// The names of the ResourceClaimTemplates `pod` refers to, in its namespace.
pub fn referenced_templates(pod: &core::Pod) -> impl Iterator<Item = &str> {
    pod.spec
        .iter()
        .flat_map(|s| s.resource_claims.iter().flatten())
        .filter_map(|c| c.resource_claim_template_name.as_deref())
}

/// The templates a rewritten pod needs: its recorded request mapped again, kept where the pod
/// refers to the template. Empty for a pod the webhook did not rewrite.
pub fn templates_for_pod(
    pod: &core::Pod,
    options: &Options,
) -> Result<Vec<res::ResourceClaimTemplate>> {
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    let object = format!(
        "Pod {namespace}/{}",
        pod.metadata.name.as_deref().unwrap_or_default()
    );
    let Some(request) = recorded_request(pod, &object) else {
        return Ok(Vec::new());
    };
    let mapping = map_request(&request?, options, &object)?;
    let referenced: BTreeSet<&str> = referenced_templates(pod).collect();
    Ok(mapping
        .claims
        .iter()
        .filter(|c| referenced.contains(c.template.as_str()))
        .map(|c| template(c, namespace))
        .collect())
}

/// A v1 template as `version` writes it: v1 and v1beta2 share the claim spec's shape; v1beta1
/// has a request's fields where v1 nests them under `exactly`.
pub fn template_document(
    template: &res::ResourceClaimTemplate,
    version: crate::apiversion::ApiVersion,
) -> Result<Value> {
    let mut value = serde_json::to_value(template).map_err(|e| Error::Decode {
        context: "ResourceClaimTemplate".to_owned(),
        message: e.to_string(),
    })?;
    value["apiVersion"] = json!(version.as_str());
    value["kind"] = json!("ResourceClaimTemplate");
    if version == crate::apiversion::ApiVersion::V1beta1
        && let Some(requests) = value
            .pointer_mut("/spec/spec/devices/requests")
            .and_then(Value::as_array_mut)
    {
        for request in requests {
            if let Some(Value::Object(exactly)) =
                request.as_object_mut().and_then(|r| r.remove("exactly"))
                && let Some(map) = request.as_object_mut()
            {
                map.extend(exactly);
            }
        }
    }
    Ok(value)
}

/// Escapes one JSON-pointer token (RFC 6901).
fn token(name: &str) -> String {
    name.replace('~', "~0").replace('/', "~1")
}

fn add(path: String, value: Value) -> PatchOp {
    PatchOp {
        op: "add",
        path,
        value,
    }
}

fn container_of<'a>(pod: &'a core::Pod, ask: &ContainerAsk) -> Option<&'a core::Container> {
    pod.spec.as_ref().and_then(|s| {
        if ask.init {
            s.init_containers.as_ref().and_then(|c| c.get(ask.index))
        } else {
            s.containers.get(ask.index)
        }
    })
}

/// The patch removing the asked names from the containers' limits and requests.
fn remove_names(pod: &core::Pod, request: &DevicePluginRequest) -> Vec<PatchOp> {
    let mut ops = Vec::new();
    for ask in &request.containers {
        let resources = container_of(pod, ask).and_then(|c| c.resources.as_ref());
        for (list, map) in [
            ("limits", resources.and_then(|r| r.limits.as_ref())),
            ("requests", resources.and_then(|r| r.requests.as_ref())),
        ] {
            for name in ask.resources.keys() {
                if map.is_some_and(|m| m.contains_key(name)) {
                    ops.push(PatchOp {
                        op: "remove",
                        path: format!("{}/resources/{list}/{}", ask.pointer(), token(name)),
                        value: Value::Null,
                    });
                }
            }
        }
    }
    ops
}

/// The JSON patch that rewrites `pod`: the names removed from requests and limits, the claims
/// added to `spec.resourceClaims` and to each container's `resources.claims`, the request
/// recorded in an annotation, and the scheduling gate.
///
/// An entry name the pod already uses is an error (the pod mixes its own claims with
/// device-plugin names under the same name).
pub fn pod_patch(
    pod: &core::Pod,
    request: &DevicePluginRequest,
    mapping: &Mapping,
    object: &str,
) -> Result<Vec<PatchOp>> {
    let spec = pod.spec.as_ref();
    let container = |ask: &ContainerAsk| container_of(pod, ask);
    let mut ops = remove_names(pod, request);
    let existing: BTreeSet<&str> = spec
        .and_then(|s| s.resource_claims.as_ref())
        .into_iter()
        .flatten()
        .map(|c| c.name.as_str())
        .collect();
    let mut with_claims: BTreeSet<usize> = BTreeSet::new();
    for claim in &mapping.claims {
        if existing.contains(claim.entry.as_str()) {
            return Err(invalid(
                object,
                "spec.resourceClaims".to_owned(),
                format!(
                    "the pod already has a claim named {:?}, the name Tessera gives the claim it \
                     makes from the device-plugin names; rename the pod's claim",
                    claim.entry
                ),
            ));
        }
        for &i in &claim.containers {
            let ask = &request.containers[i];
            let has = container(ask)
                .and_then(|c| c.resources.as_ref())
                .is_some_and(|r| r.claims.is_some());
            let reference = json!({ "name": claim.entry });
            if has || !with_claims.insert(i) {
                ops.push(add(
                    format!("{}/resources/claims/-", ask.pointer()),
                    reference,
                ));
            } else if container(ask).is_some_and(|c| c.resources.is_some()) {
                ops.push(add(
                    format!("{}/resources/claims", ask.pointer()),
                    json!([reference]),
                ));
            } else {
                ops.push(add(
                    format!("{}/resources", ask.pointer()),
                    json!({ "claims": [reference] }),
                ));
            }
        }
    }
    let entries: Vec<Value> = mapping
        .claims
        .iter()
        .map(|c| json!({ "name": c.entry, "resourceClaimTemplateName": c.template }))
        .collect();
    if existing.is_empty() && spec.is_none_or(|s| s.resource_claims.is_none()) {
        ops.push(add("/spec/resourceClaims".to_owned(), json!(entries)));
    } else {
        for entry in entries {
            ops.push(add("/spec/resourceClaims/-".to_owned(), entry));
        }
    }
    let recorded = serde_json::to_string(request).map_err(|e| Error::Decode {
        context: format!("{object}: the device-plugin request"),
        message: e.to_string(),
    })?;
    if pod.metadata.annotations.is_some() {
        ops.push(add(
            format!(
                "/metadata/annotations/{}",
                token(names::ANNOTATION_DEVICE_PLUGIN_REQUEST)
            ),
            json!(recorded),
        ));
    } else {
        ops.push(add(
            "/metadata/annotations".to_owned(),
            json!({ names::ANNOTATION_DEVICE_PLUGIN_REQUEST: recorded }),
        ));
    }
    let gates = spec.and_then(|s| s.scheduling_gates.as_ref());
    let gate = json!({ "name": names::SCHEDULING_GATE });
    match gates {
        Some(g) if g.iter().any(|g| g.name == names::SCHEDULING_GATE) => {}
        Some(_) => ops.push(add("/spec/schedulingGates/-".to_owned(), gate)),
        None => ops.push(add("/spec/schedulingGates".to_owned(), json!([gate]))),
    }
    Ok(ops)
}

/// What the pod webhook does with a pod that may use device-plugin names.
#[derive(Debug, Clone, PartialEq)]
pub enum PodRewrite {
    /// The pod asks for none of the names.
    Untouched,
    /// The pod asks for them but is left as it is, for the reason given (a warning).
    Skipped(String),
    /// The pod is rewritten.
    Rewritten {
        /// The request recorded on the pod.
        request: DevicePluginRequest,
        /// The claims.
        mapping: Mapping,
        /// The JSON patch.
        patch: Vec<PatchOp>,
    },
}

/// Decides the pod webhook's rewrite of `pod` ([`PodRewrite`]), or the error that refuses it.
///
/// A pod with `spec.nodeName` set bypasses scheduling, so it cannot wait for an allocation: it
/// is left as it is (a device plugin still running on that node may serve it). So is a pod
/// labelled [`names::LABEL_KEEP_DEVICE_PLUGIN_NAMES`]` = "true"`, silently.
pub fn rewrite_pod(pod: &core::Pod, options: &Options, object: &str) -> Result<PodRewrite> {
    let keep = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(names::LABEL_KEEP_DEVICE_PLUGIN_NAMES))
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
    if keep {
        return Ok(PodRewrite::Untouched);
    }
    let Some(request) = DevicePluginRequest::from_pod(pod, object)? else {
        return Ok(PodRewrite::Untouched);
    };
    if pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .is_some_and(|n| !n.is_empty())
    {
        return Ok(PodRewrite::Skipped(format!(
            "spec.nodeName is set, so the pod bypasses scheduling: Tessera leaves its device-plugin \
             names ({}) to a device plugin on that node",
            request
                .containers
                .iter()
                .flat_map(|c| c.resources.keys())
                .cloned()
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    let mapping = map_request(&request, options, object)?;
    let patch = pod_patch(pod, &request, &mapping, object)?;
    Ok(PodRewrite::Rewritten {
        request,
        mapping,
        patch,
    })
}

/// The pod as the API server stores it after the webhook's patch ([`pod_patch`]): what
/// `tessera allocate` and tests start from.
pub fn apply_pod_patch(pod: &core::Pod, patch: &[PatchOp], object: &str) -> Result<core::Pod> {
    let mut value = serde_json::to_value(pod).map_err(|e| Error::Decode {
        context: object.to_owned(),
        message: e.to_string(),
    })?;
    apply_patch(&mut value, patch, object)?;
    serde_json::from_value(value).map_err(|e| Error::Decode {
        context: object.to_owned(),
        message: e.to_string(),
    })
}

/// Applies the patches [`pod_patch`] writes (`add` and `remove`) to a JSON object.
fn apply_patch(target: &mut Value, ops: &[PatchOp], object: &str) -> Result<()> {
    let fail = |path: &str| Error::Decode {
        context: object.to_owned(),
        message: format!("the rewrite's patch does not apply at {path}"),
    };
    for op in ops {
        let (parent, last) = op.path.rsplit_once('/').ok_or_else(|| fail(&op.path))?;
        let last = last.replace("~1", "/").replace("~0", "~");
        let parent = target.pointer_mut(parent).ok_or_else(|| fail(&op.path))?;
        match (op.op, parent) {
            ("add", Value::Array(items)) if last == "-" => items.push(op.value.clone()),
            ("add", Value::Object(map)) => {
                map.insert(last, op.value.clone());
            }
            ("remove", Value::Object(map)) => {
                map.remove(&last).ok_or_else(|| fail(&op.path))?;
            }
            _ => return Err(fail(&op.path)),
        }
    }
    Ok(())
}

/// What `tessera allocate` does with a pod that uses device-plugin names: the pod rewritten as
/// the webhook would, with its claims made from the templates as kube-controller-manager
/// would (named `<pod>-<entry>`, referred to by name).
pub fn rewrite_offline(
    pod: &core::Pod,
    request: &DevicePluginRequest,
    mapping: &Mapping,
    object: &str,
) -> Result<(core::Pod, Vec<res::ResourceClaim>)> {
    let patch = pod_patch(pod, request, mapping, object)?;
    let mut rewritten = apply_pod_patch(pod, &patch, object)?;
    let pod_name = pod.metadata.name.clone().unwrap_or_default();
    let namespace = pod
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".to_owned());
    let mut claims = Vec::new();
    for entry in rewritten
        .spec
        .iter_mut()
        .flat_map(|s| s.resource_claims.iter_mut().flatten())
    {
        let Some(claim) = mapping.claims.iter().find(|c| c.entry == entry.name) else {
            continue;
        };
        let name = format!("{pod_name}-{}", claim.entry);
        entry.resource_claim_template_name = None;
        entry.resource_claim_name = Some(name.clone());
        claims.push(res::ResourceClaim {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                name: Some(name),
                namespace: Some(namespace.clone()),
                annotations: Some(BTreeMap::from([(
                    names::ANNOTATION_DEVICE_PLUGIN_FORMS.to_owned(),
                    claim.forms.join(","),
                )])),
                ..Default::default()
            },
            spec: claim.spec.clone(),
            status: None,
        });
    }
    Ok((rewritten, claims))
}

#[cfg(test)]
mod tests;
