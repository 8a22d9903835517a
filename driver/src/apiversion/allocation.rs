//! Writing a claim's `status.allocation` in the API version of the claim it goes into.
//!
//! An `AllocationResult` has the same fields in v1, v1beta2 and v1beta1 (the versions differ in
//! the claim's requests and in slices' devices, not in the result), so the v1 result is written
//! as is and checked by a round trip through the target version's type: a field that version
//! cannot carry is an error naming it, never dropped silently.

use k8s_openapi::api::resource::{v1, v1beta1, v1beta2};
use serde_json::Value;

use super::{ApiVersion, first_difference, round_trip};
use crate::error::{Error, Result};

/// `allocation` as the `status.allocation` of a `version` claim; `object` names the claim in
/// errors.
pub fn encode_allocation(
    allocation: &v1::AllocationResult,
    version: ApiVersion,
    object: &str,
) -> Result<Value> {
    let field = "status.allocation";
    let value = serde_json::to_value(allocation)
        .map_err(|e| Error::invalid(object, field, format!("cannot serialize: {e}")))?;
    let kept = match version {
        ApiVersion::V1 => return Ok(value),
        ApiVersion::V1beta2 => round_trip::<v1beta2::AllocationResult>(&value),
        ApiVersion::V1beta1 => round_trip::<v1beta1::AllocationResult>(&value),
    }
    .map_err(|m| Error::invalid(object, field, m))?;
    match first_difference(&value, &kept, String::new()) {
        None => Ok(value),
        Some(path) => Err(Error::invalid(
            object,
            format!("{field}.{path}"),
            format!("{version} cannot carry this field"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allocation() -> v1::AllocationResult {
        serde_json::from_value(serde_json::json!({
            "devices": {"results": [{
                "request": "gpu", "driver": "gpu.tessera.dev", "pool": "node-1", "device": "gpu-0",
                "shareID": "5e3e4a3c-0000-4000-8000-000000000001",
                "consumedCapacity": {"memory": "10Gi"},
            }]},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": ["node-1"]}]}]},
        }))
        .unwrap()
    }

    #[test]
    fn every_served_version_carries_a_share_result_unchanged() {
        let v1 = encode_allocation(&allocation(), ApiVersion::V1, "c").unwrap();
        for version in [ApiVersion::V1beta2, ApiVersion::V1beta1] {
            assert_eq!(
                encode_allocation(&allocation(), version, "c").unwrap(),
                v1,
                "{version}"
            );
        }
    }
}
