//! `tessera allocate`: the pending claims of the input, allocated against its slices.

use tessera_driver::placement::allocator::Policy;
use tessera_driver::tools::batch::{BatchOptions, ClaimOutcome, allocate_batch};

use crate::cli::input::Objects;
use crate::error::Result;

/// Allocates every pending claim of `objects` in input order.
pub fn run(
    objects: &Objects,
    driver: &str,
    policy: Policy,
    node: Option<&str>,
) -> Result<Vec<ClaimOutcome>> {
    let input = objects.batch_input();
    let options = BatchOptions {
        driver_name: driver.to_owned(),
        policy,
        node: node.map(str::to_owned),
    };
    Ok(allocate_batch(&input, &options)?)
}
