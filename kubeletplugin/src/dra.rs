//! The DRA node service, v1 and v1beta1: a thin translation onto [`ClaimPreparer`].
//!
//! Kubelet sends a batch of claims; each is prepared in its own task, concurrently (the
//! preparer fetches on the runtime and writes on a blocking worker), and its outcome goes into
//! the answer's map under its UID. A claim's failure is that claim's
//! `error`, never a failed call (which would make kubelet discard the whole batch).

use std::sync::Arc;

use tokio::task::JoinSet;
use tracing::warn;

use crate::claims::ClaimRef;
use crate::error::Error;
use crate::preparer::{ClaimPreparer, KubeletDevice};

/// The DRA service over a preparer; one value serves both API versions.
#[derive(Clone)]
pub struct DraService {
    preparer: Arc<dyn ClaimPreparer>,
}

type Outcome<T> = Vec<(String, Result<T, String>)>;

impl DraService {
    /// The service over `preparer`.
    pub fn new(preparer: Arc<dyn ClaimPreparer>) -> Self {
        Self { preparer }
    }

    async fn each<T, F, Fut>(&self, claims: Vec<ClaimRef>, call: F) -> Outcome<T>
    where
        T: Send + 'static,
        F: Fn(Arc<dyn ClaimPreparer>, ClaimRef) -> Fut,
        Fut: std::future::Future<Output = crate::Result<T>> + Send + 'static,
    {
        let mut set = JoinSet::new();
        for (i, claim) in claims.into_iter().enumerate() {
            let uid = claim.uid.clone();
            let label = claim.to_string();
            let work = call(Arc::clone(&self.preparer), claim);
            set.spawn(async move {
                let result = work.await.map_err(|e| {
                    warn!(claim = %label, error = %e, retryable = e.is_retryable(), "claim failed");
                    e.to_string()
                });
                (i, uid, result)
            });
        }
        let mut out = Vec::new();
        while let Some(joined) = set.join_next().await {
            match joined {
                Ok(item) => out.push(item),
                Err(e) => warn!(error = %Error::Task(e.to_string()), "claim worker failed"),
            }
        }
        out.sort_by_key(|(i, _, _)| *i);
        out.into_iter().map(|(_, uid, r)| (uid, r)).collect()
    }

    /// Prepares every claim; one outcome per claim, in request order.
    pub async fn prepare(&self, claims: Vec<ClaimRef>) -> Outcome<Vec<KubeletDevice>> {
        self.each(claims, ClaimPreparer::prepare).await
    }

    /// Unprepares every claim; one outcome per claim, in request order.
    pub async fn unprepare(&self, claims: Vec<ClaimRef>) -> Outcome<()> {
        self.each(claims, ClaimPreparer::unprepare).await
    }
}

/// Implements one API version's `DRAPlugin` trait on [`DraService`]; the versions' messages
/// are identical but distinct types.
macro_rules! dra_version {
    ($pb:path, $device:ident) => {
        use $pb as pb;
        #[tonic::async_trait]
        impl pb::dra_plugin_server::DraPlugin for DraService {
            async fn node_prepare_resources(
                &self,
                request: tonic::Request<pb::NodePrepareResourcesRequest>,
            ) -> Result<tonic::Response<pb::NodePrepareResourcesResponse>, tonic::Status> {
                let claims = request
                    .into_inner()
                    .claims
                    .into_iter()
                    .map(|c| ClaimRef::new(c.namespace, c.name, c.uid))
                    .collect();
                let claims = self
                    .prepare(claims)
                    .await
                    .into_iter()
                    .map(|(uid, result)| {
                        let answer = match result {
                            Ok(devices) => pb::NodePrepareResourceResponse {
                                devices: devices.into_iter().map($device).collect(),
                                error: String::new(),
                            },
                            Err(error) => pb::NodePrepareResourceResponse {
                                devices: Vec::new(),
                                error,
                            },
                        };
                        (uid, answer)
                    })
                    .collect();
                Ok(tonic::Response::new(pb::NodePrepareResourcesResponse {
                    claims,
                }))
            }

            async fn node_unprepare_resources(
                &self,
                request: tonic::Request<pb::NodeUnprepareResourcesRequest>,
            ) -> Result<tonic::Response<pb::NodeUnprepareResourcesResponse>, tonic::Status> {
                let claims = request
                    .into_inner()
                    .claims
                    .into_iter()
                    .map(|c| ClaimRef::new(c.namespace, c.name, c.uid))
                    .collect();
                let claims = self
                    .unprepare(claims)
                    .await
                    .into_iter()
                    .map(|(uid, result)| {
                        let error = result.err().unwrap_or_default();
                        (uid, pb::NodeUnprepareResourceResponse { error })
                    })
                    .collect();
                Ok(tonic::Response::new(pb::NodeUnprepareResourcesResponse {
                    claims,
                }))
            }
        }
    };
}

mod v1 {
    use super::{ClaimRef, DraService, KubeletDevice};

    /// v1 answers carry the device's `shareID` (Kubernetes 1.34+).
    fn device(d: KubeletDevice) -> pb::Device {
        pb::Device {
            request_names: d.requests,
            pool_name: d.pool,
            device_name: d.device,
            cdi_device_ids: d.cdi_ids,
            share_id: d.share_id,
        }
    }

    dra_version!(tessera_proto::dra::v1, device);
}

mod v1beta1 {
    use super::{ClaimRef, DraService, KubeletDevice};

    /// v1beta1 has no `shareID`.
    fn device(d: KubeletDevice) -> pb::Device {
        pb::Device {
            request_names: d.requests,
            pool_name: d.pool,
            device_name: d.device,
            cdi_device_ids: d.cdi_ids,
        }
    }

    dra_version!(tessera_proto::dra::v1beta1, device);
}
