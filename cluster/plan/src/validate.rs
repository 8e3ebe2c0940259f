//! `lockstep validate`: the derived sizes of every server, or the validator's message.

use std::fmt::Write;

use lockstep_actors::config::Derived;

use crate::fleet::{Fleet, PlanError};
use crate::scenario::Scenario;

/// Renders the derived sizes of every server, after the checks a run makes (so
/// `validate` accepts exactly what `sim` accepts: the servers, the roles, the model
/// profile, the workload and its trace, and that some request could be served); an
/// error stops at the first problem.
pub fn render(scenario: &Scenario) -> Result<(String, Vec<String>), PlanError> {
    let fleet = Fleet::plan(scenario, scenario.seed.unwrap_or(0))?;
    fleet.workload()?;
    let derived = scenario.derive_all()?;
    let mut out = String::new();
    let legacy = scenario.policy.legacy_switches();
    let _ = writeln!(
        out,
        "scenario {}  policy: {}",
        scenario.name,
        if legacy.is_empty() {
            "fixed".to_string()
        } else {
            format!("legacy switches on: {}", legacy.join(", "))
        }
    );
    let _ = writeln!(
        out,
        "{:<12} {:<4} {:>3} {:>3} {:>3} {:>6} {:>7} {:>5} {:>8} {:>6} {:>9} {:>10} {:>10} {:>7}",
        "server",
        "role",
        "dp",
        "tp",
        "pp",
        "B",
        "T",
        "M",
        "capacity",
        "seats",
        "kv_index",
        "kv_blocks",
        "tok/block",
        "overlap"
    );
    let mut warnings = Vec::new();
    for (server, Derived { sizes, warning }) in scenario.servers.iter().zip(derived) {
        let _ = writeln!(
            out,
            "{:<12} {:<4} {:>3} {:>3} {:>3} {:>6} {:>7} {:>5} {:>8} {:>6} {:>9} {:>10} {:>10} {:>7}",
            server.name,
            server.role.name(),
            sizes.dp,
            sizes.tp,
            sizes.pp,
            sizes.max_batch_size,
            sizes.max_num_tokens,
            sizes.max_admitted_per_rank,
            sizes.capacity,
            sizes.seats,
            sizes.pools.kv_index_pool,
            sizes.kv_blocks_per_rank,
            sizes.tokens_per_block,
            if sizes.overlap { "on" } else { "off" },
        );
        warnings.extend(warning);
    }
    Ok((out, warnings))
}
