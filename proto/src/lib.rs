//! The kubelet gRPC APIs that the Tessera kubelet plugin speaks, generated at build time from
//! the `.proto` files in `proto/` (each file names the Kubernetes releases it matches).
//!
//! Generated code is exempt from the workspace's documentation and pedantic lints: its shape
//! comes from the wire contract, not from us.

/// Kubelet plugin registration (`pluginregistration.Registration`).
pub mod pluginregistration {
    /// Version 1 of the registration API (upstream's proto package has no version suffix).
    #[allow(missing_docs, unreachable_pub, clippy::pedantic)]
    pub mod v1 {
        include!(concat!(env!("OUT_DIR"), "/pluginregistration.rs"));
    }
}

/// The DRA node API (`DRAPlugin`: prepare and unprepare claims).
pub mod dra {
    /// `k8s.io.kubelet.pkg.apis.dra.v1`, served to kubelets of Kubernetes 1.34 and later.
    #[allow(missing_docs, unreachable_pub, clippy::pedantic)]
    pub mod v1 {
        include!(concat!(
            env!("OUT_DIR"),
            "/k8s.io.kubelet.pkg.apis.dra.v1.rs"
        ));
    }

    /// `k8s.io.kubelet.pkg.apis.dra.v1beta1`, served to kubelets of Kubernetes 1.32 and 1.33.
    #[allow(missing_docs, unreachable_pub, clippy::pedantic)]
    pub mod v1beta1 {
        include!(concat!(
            env!("OUT_DIR"),
            "/k8s.io.kubelet.pkg.apis.dra.v1beta1.rs"
        ));
    }
}

/// The DRA resource health API (`v1alpha1.DRAResourceHealth`).
pub mod health {
    /// Version v1alpha1 (proto package `v1alpha1`).
    #[allow(missing_docs, unreachable_pub, clippy::pedantic)]
    pub mod v1alpha1 {
        include!(concat!(env!("OUT_DIR"), "/v1alpha1.rs"));
    }
}
