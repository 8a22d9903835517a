//! The admission webhook's pure decisions, which sit on the API server's request path:
//! checking a share claim (CEL selector, `GpuShare` config, share rules) and deciding the gate of
//! a pod with four claims. Run: `cargo bench -p tessera-driver --bench admission`.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::resource::v1 as res;
use serde_json::json;
use tessera_driver::admission::{ClaimSource, PodClaim, decide_gate, review_claim_spec};
use tessera_driver::names;
use tessera_driver::rules::cel::CelCache;

fn share_spec() -> res::ResourceClaimSpec {
    serde_json::from_value(json!({"devices": {
        "requests": [{"name": "gpu", "exactly": {
            "deviceClassName": names::CLASS_SHARED_GPU,
            "count": 2,
            "selectors": [{"cel": {"expression":
                "device.attributes[\"gpu.tessera.dev\"].model in [\"a100-80g\", \"h100-80g\"]"}}],
        }}],
        "config": [{"requests": ["gpu"], "opaque": {"driver": names::DEFAULT_DRIVER_NAME, "parameters":
            {"apiVersion": names::CONFIG_API_VERSION, "kind": "GpuShare", "memory": "16Gi", "compute": 50}}}],
    }}))
    .expect("a valid claim spec")
}

fn bench(c: &mut Criterion) {
    let spec = share_spec();
    let cel = CelCache::new();
    c.bench_function("admission: validate a share claim (warm CEL cache)", |b| {
        b.iter(|| {
            let errors = review_claim_spec(
                "ResourceClaim default/share",
                black_box(&spec),
                "",
                names::DEFAULT_DRIVER_NAME,
                &[],
                &cel,
            );
            assert!(errors.is_empty());
        });
    });
    c.bench_function("admission: validate a share claim (cold CEL cache)", |b| {
        b.iter(|| {
            let cold = CelCache::new();
            review_claim_spec(
                "ResourceClaim default/share",
                black_box(&spec),
                "",
                names::DEFAULT_DRIVER_NAME,
                &[],
                &cold,
            )
        });
    });
    let pod: core::Pod = serde_json::from_value(json!({
        "metadata": {"name": "p", "namespace": "default"},
        "spec": {"containers": [{"name": "c", "image": "i"}]},
    }))
    .expect("a valid pod");
    let claims: Vec<PodClaim> = [
        names::CLASS_GPU,
        names::CLASS_GPU,
        "other.example.com",
        names::CLASS_SHARED_GPU,
    ]
    .iter()
    .enumerate()
    .map(|(i, class)| {
        let mut spec = share_spec();
        if let Some(r) = spec
            .devices
            .as_mut()
            .and_then(|d| d.requests.as_mut())
            .and_then(|r| r.first_mut())
            .and_then(|r| r.exactly.as_mut())
        {
            (*class).clone_into(&mut r.device_class_name);
        }
        PodClaim {
            name: format!("c{i}"),
            reference: format!("ResourceClaim c{i}"),
            source: ClaimSource::Claim(spec),
        }
    })
    .collect();
    c.bench_function("admission: gate decision for a pod with 4 claims", |b| {
        b.iter(|| decide_gate(black_box(&pod), black_box(&claims), &mut |_| Ok(None)));
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
