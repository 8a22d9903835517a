//! Leader election on a coordination.k8s.io/v1 Lease: only the leader writes.
//!
//! Every `retry_period` the candidate reads the Lease and lets `tessera_driver::placement::lease::decide`
//! say whether to take it, renew it or wait; writes carry the resourceVersion read, so two
//! candidates never both win. A leader that has not renewed for `renew_deadline` (shorter than
//! the lease duration) stops leading before anyone else may take over, so two replicas never
//! write at once.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, PostParams};
use tessera_driver::placement::lease::{LeaseAction, decide};
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::error::{Error, Result};

/// How the election runs.
#[derive(Debug, Clone)]
pub struct LeaderConfig {
    /// Namespace of the Lease.
    pub namespace: String,
    /// Name of the Lease.
    pub name: String,
    /// This replica's identity (its pod name).
    pub identity: String,
    /// How long a Lease holds without renewal.
    pub lease_duration: Duration,
    /// How long a leader keeps leading without a successful renewal.
    pub renew_deadline: Duration,
    /// How often to try to take or renew the Lease.
    pub retry_period: Duration,
}

impl LeaderConfig {
    /// Checks the durations are consistent: renew deadline below the lease duration, retry
    /// period below the renew deadline.
    pub fn validate(&self) -> Result<()> {
        if self.renew_deadline >= self.lease_duration {
            return Err(Error::Config(format!(
                "--leader-election-renew-deadline ({:?}) must be shorter than --leader-election-lease-duration ({:?})",
                self.renew_deadline, self.lease_duration
            )));
        }
        if self.retry_period >= self.renew_deadline || self.retry_period.is_zero() {
            return Err(Error::Config(format!(
                "--leader-election-retry-period ({:?}) must be above zero and shorter than --leader-election-renew-deadline ({:?})",
                self.retry_period, self.renew_deadline
            )));
        }
        if self.identity.is_empty() {
            return Err(Error::Config(
                "--leader-election-id must not be empty".to_owned(),
            ));
        }
        Ok(())
    }
}

/// One attempt: `Ok(true)` when we hold the Lease afterwards.
async fn attempt(api: &Api<Lease>, config: &LeaderConfig) -> Result<bool> {
    let existing = api
        .get_opt(&config.name)
        .await
        .map_err(|e| Error::api(format!("reading Lease {}", config.name), &e))?;
    let duration = SignedDuration::try_from(config.lease_duration).unwrap_or(SignedDuration::MAX);
    let action = decide(
        existing.as_ref().and_then(|l| l.spec.as_ref()),
        &config.identity,
        Timestamp::now(),
        duration,
    );
    let spec = match action {
        LeaseAction::Wait { holder, until } => {
            debug!(%holder, %until, "another replica leads");
            return Ok(false);
        }
        LeaseAction::Write(spec) => spec,
    };
    let answer = if let Some(mut lease) = existing {
        lease.spec = Some(spec);
        api.replace(&config.name, &PostParams::default(), &lease)
            .await
    } else {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(config.name.clone()),
                namespace: Some(config.namespace.clone()),
                ..ObjectMeta::default()
            },
            spec: Some(spec),
        };
        api.create(&PostParams::default(), &lease).await
    };
    match answer {
        Ok(_) => Ok(true),
        // Someone else wrote first: they won this round.
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
        Err(e) => Err(Error::api(format!("writing Lease {}", config.name), &e)),
    }
}

/// Runs the election forever, publishing whether this replica leads on `leading`.
pub async fn run(client: kube::Client, config: LeaderConfig, leading: watch::Sender<bool>) {
    let api: Api<Lease> = Api::namespaced(client, &config.namespace);
    let mut last_renewal: Option<Instant> = None;
    loop {
        match attempt(&api, &config).await {
            Ok(true) => {
                last_renewal = Some(Instant::now());
                if !*leading.borrow() {
                    info!(identity = %config.identity, lease = %config.name, "became the leader");
                }
                leading.send_replace(true);
            }
            Ok(false) => {
                if *leading.borrow() {
                    warn!(identity = %config.identity, "lost the Lease to another replica");
                }
                last_renewal = None;
                leading.send_replace(false);
            }
            Err(e) => {
                warn!(error = %e, "leader election attempt failed");
                if last_renewal.is_none_or(|t| t.elapsed() >= config.renew_deadline) {
                    if *leading.borrow() {
                        warn!(identity = %config.identity, "could not renew the Lease in time; stopping all writes");
                    }
                    leading.send_replace(false);
                }
            }
        }
        tokio::time::sleep(config.retry_period).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(lease: u64, renew: u64, retry: u64) -> LeaderConfig {
        LeaderConfig {
            namespace: "kube-system".into(),
            name: "tessera-controller".into(),
            identity: "a".into(),
            lease_duration: Duration::from_secs(lease),
            renew_deadline: Duration::from_secs(renew),
            retry_period: Duration::from_secs(retry),
        }
    }

    #[test]
    fn durations_must_nest() {
        assert!(config(15, 10, 2).validate().is_ok());
        assert!(config(10, 10, 2).validate().is_err());
        assert!(config(15, 10, 10).validate().is_err());
        assert!(config(15, 10, 0).validate().is_err());
    }
}
