//! The client's record of each request, from which latencies are computed.

use lockstep_actors::vocab::{Failure, FailureKind};

use super::RequestDetail;

/// The client side records each request in its [`RequestDetail`], the report's own
/// record of it: the request's only per-request state once it is counted.
impl RequestDetail {
    /// A request that arrived at `arrival_ns`.
    pub fn arrived(spec: &lockstep_actors::request::RequestSpec, arrival_ns: u64) -> RequestDetail {
        RequestDetail::new(spec.id.0, spec.prompt_len, arrival_ns)
    }

    /// Records the tokens of one response received at `now_ns`; the gap since the
    /// previous delivery goes to `itl`.
    pub fn on_tokens(&mut self, r: &lockstep_actors::vocab::Response, now_ns: u64, itl: &mut Itl) {
        self.on_delivery(r.id, r.new_tokens, r.last_token, now_ns, itl);
    }

    /// Records a run of deliveries of one token each, received at `dues`, as as many
    /// responses would ([`RequestDetail::on_tokens`]), but for two parts the caller
    /// takes over: the digest of every token after `first` ([`digest_token`], which
    /// the caller runs across requests), and the gaps after the first delivery, which
    /// are every request's of the run alike ([`Itl::record_gaps`]). Whether the
    /// request's gaps are measured.
    pub fn on_token_steps(
        &mut self,
        id: lockstep_actors::ids::ReqId,
        first: u32,
        dues: &[u64],
        itl: &mut Itl,
    ) -> bool {
        let (Some(&first_ns), Some(&last_ns)) = (dues.first(), dues.last()) else {
            return false;
        };
        self.on_delivery(id, 1, first, first_ns, itl);
        self.last_token_ns = last_ns;
        self.output_tokens += dues.len() as u32 - 1;
        itl.measures(id)
    }

    /// One delivery of `new_tokens` tokens, the last `last_token`, at `now_ns`.
    fn on_delivery(
        &mut self,
        id: lockstep_actors::ids::ReqId,
        new_tokens: u32,
        last_token: u32,
        now_ns: u64,
        itl: &mut Itl,
    ) {
        if new_tokens > 0 {
            if self.first_token_ns().is_some() {
                itl.record(id, now_ns.saturating_sub(self.last_token_ns));
            } else {
                self.set_first_token_ns(Some(now_ns));
            }
            self.last_token_ns = now_ns;
            self.output_tokens += new_tokens;
            self.token_digest = digest_token(self.token_digest, last_token, new_tokens);
        }
    }

    /// Applies one response received at `now_ns` (aggregated servers: a completion ends
    /// the request; disaggregated drivers handle `ContextDone` themselves).
    pub fn on_response(
        &mut self,
        r: &lockstep_actors::vocab::Response,
        now_ns: u64,
        itl: &mut Itl,
    ) {
        use lockstep_actors::vocab::Finish;
        self.on_tokens(r, now_ns, itl);
        match &r.finish {
            None | Some(Finish::ContextDone) => {}
            Some(Finish::Completed) => self.complete(now_ns),
            Some(Finish::Failed(why)) => self.fail_with(now_ns, why),
            Some(Finish::Cancelled) => self.fail(now_ns, FailureKind::Cancelled, "cancelled"),
        }
    }

    /// Completes the request, unless it already ended.
    pub fn complete(&mut self, now_ns: u64) {
        self.end(now_ns, None);
    }

    /// Fails the request with a failure the fleet reported, unless it already ended.
    pub fn fail_with(&mut self, now_ns: u64, failure: &Failure) {
        self.end(now_ns, Some((failure.kind(), failure.to_string())));
    }

    /// Fails the request with a failure only the client saw, unless it already ended.
    pub fn fail(&mut self, now_ns: u64, kind: FailureKind, why: impl Into<String>) {
        self.end(now_ns, Some((kind, why.into())));
    }
}

/// A token stream's digest after a delivery of `new_tokens` tokens, the last
/// `last_token`: the stream's identity, so drivers can be compared token for token.
pub fn digest_token(digest: u64, last_token: u32, new_tokens: u32) -> u64 {
    lockstep_actors::kv::mix(digest ^ (u64::from(last_token) << 32 | u64::from(new_tokens)))
}

/// Inter-token latency (ITL): every gap between two successive deliveries of output
/// tokens to the client, over the measured requests (warm-up ones left out), as
/// vLLM's benchmark counts it. Memory is bounded whatever the run's length: an HDR
/// histogram (three significant digits) plus an exact sum for the mean.
#[derive(Debug, Clone)]
pub struct Itl {
    hist: hdrhistogram::Histogram<u64>,
    sum_ns: u128,
    warmup: u64,
    scale: f64,
    /// The latest gaps while they repeat, not yet in `hist`: (gap, how many). The
    /// requests of one front-door job all see the same gap, so a run is recorded with
    /// one histogram update instead of one per token.
    run: (u64, u64),
}

impl Itl {
    /// A recorder that leaves out requests `1..=warmup` (the warm-up requests).
    pub fn new(warmup: u64) -> Itl {
        Itl {
            hist: hdrhistogram::Histogram::new(3).expect("3 significant digits is valid"),
            sum_ns: 0,
            warmup,
            scale: 1.0,
            run: (0, 0),
        }
    }

    /// Reports every gap divided by `time_scale` (a real driver's wall seconds per
    /// modeled second), as the other times of a modeled report are.
    pub fn set_time_scale(&mut self, time_scale: f64) {
        if time_scale > 0.0 {
            self.scale = time_scale;
        }
    }

    /// One gap of `gap_ns` in the token stream of `id`.
    pub fn record(&mut self, id: lockstep_actors::ids::ReqId, gap_ns: u64) {
        if id.0 > self.warmup {
            match &mut self.run {
                (gap, n) if *n > 0 && *gap == gap_ns => *n += 1,
                _ => {
                    Self::add(&mut self.hist, &mut self.sum_ns, self.run);
                    self.run = (gap_ns, 1);
                }
            }
        }
    }

    /// Whether the gaps of `id`'s stream count (it is not a warm-up request).
    pub fn measures(&self, id: lockstep_actors::ids::ReqId) -> bool {
        id.0 > self.warmup
    }

    /// `requests` gaps of each of `dues`' successive differences: the gaps after the
    /// first delivery of a run of deliveries that many measured requests received
    /// alike ([`RequestDetail::on_token_steps`]); what [`Itl::record`] would record
    /// one by one.
    pub fn record_gaps(&mut self, dues: &[u64], requests: u64) {
        if requests == 0 {
            return;
        }
        for pair in dues.windows(2) {
            let gap_ns = pair[1].saturating_sub(pair[0]);
            match &mut self.run {
                (gap, n) if *n > 0 && *gap == gap_ns => *n += requests,
                _ => {
                    Self::add(&mut self.hist, &mut self.sum_ns, self.run);
                    self.run = (gap_ns, requests);
                }
            }
        }
    }

    /// Adds `n` gaps of `gap` ns.
    fn add(hist: &mut hdrhistogram::Histogram<u64>, sum_ns: &mut u128, (gap, n): (u64, u64)) {
        if n == 0 {
            return;
        }
        // The histogram grows to the value (`saturating_record` would clamp it to the
        // current range).
        if hist.record_n(gap, n).is_err() {
            hist.saturating_record_n(gap, n);
        }
        *sum_ns += u128::from(gap) * u128::from(n);
    }

    /// Gaps recorded.
    pub fn samples(&self) -> u64 {
        self.hist.len() + self.run.1
    }

    /// Mean and percentiles in milliseconds (on the report's clock); zeros when no gap
    /// was recorded.
    pub fn percentiles(&self) -> super::schema::Percentiles {
        let (mut hist, mut sum_ns) = (self.hist.clone(), self.sum_ns);
        Self::add(&mut hist, &mut sum_ns, self.run);
        let scale = self.scale;
        let n = hist.len();
        if n == 0 {
            return super::schema::Percentiles::default();
        }
        let ms = |ns: f64| ns / 1e6 / scale;
        let at = |q: f64| ms(hist.value_at_quantile(q) as f64);
        super::schema::Percentiles {
            samples: n,
            mean: ms(sum_ns as f64 / n as f64),
            p50: at(0.5),
            p90: at(0.9),
            p99: at(0.99),
        }
    }
}

/// What the client side hands to the report: its records, the ITL recorder, and the
/// time of the run's end (all on the client's clock).
#[derive(Debug, Clone)]
pub struct ClientLog {
    /// One record per request, in id order.
    pub records: Vec<RequestDetail>,
    /// Inter-token gaps.
    pub itl: Itl,
    /// The run's end.
    pub end_ns: u64,
    /// The serving front door over the run (`None`: the client had none, e.g. with
    /// `--preload`, or a real HTTP client).
    pub frontend: Option<super::FrontendSummary>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockstep_actors::ids::ReqId;

    #[test]
    fn itl_percentiles_follow_the_gaps_and_leave_out_warm_up() {
        let mut itl = Itl::new(1);
        for ms in 1..=100u64 {
            itl.record(ReqId(2), ms * 1_000_000);
        }
        itl.record(ReqId(1), 10_000_000_000);
        let p = itl.percentiles();
        assert_eq!(p.samples, 100);
        assert!((p.mean - 50.5).abs() < 1e-9, "{p:?}");
        assert!((p.p50 - 50.0).abs() < 0.1, "{p:?}");
        assert!((p.p90 - 90.0).abs() < 0.1, "{p:?}");
        assert!((p.p99 - 99.0).abs() < 0.1, "{p:?}");
        itl.set_time_scale(2.0);
        assert!((itl.percentiles().p50 - 25.0).abs() < 0.1);
        assert_eq!(Itl::new(0).percentiles().samples, 0);
    }
}
