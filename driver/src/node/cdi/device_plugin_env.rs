//! The environment images written for a device plugin read, added to a claim's CDI spec when
//! the claim was made for a pod asking with that plugin's names (the template's annotation
//! `gpu.tessera.dev/device-plugin-forms`, copied onto the claim).
//!
//! Only what is cheap and safe: values computed from the allocation record and the node's
//! inventory, never from user input. Provided:
//!
//! * Aliyun gpushare (`aliyun`): `ALIYUN_COM_GPU_MEM_IDX` (the GPU indices, comma-separated),
//!   `ALIYUN_COM_GPU_MEM_DEV` (a card's memory, whole GiB), `ALIYUN_COM_GPU_MEM_CONTAINER` and
//!   `ALIYUN_COM_GPU_MEM_POD` (the share's memory over all its cards, whole GiB).
//! * Every form: `NVIDIA_VISIBLE_DEVICES` is set by the spec itself ([`super::build_spec`]).
//!
//! Not provided (docs/migration.md says why): the scheduler bookkeeping variables of gpushare
//! (`ALIYUN_COM_GPU_MEM_ASSIGNED`, `_ASSUME_TIME`), HAMi's `CUDA_DEVICE_MEMORY_LIMIT_<i>` and
//! `CUDA_DEVICE_SM_LIMIT` outside the `hami-core` backend (they configure its library, which
//! the backend mounts and sets itself), and anything Baidu's cGPU sets (not documented).

use k8s_openapi::api::resource::v1 as res;

use super::spec::CdiSpec;
use crate::names;
use crate::node::inventory::NodeInventory;
use crate::node::prepared::PreparedClaim;
use crate::rules::share::GIB;

/// The extra variables for `claim` (prepared as `prepared` on `node`), in a stable order.
pub fn device_plugin_env(
    claim: &res::ResourceClaim,
    prepared: &PreparedClaim,
    node: &NodeInventory,
) -> Vec<String> {
    let forms = claim
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(names::ANNOTATION_DEVICE_PLUGIN_FORMS))
        .map(String::as_str)
        .unwrap_or_default();
    let mut env = Vec::new();
    if forms.split(',').any(|f| f.trim() == "aliyun") && !prepared.devices.is_empty() {
        let indices: Vec<String> = prepared
            .devices
            .iter()
            .map(|d| d.gpu.index.to_string())
            .collect();
        let card = prepared
            .devices
            .iter()
            .filter_map(|d| node.gpus.iter().find(|g| g.index == d.gpu.index))
            .map(|g| g.memory_bytes / GIB)
            .min()
            .unwrap_or_default();
        let share: u64 = prepared
            .devices
            .iter()
            .filter_map(|d| d.share.map(|s| s.memory_bytes))
            .sum::<u64>()
            / GIB;
        env.push(format!("ALIYUN_COM_GPU_MEM_IDX={}", indices.join(",")));
        env.push(format!("ALIYUN_COM_GPU_MEM_DEV={card}"));
        env.push(format!("ALIYUN_COM_GPU_MEM_CONTAINER={share}"));
        env.push(format!("ALIYUN_COM_GPU_MEM_POD={share}"));
    }
    env
}

/// Adds [`device_plugin_env`] to the claim-wide edits of `spec`.
pub fn add_device_plugin_env(
    spec: &mut CdiSpec,
    claim: &res::ResourceClaim,
    prepared: &PreparedClaim,
    node: &NodeInventory,
) {
    let env = device_plugin_env(claim, prepared, node);
    if env.is_empty() {
        return;
    }
    spec.container_edits
        .get_or_insert_with(Default::default)
        .env
        .extend(env);
}

#[cfg(test)]
mod tests {

    use std::collections::BTreeMap;

    use super::*;
    use crate::node::prepared::{GpuNode, PreparedDevice};
    use crate::rules::share::PerDeviceShare;

    fn claim(forms: Option<&str>) -> res::ResourceClaim {
        res::ResourceClaim {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                annotations: forms.map(|f| {
                    BTreeMap::from([(
                        names::ANNOTATION_DEVICE_PLUGIN_FORMS.to_owned(),
                        f.to_owned(),
                    )])
                }),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn prepared() -> PreparedClaim {
        let device = |index: u32| PreparedDevice {
            request: "aliyun".into(),
            pool: "n".into(),
            device: format!("gpu-{index}"),
            gpu: GpuNode {
                index,
                uuid: format!("GPU-{index}"),
                minor: index,
            },
            mig: None,
            share: Some(PerDeviceShare {
                memory_bytes: 4 * GIB,
                compute_percent: 0,
            }),
            share_id: None,
            tier: crate::rules::config::Tier::Online,
            memory_overcommitted: false,
        };
        PreparedClaim {
            uid: "u".into(),
            namespace: "ns".into(),
            name: "c".into(),
            devices: vec![device(1), device(3)],
        }
    }

    fn node() -> NodeInventory {
        crate::testing::node_inventory(
            "nodes:\n- name: n\n  mode: shared\n  gpus:\n  - model: t4-16g\n    count: 4\n",
        )
    }

    #[test]
    fn an_aliyun_claim_gets_gpushares_variables_from_its_allocation() {
        let env = device_plugin_env(&claim(Some("aliyun")), &prepared(), &node());
        assert_eq!(
            env,
            [
                "ALIYUN_COM_GPU_MEM_IDX=1,3",
                "ALIYUN_COM_GPU_MEM_DEV=15",
                "ALIYUN_COM_GPU_MEM_CONTAINER=8",
                "ALIYUN_COM_GPU_MEM_POD=8",
            ]
        );
    }

    #[test]
    fn other_claims_get_nothing_extra() {
        assert!(device_plugin_env(&claim(None), &prepared(), &node()).is_empty());
        assert!(device_plugin_env(&claim(Some("baidu,nvidia")), &prepared(), &node()).is_empty());
    }
}
