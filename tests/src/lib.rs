//! A harness that drives one server's real actors iteration by iteration through
//! [`ServerGroup`], with an explicit ingress queue and optional closed-loop client; the
//! integration tests in `tests/tests/` are written against it.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, VecDeque};

use lockstep_actors::config::{KvCacheConfig, ServerConfig};
use lockstep_actors::executor::{FetchBatch, FetchMode, Finish};
use lockstep_actors::group::{DeterministicTokens, GroupIteration, GroupStep, ServerGroup};
use lockstep_actors::ids::ReqId;
use lockstep_actors::invariants::Violation;
use lockstep_actors::policy::Policy;
use lockstep_actors::request::RequestSpec;

/// A small aggregated ADP server: `dp` ranks, batch `b`, overlap as given.
pub fn adp_server(dp: i64, b: i64, overlap: bool) -> ServerConfig {
    ServerConfig {
        name: "test".into(),
        tensor_parallel_size: dp,
        enable_attention_dp: true,
        max_batch_size: b,
        max_num_tokens: 4096,
        disable_overlap_scheduler: !overlap,
        kv_cache_config: KvCacheConfig {
            tokens_per_block: 16,
            max_tokens: 1 << 16,
            enable_block_reuse: true,
        },
        ..ServerConfig::default()
    }
}

/// A closed-loop client: keeps `concurrency` requests outstanding until `total` were sent.
#[derive(Debug, Clone)]
pub struct ClosedLoop {
    /// Outstanding requests wanted.
    pub concurrency: usize,
    /// Requests to send in all.
    pub total: u64,
    /// Prompt tokens of each request.
    pub prompt_len: u32,
    /// Output tokens of each request.
    pub output_len: u32,
    sent: u64,
    outstanding: usize,
}

impl ClosedLoop {
    /// A client.
    pub fn new(concurrency: usize, total: u64, prompt_len: u32, output_len: u32) -> ClosedLoop {
        ClosedLoop {
            concurrency,
            total,
            prompt_len,
            output_len,
            sent: 0,
            outstanding: 0,
        }
    }
}

/// Drives a [`ServerGroup`] and records what happened.
#[derive(Debug)]
pub struct Harness {
    /// The server.
    pub group: ServerGroup,
    /// Rank 0's ingress queue.
    pub ingress: VecDeque<RequestSpec>,
    /// Cancellations to deliver with the next fetch.
    pub cancellations: Vec<ReqId>,
    /// Every iteration so far.
    pub iterations: Vec<GroupIteration>,
    /// How each request ended.
    pub finished: BTreeMap<ReqId, Finish>,
    /// Output tokens per request, as streamed.
    pub streamed: BTreeMap<ReqId, Vec<u32>>,
    /// Requests submitted.
    pub submitted: u64,
    client: Option<ClosedLoop>,
    tokens: DeterministicTokens,
}

impl Harness {
    /// A harness over `server` with `policy`. Panics on an invalid config (tests only).
    pub fn new(server: &ServerConfig, policy: Policy) -> Harness {
        Harness {
            group: ServerGroup::new(server, policy).expect("valid test config"),
            ingress: VecDeque::new(),
            cancellations: Vec::new(),
            iterations: Vec::new(),
            finished: BTreeMap::new(),
            streamed: BTreeMap::new(),
            submitted: 0,
            client: None,
            tokens: DeterministicTokens,
        }
    }

    /// Adds a closed-loop client (it sends its first `concurrency` requests now).
    pub fn with_client(mut self, client: ClosedLoop) -> Harness {
        self.client = Some(client);
        self.refill();
        self
    }

    /// Submits one request.
    pub fn submit(&mut self, spec: RequestSpec) {
        self.submitted += 1;
        self.ingress.push_back(spec);
    }

    /// Submits `n` plain requests with ids from `first`.
    pub fn submit_many(&mut self, first: u64, n: u64, prompt_len: u32, output_len: u32) {
        for id in first..first + n {
            self.submit(RequestSpec::new(id, prompt_len, output_len));
        }
    }

    fn refill(&mut self) {
        let Some(c) = self.client.as_mut() else {
            return;
        };
        let mut new = Vec::new();
        while c.outstanding < c.concurrency && c.sent < c.total {
            c.sent += 1;
            c.outstanding += 1;
            new.push(RequestSpec::new(c.sent, c.prompt_len, c.output_len));
        }
        for spec in new {
            self.submit(spec);
        }
    }

    /// Runs one iteration; `None` when the server is idle (rank 0 would block).
    pub fn step(&mut self) -> Option<&GroupIteration> {
        let ingress = &mut self.ingress;
        let cancellations = &mut self.cancellations;
        // The harness's clock: one millisecond per iteration.
        let now_ns = self.iterations.len() as u64 * 1_000_000;
        let mut fetch = |mode: FetchMode| {
            if mode == FetchMode::Block && ingress.is_empty() && cancellations.is_empty() {
                return None;
            }
            Some(FetchBatch {
                requests: ingress.drain(..).collect(),
                cancellations: std::mem::take(cancellations),
                shutdown: false,
                peers_ready: Vec::new(),
                now_ns,
            })
        };
        let step = self
            .group
            .step(&mut fetch, &mut self.tokens)
            .expect("well-formed collectives");
        let GroupStep::Ran(it) = step else {
            return None;
        };
        let mut ended = 0;
        for r in &it.responses {
            if r.new_tokens > 0 {
                self.streamed.entry(r.id).or_default().push(r.last_token);
            }
            if let Some(f) = &r.finish {
                assert!(
                    self.finished.insert(r.id, f.clone()).is_none(),
                    "request {} finished twice",
                    r.id
                );
                ended += 1;
            }
        }
        if let Some(c) = self.client.as_mut() {
            c.outstanding -= ended;
        }
        self.iterations.push(it);
        self.refill();
        self.iterations.last()
    }

    /// Steps until idle or `max` iterations; returns the iterations run.
    pub fn run(&mut self, max: usize) -> usize {
        let mut n = 0;
        while n < max && self.step().is_some() {
            n += 1;
        }
        n
    }

    /// Every violation reported so far.
    pub fn violations(&self) -> Vec<&Violation> {
        self.iterations
            .iter()
            .flat_map(|it| it.reports.iter().flat_map(|r| r.violations.iter()))
            .collect()
    }

    /// Mean real requests per rank per forward iteration, over iterations `from..`.
    pub fn mean_scheduled(&self, from: usize) -> f64 {
        let mut sum = 0u64;
        let mut n = 0u64;
        for it in self
            .iterations
            .iter()
            .skip(from)
            .filter(|it| it.forward_ran)
        {
            for r in &it.reports {
                sum += u64::from(r.stats.num_scheduled_requests);
                n += 1;
            }
        }
        if n == 0 { 0.0 } else { sum as f64 / n as f64 }
    }

    /// Requests routed to each rank so far.
    pub fn routed_per_rank(&self) -> Vec<u64> {
        self.group
            .ranks()
            .iter()
            .map(|r| r.totals().routed_requests)
            .collect()
    }

    /// Whether every submitted request has finished.
    pub fn all_finished(&self) -> bool {
        self.finished.len() as u64 == self.submitted
    }
}

/// Drives rank 0 of a dp=2 server alone, making up rank 1's contributions, so a test can
/// script situations (a peer that vetoes, a peer with load) through the real phases.
#[derive(Debug)]
pub struct SoloRank {
    /// The executor under test (rank 0).
    pub exec: lockstep_actors::executor::RankExecutor,
    outputs: BTreeMap<lockstep_actors::ids::BatchNumber, lockstep_actors::executor::ForwardOutput>,
    tokens: DeterministicTokens,
    /// Rank 0's contribution to the last transfer-status allgather.
    pub last_status: lockstep_actors::executor::TransferStatus,
}

/// A peer holding `routable` schedulable requests of 16 prompt tokens.
pub fn peer_with(routable: u32) -> lockstep_actors::counts::RankCounts {
    lockstep_actors::counts::RankCounts {
        live: routable,
        routable,
        routable_prompt_tokens: u64::from(routable) * 16,
        schedulable: routable,
        pad_schedulable: routable,
        retiring: 0,
    }
}

impl SoloRank {
    /// Rank 0 of `server` (which must have dp = 2).
    pub fn new(server: &ServerConfig, policy: Policy) -> SoloRank {
        let sizes = server.derive(&policy).expect("valid test config").sizes;
        assert_eq!(sizes.dp, 2, "SoloRank scripts a dp=2 server");
        SoloRank {
            exec: lockstep_actors::executor::RankExecutor::new(
                lockstep_actors::ids::RankId(0),
                server,
                &sizes,
                policy,
            ),
            outputs: BTreeMap::new(),
            tokens: DeterministicTokens,
            last_status: Default::default(),
        }
    }

    /// One iteration: the peer reports `peer` counts and votes `peer_vote`. Returns
    /// whether the forward ran and rank 0's report.
    pub fn iterate(
        &mut self,
        peer: lockstep_actors::counts::RankCounts,
        fetched: FetchBatch,
        peer_vote: u32,
    ) -> (bool, lockstep_actors::executor::IterationReport) {
        use lockstep_actors::executor::{BatchVote, PrefixMatches, RankState, TransferStatus};
        use lockstep_actors::group::TokenSource;
        let e = &mut self.exec;
        let (t, mine) = e.begin_iteration();
        let gathered = [
            mine,
            RankState {
                rank: lockstep_actors::ids::RankId(1),
                counts: peer,
                responses_due: false,
            },
        ];
        let (t, m) = e.on_fetch(t, &gathered, &fetched).expect("gather");
        let matches = [m, PrefixMatches::default()];
        let (t, intent) = e.on_prefix_matches(t, &matches).expect("matches");
        let (t, vote) = e.on_pad_intent(t, intent);
        let votes = [
            vote,
            BatchVote {
                batch_size: peer_vote,
            },
        ];
        let (t, plan) = e.on_vote(t, &votes).expect("vote");
        if let Some(batch) = &plan.launch {
            self.outputs.insert(batch.number, self.tokens.sample(batch));
        }
        let output = plan.await_output.and_then(|b| self.outputs.remove(&b));
        let (t, _) = e.on_forward_output(t, output).expect("output");
        let (t, st) = e.transfer_status(t);
        self.last_status = st.clone();
        let report = e
            .on_transfer_status(t, &[st, TransferStatus::default()])
            .expect("transfers");
        (plan.can_queue, report)
    }
}
