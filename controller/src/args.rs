//! The `tessera-controller` command line, and the process around the service: logs, signals,
//! the async runtime.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use tessera_driver::names;
use tessera_driver::placement::allocator::Policy;
use tokio::sync::watch;

use crate::leader::LeaderConfig;
use crate::service::{self, ControllerConfig};
use crate::webhook::{self, ApiAdmissionLookup, WebhookConfig};
use tessera_driver::admission::device_plugin_names;

/// Log line format (the one setting of every Tessera binary).
pub use tessera_kubeapi::logs::LogFormat;

/// Tessera's controller: allocates the claims of pods gated with `gpu.tessera.dev/allocation`.
#[derive(Debug, Clone, Parser)]
#[command(name = "tessera-controller", version)]
pub struct Args {
    /// Kubeconfig file; without it the pod's service account is used.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Placement policy (every policy but first-fit prefers one NVLink island, then one NUMA
    /// node, for multi-GPU requests).
    #[arg(long, env = "TESSERA_POLICY", default_value_t)]
    pub policy: Policy,
    /// The DRA driver name Tessera's GPUs are published under.
    #[arg(long, env = "TESSERA_DRIVER_NAME", default_value = names::DEFAULT_DRIVER_NAME)]
    pub driver_name: String,
    /// Where to serve /metrics, /healthz and /readyz.
    #[arg(long, env = "TESSERA_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    pub metrics_addr: SocketAddr,
    /// Where the admission webhook listens (HTTPS), e.g. `0.0.0.0:9443`; not served without it.
    #[arg(long, env = "TESSERA_WEBHOOK_ADDR", requires = "webhook_cert_dir")]
    pub webhook_addr: Option<SocketAddr>,
    /// Folder holding the webhook's tls.crt and tls.key (a mounted Secret; reloaded when it
    /// changes).
    #[arg(long, env = "TESSERA_WEBHOOK_CERT_DIR")]
    pub webhook_cert_dir: Option<PathBuf>,
    /// Elect a leader among replicas on a Lease (turn off only with a single replica).
    #[arg(long, env = "TESSERA_LEADER_ELECT", default_value_t = true, action = clap::ArgAction::Set)]
    pub leader_elect: bool,
    /// Namespace of the leader Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "kube-system")]
    pub leader_election_namespace: String,
    /// Name of the leader Lease.
    #[arg(long, env = "TESSERA_LEADER_ELECTION_LEASE", default_value = names::LEADER_LEASE)]
    pub leader_election_lease: String,
    /// This replica's identity in the Lease (default: the host name).
    #[arg(long, env = "POD_NAME")]
    pub leader_election_id: Option<String>,
    /// Seconds a Lease holds without renewal.
    #[arg(
        long,
        env = "TESSERA_LEADER_ELECTION_LEASE_DURATION",
        default_value_t = 15
    )]
    pub leader_election_lease_duration: u64,
    /// Seconds a leader keeps writing without renewing the Lease.
    #[arg(
        long,
        env = "TESSERA_LEADER_ELECTION_RENEW_DEADLINE",
        default_value_t = 10
    )]
    pub leader_election_renew_deadline: u64,
    /// Seconds between attempts to take or renew the Lease.
    #[arg(
        long,
        env = "TESSERA_LEADER_ELECTION_RETRY_PERIOD",
        default_value_t = 2
    )]
    pub leader_election_retry_period: u64,
    /// Seconds after which an allocation whose pod has not bound is reported (Event, metric).
    #[arg(long, env = "TESSERA_UNBOUND_AFTER_SECONDS", default_value_t = 300)]
    pub unbound_after_seconds: u64,
    /// For pods whose every placement constraint the controller evaluates itself, write each
    /// claim's allocation with `reservedFor` naming the pod in the same status write, so
    /// kube-scheduler only binds the pod. `--fast-path=false` leaves the reservation to
    /// kube-scheduler for every pod.
    #[arg(long, env = "TESSERA_FAST_PATH", default_value_t = true, action = clap::ArgAction::Set)]
    pub fast_path: bool,
    /// Seconds between full retries of pods that could not be placed.
    #[arg(long, env = "TESSERA_RESYNC_SECONDS", default_value_t = 60)]
    pub resync_seconds: u64,
    /// Time-sliced replicas per GPU: a pod's `nvidia.com/gpu.shared: N` becomes N shares of
    /// 1/R of a card each (1..=100; as the device plugin's time-slicing `replicas`).
    #[arg(long, env = "TESSERA_SHARED_GPU_REPLICAS", default_value_t = device_plugin_names::DEFAULT_SHARED_REPLICAS,
          value_parser = clap::value_parser!(u32).range(1..=100))]
    pub shared_gpu_replicas: u32,
    /// Let an online pod that fits nowhere evict batch pods (through the Eviction API, so
    /// `PodDisruptionBudgets` are respected); off by default. See docs/controller.md.
    #[arg(long, env = "TESSERA_PREEMPTION", default_value_t = false)]
    pub preemption: bool,
    /// Let a pod that fits nowhere for lack of contiguous room have at most this many batch
    /// pods per hour moved out of its way (evicted through the Eviction API, so
    /// `PodDisruptionBudgets` are respected; only pods a controller re-creates); 0, the default,
    /// turns defragmentation off. See docs/controller.md.
    #[arg(long, env = "TESSERA_DEFRAG_EVICTIONS_PER_HOUR", default_value_t = 0)]
    pub defrag_evictions_per_hour: u32,
    /// Log line format.
    #[arg(long, env = "TESSERA_LOG_FORMAT", value_enum, default_value = "plain")]
    pub log_format: LogFormat,
}

/// Installs the process's log subscriber on stdout: plain lines escaped as the plugin's are,
/// colour only on a terminal ([`tessera_kubeapi::logs`]).
fn init_logs(format: LogFormat) {
    tessera_kubeapi::logs::init(format, tessera_kubeapi::logs::Stream::Stdout);
}

fn host_name() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|h| h.trim().to_owned())
        })
        .unwrap_or_else(|| names::CONTROLLER_COMPONENT.to_owned())
}

impl Args {
    /// Parses the command line and runs the controller until SIGTERM or Ctrl-C.
    pub fn parse_and_run() -> anyhow::Result<()> {
        let args = Self::parse();
        init_logs(args.log_format);
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .context("starting the async runtime")?
            // The stop signal is watched before anything serves (tessera_kubeapi::signals).
            .block_on(async { args.run(tessera_kubeapi::signals::shutdown()).await })
    }

    /// The service configuration these flags describe.
    pub fn config(&self) -> ControllerConfig {
        let leader = self.leader_elect.then(|| LeaderConfig {
            namespace: self.leader_election_namespace.clone(),
            name: self.leader_election_lease.clone(),
            identity: self.leader_election_id.clone().unwrap_or_else(host_name),
            lease_duration: Duration::from_secs(self.leader_election_lease_duration),
            renew_deadline: Duration::from_secs(self.leader_election_renew_deadline),
            retry_period: Duration::from_secs(self.leader_election_retry_period),
        });
        ControllerConfig {
            driver_name: self.driver_name.clone(),
            policy: self.policy,
            unbound_after: Duration::from_secs(self.unbound_after_seconds),
            resync: Duration::from_secs(self.resync_seconds.max(1)),
            leader,
            metrics_addr: Some(self.metrics_addr),
            shared_replicas: self.shared_gpu_replicas,
            fast_path: self.fast_path,
            preemption: self.preemption,
            defrag_per_hour: self.defrag_evictions_per_hour,
        }
    }

    /// Runs the controller until `shutdown` completes.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
        let config = self.config();
        if let Some(leader) = &config.leader {
            leader.validate()?;
        }
        let client = tessera_kubeapi::client(self.kubeconfig.as_deref()).await?;
        let webhook = match (self.webhook_addr, self.webhook_cert_dir) {
            (Some(addr), Some(cert_dir)) => {
                let mut webhook_config = WebhookConfig::new(addr, cert_dir);
                webhook_config.driver_name.clone_from(&config.driver_name);
                webhook_config.shared_replicas = config.shared_replicas;
                let lookup = Arc::new(ApiAdmissionLookup::new(client.clone()).await?);
                Some(webhook::bind(webhook_config, lookup).await?)
            }
            _ => None,
        };
        // The webhook stops with the service: on the signal, or when the service fails (the
        // sender is dropped with the service's future).
        let (stop_tx, stop_rx) = watch::channel(false);
        let webhook_task = webhook.map(|w| {
            let mut stop = stop_rx.clone();
            tokio::spawn(w.run(async move {
                let _ = stop.wait_for(|stopped| *stopped).await;
            }))
        });
        let outcome = service::run(client, config, async move {
            shutdown.await;
            let _ = stop_tx.send(true);
        })
        .await;
        if let Some(task) = webhook_task {
            task.await.context("the webhook task")??;
        }
        outcome?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {

    use super::*;

    #[test]
    fn every_policy_the_allocator_knows_is_accepted() {
        for p in Policy::ALL {
            let args =
                Args::try_parse_from(["tessera-controller", "--policy", &p.to_string()]).unwrap();
            assert_eq!(args.policy, p);
        }
        let err =
            Args::try_parse_from(["tessera-controller", "--policy", "no-such-policy"]).unwrap_err();
        assert!(err.to_string().contains("unknown policy"), "{err}");
    }

    #[test]
    fn the_webhook_needs_its_certificate_folder() {
        let err = Args::try_parse_from(["tessera-controller", "--webhook-addr", "127.0.0.1:9443"])
            .unwrap_err();
        assert!(err.to_string().contains("--webhook-cert-dir"), "{err}");
        let args = Args::try_parse_from([
            "tessera-controller",
            "--webhook-addr",
            "127.0.0.1:9443",
            "--webhook-cert-dir",
            "/etc/tessera/webhook",
        ])
        .unwrap();
        assert_eq!(
            args.webhook_cert_dir.as_deref(),
            Some(std::path::Path::new("/etc/tessera/webhook"))
        );
    }

    #[test]
    fn leader_election_can_be_turned_off() {
        let args = Args::try_parse_from([
            "tessera-controller",
            "--leader-elect",
            "false",
            "--leader-election-id",
            "a",
        ])
        .unwrap();
        assert!(args.config().leader.is_none());
        let args =
            Args::try_parse_from(["tessera-controller", "--leader-election-id", "a"]).unwrap();
        assert_eq!(args.config().leader.unwrap().identity, "a");
    }
}
