//! The `tessera` command: see `tessera --help`.

use std::process::ExitCode;

fn main() -> ExitCode {
    tessera_controller::cli::Cli::parse_and_run()
}
