//! The path a step's token mixes in, and the token a deterministic backend samples along
//! it: what makes a stream prove where it was computed. The executor stamps the path on
//! each [`crate::executor::ForwardEntry`]; any token source may read it.

use crate::config::Role;
use crate::ids::RankId;
use crate::kv::mix;
use crate::vocab::KvAddress;

/// The path a step's token mixes in ([`crate::executor::ForwardEntry::path`]).
///
/// - aggregated server: the rank that runs the step and the batch number (the rank's
///   forward index). Every driver agrees on both when requests are preloaded.
/// - ctx server: the rank. Not the batch number: at zero cost a real driver's KV sends
///   finish in thread time, so which iteration frees a ctx rank's index slots (and runs
///   a deferred prefill) is timing, not control plane.
/// - gen server: the ctx server and rank its KV was pulled from (`kv_source`, set by the
///   front). Not the gen rank: which requests reach a gen server's ingress together, and
///   so how they are routed, depends on when their prefills ended, which at zero cost is
///   thread timing. The whole stream of a disaggregated request thus proves where its
///   prompt was computed.
pub fn token_path(role: Role, rank: RankId, batch: u64, kv_source: Option<KvAddress>) -> u64 {
    match role {
        Role::Agg => mix(0xA6 ^ (u64::from(rank.0) << 8) ^ (batch << 32)),
        Role::Ctx => mix(0xC7 ^ (u64::from(rank.0) << 8)),
        Role::Gen => match kv_source {
            // The first token came from that ctx rank: the rest carry its mark.
            Some(a) => mix(0xC7 ^ (u64::from(a.rank.0) << 8) ^ (u64::from(a.server) << 40)),
            None => 0,
        },
    }
}

/// The token a deterministic backend samples for request `id` at output `position`
/// along `path` ([`token_path`]).
pub fn deterministic_token(id: u64, position: u32, path: u64) -> u32 {
    (mix(id.wrapping_mul(0x100_0000_01B3) ^ u64::from(position) ^ path.rotate_left(17)) % 32_000)
        as u32
}
