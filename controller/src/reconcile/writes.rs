//! The writes (and the few reads) the reconcile loop sends to the API server, behind one small
//! trait so the loop can be tested without an HTTP server. [`crate::writer::Writer`] is the real
//! one; the tests' `FakeWrites` keeps objects in memory and records every call.

use std::future::Future;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1 as res;
use k8s_openapi::jiff::Timestamp;

use crate::error::Result;
use crate::writer::Eviction;

/// What the reconcile loop asks of the API server; every write carries the object's
/// resourceVersion as a precondition and answers the object as stored after it.
pub trait Writes: Send + Sync {
    /// The claim as stored now, or `None` when it is gone.
    fn get_claim(
        &self,
        namespace: &str,
        name: &str,
    ) -> impl Future<Output = Result<Option<res::ResourceClaim>>> + Send;

    /// Adds the delete-protection finalizer and the allocated-by annotation naming `pod`.
    fn mark_claim(
        &self,
        claim: &res::ResourceClaim,
        pod: &str,
    ) -> impl Future<Output = Result<res::ResourceClaim>> + Send;

    /// Writes `allocation` into the claim's status; with `reserve_for` (the fast path), also
    /// `reservedFor` naming that pod, in the same write.
    fn write_allocation(
        &self,
        claim: &res::ResourceClaim,
        allocation: &res::AllocationResult,
        reserve_for: Option<&Pod>,
    ) -> impl Future<Output = Result<res::ResourceClaim>> + Send;

    /// Clears the claim's allocation, and `reservedFor` with it when the claim in hand has
    /// one (only ever the controller's own reservation: the caller checks).
    fn clear_allocation(
        &self,
        claim: &res::ResourceClaim,
    ) -> impl Future<Output = Result<res::ResourceClaim>> + Send;

    /// Removes the allocated-by annotation, and the finalizer when nothing is allocated or
    /// reserved any more.
    fn unmark_claim(
        &self,
        claim: &res::ResourceClaim,
    ) -> impl Future<Output = Result<res::ResourceClaim>> + Send;

    /// The pod as stored now, or `None` when it is gone.
    fn get_pod(
        &self,
        namespace: &str,
        name: &str,
    ) -> impl Future<Output = Result<Option<Pod>>> + Send;

    /// Removes Tessera's scheduling gate (other gates stay).
    fn ungate(&self, pod: &Pod) -> impl Future<Output = Result<Pod>> + Send;

    /// Sets the controller's condition on the pod.
    fn set_condition(
        &self,
        pod: &Pod,
        allocated: bool,
        reason: &str,
        message: &str,
        now: Timestamp,
    ) -> impl Future<Output = Result<Pod>> + Send;

    /// Asks the API server to evict the pod (policy/v1 Eviction, so `PodDisruptionBudgets` are
    /// respected), or with `dry_run` only whether it would.
    fn evict(&self, pod: &Pod, dry_run: bool) -> impl Future<Output = Result<Eviction>> + Send;

    /// Records an Event about the pod.
    fn event(
        &self,
        pod: &Pod,
        warning: bool,
        reason: &str,
        message: &str,
        now: Timestamp,
    ) -> impl Future<Output = Result<()>> + Send;
}

impl Writes for crate::writer::Writer {
    async fn get_claim(&self, namespace: &str, name: &str) -> Result<Option<res::ResourceClaim>> {
        Self::get_claim(self, namespace, name).await
    }
    async fn mark_claim(
        &self,
        claim: &res::ResourceClaim,
        pod: &str,
    ) -> Result<res::ResourceClaim> {
        Self::mark_claim(self, claim, pod).await
    }
    async fn write_allocation(
        &self,
        claim: &res::ResourceClaim,
        allocation: &res::AllocationResult,
        reserve_for: Option<&Pod>,
    ) -> Result<res::ResourceClaim> {
        Self::write_allocation(self, claim, allocation, reserve_for).await
    }
    async fn clear_allocation(&self, claim: &res::ResourceClaim) -> Result<res::ResourceClaim> {
        Self::clear_allocation(self, claim).await
    }
    async fn unmark_claim(&self, claim: &res::ResourceClaim) -> Result<res::ResourceClaim> {
        Self::unmark_claim(self, claim).await
    }
    async fn get_pod(&self, namespace: &str, name: &str) -> Result<Option<Pod>> {
        Self::get_pod(self, namespace, name).await
    }
    async fn ungate(&self, pod: &Pod) -> Result<Pod> {
        Self::ungate(self, pod).await
    }
    async fn set_condition(
        &self,
        pod: &Pod,
        allocated: bool,
        reason: &str,
        message: &str,
        now: Timestamp,
    ) -> Result<Pod> {
        Self::set_condition(self, pod, allocated, reason, message, now).await
    }
    async fn evict(&self, pod: &Pod, dry_run: bool) -> Result<Eviction> {
        Self::evict(self, pod, dry_run).await
    }
    async fn event(
        &self,
        pod: &Pod,
        warning: bool,
        reason: &str,
        message: &str,
        now: Timestamp,
    ) -> Result<()> {
        Self::event(self, pod, warning, reason, message, now).await
    }
}
