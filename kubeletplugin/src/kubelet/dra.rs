//! The DRA node service, v1 and v1beta1: a thin translation onto [`ClaimPreparer`].
//!
//! Kubelet sends a batch of claims; the preparer takes them together (one checkpoint write per
//! step for the whole call) and each claim's outcome goes into the answer's map under its UID.
//! A claim's failure is that claim's `error`, never a failed call (which would make kubelet
//! discard the whole batch), with every character `tessera_kubeapi::text::is_hidden` names
//! escaped (kubelet puts it in the pod's events). A UID sent twice is prepared once (the answer has one entry per
//! UID). When kubelet gives up on the call, the work stops at the next claim
//! ([`crate::claims::cancel`]). An answer must fit the 4 MiB a gRPC message may hold (kubelet reads no
//! more): past it, each claim's error is cut (to [`ERROR_BYTES`], then [`SHORT_ERROR_BYTES`]),
//! and an answer still too large fails the call with `RESOURCE_EXHAUSTED`, naming the size,
//! rather than reaching kubelet unreadable.

use std::collections::BTreeSet;
use std::sync::Arc;

use tracing::{Instrument as _, warn};

use crate::claims::ClaimRef;
use crate::claims::cancel::Cancel;
use crate::claims::preparer::{ClaimPreparer, KubeletDevice};

/// The largest gRPC message kubelet reads (grpc-go's default receive limit), and tonic's
/// default limit on a request the plugin reads.
pub const MAX_MESSAGE_BYTES: usize = 4 << 20;

/// What a claim's error is cut to when the whole answer would not fit [`MAX_MESSAGE_BYTES`].
pub const ERROR_BYTES: usize = 512;

/// What it is cut to when that is not enough either.
pub const SHORT_ERROR_BYTES: usize = 64;

/// The DRA service over a preparer; one value serves both API versions.
#[derive(Clone)]
pub struct DraService {
    preparer: Arc<dyn ClaimPreparer>,
}

type Outcome<T> = Vec<(String, Result<T, String>)>;

/// The claims with each UID once, first sending first.
fn distinct(claims: Vec<ClaimRef>) -> Vec<ClaimRef> {
    let mut seen = BTreeSet::new();
    claims
        .into_iter()
        .filter(|c| seen.insert(c.uid.clone()))
        .collect()
}

fn outcome<T>(
    work: &'static str,
    claims: Vec<ClaimRef>,
    results: Vec<crate::Result<T>>,
) -> Outcome<T> {
    claims
        .into_iter()
        .zip(results)
        .map(|(claim, result)| {
            let _span = claim.span(work).entered();
            let result = result.map_err(|e| {
                warn!(%claim, error = %e, retryable = e.is_retryable(), "claim failed");
                // kubelet shows it in the pod's events (`kubectl describe`): names, UIDs and
                // the API server's texts in it must not end a line, forge one or drive a
                // terminal there.
                tessera_kubeapi::text::escaped(&e.to_string())
            });
            (claim.uid, result)
        })
        .collect()
}

/// `error` cut to `limit` bytes (on a character boundary), saying so.
pub fn cut_error(error: &mut String, limit: usize) {
    if error.len() <= limit {
        return;
    }
    let mut end = limit;
    while !error.is_char_boundary(end) {
        end -= 1;
    }
    error.truncate(end);
    error.push_str(" … (cut to fit the answer; the plugin's log has it all)");
}

/// The answer, if it fits one gRPC message; while it does not, the claims' `errors` are cut
/// to a limit, first [`ERROR_BYTES`], then [`SHORT_ERROR_BYTES`].
fn fit<M: prost::Message>(
    mut answer: M,
    claims: usize,
    errors: impl Fn(&mut M) -> Vec<&mut String>,
) -> Result<tonic::Response<M>, tonic::Status> {
    for limit in [ERROR_BYTES, SHORT_ERROR_BYTES] {
        if answer.encoded_len() <= MAX_MESSAGE_BYTES {
            break;
        }
        for error in errors(&mut answer) {
            cut_error(error, limit);
        }
    }
    let size = answer.encoded_len();
    if size > MAX_MESSAGE_BYTES {
        warn!(
            claims,
            bytes = size,
            "answer too large for one gRPC message"
        );
        return Err(tonic::Status::resource_exhausted(format!(
            "the answer for {claims} claims would be {size} bytes, more than the {} MiB one gRPC \
             message may hold; send fewer claims per call",
            MAX_MESSAGE_BYTES >> 20
        )));
    }
    Ok(tonic::Response::new(answer))
}

impl DraService {
    /// The service over `preparer`.
    pub fn new(preparer: Arc<dyn ClaimPreparer>) -> Self {
        Self { preparer }
    }

    /// Prepares every claim; one outcome per distinct UID, in request order. Dropping the
    /// future cancels the claims not done yet.
    pub async fn prepare(&self, claims: Vec<ClaimRef>) -> Outcome<Vec<KubeletDevice>> {
        self.call("prepare", claims, ClaimPreparer::prepare_all)
            .await
    }

    /// Unprepares every claim; one outcome per distinct UID, in request order. Dropping the
    /// future cancels the claims not done yet.
    pub async fn unprepare(&self, claims: Vec<ClaimRef>) -> Outcome<()> {
        self.call("unprepare", claims, ClaimPreparer::unprepare_all)
            .await
    }

    /// One call of `work` for the distinct claims, cancelled if the future is dropped.
    async fn call<T, F>(
        &self,
        name: &'static str,
        claims: Vec<ClaimRef>,
        work: impl FnOnce(Arc<dyn ClaimPreparer>, Vec<ClaimRef>, Cancel) -> F,
    ) -> Outcome<T>
    where
        F: Future<Output = Vec<crate::Result<T>>>,
    {
        let claims = distinct(claims);
        let span = tracing::info_span!("kubelet_call", call = name, claims = claims.len());
        let cancel = Cancel::new();
        let guard = cancel.on_drop();
        let results = work(Arc::clone(&self.preparer), claims.clone(), cancel)
            .instrument(span.clone())
            .await;
        guard.finish();
        span.in_scope(|| outcome(name, claims, results))
    }
}

/// Implements one API version's `DRAPlugin` trait on [`DraService`]; the versions' messages
/// are the same but distinct types, except that a version's `Device` may carry the `shareID`
/// (then named as the second argument, its field).
macro_rules! dra_version {
    ($pb:path $(, $share_id:ident)?) => {
        use $pb as pb;

        /// A prepared device as the answer carries it.
        fn device(d: KubeletDevice) -> pb::Device {
            pb::Device {
                request_names: d.requests,
                pool_name: d.pool,
                device_name: d.device,
                cdi_device_ids: d.cdi_ids,
                $($share_id: d.share_id,)?
            }
        }

        /// The claims of a request.
        fn claim_refs(claims: Vec<pb::Claim>) -> Vec<ClaimRef> {
            claims
                .into_iter()
                .map(|c| ClaimRef::new(c.namespace, c.name, c.uid))
                .collect()
        }

        #[tonic::async_trait]
        impl pb::dra_plugin_server::DraPlugin for DraService {
            async fn node_prepare_resources(
                &self,
                request: tonic::Request<pb::NodePrepareResourcesRequest>,
            ) -> Result<tonic::Response<pb::NodePrepareResourcesResponse>, tonic::Status> {
                let outcomes = self.prepare(claim_refs(request.into_inner().claims)).await;
                let count = outcomes.len();
                let claims = outcomes
                    .into_iter()
                    .map(|(uid, result)| {
                        let answer = match result {
                            Ok(devices) => pb::NodePrepareResourceResponse {
                                devices: devices.into_iter().map(device).collect(),
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
                fit(
                    pb::NodePrepareResourcesResponse { claims },
                    count,
                    |answer| answer.claims.values_mut().map(|c| &mut c.error).collect(),
                )
            }

            async fn node_unprepare_resources(
                &self,
                request: tonic::Request<pb::NodeUnprepareResourcesRequest>,
            ) -> Result<tonic::Response<pb::NodeUnprepareResourcesResponse>, tonic::Status> {
                let outcomes = self
                    .unprepare(claim_refs(request.into_inner().claims))
                    .await;
                let count = outcomes.len();
                let claims = outcomes
                    .into_iter()
                    .map(|(uid, result)| {
                        let error = result.err().unwrap_or_default();
                        (uid, pb::NodeUnprepareResourceResponse { error })
                    })
                    .collect();
                fit(
                    pb::NodeUnprepareResourcesResponse { claims },
                    count,
                    |answer| answer.claims.values_mut().map(|c| &mut c.error).collect(),
                )
            }
        }
    };
}

mod v1 {
    use super::{ClaimRef, DraService, KubeletDevice, fit};

    // v1 answers carry the device's `shareID` (Kubernetes 1.34+).
    dra_version!(tessera_proto::dra::v1, share_id);
}

mod v1beta1 {
    use super::{ClaimRef, DraService, KubeletDevice, fit};

    // v1beta1 has no `shareID`.
    dra_version!(tessera_proto::dra::v1beta1);
}
