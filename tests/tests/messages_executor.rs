//! The rank executor driven only through its protocol (mechanisms.md §3): `poll() -> Io`
//! says what the rank needs, `handle(Input)` answers it. The test is the host: it runs
//! each collective by hand from the ranks' own contributions (as `group::ServerGroup`
//! does), reads the ingress for rank 0, and plays the device with a fixed token rule.

use std::collections::{BTreeMap, VecDeque};

use lockstep_actors::config::{KvCacheConfig, ServerConfig};
use lockstep_actors::executor::{
    BatchVote, CollectiveSchedule, CollectiveTag, Exchange, ExecutorError, FetchBatch, FetchMode,
    ForwardEntry, ForwardKind, ForwardOutput, Input, Io, IterationReport, Phase, PrefixMatches,
    RankExecutor, RankResponses, RankState, ScheduledBatch, StopReason, TransferStatus,
};
use lockstep_actors::ids::{BatchNumber, RankId, ReqId};
use lockstep_actors::policy::Policy;
use lockstep_actors::request::RequestSpec;
use lockstep_actors::vocab::{Finish, PadIntent, Response};

/// An aggregated ADP server of `dp` ranks, batch 4.
fn server(dp: i64, overlap: bool) -> ServerConfig {
    ServerConfig {
        name: "exec".into(),
        tensor_parallel_size: dp,
        enable_attention_dp: true,
        max_batch_size: 4,
        max_num_tokens: 1024,
        disable_overlap_scheduler: !overlap,
        kv_cache_config: KvCacheConfig {
            tokens_per_block: 16,
            max_tokens: 4096,
            enable_block_reuse: false,
        },
        ..ServerConfig::default()
    }
}

fn ranks(server: &ServerConfig) -> Vec<RankExecutor> {
    let policy = Policy::FIXED;
    let sizes = server.derive(&policy).expect("a valid server").sizes;
    (0..sizes.dp)
        .map(|r| RankExecutor::new(RankId(r), server, &sizes, policy))
        .collect()
}

/// The device's token rule: request `id` at output position `p` samples `100 * id + p`.
fn token(id: ReqId, position: u32) -> u32 {
    id.0 as u32 * 100 + position
}

/// One step a rank asked for, as the host saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    States(u64),
    ReadIngress(FetchMode),
    Fetch(u64),
    PrefixMatches(u64),
    PadIntent(u64),
    Votes(u64),
    Forward {
        launch: Option<u64>,
        await_output: Option<u64>,
    },
    Responses(u64),
    TransferStatus(u64),
    Ended(u64),
    Finished,
    Stopped,
}

/// What a poll asked for, copied out of the borrow with the rank's contribution.
#[derive(Debug, Clone)]
enum Asked {
    States(CollectiveTag, RankState),
    ReadIngress(FetchMode),
    Fetch(CollectiveTag, Option<FetchBatch>),
    PrefixMatches(CollectiveTag, PrefixMatches),
    PadIntent(CollectiveTag, PadIntent),
    Votes(CollectiveTag, BatchVote),
    Forward(Option<ScheduledBatch>, Option<BatchNumber>),
    Responses(CollectiveTag, RankResponses),
    TransferStatus(CollectiveTag, TransferStatus, RankResponses),
    Ended(IterationReport),
    Finished,
    Stopped(StopReason),
}

impl Asked {
    fn step(&self) -> Step {
        match self {
            Asked::States(t, _) => Step::States(t.iteration),
            Asked::ReadIngress(m) => Step::ReadIngress(*m),
            Asked::Fetch(t, _) => Step::Fetch(t.iteration),
            Asked::PrefixMatches(t, _) => Step::PrefixMatches(t.iteration),
            Asked::PadIntent(t, _) => Step::PadIntent(t.iteration),
            Asked::Votes(t, _) => Step::Votes(t.iteration),
            Asked::Forward(l, a) => Step::Forward {
                launch: l.as_ref().map(|b| b.number.0),
                await_output: a.map(|b| b.0),
            },
            Asked::Responses(t, _) => Step::Responses(t.iteration),
            Asked::TransferStatus(t, ..) => Step::TransferStatus(t.iteration),
            Asked::Ended(r) => Step::Ended(r.stats.iteration),
            Asked::Finished => Step::Finished,
            Asked::Stopped(_) => Step::Stopped,
        }
    }

    fn tag(&self) -> Option<CollectiveTag> {
        match self {
            Asked::States(t, _)
            | Asked::Fetch(t, _)
            | Asked::PrefixMatches(t, _)
            | Asked::PadIntent(t, _)
            | Asked::Votes(t, _)
            | Asked::Responses(t, _)
            | Asked::TransferStatus(t, ..) => Some(*t),
            _ => None,
        }
    }
}

fn ask(exec: &mut RankExecutor) -> Asked {
    match exec.poll() {
        Io::Exchange(Exchange::States { tag, mine }) => Asked::States(tag, *mine),
        Io::Exchange(Exchange::Fetch { tag, mine }) => Asked::Fetch(tag, mine.cloned()),
        Io::Exchange(Exchange::PrefixMatches { tag, mine }) => {
            Asked::PrefixMatches(tag, mine.clone())
        }
        Io::Exchange(Exchange::PadIntent { tag, mine }) => Asked::PadIntent(tag, mine),
        Io::Exchange(Exchange::Votes { tag, mine }) => Asked::Votes(tag, *mine),
        Io::Exchange(Exchange::Responses { tag, mine }) => Asked::Responses(tag, mine.clone()),
        Io::Exchange(Exchange::TransferStatus {
            tag,
            mine,
            responses,
        }) => Asked::TransferStatus(tag, mine.clone(), responses.clone()),
        Io::ReadIngress(mode) => Asked::ReadIngress(mode),
        Io::Forward {
            launch,
            await_output,
            ..
        } => Asked::Forward(launch.cloned(), await_output),
        Io::IterationEnded(report) => Asked::Ended(report.clone()),
        Io::Finished => Asked::Finished,
        Io::Stopped(why) => Asked::Stopped(why.clone()),
    }
}

/// How one [`Host::iterate`] ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    /// Rank 0 asked to block and the ingress was empty: the ranks wait at the read.
    Idle,
    /// An iteration ran: responses gathered to rank 0 (rank order) and every report.
    Ran {
        responses: Vec<Response>,
        reports: Vec<IterationReport>,
        launched: Vec<ScheduledBatch>,
    },
    Finished,
    Stopped(StopReason),
}

/// The host of a server's ranks: collectives by hand, rank 0's ingress, the device.
struct Host {
    ranks: Vec<RankExecutor>,
    /// What rank 0 reads next.
    ingress: VecDeque<FetchBatch>,
    /// Per rank, the outputs sampled and not handed back yet.
    outputs: Vec<BTreeMap<BatchNumber, ForwardOutput>>,
    /// Per rank, every step it asked for.
    log: Vec<Vec<Step>>,
    /// Per rank, what it asked for last and was not answered yet.
    pending: Vec<Option<Asked>>,
}

impl Host {
    fn new(server: &ServerConfig) -> Host {
        let ranks = ranks(server);
        let n = ranks.len();
        Host {
            ranks,
            ingress: VecDeque::new(),
            outputs: vec![BTreeMap::new(); n],
            log: vec![Vec::new(); n],
            pending: vec![None; n],
        }
    }

    fn submit(&mut self, requests: Vec<RequestSpec>) {
        self.ingress.push_back(FetchBatch {
            requests,
            ..FetchBatch::default()
        });
    }

    fn control(&mut self, fetch: FetchBatch) {
        self.ingress.push_back(fetch);
    }

    fn poll(&mut self, i: usize) -> Asked {
        if let Some(a) = self.pending[i].clone() {
            return a;
        }
        let a = ask(&mut self.ranks[i]);
        self.log[i].push(a.step());
        self.pending[i] = Some(a.clone());
        a
    }

    fn answer(&mut self, i: usize, input: Input<'_>) {
        self.pending[i] = None;
        self.ranks[i]
            .handle(input)
            .unwrap_or_else(|e| panic!("rank {i} refused a well-formed input: {e}"));
    }

    /// Steps every rank through one iteration.
    fn iterate(&mut self) -> Outcome {
        let n = self.ranks.len();
        let mut launched = Vec::new();
        let mut responses = Vec::new();
        loop {
            let asked: Vec<Asked> = (0..n).map(|i| self.poll(i)).collect();
            if let Asked::ReadIngress(mode) = asked[0] {
                let read = match mode {
                    FetchMode::Poll => Some(self.ingress.pop_front().unwrap_or_default()),
                    FetchMode::Block | FetchMode::Stalled { .. } => self.ingress.pop_front(),
                };
                let Some(read) = read else {
                    return Outcome::Idle;
                };
                self.answer(0, Input::Ingress(read));
                continue;
            }
            // Every rank is at the same collective, with the same tag.
            let tag = asked[0].tag();
            for (i, a) in asked.iter().enumerate() {
                assert_eq!(
                    std::mem::discriminant(a),
                    std::mem::discriminant(&asked[0]),
                    "rank {i} diverged: {a:?} vs {:?}",
                    asked[0]
                );
                assert_eq!(a.tag(), tag, "rank {i}'s tag");
            }
            match &asked[0] {
                Asked::States(..) => {
                    let all: Vec<RankState> = asked
                        .iter()
                        .map(|a| match a {
                            Asked::States(_, s) => *s,
                            _ => unreachable!(),
                        })
                        .collect();
                    for i in 0..n {
                        self.answer(i, Input::States(&all));
                    }
                }
                Asked::Fetch(_, root) => {
                    let root = root.clone().expect("rank 0 broadcasts its read");
                    for (i, a) in asked.iter().enumerate().skip(1) {
                        assert!(
                            matches!(a, Asked::Fetch(_, None)),
                            "only rank 0 reads the ingress; rank {i}: {a:?}"
                        );
                    }
                    for i in 0..n {
                        self.answer(i, Input::Fetch(&root));
                    }
                }
                Asked::PrefixMatches(..) => {
                    let all: Vec<PrefixMatches> = asked
                        .iter()
                        .map(|a| match a {
                            Asked::PrefixMatches(_, m) => m.clone(),
                            _ => unreachable!(),
                        })
                        .collect();
                    for i in 0..n {
                        self.answer(i, Input::PrefixMatches(&all));
                    }
                }
                Asked::PadIntent(..) => {
                    let max = asked
                        .iter()
                        .map(|a| match a {
                            Asked::PadIntent(_, p) => *p,
                            _ => unreachable!(),
                        })
                        .max()
                        .unwrap_or_default();
                    for i in 0..n {
                        self.answer(i, Input::PadIntent(max));
                    }
                }
                Asked::Votes(..) => {
                    let all: Vec<BatchVote> = asked
                        .iter()
                        .map(|a| match a {
                            Asked::Votes(_, v) => *v,
                            _ => unreachable!(),
                        })
                        .collect();
                    for i in 0..n {
                        self.answer(i, Input::Votes(&all));
                    }
                }
                Asked::Forward(..) => {
                    for (i, a) in asked.iter().enumerate() {
                        let Asked::Forward(launch, await_output) = a else {
                            unreachable!()
                        };
                        if let Some(batch) = launch {
                            let sampled = batch
                                .entries
                                .iter()
                                .map(|e: &ForwardEntry| token(e.id, e.position))
                                .collect();
                            self.outputs[i].insert(
                                batch.number,
                                ForwardOutput {
                                    batch: batch.number,
                                    sampled,
                                    logprobs: Vec::new(),
                                },
                            );
                            launched.push(batch.clone());
                        }
                        let out = await_output.map(|b| {
                            self.outputs[i]
                                .remove(&b)
                                .unwrap_or_else(|| panic!("rank {i} awaits {b:?}, never launched"))
                        });
                        self.answer(i, Input::Output(out.as_ref()));
                    }
                }
                Asked::Responses(..) => {
                    for (i, a) in asked.iter().enumerate() {
                        let Asked::Responses(_, mine) = a else {
                            unreachable!()
                        };
                        assert_eq!(mine.rank, RankId(i as u32));
                        responses.extend(mine.responses.iter().cloned());
                        self.answer(i, Input::ResponsesGathered);
                    }
                }
                Asked::TransferStatus(..) => {
                    // The allgather carries the responses too.
                    let mut all: Vec<TransferStatus> = Vec::new();
                    for (i, a) in asked.iter().enumerate() {
                        let Asked::TransferStatus(_, status, mine) = a else {
                            unreachable!()
                        };
                        assert_eq!(mine.rank, RankId(i as u32));
                        responses.extend(mine.responses.iter().cloned());
                        all.push(status.clone());
                    }
                    for i in 0..n {
                        self.answer(i, Input::TransferStatus(&all));
                    }
                }
                Asked::Ended(_) => {
                    let reports = asked
                        .into_iter()
                        .map(|a| match a {
                            Asked::Ended(r) => r,
                            _ => unreachable!(),
                        })
                        .collect();
                    // `IterationEnded` is returned once: the next poll opens the next
                    // iteration.
                    self.pending = vec![None; n];
                    return Outcome::Ran {
                        responses,
                        reports,
                        launched,
                    };
                }
                Asked::Finished => return Outcome::Finished,
                Asked::Stopped(why) => return Outcome::Stopped(why.clone()),
                Asked::ReadIngress(_) => unreachable!("handled above"),
            }
        }
    }

    /// Iterates until idle or finished (at most `max` iterations); every response.
    fn run(&mut self, max: usize) -> Vec<Response> {
        let mut all = Vec::new();
        for _ in 0..max {
            match self.iterate() {
                Outcome::Ran { responses, .. } => all.extend(responses),
                Outcome::Idle | Outcome::Finished => return all,
                Outcome::Stopped(why) => panic!("stopped: {why:?}"),
            }
        }
        all
    }

    /// The steps rank `i` asked for since the last call.
    fn take_log(&mut self, i: usize) -> Vec<Step> {
        std::mem::take(&mut self.log[i])
    }
}

fn ran(outcome: Outcome) -> (Vec<Response>, Vec<IterationReport>, Vec<ScheduledBatch>) {
    match outcome {
        Outcome::Ran {
            responses,
            reports,
            launched,
        } => (responses, reports, launched),
        other => panic!("expected an iteration, got {other:?}"),
    }
}

fn tok(id: u64, position: u32, generated: u32, finish: Option<Finish>) -> Response {
    Response {
        id: ReqId(id),
        new_tokens: 1,
        last_token: token(ReqId(id), position),
        generated,
        finish,
        logprobs: None,
    }
}

fn shutdown() -> FetchBatch {
    FetchBatch {
        shutdown: true,
        ..FetchBatch::default()
    }
}

// ---- one rank ----

#[test]
fn an_aggregated_server_runs_states_fetch_votes_forward_responses_and_nothing_else() {
    let mut h = Host::new(&server(1, false));
    assert_eq!(
        h.ranks[0].schedule(),
        CollectiveSchedule {
            prefix_matches: false,
            pad_intent: false,
            transfers: false,
        }
    );
    assert_eq!(
        h.ranks[0].schedule().phases(),
        vec![Phase::Gather, Phase::Fetch, Phase::Vote, Phase::Responses]
    );
    h.submit(vec![RequestSpec::new(1, 20, 2)]);

    // Iteration 0: idle at the gather, so rank 0 blocks on the ingress; the request
    // arrives, its prefill runs, and its first token comes back in the same iteration.
    let (responses, reports, launched) = ran(h.iterate());
    assert_eq!(
        h.take_log(0),
        vec![
            Step::States(0),
            Step::ReadIngress(FetchMode::Block),
            Step::Fetch(0),
            Step::Votes(0),
            Step::Forward {
                launch: Some(0),
                await_output: Some(0),
            },
            Step::Responses(0),
            Step::Ended(0),
        ]
    );
    assert_eq!(responses, vec![tok(1, 0, 1, None)]);
    assert_eq!(launched.len(), 1);
    assert_eq!(launched[0].entries.len(), 1);
    assert_eq!(launched[0].entries[0].id, ReqId(1));
    assert_eq!(launched[0].entries[0].tokens(), 20, "the whole prompt");
    assert!(reports[0].stats.forward_ran);
    assert_eq!(reports[0].stats.num_ctx_requests, 1);
    assert!(reports[0].violations.is_empty());

    // Iteration 1: something is live, so rank 0 polls; the last token completes it.
    let (responses, reports, _) = ran(h.iterate());
    assert_eq!(
        h.take_log(0),
        vec![
            Step::States(1),
            Step::ReadIngress(FetchMode::Poll),
            Step::Fetch(1),
            Step::Votes(1),
            Step::Forward {
                launch: Some(1),
                await_output: Some(1),
            },
            Step::Responses(1),
            Step::Ended(1),
        ]
    );
    assert_eq!(responses, vec![tok(1, 1, 2, Some(Finish::Completed))]);
    assert_eq!(reports[0].stats.num_gen_requests, 1);
    assert!(h.ranks[0].active().is_empty());
    assert_eq!(h.ranks[0].kv().used_blocks(), 0, "its KV is freed");
    assert_eq!(h.ranks[0].seats_used(), 0, "its seat is freed");

    // Iteration 2: idle again: rank 0 blocks, and with nothing queued the rank waits.
    assert_eq!(h.iterate(), Outcome::Idle);
    assert_eq!(
        h.take_log(0),
        vec![Step::States(2), Step::ReadIngress(FetchMode::Block)]
    );
    assert_eq!(h.ranks[0].iteration(), 2);
}

#[test]
fn with_overlap_the_forward_launches_batch_n_plus_1_and_awaits_batch_n() {
    let mut h = Host::new(&server(1, true));
    h.submit(vec![RequestSpec::new(3, 20, 2)]);
    let mut steps = Vec::new();
    let mut responses = Vec::new();
    for _ in 0..3 {
        let (r, _, _) = ran(h.iterate());
        responses.push(r);
        steps.push(
            h.take_log(0)
                .into_iter()
                .filter(|s| matches!(s, Step::Forward { .. }))
                .collect::<Vec<_>>(),
        );
    }
    assert_eq!(
        steps,
        vec![
            // The prefill launches; nothing was in flight.
            vec![Step::Forward {
                launch: Some(0),
                await_output: None
            }],
            // The last token's step launches while the first token is applied.
            vec![Step::Forward {
                launch: Some(1),
                await_output: Some(0)
            }],
            // Nothing left to launch (the request is retiring): the last output is applied.
            vec![Step::Forward {
                launch: None,
                await_output: Some(1)
            }],
        ]
    );
    assert_eq!(
        responses,
        vec![
            vec![],
            vec![tok(3, 0, 1, None)],
            vec![tok(3, 1, 2, Some(Finish::Completed))],
        ]
    );
    assert_eq!(h.iterate(), Outcome::Idle);
}

#[test]
fn a_shutdown_drains_the_work_in_hand_then_every_poll_says_finished() {
    let mut h = Host::new(&server(1, false));
    h.submit(vec![RequestSpec::new(1, 20, 3)]);
    h.control(shutdown());
    // Iteration 0 reads the request, iteration 1 the shutdown; the request still runs
    // to its end before the server leaves.
    let responses = h.run(10);
    assert_eq!(
        responses,
        vec![
            tok(1, 0, 1, None),
            tok(1, 1, 2, None),
            tok(1, 2, 3, Some(Finish::Completed)),
        ]
    );
    assert!(h.ranks[0].shutdown_received());
    let log = h.take_log(0);
    assert_eq!(log.last(), Some(&Step::Finished));
    assert_eq!(
        log.iter().filter(|s| matches!(s, Step::Ended(_))).count(),
        3,
        "three iterations, then the gather that finds the server drained"
    );
    assert_eq!(log[log.len() - 2], Step::States(3));
    // Finished is final: polling again says so, and no input is taken.
    assert!(matches!(h.ranks[0].poll(), Io::Finished));
    let before = format!("{:?}", h.ranks[0]);
    let err = h.ranks[0].handle(Input::ResponsesGathered).unwrap_err();
    assert!(
        matches!(err, ExecutorError::UnexpectedInput { .. }),
        "{err}"
    );
    assert_eq!(format!("{:?}", h.ranks[0]), before);
}

#[test]
fn a_shutdown_read_while_idle_finishes_at_the_next_gather() {
    let mut h = Host::new(&server(1, false));
    assert_eq!(h.iterate(), Outcome::Idle);
    h.control(shutdown());
    let (responses, reports, launched) = ran(h.iterate());
    assert!(responses.is_empty() && launched.is_empty());
    assert!(!reports[0].stats.forward_ran);
    assert_eq!(h.iterate(), Outcome::Finished);
    assert_eq!(
        h.take_log(0),
        vec![
            Step::States(0),
            Step::ReadIngress(FetchMode::Block),
            Step::Fetch(0),
            Step::Votes(0),
            Step::Forward {
                launch: None,
                await_output: None
            },
            Step::Responses(0),
            Step::Ended(0),
            Step::States(1),
            Step::Finished,
        ]
    );
}

#[test]
fn refused_and_cancelled_requests_are_answered_in_the_responses() {
    let mut h = Host::new(&server(1, false));
    // Id 0 is the dummy's; a duplicate id; a prompt larger than T without chunking.
    h.submit(vec![
        RequestSpec::new(0, 8, 2),
        RequestSpec::new(5, 16, 8),
        RequestSpec::new(5, 16, 8),
        RequestSpec::new(6, 4096, 2),
    ]);
    let (responses, _, _) = ran(h.iterate());
    let failed: Vec<u64> = responses
        .iter()
        .filter(|r| matches!(r.finish, Some(Finish::Failed(_))))
        .map(|r| r.id.0)
        .collect();
    assert_eq!(failed, vec![0, 5, 6]);
    assert!(responses.contains(&tok(5, 0, 1, None)), "{responses:?}");
    // Request 5 is cancelled with the next read.
    h.control(FetchBatch {
        cancellations: vec![ReqId(5)],
        ..FetchBatch::default()
    });
    let (responses, _, _) = ran(h.iterate());
    assert_eq!(
        responses,
        vec![Response {
            id: ReqId(5),
            new_tokens: 0,
            last_token: 0,
            generated: 1,
            finish: Some(Finish::Cancelled),
            logprobs: None,
        }]
    );
    assert!(h.ranks[0].active().is_empty());
    assert_eq!(h.ranks[0].kv().used_blocks(), 0);
    assert_eq!(h.iterate(), Outcome::Idle);
}

#[test]
fn a_request_cancelled_in_the_fetch_that_brings_it_never_runs() {
    // A client that leaves at once: its cancel reaches rank 0's ingress before the
    // request was read, and both come in one fetch.
    let mut h = Host::new(&server(1, false));
    h.control(FetchBatch {
        requests: vec![RequestSpec::new(5, 16, 8)],
        cancellations: vec![ReqId(5)],
        ..FetchBatch::default()
    });
    let (responses, _, _) = ran(h.iterate());
    assert_eq!(
        responses,
        vec![Response {
            id: ReqId(5),
            new_tokens: 0,
            last_token: 0,
            generated: 0,
            finish: Some(Finish::Cancelled),
            logprobs: None,
        }]
    );
    assert!(h.ranks[0].active().is_empty());
    assert_eq!(h.ranks[0].kv().used_blocks(), 0);
    assert_eq!(h.iterate(), Outcome::Idle);
}

// ---- malformed inputs ----

/// Inputs that are wrong for what `asked` asks (wrong kind, wrong arity, wrong batch).
fn bad_inputs(asked: &Asked, dp: usize) -> Vec<Input<'static>> {
    static NO_STATES: [RankState; 0] = [];
    static NO_MATCHES: [PrefixMatches; 0] = [];
    static NO_VOTES: [BatchVote; 0] = [];
    static NO_STATUS: [TransferStatus; 0] = [];
    static THREE_STATES: [RankState; 3] = [RankState {
        rank: RankId(0),
        counts: lockstep_actors::counts::RankCounts {
            live: 0,
            routable: 0,
            routable_prompt_tokens: 0,
            schedulable: 0,
            pad_schedulable: 0,
            retiring: 0,
            receiving: 0,
        },
        responses_due: false,
        progressed: false,
        awaiting_transfer: false,
        balance: lockstep_actors::executor::BalanceLoad {
            context: 0,
            generation: 0,
        },
    }; 3];
    static BOGUS_FETCH: FetchBatch = FetchBatch {
        requests: Vec::new(),
        cancellations: Vec::new(),
        shutdown: true,
        peers_ready: Vec::new(),
        now_ns: 0,
        stalled_out: None,
    };
    static BOGUS_OUTPUT: ForwardOutput = ForwardOutput {
        batch: BatchNumber(999),
        sampled: Vec::new(),
        logprobs: Vec::new(),
    };
    assert!(dp < 3, "the wrong arities below assume dp < 3");
    let mut v: Vec<Input<'static>> = vec![
        Input::States(&NO_STATES),
        Input::States(&THREE_STATES),
        Input::PrefixMatches(&NO_MATCHES),
        Input::Votes(&NO_VOTES),
        Input::TransferStatus(&NO_STATUS),
        Input::Output(Some(&BOGUS_OUTPUT)),
    ];
    if !matches!(asked, Asked::ReadIngress(_)) {
        v.push(Input::Ingress(shutdown()));
    }
    if !matches!(asked, Asked::Fetch(..)) {
        v.push(Input::Fetch(&BOGUS_FETCH));
    }
    if !matches!(asked, Asked::PadIntent(..)) {
        v.push(Input::PadIntent(PadIntent::Context));
    }
    if !matches!(asked, Asked::Responses(..)) {
        v.push(Input::ResponsesGathered);
    }
    // `Output(None)` is the right answer only to a forward that awaits nothing.
    if !matches!(asked, Asked::Forward(_, None)) {
        v.push(Input::Output(None));
    }
    v
}

#[test]
fn every_malformed_or_out_of_order_input_is_refused_and_changes_nothing() {
    let cfg = server(1, true);
    let mut h = Host::new(&cfg);
    h.submit(vec![RequestSpec::new(1, 20, 3), RequestSpec::new(2, 40, 2)]);
    h.control(shutdown());
    let mut refused = 0;
    let mut finished = false;
    for _ in 0..20 {
        // Before each answer the host would give, try every wrong one first.
        loop {
            let asked = h.poll(0);
            if matches!(asked, Asked::Ended(_)) {
                // `IterationEnded` was returned; the rank awaits the next poll.
                h.pending[0] = None;
                for bad in bad_inputs(&Asked::Finished, 1) {
                    let before = format!("{:?}", h.ranks[0]);
                    let err = h.ranks[0].handle(bad).unwrap_err();
                    assert!(
                        matches!(err, ExecutorError::UnexpectedInput { .. }),
                        "{err}"
                    );
                    assert_eq!(format!("{:?}", h.ranks[0]), before);
                    refused += 1;
                }
                break;
            }
            if matches!(asked, Asked::Finished) {
                finished = true;
                break;
            }
            for bad in bad_inputs(&asked, 1) {
                let name = format!("{bad:?}");
                let before = format!("{:?}", h.ranks[0]);
                let err = h.ranks[0]
                    .handle(bad)
                    .expect_err(&format!("{name} accepted while the rank asked {asked:?}"));
                assert_eq!(
                    format!("{:?}", h.ranks[0]),
                    before,
                    "{name} ({err}) changed the rank"
                );
                refused += 1;
            }
            // The same question is asked again, unchanged.
            let again = ask(&mut h.ranks[0]);
            assert_eq!(format!("{again:?}"), format!("{asked:?}"));
            // Now the right answer, one step.
            match h.step_once() {
                StepResult::Continue => {}
                StepResult::Idle => panic!("the script never idles"),
            }
        }
        if finished {
            break;
        }
    }
    assert!(finished, "the server drained and finished");
    assert!(refused > 50, "{refused} refusals tried");

    // The same script without the bad inputs gives the same responses and end state.
    let mut clean = Host::new(&cfg);
    clean.submit(vec![RequestSpec::new(1, 20, 3), RequestSpec::new(2, 40, 2)]);
    clean.control(shutdown());
    clean.run(20);
    assert_eq!(
        format!("{:?}", clean.ranks[0].totals()),
        format!("{:?}", h.ranks[0].totals())
    );
    assert_eq!(
        format!("{:?}", clean.ranks[0].last_report()),
        format!("{:?}", h.ranks[0].last_report())
    );
}

/// What one [`Host::step_once`] did.
enum StepResult {
    Continue,
    Idle,
}

impl Host {
    /// Answers the one pending question of a one-rank host (the single-rank form of
    /// [`Host::iterate`]'s loop body).
    fn step_once(&mut self) -> StepResult {
        assert_eq!(self.ranks.len(), 1);
        let asked = self.poll(0);
        match asked {
            Asked::States(_, s) => self.answer(0, Input::States(&[s])),
            Asked::ReadIngress(mode) => {
                let read = match mode {
                    FetchMode::Poll => Some(self.ingress.pop_front().unwrap_or_default()),
                    _ => self.ingress.pop_front(),
                };
                let Some(read) = read else {
                    return StepResult::Idle;
                };
                self.answer(0, Input::Ingress(read));
            }
            Asked::Fetch(_, f) => self.answer(0, Input::Fetch(&f.expect("rank 0 read"))),
            Asked::PrefixMatches(_, m) => self.answer(0, Input::PrefixMatches(&[m])),
            Asked::PadIntent(_, p) => self.answer(0, Input::PadIntent(p)),
            Asked::Votes(_, v) => self.answer(0, Input::Votes(&[v])),
            Asked::Forward(launch, await_output) => {
                if let Some(batch) = launch {
                    let sampled = batch
                        .entries
                        .iter()
                        .map(|e| token(e.id, e.position))
                        .collect();
                    self.outputs[0].insert(
                        batch.number,
                        ForwardOutput {
                            batch: batch.number,
                            sampled,
                            logprobs: Vec::new(),
                        },
                    );
                }
                let out = await_output.map(|b| self.outputs[0].remove(&b).expect("launched"));
                self.answer(0, Input::Output(out.as_ref()));
            }
            Asked::Responses(..) => self.answer(0, Input::ResponsesGathered),
            Asked::TransferStatus(_, s, _) => self.answer(0, Input::TransferStatus(&[s])),
            Asked::Ended(_) | Asked::Finished | Asked::Stopped(_) => {
                self.pending[0] = None;
            }
        }
        StepResult::Continue
    }
}

#[test]
fn wrong_arity_wrong_batch_and_wrong_phase_name_the_problem() {
    let mut h = Host::new(&server(1, false));
    h.submit(vec![RequestSpec::new(1, 20, 2)]);
    let Asked::States(tag, mine) = h.poll(0) else {
        panic!("an iteration opens with the gather")
    };
    assert_eq!(
        tag,
        CollectiveTag {
            iteration: 0,
            phase: Phase::Gather
        }
    );
    assert_eq!(
        h.ranks[0].handle(Input::States(&[mine, mine])),
        Err(ExecutorError::WrongArity {
            rank: RankId(0),
            iteration: 0,
            phase: Phase::Gather,
            got: 2,
            want: 1,
        })
    );
    assert_eq!(
        h.ranks[0].handle(Input::Votes(&[BatchVote::default()])),
        Err(ExecutorError::UnexpectedInput {
            rank: RankId(0),
            iteration: 0,
            awaiting: "the states",
            got: "the votes",
        })
    );
    // On to the forward step.
    while !matches!(h.poll(0), Asked::Forward(..)) {
        h.step_once();
    }
    let Asked::Forward(Some(batch), Some(awaited)) = h.poll(0) else {
        panic!("the prefill launches and is awaited")
    };
    assert_eq!(awaited, batch.number);
    let wrong = ForwardOutput {
        batch: BatchNumber(batch.number.0 + 1),
        sampled: vec![0],
        logprobs: Vec::new(),
    };
    assert_eq!(
        h.ranks[0].handle(Input::Output(Some(&wrong))),
        Err(ExecutorError::WrongBatch {
            rank: RankId(0),
            got: Some(BatchNumber(batch.number.0 + 1)),
            want: Some(batch.number),
        })
    );
    assert_eq!(
        h.ranks[0].handle(Input::Output(None)),
        Err(ExecutorError::WrongBatch {
            rank: RankId(0),
            got: None,
            want: Some(batch.number),
        })
    );
    // The right output is still taken and the request proceeds.
    h.step_once();
    assert!(matches!(h.poll(0), Asked::Responses(_, r) if r.responses == vec![tok(1, 0, 1, None)]));
}

// ---- two ranks by hand ----

#[test]
fn two_ranks_run_the_same_collectives_and_only_rank_0_reads_the_ingress() {
    let mut h = Host::new(&server(2, false));
    h.submit(vec![RequestSpec::new(1, 20, 2), RequestSpec::new(2, 30, 2)]);
    let (responses, reports, launched) = ran(h.iterate());
    assert_eq!(
        h.take_log(0),
        vec![
            Step::States(0),
            Step::ReadIngress(FetchMode::Block),
            Step::Fetch(0),
            Step::Votes(0),
            Step::Forward {
                launch: Some(0),
                await_output: Some(0),
            },
            Step::Responses(0),
            Step::Ended(0),
        ]
    );
    assert_eq!(
        h.take_log(1),
        vec![
            Step::States(0),
            Step::Fetch(0),
            Step::Votes(0),
            Step::Forward {
                launch: Some(0),
                await_output: Some(0),
            },
            Step::Responses(0),
            Step::Ended(0),
        ]
    );
    // Balanced routing, longest prompt first: request 2 to rank 0, request 1 to rank 1.
    let placed: Vec<(u32, Vec<u64>)> = launched
        .iter()
        .map(|b| (b.rank.0, b.entries.iter().map(|e| e.id.0).collect()))
        .collect();
    assert_eq!(placed, vec![(0, vec![2]), (1, vec![1])]);
    // Rank 0 gathers both ranks' responses, in rank order.
    assert_eq!(responses, vec![tok(2, 0, 1, None), tok(1, 0, 1, None)]);
    assert!(reports.iter().all(|r| r.stats.forward_ran));
    assert_eq!(reports.len(), 2);
    // Both ranks keep the same replicated waiting queue (empty) and each holds one.
    assert_eq!(h.ranks[0].active().len(), 1);
    assert_eq!(h.ranks[1].active().len(), 1);

    let (responses, _, _) = ran(h.iterate());
    assert_eq!(
        responses,
        vec![
            tok(2, 1, 2, Some(Finish::Completed)),
            tok(1, 1, 2, Some(Finish::Completed)),
        ]
    );
    assert_eq!(h.take_log(0)[1], Step::ReadIngress(FetchMode::Poll));
    assert!(
        !h.take_log(1)
            .iter()
            .any(|s| matches!(s, Step::ReadIngress(_)))
    );
    // Idle: rank 0 blocks at the read; rank 1 waits at the fetch broadcast.
    assert_eq!(h.iterate(), Outcome::Idle);
    assert_eq!(
        h.take_log(0),
        vec![Step::States(2), Step::ReadIngress(FetchMode::Block)]
    );
    assert_eq!(h.take_log(1), vec![Step::States(2), Step::Fetch(2)]);

    // Shutdown: both ranks leave at the same gather.
    h.control(shutdown());
    ran(h.iterate());
    assert_eq!(h.iterate(), Outcome::Finished);
    assert_eq!(h.take_log(0).last(), Some(&Step::Finished));
    assert_eq!(h.take_log(1).last(), Some(&Step::Finished));
}

#[test]
fn a_rank_with_nothing_to_run_pads_a_dummy_so_its_peer_can_run() {
    let mut h = Host::new(&server(2, false));
    h.submit(vec![RequestSpec::new(1, 20, 3)]);
    let (responses, reports, launched) = ran(h.iterate());
    assert_eq!(responses, vec![tok(1, 0, 1, None)]);
    assert!(reports.iter().all(|r| r.stats.forward_ran));
    let by_rank: Vec<(u32, Vec<(u64, bool)>)> = launched
        .iter()
        .map(|b| {
            (
                b.rank.0,
                b.entries.iter().map(|e| (e.id.0, e.is_dummy)).collect(),
            )
        })
        .collect();
    assert_eq!(
        by_rank,
        vec![(0, vec![(1, false)]), (1, vec![(ReqId::DUMMY.0, true)])]
    );
    assert!(reports[1].stats.dummy_added && reports[1].stats.dummy_committed);
    assert!(
        h.ranks[1].dummy().is_none(),
        "no dummy outlives its iteration"
    );
    assert_eq!(h.ranks[1].kv().used_blocks(), 0);
    assert_eq!(h.ranks[1].seats_used(), 0);
}

#[test]
fn a_malformed_collective_result_on_one_rank_changes_nothing_there() {
    let mut h = Host::new(&server(2, false));
    h.submit(vec![RequestSpec::new(1, 20, 2)]);
    // Rank 1 gets a one-entry gather (dp is 2); refused, and its state is unchanged.
    let Asked::States(_, mine) = h.poll(1) else {
        panic!("the gather")
    };
    let before = format!("{:?}", h.ranks[1]);
    assert!(matches!(
        h.ranks[1].handle(Input::States(&[mine])),
        Err(ExecutorError::WrongArity {
            phase: Phase::Gather,
            got: 1,
            want: 2,
            ..
        })
    ));
    // Rank 1 never reads the ingress.
    assert!(matches!(
        h.ranks[1].handle(Input::Ingress(FetchBatch::default())),
        Err(ExecutorError::UnexpectedInput { .. })
    ));
    assert_eq!(format!("{:?}", h.ranks[1]), before);
    // The iteration then runs as if nothing happened.
    let (responses, _, _) = ran(h.iterate());
    assert_eq!(responses, vec![tok(1, 0, 1, None)]);
}

#[test]
fn a_kv_aware_server_adds_the_prefix_match_allgather_and_checks_its_width() {
    use lockstep_actors::config::{AttentionDpConfig, RouterKind};
    let cfg = ServerConfig {
        attention_dp_config: AttentionDpConfig {
            router: RouterKind::KvAware,
            ..AttentionDpConfig::default()
        },
        ..server(2, false)
    };
    let mut h = Host::new(&cfg);
    assert_eq!(
        h.ranks[0].schedule().phases(),
        vec![
            Phase::Gather,
            Phase::Fetch,
            Phase::PrefixMatch,
            Phase::Vote,
            Phase::Responses
        ]
    );
    h.submit(vec![RequestSpec::new(1, 20, 2), RequestSpec::new(2, 20, 2)]);
    // Run to the prefix-match allgather by hand.
    let (Asked::States(_, s0), Asked::States(_, s1)) = (h.poll(0), h.poll(1)) else {
        panic!("the gather")
    };
    for i in 0..2 {
        h.answer(i, Input::States(&[s0, s1]));
    }
    let Asked::ReadIngress(FetchMode::Block) = h.poll(0) else {
        panic!("rank 0 reads")
    };
    let read = h.ingress.pop_front().expect("queued");
    h.answer(0, Input::Ingress(read));
    let Asked::Fetch(_, Some(fetched)) = h.poll(0) else {
        panic!("the broadcast")
    };
    for i in 0..2 {
        h.answer(i, Input::Fetch(&fetched));
    }
    let Asked::PrefixMatches(tag, m0) = h.poll(0) else {
        panic!("the prefix matches")
    };
    assert_eq!(tag.phase, Phase::PrefixMatch);
    assert_eq!(m0.tokens, vec![0, 0], "one entry per popped request");
    // A peer's entry with the wrong width is refused and changes nothing.
    let short = PrefixMatches { tokens: vec![0] };
    let before = format!("{:?}", h.ranks[0]);
    assert_eq!(
        h.ranks[0].handle(Input::PrefixMatches(&[m0.clone(), short])),
        Err(ExecutorError::WrongArity {
            rank: RankId(0),
            iteration: 0,
            phase: Phase::PrefixMatch,
            got: 1,
            want: 2,
        })
    );
    assert_eq!(format!("{:?}", h.ranks[0]), before);
    // The well-formed round goes on as usual.
    let (responses, _, _) = ran(h.iterate());
    assert_eq!(responses.len(), 2);
    assert!(h.take_log(1).contains(&Step::PrefixMatches(0)));
}

/// The prompt ids test request `id` carries.
fn carried_prompt(id: u64, len: u32) -> Vec<u32> {
    (0..len).map(|t| (id as u32) * 1000 + t).collect()
}

/// Runs `specs` on a server of `dp` ranks whose executors fill the forward inputs or
/// not (`on`), calling `check` with every rank and its launched batch at each forward.
fn with_launched_batches(
    dp: i64,
    overlap: bool,
    on: bool,
    specs: Vec<RequestSpec>,
    mut check: impl FnMut(&RankExecutor, &ScheduledBatch),
) -> usize {
    use lockstep_actors::group::{DeterministicTokens, GroupNeed, ServerGroup};
    let mut group = ServerGroup::new(&server(dp, overlap), Policy::FIXED).expect("valid");
    group.set_forward_inputs(on);
    let mut specs = Some(specs);
    let mut launched = 0;
    for _ in 0..10_000 {
        match group.advance().expect("no protocol error") {
            GroupNeed::ReadIngress(_) => {
                let mut read = FetchBatch::default();
                match specs.take() {
                    Some(s) => read.requests = s,
                    None => read.shutdown = true,
                }
                group.provide_ingress(read).expect("ingress");
            }
            GroupNeed::Forward { .. } => {
                for exec in group.ranks() {
                    if let Some(batch) = exec.launched() {
                        check(exec, batch);
                        launched += 1;
                    }
                }
                group
                    .sample_launched(&mut DeterministicTokens)
                    .expect("sampled");
                group.provide_outputs().expect("outputs");
            }
            GroupNeed::IterationEnded => {}
            GroupNeed::Finished => return launched,
            GroupNeed::Stopped(why) => panic!("stopped: {why:?}"),
        }
    }
    panic!("the server did not drain");
}

#[test]
fn a_launched_batch_carries_each_entrys_block_table_prompt_and_sampling() {
    for overlap in [false, true] {
        let specs = (1..=6)
            .map(|id| {
                let mut s = RequestSpec::new(id, 40, 5);
                // Two full blocks of 16 tokens: two hashes.
                s.block_hashes = vec![id * 10, id * 10 + 1].into();
                if id % 2 == 0 {
                    s.prompt_tokens = carried_prompt(id, 40);
                    s.sampling = Some(lockstep_actors::request::RequestSampling {
                        temperature: 0.5,
                        top_p: 0.9,
                        top_k: 7,
                        seed: id,
                        ..lockstep_actors::request::RequestSampling::default()
                    });
                    s.logit_bias = vec![lockstep_actors::request::TokenBias {
                        token: id as u32,
                        bias: -1.5,
                    }];
                    s.end_ids = vec![2, id as u32];
                }
                s
            })
            .collect();
        let (mut contexts, mut decodes) = (0, 0);
        let launched = with_launched_batches(2, overlap, true, specs, |exec, batch| {
            assert!(batch.inputs.filled);
            assert_eq!(batch.inputs.pool.tokens_per_block, 16);
            assert_eq!(batch.inputs.pool.blocks, exec.kv().total_blocks());
            assert_eq!(batch.inputs.entries.len(), batch.entries.len());
            let inputs = &batch.inputs;
            for (e, inp) in batch.with_inputs() {
                if e.is_dummy {
                    assert!(inputs.block_table(inp).is_empty());
                    continue;
                }
                // The table as the KV manager holds it at launch.
                let held: Vec<u32> = exec.kv().block_ids_of(e.id).iter().map(|b| b.0).collect();
                assert!(!held.is_empty(), "request {} holds blocks", e.id);
                assert_eq!(inputs.block_table(inp), held, "request {}", e.id);
                assert_eq!(inp.prompt_len, 40);
                let even = e.id.0 % 2 == 0;
                assert_eq!(inp.sampling.map(|s| s.seed), even.then_some(e.id.0));
                // Every step samples, so every entry carries its request's logit rules.
                let (bias, end_ids) = (inputs.logit_bias(inp), inputs.end_ids(inp));
                if even {
                    assert_eq!(
                        bias.iter().map(|b| (b.token, b.bias)).collect::<Vec<_>>(),
                        [(e.id.0 as u32, -1.5)]
                    );
                    assert_eq!(end_ids, [2, e.id.0 as u32]);
                } else {
                    assert!(bias.is_empty() && end_ids.is_empty());
                }
                match e.kind {
                    ForwardKind::Context { .. } => {
                        contexts += 1;
                        let want = if even {
                            carried_prompt(e.id.0, 40)
                        } else {
                            Vec::new()
                        };
                        assert_eq!(inputs.prompt_ids(inp), want);
                        assert_eq!(inputs.block_hashes(inp), [e.id.0 * 10, e.id.0 * 10 + 1]);
                    }
                    ForwardKind::Generation { .. } => {
                        decodes += 1;
                        assert!(inputs.prompt_ids(inp).is_empty());
                        assert!(inputs.block_hashes(inp).is_empty());
                    }
                }
            }
        });
        assert!(launched > 0);
        assert_eq!(contexts, 6, "overlap {overlap}: every prefill seen once");
        assert!(
            decodes >= 6 * 4,
            "overlap {overlap}: {decodes} decode steps"
        );
    }
}

#[test]
fn without_a_device_that_reads_them_a_batch_carries_no_forward_inputs() {
    let specs = (1..=4)
        .map(|id| {
            let mut s = RequestSpec::new(id, 40, 3);
            s.prompt_tokens = carried_prompt(id, 40);
            s
        })
        .collect();
    let mut entries = 0;
    with_launched_batches(2, false, false, specs, |_, batch| {
        let inputs = &batch.inputs;
        assert!(!inputs.filled);
        assert!(inputs.entries.is_empty());
        assert!(inputs.block_ids.is_empty() && inputs.prompt_ids.is_empty());
        assert!(inputs.block_hashes.is_empty() && inputs.live.is_none());
        entries += batch.real_entries().count();
    });
    assert!(entries > 0);
}

#[test]
fn every_256th_batch_lists_the_requests_the_rank_still_holds() {
    // One long request on one rank, another that finishes early.
    let specs = vec![RequestSpec::new(1, 20, 600), RequestSpec::new(2, 20, 3)];
    let mut listed = Vec::new();
    with_launched_batches(1, false, true, specs, |_, batch| {
        let n = batch.number.0;
        match &batch.inputs.live {
            Some(live) => listed.push((n, live.clone())),
            None => assert!(n == 0 || !n.is_multiple_of(256), "batch {n} lists none"),
        }
    });
    let n = lockstep_actors::executor::LIVE_EVERY;
    assert_eq!(
        listed,
        vec![(n, vec![ReqId(1)]), (2 * n, vec![ReqId(1)])],
        "the finished request is not listed"
    );
}
