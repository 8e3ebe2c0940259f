//! The client, written once: plays the workload into the front through the serving
//! front door ([`crate::frontend`]), keeps a record per request from the responses the
//! front passes on (through the front door too), and says when it is done. Sans-I/O:
//! the driver says what time it is, hands it the responses, and sends what it gives.
//! The simulator runs it in virtual time; the real drivers in wall time, scaled.

use lockstep_actors::ids::ReqId;
use lockstep_actors::request::RequestSpec;
use lockstep_actors::vocab::{FailureKind, Response, TokenRun};

use crate::by_id::ById;
use crate::frontend::{Frontend, Passed};
use lockstep_plan::report::{Itl, RequestDetail, digest_token};
use lockstep_plan::workload::Workload;

/// What the client tells the front.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientItem {
    /// A new request.
    Request(RequestSpec),
    /// Cancel a request.
    Cancel(ReqId),
    /// Nothing more will come.
    Shutdown,
}

/// `--preload` with a workload whose later requests depend on earlier ones finishing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--preload delivers every request before the first iteration, but {0}")]
pub struct NotPreloadable(pub String);

/// The failure of a request the client could not send: the fleet had stopped.
const FRONT_STOPPED: &str = "not served: every server had stopped before the request was sent";

/// What the client saw.
pub struct ClientResult {
    /// One record per request, in id order.
    pub records: Vec<RequestDetail>,
    /// Inter-token gaps.
    pub itl: Itl,
    /// The time of the client's end.
    pub end_ns: u64,
    /// What the front door did (`None`: the run had none, e.g. `--preload`).
    pub frontend: Option<lockstep_plan::report::FrontendSummary>,
}

/// The client.
pub struct Client {
    workload: Workload,
    /// The front door every request and response passes (free with `--preload`).
    frontend: Frontend,
    /// Whether the run had a front door to report.
    has_frontend: bool,
    records: ById<RequestDetail>,
    itl: Itl,
    /// Requests issued, and those that ended (completed or failed).
    issued: u64,
    finished: u64,
    shutdown_sent: bool,
}

impl Client {
    /// A client playing `workload` through `frontend`.
    pub fn new(workload: Workload, frontend: Frontend) -> Client {
        Client {
            itl: Itl::new(workload.warmup_requests()),
            workload,
            frontend,
            has_frontend: true,
            records: ById::new(),
            issued: 0,
            finished: 0,
            shutdown_sent: false,
        }
    }

    /// Every request at time 0 and the shutdown, for the front before any rank runs
    /// (refused for a workload whose arrivals wait on completions). They skip the front
    /// door, and so do their responses: a preloaded run has none.
    pub fn preload(&mut self) -> Result<Vec<ClientItem>, NotPreloadable> {
        if let Some(why) = self.workload.preload_blocker() {
            return Err(NotPreloadable(why));
        }
        self.frontend = Frontend::free();
        self.has_frontend = false;
        let mut items = Vec::new();
        while let Some(t) = self.workload.next_arrival_ns() {
            let Some(a) = self.workload.pop_due(t) else {
                break;
            };
            self.records
                .insert(a.spec.id, RequestDetail::arrived(&a.spec, 0));
            self.issued += 1;
            items.push(ClientItem::Request(a.spec));
        }
        items.push(ClientItem::Shutdown);
        self.shutdown_sent = true;
        Ok(items)
    }

    /// When the next request is due, in workload time (`None`: none known now).
    pub fn next_arrival_ns(&self) -> Option<u64> {
        self.workload.next_arrival_ns()
    }

    /// Sends every request due by `due_ns` (workload time) at `now`: each enters the
    /// front door, recorded as sent then; those it passes at once go into `out`, for
    /// the front.
    pub fn send_due(&mut self, due_ns: u64, now: u64, out: &mut Vec<ClientItem>) {
        self.settle_tokens(now);
        while let Some(a) = self.workload.pop_due(due_ns) {
            let mut rec = RequestDetail::arrived(&a.spec, now);
            let admitted = self.frontend.admit(now, a.spec);
            rec.front_queue_ns = admitted.queue_ns;
            rec.front_service_ns = admitted.service_ns;
            self.records.insert(ReqId(rec.id), rec);
            self.issued += 1;
            if let Some(spec) = admitted.passed {
                out.push(ClientItem::Request(spec));
            }
        }
    }

    /// When the front door is next done with something that cannot wait (driver
    /// time; [`Frontend::poll_timeout`]: plain tokens wait until then, or until the
    /// client takes anything in).
    pub fn poll_timeout(&self) -> Option<u64> {
        self.frontend.poll_timeout()
    }

    /// When the front door is next done with anything, plain tokens too: for a driver
    /// with nothing else to wait for.
    pub fn next_due(&self) -> Option<u64> {
        self.frontend.next_due()
    }

    /// When the front door is next done with something other than plain tokens
    /// ([`Frontend::next_due_beyond_tokens`]).
    pub fn next_due_beyond_tokens(&self) -> Option<u64> {
        self.frontend.next_due_beyond_tokens()
    }

    /// What the front door is done with by `now`: requests go into `out`, for the
    /// front; responses reach their records.
    pub fn handle_timeout(&mut self, now: u64, out: &mut Vec<ClientItem>) {
        let Client {
            frontend,
            records,
            itl,
            workload,
            finished,
            ..
        } = self;
        frontend.release(now, |passed| {
            if let Passed::Request(spec) = passed {
                out.push(ClientItem::Request(spec));
            } else {
                *finished += pass_on(records, itl, workload, passed);
            }
        });
    }

    /// The plain tokens the front door is done with by `now` reach their records
    /// ([`Frontend::release_tokens`]): before the door takes anything new, or anyone
    /// reads the records.
    fn settle_tokens(&mut self, now: u64) {
        let Client {
            frontend,
            records,
            itl,
            workload,
            ..
        } = self;
        frontend.release_tokens(now, |passed| {
            pass_on(records, itl, workload, passed);
        });
    }

    /// A coasting server's iteration that ended at `now` gave `shares[p]` plain
    /// tokens to the requests of front-door process `p`
    /// ([`Frontend::serve_tokens`]; when each job is done goes to `dues[p]`).
    pub fn serve_tokens(&mut self, now: u64, shares: &[u64], dues: &mut [Vec<u64>]) {
        self.frontend.serve_tokens(now, shares, dues);
    }

    /// The tokens of the iterations [`Client::serve_tokens`] served, to pass the
    /// front door when their jobs are done ([`Frontend::hold_tokens`]).
    pub fn hold_tokens(&mut self, run: TokenRun, dues: Vec<Vec<u64>>) {
        self.frontend.hold_tokens(run, dues);
    }

    /// How many processes the front door has.
    pub fn door_processes(&self) -> usize {
        self.frontend.processes()
    }

    /// The front door process that serves request `id`.
    pub fn door_process_of(&self, id: u64) -> usize {
        self.frontend.process_of(id)
    }

    /// The front passed on `responses` at `now`: they pass the front door on their way
    /// (at once, or at [`Client::poll_timeout`]).
    pub fn on_responses(&mut self, now: u64, responses: &[Response]) {
        self.settle_tokens(now);
        if self.frontend.emit(now, responses) {
            for r in responses {
                self.finished +=
                    receive(&mut self.records, &mut self.itl, &mut self.workload, now, r);
            }
        }
    }

    /// The shutdown, once: when every request was issued and has ended.
    pub fn shutdown_due(&mut self) -> Option<ClientItem> {
        if !self.shutdown_sent && self.workload.exhausted() && self.finished >= self.issued {
            self.shutdown_sent = true;
            return Some(ClientItem::Shutdown);
        }
        None
    }

    /// Requests that ended, and how many there will be (if known).
    pub fn progress(&self) -> (u64, Option<u64>) {
        (self.finished, self.workload.total())
    }

    /// The front stopped (it does once every server has stopped, e.g. a deadlocked
    /// server) before the workload was played out: `refused`, if the front refused it,
    /// and every request still to come fail, as requests sent to a stopped fleet do.
    pub fn front_stopped(&mut self, now: u64, refused: Option<ReqId>) {
        self.settle_tokens(now);
        let fail = |rec: &mut RequestDetail, workload: &mut Workload| {
            rec.fail(now, FailureKind::Unavailable, FRONT_STOPPED);
            workload.on_finished(ReqId(rec.id), now, false);
        };
        if let Some(rec) = refused.and_then(|id| self.records.get_mut(&id)) {
            fail(rec, &mut self.workload);
            self.finished += 1;
        }
        // Requests still open stay open (the report fails them as "still open when the
        // run ended (OUTCOME)"), but their clients are free, so a closed loop's
        // remaining requests are all drawn and failed below.
        for rec in self.records.values().filter(|r| r.end_ns().is_none()) {
            self.workload.on_finished(ReqId(rec.id), now, false);
        }
        while let Some(t) = self.workload.next_arrival_ns() {
            let Some(a) = self.workload.pop_due(t) else {
                break;
            };
            let mut rec = RequestDetail::arrived(&a.spec, now);
            fail(&mut rec, &mut self.workload);
            self.issued += 1;
            self.finished += 1;
            self.records.insert(ReqId(rec.id), rec);
        }
    }

    /// What the client saw, ending at `end_ns`.
    pub fn into_result(mut self, end_ns: u64) -> ClientResult {
        self.settle_tokens(end_ns);
        ClientResult {
            frontend: self.has_frontend.then(|| self.frontend.summary(end_ns)),
            records: self.records.into_values(),
            itl: self.itl,
            end_ns,
        }
    }
}

/// A job the front door handed on (not a request) reaches the records, at the times
/// the door was done with it: 1 if it ended a request.
fn pass_on(
    records: &mut ById<RequestDetail>,
    itl: &mut Itl,
    workload: &mut Workload,
    passed: Passed<'_>,
) -> u64 {
    match passed {
        Passed::Request(_) => unreachable!("requests go to the front"),
        // At the time the door was done with them: plain tokens may come out later.
        Passed::Responses { responses, due } => responses
            .iter()
            .map(|r| receive(records, itl, workload, due, r))
            .sum(),
        Passed::Tokens { run, steps, dues } => {
            let mut measured = 0;
            let mut digests = Vec::with_capacity(run.ids.len());
            for (i, id) in run.ids.iter().enumerate() {
                if let Some(rec) = records.get_mut(id) {
                    let first = run.tokens_of(i)[steps.start];
                    measured += u64::from(rec.on_token_steps(*id, first, dues, itl));
                    digests.push((i, rec.token_digest));
                }
            }
            // The gaps after each request's first delivery are every request's.
            itl.record_gaps(dues, measured);
            // Each stream's digest is a chain; the requests' chains are independent, so
            // they advance together, step by step (one chain at a time would wait on
            // each multiplication).
            for j in steps.start + 1..steps.end {
                for (i, digest) in &mut digests {
                    *digest = digest_token(*digest, run.tokens_of(*i)[j], 1);
                }
            }
            for (i, digest) in digests {
                if let Some(rec) = records.get_mut(&run.ids[i]) {
                    rec.token_digest = digest;
                }
            }
            0
        }
    }
}

/// A response reaches the client at `now`: 1 if it ended its request.
fn receive(
    records: &mut ById<RequestDetail>,
    itl: &mut Itl,
    workload: &mut Workload,
    now: u64,
    r: &Response,
) -> u64 {
    let Some(rec) = records.get_mut(&r.id) else {
        return 0;
    };
    let was_open = rec.end_ns().is_none();
    rec.on_response(r, now, itl);
    if was_open && rec.end_ns().is_some() {
        workload.on_finished(r.id, now, rec.completed());
        return 1;
    }
    0
}
