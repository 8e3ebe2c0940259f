//! The client's record of each request, from which latencies are computed.

/// The client side's record of one request, from which latencies are computed. Compact
/// (about 100 bytes): it outlives the request, so it keeps only what the report needs,
/// not the request's spec and its block hashes.
#[derive(Debug, Clone)]
pub struct ClientRecord {
    /// The request.
    pub id: lockstep_actors::ids::ReqId,
    /// Its prompt length (the report's token throughput counts it).
    pub prompt_len: u32,
    /// When it arrived.
    pub arrival_ns: u64,
    /// When the first output token reached the client.
    pub first_token_ns: Option<u64>,
    /// When it ended.
    pub end_ns: Option<u64>,
    /// Output tokens received.
    pub output_tokens: u32,
    /// Completed (rather than failed).
    pub completed: bool,
    /// Why it failed, if it did.
    pub failure: Option<String>,
    /// A digest of the token stream received.
    pub token_digest: u64,
}

impl ClientRecord {
    /// A request that arrived at `arrival_ns`.
    pub fn new(spec: &lockstep_actors::request::RequestSpec, arrival_ns: u64) -> ClientRecord {
        ClientRecord {
            id: spec.id,
            prompt_len: spec.prompt_len,
            arrival_ns,
            first_token_ns: None,
            end_ns: None,
            output_tokens: 0,
            completed: false,
            failure: None,
            token_digest: 0,
        }
    }

    /// Records the tokens of one response received at `now_ns`.
    pub fn on_tokens(&mut self, r: &lockstep_actors::executor::Response, now_ns: u64) {
        if r.new_tokens > 0 {
            self.first_token_ns.get_or_insert(now_ns);
            self.output_tokens += r.new_tokens;
            // The stream's identity, so drivers can be compared token for token.
            self.token_digest = lockstep_actors::kv::mix(
                self.token_digest ^ (u64::from(r.last_token) << 32 | u64::from(r.new_tokens)),
            );
        }
    }

    /// Applies one response received at `now_ns` (aggregated servers: a completion ends
    /// the request; disaggregated drivers handle `ContextDone` themselves).
    pub fn on_response(&mut self, r: &lockstep_actors::executor::Response, now_ns: u64) {
        use lockstep_actors::executor::Finish;
        self.on_tokens(r, now_ns);
        match &r.finish {
            None | Some(Finish::ContextDone) => {}
            Some(Finish::Completed) => self.end(now_ns, true, None),
            Some(Finish::Failed(why)) => self.end(now_ns, false, Some(why.clone())),
            Some(Finish::Cancelled) => self.end(now_ns, false, Some("cancelled".into())),
        }
    }

    /// Ends the request once.
    pub fn end(&mut self, now_ns: u64, completed: bool, failure: Option<String>) {
        if self.end_ns.is_none() {
            self.end_ns = Some(now_ns);
            self.completed = completed;
            self.failure = failure;
        }
    }
}
