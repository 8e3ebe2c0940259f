//! A harness that drives one server's real actors iteration by iteration through
//! [`ServerGroup`], with an explicit ingress queue and optional closed-loop client; the
//! integration tests in `tests/tests/` are written against it.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, VecDeque};

use lockstep_actors::config::{KvCacheConfig, ServerConfig};
use lockstep_actors::executor::{FetchBatch, FetchMode, StopReason};
use lockstep_actors::group::{DeterministicTokens, GroupIteration, GroupStep, ServerGroup};
use lockstep_actors::ids::ReqId;
use lockstep_actors::invariants::Violation;
use lockstep_actors::policy::Policy;
use lockstep_actors::request::RequestSpec;
use lockstep_actors::vocab::Finish;

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
    /// Why the server stopped, if a fatal violation stopped it.
    pub stopped: Option<StopReason>,
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
            stopped: None,
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
            // A waiting rank 0 (idle, or stalled: nothing changed last iteration) with
            // nothing to read: the server sleeps.
            if mode != FetchMode::Poll && ingress.is_empty() && cancellations.is_empty() {
                return None;
            }
            Some(FetchBatch {
                requests: ingress.drain(..).collect(),
                cancellations: std::mem::take(cancellations),
                now_ns,
                ..FetchBatch::default()
            })
        };
        let step = self
            .group
            .step(&mut fetch, &mut self.tokens)
            .expect("well-formed collectives");
        let it = match step {
            GroupStep::Ran(it) => it,
            GroupStep::Stopped(why) => {
                self.stopped = Some(why);
                return None;
            }
            GroupStep::Idle | GroupStep::Finished => return None,
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

    /// Steps until idle, stalled or stopped, or `max` iterations; returns the
    /// iterations run.
    pub fn run(&mut self, max: usize) -> usize {
        let mut n = 0;
        while n < max && self.step().is_some() {
            n += 1;
        }
        n
    }

    /// Every violation reported so far (the fatal one that stopped the server last).
    pub fn violations(&self) -> Vec<&Violation> {
        let fatal = match &self.stopped {
            Some(StopReason::Crashed(v)) => Some(v),
            _ => None,
        };
        self.iterations
            .iter()
            .flat_map(|it| it.reports.iter().flat_map(|r| r.violations.iter()))
            .chain(fatal)
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

    /// Asserts that every submitted request *completed* (reached its length): none
    /// failed, was cancelled or is still open. Panics naming the ones that did not.
    #[track_caller]
    pub fn assert_all_completed(&self) {
        let not_completed: Vec<(&ReqId, &Finish)> = self
            .finished
            .iter()
            .filter(|(_, f)| **f != Finish::Completed)
            .collect();
        assert!(
            not_completed.is_empty(),
            "requests that ended without completing: {not_completed:?}"
        );
        assert_eq!(
            self.finished.len() as u64,
            self.submitted,
            "{} of {} requests completed; the others are still open",
            self.finished.len(),
            self.submitted
        );
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
    /// Rank 0's last vote.
    pub last_vote: lockstep_actors::executor::BatchVote,
    /// Why the server stopped, if a fatal violation stopped it at a vote.
    pub stopped: Option<StopReason>,
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
        receiving: 0,
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
            last_vote: Default::default(),
            stopped: None,
        }
    }

    /// One iteration through the real protocol: the peer reports `peer` counts (and
    /// made progress), votes `peer_vote`, and contributes nothing else. Returns whether
    /// the forward ran and rank 0's report.
    pub fn iterate(
        &mut self,
        peer: lockstep_actors::counts::RankCounts,
        fetched: FetchBatch,
        peer_vote: u32,
    ) -> (bool, lockstep_actors::executor::IterationReport) {
        use lockstep_actors::executor::{
            BatchVote, Exchange, Input, Io, PrefixMatches, RankState, TransferStatus,
        };
        use lockstep_actors::group::TokenSource;
        use lockstep_actors::ids::RankId;
        let peer_state = RankState {
            rank: RankId(1),
            counts: peer,
            responses_due: false,
            progressed: true,
            awaiting_transfer: false,
            balance: Default::default(),
        };
        let mut fetched = Some(fetched);
        let mut forward_ran = false;
        loop {
            let e = &mut self.exec;
            match e.poll() {
                Io::Exchange(Exchange::States { mine, .. }) => {
                    let all = [*mine, peer_state];
                    e.handle(Input::States(&all))
                }
                Io::ReadIngress(_) => e.handle(Input::Ingress(fetched.take().expect("one fetch"))),
                Io::Exchange(Exchange::Fetch { mine, .. }) => {
                    let f = mine.expect("rank 0 broadcasts").clone();
                    e.handle(Input::Fetch(&f))
                }
                Io::Exchange(Exchange::PrefixMatches { mine, .. }) => {
                    let peer = PrefixMatches {
                        tokens: vec![0; mine.tokens.len()],
                    };
                    let all = [mine.clone(), peer];
                    e.handle(Input::PrefixMatches(&all))
                }
                Io::Exchange(Exchange::PadIntent { mine, .. }) => e.handle(Input::PadIntent(mine)),
                Io::Exchange(Exchange::Votes { mine, .. }) => {
                    let all = [
                        *mine,
                        BatchVote {
                            batch_size: peer_vote,
                            ..BatchVote::default()
                        },
                    ];
                    self.last_vote = *mine;
                    forward_ran = all.iter().all(|v| v.batch_size > 0);
                    e.handle(Input::Votes(&all))
                }
                Io::Forward {
                    launch,
                    await_output,
                    ..
                } => {
                    // The stand-in backend never fails a forward.
                    if let Some(batch) = launch
                        && let Ok(out) = self.tokens.sample(batch)
                    {
                        self.outputs.insert(batch.number, out);
                    }
                    let output = await_output.and_then(|b| self.outputs.remove(&b));
                    e.handle(Input::Output(output.as_ref()))
                }
                Io::Exchange(Exchange::Responses { .. }) => e.handle(Input::ResponsesGathered),
                Io::Exchange(Exchange::TransferStatus { mine, .. }) => {
                    self.last_status = mine.clone();
                    let all = [mine.clone(), TransferStatus::default()];
                    e.handle(Input::TransferStatus(&all))
                }
                Io::IterationEnded(report) => return (forward_ran, report.clone()),
                Io::Finished => panic!("SoloRank: the server finished"),
                Io::Stopped(why) => {
                    // The iteration ends at the vote: its report is the crash.
                    let mut report = lockstep_actors::executor::IterationReport::default();
                    if let StopReason::Crashed(v) = why {
                        report.violations.push(v.clone());
                    }
                    self.stopped = Some(why.clone());
                    return (false, report);
                }
            }
            .expect("a well-formed scripted input");
        }
    }
}
