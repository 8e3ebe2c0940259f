//! `--iter-log`: one JSON line per server iteration and rank with the fields of §9.

use serde::Serialize;

use lockstep_actors::executor::{BalanceDecision, IterationStats};

/// One line of the iteration log.
#[derive(Debug, Clone, Serialize)]
pub struct IterLogLine {
    /// Server name.
    pub server: String,
    /// Virtual time the iteration started, ns.
    pub time_ns: u64,
    /// Iteration.
    pub iteration: u64,
    /// Rank.
    pub rank: u32,
    /// Whether the forward ran.
    pub forward_ran: bool,
    /// Real requests scheduled.
    pub num_scheduled_requests: u32,
    /// Dummies scheduled.
    pub num_dummies: u32,
    /// Context requests.
    pub num_ctx_requests: u32,
    /// Context tokens.
    pub num_ctx_tokens: u32,
    /// Generation requests.
    pub num_gen_requests: u32,
    /// Live count.
    pub live: u32,
    /// Routable count.
    pub routable: u32,
    /// Retiring count.
    pub retiring: u32,
    /// `expected` of the iteration.
    pub expected: u32,
    /// KV blocks used.
    pub kv_blocks_used: u32,
    /// KV blocks free.
    pub kv_blocks_free: u32,
    /// Seats held.
    pub seats_used: u32,
    /// No-free-index-slot deferrals this iteration.
    pub deferrals_no_free_index_slot: u32,
    /// Out-of-blocks deferrals this iteration.
    pub deferrals_out_of_blocks: u32,
    /// Dummy added.
    pub dummy_added: bool,
    /// Dummy committed.
    pub dummy_committed: bool,
    /// Dummy rolled back.
    pub dummy_rolled_back: bool,
    /// Requests routed to this rank so far / routed in total.
    pub currank_total_requests: String,
    /// Host time of the iteration, ns (server-wide: max over ranks).
    pub host_ns: u64,
    /// Forward time of the iteration, ns (server-wide).
    pub forward_ns: u64,
    /// Tokens this rank carried in the forward (0 when it was skipped).
    pub num_tokens: u32,
    /// The most tokens any rank carried.
    pub max_rank_tokens: u32,
    /// Mean over max tokens across the server's ranks; `null` when none carried any.
    pub balance_ratio: Option<f64>,
    /// ADP balance's decision (`off` when not enabled).
    pub balance: BalanceDecision,
    /// ADP balance on: this rank's requests with a context phase to run, as the decision
    /// saw them.
    pub context_work: u32,
    /// ADP balance on: this rank's requests in generation, as the decision saw them.
    pub generation_work: u32,
}

impl IterLogLine {
    /// A line from a rank's stats.
    pub fn new(
        server: &str,
        time_ns: u64,
        host_ns: u64,
        forward_ns: u64,
        s: &IterationStats,
    ) -> IterLogLine {
        IterLogLine {
            server: server.to_string(),
            time_ns,
            iteration: s.iteration,
            rank: s.rank.0,
            forward_ran: s.forward_ran,
            num_scheduled_requests: s.num_scheduled_requests,
            num_dummies: s.num_dummies,
            num_ctx_requests: s.num_ctx_requests,
            num_ctx_tokens: s.num_ctx_tokens,
            num_gen_requests: s.num_gen_requests,
            live: s.counts.live,
            routable: s.counts.routable,
            retiring: s.counts.retiring,
            expected: s.expected,
            kv_blocks_used: s.kv_blocks_used,
            kv_blocks_free: s.kv_blocks_free,
            seats_used: s.seats_used,
            deferrals_no_free_index_slot: s.deferrals_no_free_index_slot,
            deferrals_out_of_blocks: s.deferrals_out_of_blocks,
            dummy_added: s.dummy_added,
            dummy_committed: s.dummy_committed,
            dummy_rolled_back: s.dummy_rolled_back,
            currank_total_requests: format!("{}/{}", s.routed_to_rank, s.routed_total),
            host_ns,
            forward_ns,
            num_tokens: s.num_tokens,
            max_rank_tokens: s.max_rank_tokens,
            balance_ratio: s.balance_ratio(),
            balance: s.balance,
            context_work: s.balance_load.context,
            generation_work: s.balance_load.generation,
        }
    }
}
