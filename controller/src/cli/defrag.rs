//! `tessera defrag`: the plan that would make contiguous room for the pending pods of a
//! cluster snapshot, with the reason for every move (`tessera_driver::tools::defrag`).

use std::fmt::Write as _;

use tessera_driver::placement::allocator::Policy;
use tessera_driver::tools::defrag::{DefragOutcome, defrag_batch};

use crate::cli::input::Objects;
use crate::cli::output::printable;
use crate::error::{Error, Result};

/// Plans for every pending pod of `objects`, moving at most `budget` pods; prints them to
/// `out` as a table, or as JSON.
pub fn run(
    objects: &Objects,
    driver: &str,
    policy: Policy,
    budget: usize,
    json: bool,
    out: &mut String,
) -> Result<()> {
    let outcomes = defrag_batch(&objects.batch_input(), driver, policy, budget)?;
    if json {
        let text = serde_json::to_string_pretty(&serde_json::json!({ "plans": outcomes }))
            .map_err(|e| Error::Output(e.to_string()))?;
        out.push_str(&text);
        out.push('\n');
        return Ok(());
    }
    write_table(&outcomes, budget, out);
    Ok(())
}

fn write_table(outcomes: &[DefragOutcome], budget: usize, out: &mut String) {
    if outcomes.is_empty() {
        out.push_str("no pending claims: nothing to make room for\n");
        return;
    }
    let moves: usize = outcomes.iter().map(|o| o.moves.len()).sum();
    for o in outcomes {
        let who = printable(&o.pending, false);
        match (&o.node, o.moves.is_empty()) {
            (Some(node), true) => {
                let _ = writeln!(
                    out,
                    "{who}: fits on {} as the cluster is; no move needed",
                    printable(node, false)
                );
            }
            (Some(node), false) => {
                let _ = writeln!(
                    out,
                    "{who}: fits on {} after {} move(s):",
                    printable(node, false),
                    o.moves.len()
                );
                for m in &o.moves {
                    let _ = writeln!(
                        out,
                        "  move {}  {} -> {}  because {}",
                        printable(&m.pod, false),
                        printable(&m.from, false),
                        printable(&m.to, false),
                        printable(&m.reason, false)
                    );
                }
            }
            (None, _) => {
                let _ = writeln!(
                    out,
                    "{who}: no plan: {}",
                    o.reason.as_deref().unwrap_or("it fits nowhere")
                );
            }
        }
    }
    let _ = writeln!(out, "{moves} move(s) of a budget of {budget}");
}
