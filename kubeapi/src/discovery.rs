//! Which resource.k8s.io version the API server serves, and the dynamic resource of a kind in
//! it.

use kube::core::{ApiResource, GroupVersionKind};
use serde::Serialize;
use serde_json::Value;
use tessera_driver::apiversion::ApiVersion;
use tessera_driver::names::ResourceKind;

use crate::error::{Error, Result};

/// The API group of Dynamic Resource Allocation.
pub const RESOURCE_GROUP: &str = "resource.k8s.io";

/// The newest resource.k8s.io version the API server serves among those Tessera speaks
/// (v1, else v1beta2, else v1beta1).
pub async fn served_resource_version(client: &kube::Client) -> Result<ApiVersion> {
    let groups = client
        .list_api_groups()
        .await
        .map_err(|e| Error::api("discovering API groups", &e))?;
    let served: Vec<String> = groups
        .groups
        .iter()
        .filter(|g| g.name == RESOURCE_GROUP)
        .flat_map(|g| g.versions.iter().map(|v| v.group_version.clone()))
        .collect();
    newest_known(&served).ok_or_else(|| Error::Api {
        action: "discovering resource.k8s.io".to_owned(),
        code: None,
        message: format!(
            "the API server serves none of {} (it serves {served:?}); DRA needs Kubernetes 1.32 or later",
            ApiVersion::ALL.map(ApiVersion::as_str).join(", ")
        ),
    })
}

/// The first of [`ApiVersion::ALL`] (newest first) among the served group versions.
fn newest_known(served: &[String]) -> Option<ApiVersion> {
    ApiVersion::ALL
        .into_iter()
        .find(|v| served.iter().any(|s| s == v.as_str()))
}

/// The dynamic API resource of a resource.k8s.io kind in `version`.
pub fn resource(version: ApiVersion, kind: ResourceKind) -> ApiResource {
    let group_version = version.as_str();
    let short = group_version
        .strip_prefix("resource.k8s.io/")
        .unwrap_or(group_version);
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(RESOURCE_GROUP, short, kind.kind),
        kind.plural,
    )
}

/// `object`'s JSON, ready to decode as a `kind` of `version`: an answer without type
/// information (list items, and some gets, come without it) is the kind and version asked for.
/// `action` names the call for the error.
pub fn typed_json(
    object: &impl Serialize,
    version: ApiVersion,
    kind: ResourceKind,
    action: &str,
) -> Result<Value> {
    let mut value = serde_json::to_value(object).map_err(|e| Error::Api {
        action: action.to_owned(),
        code: None,
        message: format!("cannot re-encode the answer: {e}"),
    })?;
    if let Some(map) = value.as_object_mut() {
        map.entry("apiVersion")
            .or_insert_with(|| version.as_str().into());
        map.entry("kind").or_insert_with(|| kind.kind.into());
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resources_name_the_group_version() {
        let r = resource(ApiVersion::V1beta2, tessera_driver::names::RESOURCE_CLAIM);
        assert_eq!(r.api_version, "resource.k8s.io/v1beta2");
        assert_eq!(r.version, "v1beta2");
        assert_eq!(r.plural, "resourceclaims");
    }

    #[test]
    fn the_newest_served_version_wins_and_unknown_ones_are_ignored() {
        let served = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        assert_eq!(
            newest_known(&served(&[
                "resource.k8s.io/v1beta1",
                "resource.k8s.io/v1beta2"
            ])),
            Some(ApiVersion::V1beta2)
        );
        assert_eq!(
            newest_known(&served(&["resource.k8s.io/v1", "resource.k8s.io/v1beta1"])),
            Some(ApiVersion::V1)
        );
        assert_eq!(newest_known(&served(&["resource.k8s.io/v1alpha3"])), None);
    }
}
