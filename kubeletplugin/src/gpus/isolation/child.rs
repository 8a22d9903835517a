//! The probe child: the plugin's own binary run as `tessera-kubelet-plugin isolation-probe` in
//! the environment of a 1 GiB share's claim (`runner` starts it). Through the CUDA driver API
//! (`libcuda.so.1`, loaded at run time by cudarc; nothing of CUDA is needed to build), on the
//! first device the environment lets it see, it allocates half the limit (must be served), then
//! one and a half times the limit (must be refused), touching every byte so nothing is merely
//! reserved, and prints one JSON [`ProbeReport`] on stdout. The limit is read from
//! `TESSERA_GPU_MEMORY_LIMIT_BYTES`, the variable the claim's CDI spec gives every container.
//!
//! With arguments (`--bind SOURCE TARGET OPTIONS ... -- PROGRAM ARGS`,
//! `tessera_driver::node::isolation::namespace`) it first gives itself the claim's mounts: in
//! this still single-threaded process (`main` dispatches here before any runtime or thread
//! starts; `unshare(CLONE_NEWNS)` refuses a multi-threaded one) it makes a mount namespace of
//! its own and applies the steps in Rust, as `tessera-mps exec` does, then replaces itself
//! with `PROGRAM ARGS` (the plugin's binary in probe mode), so that what the environment
//! preloads (HAMi-core's `LD_PRELOAD`, handed over in `TESSERA_PROBE_LD_PRELOAD` and set only
//! for that exec) is loaded from the mounted path, as in a container.
//!
//! Exit status: 0 with a report; 2 when the environment holds no limit; 3 when CUDA cannot be
//! used at all (no `libcuda.so.1`, no device, no MPS server); 4 when the mounts could not be
//! applied (bad arguments, a missing source, a refused namespace or mount); the reason on
//! stderr.

use std::ffi::OsString;
use std::io::Write as _;
use std::os::unix::process::CommandExt as _;
use std::process::Command;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, DriverError};
use tessera_driver::node::cdi::MEMORY_LIMIT_ENV;
use tessera_driver::node::isolation::namespace::{self, Bind, Invocation};
use tessera_driver::node::isolation::{
    Allocation, PRELOAD_HANDOFF_ENV, PROBE_SUBCOMMAND, ProbeReport,
};

use crate::error::{Error, Result};
use crate::mps::exec::apply_steps;

/// The first argument that runs the binary as the probe child.
pub const SUBCOMMAND: &str = PROBE_SUBCOMMAND;

/// The exit status of a child whose mounts could not be applied.
const MOUNTS_FAILED: i32 = 4;

/// Runs the probe child with `args` (those after the subcommand); returns the process's exit
/// status, or does not return when it replaced itself with the probe's command.
pub fn run_child(args: Vec<OsString>) -> i32 {
    match contain(args) {
        Ok(()) => probe(),
        Err(error) => {
            let _ = writeln!(std::io::stderr(), "isolation probe: {error}");
            MOUNTS_FAILED
        }
    }
}

/// With mounts in `args`, applies them and replaces this process with the probe's command, so
/// it returns only why that failed; without (no arguments), `Ok`: this process is the probe.
fn contain(args: Vec<OsString>) -> Result<()> {
    let args = args
        .into_iter()
        .map(|a| {
            a.into_string()
                .map_err(|a| Error::Config(format!("argument {} is not UTF-8", a.display())))
        })
        .collect::<Result<Vec<String>>>()?;
    let (mounts, command) = match namespace::parse(&args).map_err(|e| plan_error(&e))? {
        Invocation::Probe => return Ok(()),
        Invocation::Contained { binds, command } => (binds, command),
    };
    let mut binds = Vec::with_capacity(mounts.len());
    for mount in mounts {
        let source = std::fs::metadata(&mount.host_path)
            .map_err(|e| Error::io("reading the mount source", &mount.host_path, e))?;
        binds.push(Bind {
            mount,
            source_is_dir: source.is_dir(),
        });
    }
    apply_steps(
        "applying the claim's mounts",
        &namespace::plan(&binds).map_err(|e| plan_error(&e))?,
    )?;
    let (program, args) = command
        .split_first()
        .ok_or_else(|| Error::Config("no program to run".to_owned()))?;
    let mut probe = Command::new(program);
    probe.args(args);
    // The spec's preload, now that its library is mounted at its path.
    if let Some(preload) = std::env::var_os(PRELOAD_HANDOFF_ENV) {
        probe
            .env_remove(PRELOAD_HANDOFF_ENV)
            .env("LD_PRELOAD", preload);
    }
    let error = probe.exec();
    Err(Error::io("running", program, error))
}

fn plan_error(e: &namespace::PlanError) -> Error {
    Error::Config(e.to_string())
}

/// The probe itself, in this process.
fn probe() -> i32 {
    let Some(limit) = std::env::var(MEMORY_LIMIT_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|&v| v > 0)
    else {
        let _ = writeln!(
            std::io::stderr(),
            "isolation probe: {MEMORY_LIMIT_ENV} does not hold a limit in bytes"
        );
        return 2;
    };
    let stream = match open_cuda() {
        Ok(stream) => stream,
        Err(message) => {
            let _ = writeln!(
                std::io::stderr(),
                "isolation probe: CUDA is not usable: {message}"
            );
            return 3;
        }
    };
    let (past_bytes, under_bytes) = ProbeReport::sizes(limit);
    let under = allocate(&stream, under_bytes);
    let past = allocate(&stream, past_bytes);
    let report = ProbeReport {
        limit_bytes: limit,
        past_bytes,
        past,
        under_bytes,
        under,
    };
    match serde_json::to_string(&report) {
        Ok(line) => {
            let _ = writeln!(std::io::stdout(), "{line}");
            0
        }
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "isolation probe: {e}");
            3
        }
    }
}

/// The default stream of device 0. cudarc panics when it finds no CUDA library: that is caught
/// (with the default panic message silenced) and reported as a reason.
fn open_cuda() -> Result<Arc<CudaStream>, String> {
    std::panic::set_hook(Box::new(|_| {}));
    let opened = std::panic::catch_unwind(|| CudaContext::new(0));
    let _ = std::panic::take_hook();
    match opened {
        Ok(Ok(ctx)) => Ok(ctx.default_stream()),
        Ok(Err(e)) => Err(error_name(e)),
        Err(panic) => Err(panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_else(|| "the CUDA driver library could not be loaded".to_owned())),
    }
}

fn error_name(e: DriverError) -> String {
    e.error_name()
        .map_or_else(|_| format!("{e:?}"), |n| n.to_string_lossy().into_owned())
}

/// One allocation of `bytes`, zeroed on the device and waited for.
fn allocate(stream: &Arc<CudaStream>, bytes: u64) -> Allocation {
    let Ok(len) = usize::try_from(bytes) else {
        return Allocation::Refused("larger than the address space".to_owned());
    };
    let outcome = stream
        .alloc_zeros::<u8>(len)
        .and_then(|buffer| stream.synchronize().map(|()| buffer));
    match outcome {
        Ok(buffer) => {
            drop(buffer);
            // A failure to free is reported by the next call; wait for it here.
            let _ = stream.synchronize();
            Allocation::Served
        }
        Err(e) => Allocation::Refused(error_name(e)),
    }
}
