//! The probe child: the plugin's own binary run as `tessera-kubelet-plugin isolation-probe` in
//! the environment of a 1 GiB share's claim (`runner` sets it up). Through the CUDA driver API
//! (`libcuda.so.1`, loaded at run time by cudarc; nothing of CUDA is needed to build), on the
//! first device the environment lets it see, it allocates half the limit (must be served), then
//! one and a half times the limit (must be refused), touching every byte so nothing is merely
//! reserved, and prints one JSON [`ProbeReport`] on stdout. The limit is read from
//! `TESSERA_GPU_MEMORY_LIMIT_BYTES`, the variable the claim's CDI spec gives every container.
//!
//! Exit status: 0 with a report; 2 when the environment holds no limit; 3 when CUDA cannot be
//! used at all (no `libcuda.so.1`, no device, no MPS server), with the reason on stderr.

use std::io::Write as _;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, DriverError};
use tessera_driver::node::cdi::MEMORY_LIMIT_ENV;
use tessera_driver::node::isolation::{Allocation, ProbeReport};

/// The first argument that runs the binary as the probe child.
pub const SUBCOMMAND: &str = "isolation-probe";

/// Runs the probe child; returns the process's exit status.
pub fn run_child() -> i32 {
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
