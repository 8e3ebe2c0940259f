//! The report of a run: what a user of an ADP fleet needs to know (admission, occupancy,
//! routing balance, throughput, latency), as JSON ([`schema`]) and as a table
//! ([`table`]), computed from the client's records and the ranks' summaries
//! ([`stats`]). Every driver assembles it the same way.

pub mod balance;
mod detail;
pub mod goodput;
pub mod html;
pub mod plot;
mod records;
pub mod saturation;
pub mod schema;
pub mod series;
pub mod stats;
pub mod table;

pub use goodput::SloError;
pub use records::{ClientLog, Itl, digest_token};
pub use saturation::saturation_note;
pub use schema::*;
pub use stats::{RankEnding, RankSummary, assemble_report, run_outcome, server_report};
pub use table::ab_table;
