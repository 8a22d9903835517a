//! The `tessera` command: demo, allocate, validate and simulate offline (no cluster, no GPU),
//! inspect live.

pub mod allocate;
pub mod defrag;
pub mod demo;
pub mod device_plugin;
pub mod input;
pub mod inspect;
pub mod output;
pub mod simulate;
pub mod validate;

use std::io::Write as _;
use std::path::PathBuf;

use inspect::InspectFormat;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use tessera_driver::names;
use tessera_driver::placement::allocator::Policy;
use tessera_driver::rules::config::Factor;

use crate::error::{Error, Result};

/// Try Tessera's GPU allocation offline (plain Kubernetes YAML in, decisions out), and inspect
/// a live cluster.
#[derive(Debug, Parser)]
#[command(name = "tessera", version, about)]
pub struct Cli {
    /// The DRA driver name Tessera runs under.
    #[arg(long, global = true, env = "TESSERA_DRIVER_NAME", default_value = names::DEFAULT_DRIVER_NAME)]
    pub driver_name: String,

    /// Time-sliced replicas per GPU: a pod's `nvidia.com/gpu.shared: N` is N shares of 1/R of
    /// a card each (as the controller's flag of the same name).
    #[arg(long, global = true, env = "TESSERA_SHARED_GPU_REPLICAS",
          default_value_t = tessera_driver::admission::device_plugin_names::DEFAULT_SHARED_REPLICAS,
          value_parser = clap::value_parser!(u32).range(1..=100))]
    pub shared_gpu_replicas: u32,

    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the whole flow on a built-in example cluster and print a report.
    Demo {
        /// Placement policy.
        #[arg(long, env = "TESSERA_POLICY", default_value_t)]
        policy: Policy,
    },
    /// Allocate the pending ResourceClaims of the given files against their ResourceSlices.
    Allocate {
        /// Files or folders of DeviceClasses, ResourceSlices, ResourceClaims, Nodes and Pods
        /// (`-` reads standard input).
        #[arg(short = 'f', long = "filename", required = true, num_args = 1..)]
        files: Vec<PathBuf>,
        /// Only use devices available on this node.
        #[arg(long)]
        node: Option<String>,
        /// Placement policy.
        #[arg(long, env = "TESSERA_POLICY", default_value_t)]
        policy: Policy,
        /// Output format.
        #[arg(short = 'o', long, default_value = "table")]
        output: OutputFormat,
    },
    /// Plan defragmentation offline: for each pending pod that fits nowhere, the fewest
    /// movable batch pods (owned by a controller) whose move to other nodes makes room for it,
    /// with the reason for every move. Reads what `allocate` reads; changes nothing.
    Defrag {
        /// Files or folders of DeviceClasses, ResourceSlices, ResourceClaims, Nodes and Pods
        /// (`-` reads standard input).
        #[arg(short = 'f', long = "filename", required = true, num_args = 1..)]
        files: Vec<PathBuf>,
        /// Placement policy.
        #[arg(long, env = "TESSERA_POLICY", default_value_t)]
        policy: Policy,
        /// The most pods moved in all (the controller's evictions per hour).
        #[arg(long, default_value_t = 10)]
        budget: usize,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Check every CEL expression, opaque config and share rule of the given files.
    Validate {
        /// Files or folders to check (`-` reads standard input).
        #[arg(short = 'f', long = "filename", required = true, num_args = 1..)]
        files: Vec<PathBuf>,
    },
    /// Replay a GPU cluster trace (Alibaba "openb" CSVs) through the allocator and report
    /// unallocated GPU, fragmentation and failed pods.
    Simulate {
        /// The node list (`sn,cpu_milli,memory_mib,gpu,model`).
        #[arg(long)]
        nodes: PathBuf,
        /// The pod list (`name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec,...]`).
        #[arg(long)]
        pods: PathBuf,
        /// Placement policy.
        #[arg(long, env = "TESSERA_POLICY", default_value_t)]
        policy: Policy,
        /// One seed of the arrival order.
        #[arg(long, conflicts_with = "seeds")]
        seed: Option<u64>,
        /// An inclusive range of seeds, `A..B` (default: 42..51, the paper's).
        #[arg(long)]
        seeds: Option<simulate::SeedRange>,
        /// A pod list whose task shapes the policy knows from the start (the paper's FGD
        /// knows the whole trace's); without it the policy learns from arrivals only.
        #[arg(long)]
        history: Option<PathBuf>,
        /// Output format.
        #[arg(short = 'o', long, default_value = "table")]
        output: SimulateFormat,
        /// Mix tiers: best-effort tasks (`qos` BE) become batch shares of
        /// `batch.gpu.tessera.dev`, the rest stay online; reports online and batch apart.
        #[arg(long)]
        mixing: bool,
        /// With --mixing: the batch class's compute over-commit factor (1.0..=10.0).
        #[arg(long, requires = "mixing", value_parser = simulate::parse_factor)]
        batch_overcommit: Option<Factor>,
        /// With --mixing: the batch class's memory over-commit factor; every simulated GPU
        /// then publishes `enforcement: hami-core`, which can back it.
        #[arg(long, requires = "mixing", value_parser = simulate::parse_factor)]
        batch_memory_overcommit: Option<Factor>,
        /// Replay in time instead: tasks arrive at `creation_time` and leave after their
        /// lifetime, pending tasks wait; compares a static online/batch split with a
        /// `--schedule`, with and without defragmentation (docs/placement.md).
        #[arg(long, conflicts_with_all = ["mixing", "seed", "seeds", "history"])]
        time: bool,
        /// With --time: a `GpuProfileSchedule` file the tidal nodes follow.
        #[arg(long, requires = "time")]
        schedule: Option<PathBuf>,
        /// With --time: also run each scenario with defragmentation, under this many
        /// evictions per hour (the controller's flag of the same name).
        #[arg(long, requires = "time", default_value_t = 0)]
        defrag_evictions_per_hour: u32,
        /// With --time: percent of the nodes that serve batch all the time.
        #[arg(long, requires = "time", default_value_t = 20)]
        batch_nodes: u32,
        /// With --time: percent of the nodes the schedule moves between online (day) and
        /// batch (night); online all the time in the static split.
        #[arg(long, requires = "time", default_value_t = 30)]
        tidal_nodes: u32,
        /// With --time: the instant of the trace's second 0 (the traces have no wall clock).
        #[arg(long, requires = "time", default_value = simulate::DEFAULT_TRACE_START)]
        trace_start: String,
        /// With --time: keep every N-th node of the node list (1: all), to scale the cluster
        /// to the trace's demand (the openb pod lists are a sample of the cluster's tasks).
        #[arg(long, requires = "time", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
        node_stride: u16,
    },
    /// Show a live cluster's GPUs per node (mode, memory and compute allocated and free, the
    /// claims and pods using them), or why a gated pod is pending (`inspect pod NAME`).
    Inspect {
        /// Kubeconfig file; without it, the pod's service account.
        #[arg(long, global = true, env = "KUBECONFIG")]
        kubeconfig: Option<PathBuf>,
        /// Output format.
        #[arg(short = 'o', long, global = true, default_value = "table")]
        output: InspectFormat,
        /// What to inspect (default: every node's GPUs).
        #[command(subcommand)]
        target: Option<InspectTarget>,
    },
}

/// What `tessera inspect` looks at.
#[derive(Debug, Subcommand)]
pub enum InspectTarget {
    /// Explain why a pod is pending: not Tessera's, waiting for claims, or why its claims
    /// cannot be placed.
    Pod {
        /// The pod's name.
        name: String,
        /// The pod's namespace.
        #[arg(short = 'n', long, default_value = "default")]
        namespace: String,
    },
    /// Show what a claim booked, what the node that prepared it says it got and uses (its
    /// status.devices), and the node's Events about it or its pods.
    Claim {
        /// `NAMESPACE/NAME`, or a name in `--namespace`.
        claim: String,
        /// The claim's namespace, when the name does not carry one.
        #[arg(short = 'n', long, default_value = "default")]
        namespace: String,
    },
}

/// Output formats of `tessera simulate`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SimulateFormat {
    /// Per seed and mean, with curves.
    Json,
    /// A table for people.
    Table,
}

/// Output formats of `tessera allocate`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    /// `{"results":[...]}` as JSON (with `"errors":[...]` when objects were left out).
    Json,
    /// The same as YAML.
    Yaml,
    /// A table for people.
    Table,
    /// The input's ResourceClaims as YAML, each in its own API version, with
    /// `status.allocation` filled in where allocated: input for `kubectl`, the kubelet
    /// plugin's `--fake-claims`, or `tessera allocate` again.
    Claims,
}

impl Cli {
    /// Parses the command line, runs the command and maps errors to exit codes
    /// (2 for malformed input, 1 for other failures).
    pub fn parse_and_run() -> ExitCode {
        let cli = Self::parse();
        let mut out = String::new();
        let result = cli.run(&mut out);
        let mut stdout = std::io::stdout().lock();
        if stdout
            .write_all(out.as_bytes())
            .and_then(|()| stdout.flush())
            .is_err()
        {
            return ExitCode::from(1);
        }
        match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                if !matches!(e, Error::Findings { .. }) {
                    let message = output::printable(&e.to_string(), true);
                    let _ = writeln!(std::io::stderr(), "error: {message}");
                }
                ExitCode::from(e.exit_code())
            }
        }
    }

    /// How device-plugin names are mapped, from the global flags.
    pub fn device_plugin_options(&self) -> tessera_driver::admission::device_plugin_names::Options {
        tessera_driver::admission::device_plugin_names::Options {
            driver: self.driver_name.clone(),
            shared_replicas: self.shared_gpu_replicas,
        }
    }

    /// `tessera defrag`: loads the files as `allocate` does and prints the plans.
    fn run_defrag(
        &self,
        files: &[PathBuf],
        policy: Policy,
        budget: usize,
        json: bool,
        out: &mut String,
    ) -> Result<()> {
        let mut objects = input::Objects::load_skipping_refused(files)?;
        for warning in device_plugin::rewrite(&mut objects, &self.device_plugin_options())? {
            let _ = writeln!(std::io::stderr(), "warning: {warning}");
        }
        for refusal in &objects.refusals {
            let _ = writeln!(
                std::io::stderr(),
                "warning: left out: {}",
                output::printable(&refusal.message, false)
            );
        }
        defrag::run(&objects, &self.driver_name, policy, budget, json, out)
    }

    /// Runs the command, appending what it prints to `out`.
    #[allow(clippy::too_many_lines)] // Reason: one arm per subcommand, each only adapting its flags.
    pub fn run(&self, out: &mut String) -> Result<()> {
        match &self.command {
            Command::Demo { policy } => demo::run(&self.driver_name, *policy, out),
            Command::Allocate {
                files,
                node,
                policy,
                output,
            } => {
                let mut objects = input::Objects::load_skipping_refused(files)?;
                for warning in device_plugin::rewrite(&mut objects, &self.device_plugin_options())?
                {
                    let _ = writeln!(std::io::stderr(), "warning: {warning}");
                }
                let answer = allocate::run(&objects, &self.driver_name, *policy, node.as_deref())?;
                output::write(&answer, &objects, *output, out)?;
                if answer.errors.is_empty() {
                    return Ok(());
                }
                if *output == OutputFormat::Claims {
                    // Standard output is YAML for other tools; the errors go beside it.
                    let mut stderr = std::io::stderr().lock();
                    for error in &answer.errors {
                        let _ = writeln!(stderr, "error: {}", output::printable(error, false));
                    }
                }
                Err(Error::Malformed(format!(
                    "{} error(s) in the input (listed with the results); what they name was \
                     left out, every other object has its result",
                    answer.errors.len()
                )))
            }
            Command::Simulate {
                nodes,
                pods,
                policy,
                seed,
                seeds,
                history,
                output,
                mixing,
                batch_overcommit,
                batch_memory_overcommit,
                time,
                schedule,
                defrag_evictions_per_hour,
                batch_nodes,
                tidal_nodes,
                trace_start,
                node_stride,
            } => {
                if *time {
                    let args = simulate::TimeArgs {
                        nodes: nodes.clone(),
                        pods: pods.clone(),
                        policy: *policy,
                        schedule: schedule.clone(),
                        defrag_evictions_per_hour: *defrag_evictions_per_hour,
                        batch_nodes_percent: *batch_nodes,
                        tidal_nodes_percent: *tidal_nodes,
                        trace_start: trace_start.clone(),
                        node_stride: usize::from(*node_stride),
                        json: *output == SimulateFormat::Json,
                    };
                    return simulate::run_time(&args, &self.driver_name, out);
                }
                let seeds = match (seed, seeds) {
                    (Some(s), _) => vec![*s],
                    (None, Some(r)) => (r.first..=r.last).collect(),
                    (None, None) => (42..=51).collect(),
                };
                let args = simulate::SimulateArgs {
                    nodes: nodes.clone(),
                    pods: pods.clone(),
                    policy: *policy,
                    seeds,
                    history: history.clone(),
                    json: *output == SimulateFormat::Json,
                    progress: true,
                    mixing: mixing.then(|| simulate::MixingArgs {
                        compute: batch_overcommit.unwrap_or(Factor::ONE),
                        memory: batch_memory_overcommit.unwrap_or(Factor::ONE),
                    }),
                };
                simulate::run(&args, &self.driver_name, out)
            }
            Command::Defrag {
                files,
                policy,
                budget,
                json,
            } => self.run_defrag(files, *policy, *budget, *json, out),
            Command::Validate { files } => {
                let objects = input::Objects::load_listing_refusals(files)?;
                validate::run(&objects, &self.driver_name, out)
            }
            Command::Inspect {
                kubeconfig,
                output,
                target,
            } => inspect::run(
                kubeconfig.as_deref(),
                &self.driver_name,
                &inspect_target(target.as_ref()),
                *output,
                out,
            ),
        }
    }
}

/// What `tessera inspect` looks at: the cluster, a pod, or a claim (`NS/NAME`, or `NAME` with
/// its `--namespace`).
fn inspect_target(target: Option<&InspectTarget>) -> inspect::Target {
    match target {
        None => inspect::Target::Cluster,
        Some(InspectTarget::Pod { name, namespace }) => inspect::Target::Pod {
            namespace: namespace.clone(),
            name: name.clone(),
        },
        Some(InspectTarget::Claim { claim, namespace }) => {
            let (namespace, name) = claim
                .split_once('/')
                .unwrap_or((namespace.as_str(), claim.as_str()));
            inspect::Target::Claim {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
            }
        }
    }
}
