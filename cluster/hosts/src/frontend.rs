//! The serving front door, written once and sans-I/O: between the client and the front,
//! N processes each serve one job at a time, in the order the jobs came — a request
//! (parse, tokenize, hand to the executor's queue: `request_us` + `prompt_token_ns` per
//! prompt token) or a response (detokenize and stream: `output_token_ns` per new token).
//! A request and its responses stay on one process, as a connection does: request `id`
//! on process `(id − 1) mod N` (ids are issued in arrival order, so that is round
//! robin). The responses of one iteration reach a process as one message and it
//! handles them as one job, as the Python front doors' output loops do: their clients
//! see the tokens when the whole job is done. The client ([`crate::client`]) runs it in every driver: the simulator at
//! scale 1, the real drivers with their time scale.
//!
//! Each process's jobs finish in the order they came (one at a time, first come first
//! served), so a job's end is known when it comes: `max(now, process free) + cost`.
//! Each process keeps its held jobs in that order, and the next one due is the earliest
//! of their heads.

use std::collections::VecDeque;

use lockstep_actors::request::RequestSpec;
use lockstep_actors::vocab::{Response, TokenRun};
use lockstep_plan::frontend::FrontendCosts;
use lockstep_plan::report::FrontendSummary;

/// A job the front door holds until its process is done with it.
#[derive(Debug)]
enum Job {
    /// A request, for the front.
    Request(RequestSpec),
    /// One iteration's responses on one process, for the client.
    Responses(Vec<Response>),
    /// A stretch's plain tokens on one process ([`Frontend::hold_tokens`]): one job
    /// per iteration, each done at its own time, handed on in order.
    Tokens(TokenJob),
}

/// A stretch's tokens on one process: its iterations' jobs, done at `dues` (in order),
/// the first `released` handed on.
#[derive(Debug)]
struct TokenJob {
    run: TokenRun,
    dues: Vec<u64>,
    released: usize,
}

impl Job {
    /// Whether handing the job on does more than add tokens to open requests' records:
    /// a request, or responses with an ending among them.
    fn beyond_tokens(&self) -> bool {
        match self {
            Job::Request(_) => true,
            Job::Responses(rs) => rs.iter().any(|r| r.finish.is_some()),
            Job::Tokens(_) => false,
        }
    }

    /// When the job (its last part) is done, given when its next part is.
    fn done_at(&self, next_due: u64) -> u64 {
        match self {
            Job::Tokens(t) => t.dues.last().copied().unwrap_or(next_due),
            _ => next_due,
        }
    }
}

/// A job the front door is done with, handed on ([`Frontend::release`]).
#[derive(Debug)]
pub enum Passed<'a> {
    /// A request, for the front.
    Request(RequestSpec),
    /// One iteration's responses on one process (lent: the vector is reused), and
    /// when the door was done with them (plain tokens may be handed on later).
    Responses { responses: &'a [Response], due: u64 },
    /// A stretch's iterations `steps` on one process, each done at its `dues`.
    Tokens {
        run: &'a TokenRun,
        steps: std::ops::Range<usize>,
        dues: &'a [u64],
    },
}

/// A request as it entered the front door.
#[derive(Debug)]
pub struct Admitted {
    /// Time it waits for its process (ns).
    pub queue_ns: u64,
    /// Its service (ns).
    pub service_ns: u64,
    /// The request, when it passes at once (nothing to wait for, no cost).
    pub passed: Option<RequestSpec>,
}

#[derive(Debug, Default)]
struct Process {
    free_at: u64,
    busy_ns: u64,
    held: VecDeque<(u64, Job)>,
    /// When each held job that is more than plain tokens is done, in order.
    beyond: VecDeque<u64>,
}

impl Process {
    /// Holds `job` until `due`, after the others.
    fn hold(&mut self, due: u64, job: Job) {
        if job.beyond_tokens() {
            self.beyond.push_back(due);
        }
        self.held.push_back((due, job));
    }
}

/// Response vectors of jobs already handed on, reused for the next (a run emits one job
/// per iteration and process: allocating each anew showed in the simulator's profile).
const SPARE_SHARES: usize = 8;

/// The front door.
#[derive(Debug)]
pub struct Frontend {
    costs: FrontendCosts,
    /// Driver nanoseconds per modeled nanosecond.
    scale: f64,
    processes: Vec<Process>,
    /// Requests entered and not yet handed on, and the most there were at once.
    in_door: u32,
    peak_in_door: u32,
    /// Emptied response vectors, for the next jobs.
    spare: Vec<Vec<Response>>,
}

impl Frontend {
    /// A front door with `costs`, its times multiplied by `time_scale` (0: free).
    pub fn new(costs: FrontendCosts, time_scale: f64) -> Frontend {
        Frontend {
            costs,
            scale: time_scale.max(0.0),
            processes: (0..costs.processes.max(1))
                .map(|_| Process::default())
                .collect(),
            in_door: 0,
            peak_in_door: 0,
            spare: Vec::new(),
        }
    }

    /// A front door that costs nothing.
    pub fn free() -> Frontend {
        Frontend::new(FrontendCosts::NONE, 0.0)
    }

    /// How many processes serve.
    pub fn processes(&self) -> usize {
        self.processes.len()
    }

    /// The process that serves request `id` and its responses.
    pub fn process_of(&self, id: u64) -> usize {
        (id.saturating_sub(1) % self.processes.len() as u64) as usize
    }

    /// A modeled cost (ns) in driver time.
    fn scaled(&self, modeled_ns: f64) -> u64 {
        (modeled_ns * self.scale).round() as u64
    }

    /// Takes `process` for a job of `cost` ns coming at `now`, after the jobs before it:
    /// when it starts and when it is done.
    fn serve(&mut self, process: usize, now: u64, cost: u64) -> (u64, u64) {
        let p = &mut self.processes[process];
        let start = now.max(p.free_at);
        p.free_at = start + cost;
        p.busy_ns += cost;
        (start, start + cost)
    }

    /// A request enters at `now`.
    pub fn admit(&mut self, now: u64, spec: RequestSpec) -> Admitted {
        let process = self.process_of(spec.id.0);
        let cost = self.scaled(self.costs.request_ns(spec.prompt_len));
        let (start, done) = self.serve(process, now, cost);
        let passed = if done <= now && self.processes[process].held.is_empty() {
            Some(spec)
        } else {
            self.processes[process].hold(done, Job::Request(spec));
            self.in_door += 1;
            self.peak_in_door = self.peak_in_door.max(self.in_door);
            None
        };
        Admitted {
            queue_ns: start - now,
            service_ns: cost,
            passed,
        }
    }

    /// One iteration's responses reach the front door at `now`: whether they all pass
    /// at once (else the door holds a copy of each process's share until
    /// [`Frontend::release`] hands it on, in order with that process's other jobs).
    pub fn emit(&mut self, now: u64, responses: &[Response]) -> bool {
        if self.passes_at_once(now, &[]) {
            return true;
        }
        let n = self.processes.len();
        // Each process's share, in the order given (a process's responses stay in
        // order); one pass per process keeps that without a vector of vectors.
        for process in 0..n {
            let mut share = self.spare.pop().unwrap_or_default();
            if n == 1 {
                share.extend_from_slice(responses);
            } else {
                share.extend(
                    responses
                        .iter()
                        .filter(|r| self.process_of(r.id.0) == process)
                        .cloned(),
                );
            }
            if share.is_empty() {
                self.spare.push(share);
                continue;
            }
            let tokens = share.iter().map(|r| u64::from(r.new_tokens)).sum();
            let cost = self.scaled(self.costs.output_ns(tokens));
            let (_, done) = self.serve(process, now, cost);
            self.processes[process].hold(done, Job::Responses(share));
        }
        false
    }

    /// Whether output reaching the door at `now` passes at once: it costs nothing, and
    /// no job held on any process is still being worked on at `now` — neither one the
    /// door holds nor one of `pending` (per process, when the jobs
    /// [`Frontend::serve_tokens`] served and has not handed to the door yet are done).
    /// A held job done by `now` is as good as handed on (plain tokens wait for the
    /// client to take anything in: [`Frontend::poll_timeout`]).
    fn passes_at_once(&self, now: u64, pending: &[Vec<u64>]) -> bool {
        self.scaled(self.costs.output_ns(1)) == 0
            && self.processes.iter().enumerate().all(|(i, p)| {
                p.held
                    .back()
                    .is_none_or(|(due, job)| job.done_at(*due) <= now)
                    && pending
                        .get(i)
                        .and_then(|d| d.last())
                        .is_none_or(|&due| due <= now)
            })
    }

    /// A stretch of iterations whose responses are all plain tokens (a coasting
    /// server's), served before their tokens are known: the iteration that ended at
    /// `now` gave `shares[p]` tokens to process `p`'s requests, each a job there as in
    /// [`Frontend::emit`] (nothing else reached the door meanwhile, and nothing held is
    /// released until [`Frontend::hold_tokens`]). When each job is done goes to
    /// `dues[p]`.
    pub fn serve_tokens(&mut self, now: u64, shares: &[u64], dues: &mut [Vec<u64>]) {
        let passes = self.passes_at_once(now, dues);
        for (process, &tokens) in shares.iter().enumerate() {
            if tokens == 0 {
                continue;
            }
            let due = if passes {
                now
            } else {
                let cost = self.scaled(self.costs.output_ns(tokens));
                self.serve(process, now, cost).1
            };
            dues[process].push(due);
        }
    }

    /// The tokens of the stretch [`Frontend::serve_tokens`] served: `run`'s requests,
    /// each process's share held until its iterations' jobs are done (`dues`, per
    /// process), in order with that process's other jobs.
    pub fn hold_tokens(&mut self, run: TokenRun, dues: Vec<Vec<u64>>) {
        let n = self.processes.len();
        let mut shares: Vec<TokenRun> = if n == 1 {
            vec![run]
        } else {
            let mut shares = vec![TokenRun::default(); n];
            for (i, id) in run.ids.iter().enumerate() {
                let share = &mut shares[self.process_of(id.0)];
                share.ids.push(*id);
                share.tokens.extend_from_slice(run.tokens_of(i));
            }
            shares
        };
        for ((process, dues), share) in dues.into_iter().enumerate().zip(&mut shares) {
            if dues.is_empty() {
                continue;
            }
            let mut share = std::mem::take(share);
            share.steps = dues.len() as u32;
            debug_assert_eq!(share.tokens.len(), share.ids.len() * dues.len());
            let first = dues[0];
            let job = Job::Tokens(TokenJob {
                run: share,
                dues,
                released: 0,
            });
            self.processes[process].hold(first, job);
        }
    }

    /// When the first held job that is not one iteration's plain tokens (a request, or
    /// responses with an ending among them) is done: before then, what the door hands
    /// on only adds tokens to open requests' records (the simulator's horizon).
    pub fn next_due_beyond_tokens(&self) -> Option<u64> {
        self.processes
            .iter()
            .filter_map(|p| p.beyond.front().copied())
            .min()
    }

    /// When the door next has something to hand on that cannot wait: a job that is
    /// more than plain tokens ([`Frontend::next_due_beyond_tokens`]). Plain tokens
    /// wait for that, for [`Frontend::release_tokens`], or for a driver with nothing
    /// else to do ([`Frontend::next_due`]): they only add to open requests' records,
    /// each at the time it was done, and each process hands its jobs on in order, so a
    /// request's tokens still reach its record before its ending, and every record is
    /// whole when anything reads it.
    pub fn poll_timeout(&self) -> Option<u64> {
        self.next_due_beyond_tokens()
    }

    /// When the next held job, of any kind, is done.
    pub fn next_due(&self) -> Option<u64> {
        self.processes
            .iter()
            .filter_map(|p| p.held.front().map(|&(due, _)| due))
            .min()
    }

    /// Hands every job done by `now` on to `on`, each process's in order.
    pub fn release(&mut self, now: u64, on: impl FnMut(Passed<'_>)) {
        self.release_while(now, false, on);
    }

    /// Hands the plain tokens done by `now` on to `on`, each process's in order up to
    /// its first job that is more (which [`Frontend::release`] hands on when due): what
    /// must be out before the door takes anything new, or anyone reads the records.
    pub fn release_tokens(&mut self, now: u64, on: impl FnMut(Passed<'_>)) {
        self.release_while(now, true, on);
    }

    fn release_while(&mut self, now: u64, tokens_only: bool, mut on: impl FnMut(Passed<'_>)) {
        for p in &mut self.processes {
            while let Some((due, job)) = p.held.front_mut() {
                if *due > now || (tokens_only && job.beyond_tokens()) {
                    break;
                }
                if let Job::Tokens(job) = job {
                    let from = job.released;
                    let to = from + job.dues[from..].partition_point(|&d| d <= now);
                    on(Passed::Tokens {
                        run: &job.run,
                        steps: from..to,
                        dues: &job.dues[from..to],
                    });
                    job.released = to;
                    if to < job.dues.len() {
                        // The rest waits, and so does what comes after it.
                        *due = job.dues[to];
                        break;
                    }
                }
                let (due, job) = p.held.pop_front().expect("just seen");
                if job.beyond_tokens() {
                    p.beyond.pop_front();
                }
                match job {
                    Job::Tokens(_) => {}
                    Job::Request(spec) => {
                        self.in_door -= 1;
                        on(Passed::Request(spec));
                    }
                    Job::Responses(mut share) => {
                        on(Passed::Responses {
                            responses: &share,
                            due,
                        });
                        if self.spare.len() < SPARE_SHARES {
                            share.clear();
                            self.spare.push(share);
                        }
                    }
                }
            }
        }
    }

    /// What the front door did over a run that ended at `end_ns`.
    pub fn summary(&self, end_ns: u64) -> FrontendSummary {
        let busy: u64 = self.processes.iter().map(|p| p.busy_ns).sum();
        let capacity = end_ns as f64 * self.processes.len() as f64;
        FrontendSummary {
            processes: self.processes.len() as u32,
            utilization: if capacity > 0.0 {
                (busy as f64 / capacity).min(1.0)
            } else {
                0.0
            },
            peak_queue: self.peak_in_door,
            // The report fills these from its measured requests.
            mean_queue_ms: 0.0,
            mean_service_ms: 0.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockstep_actors::ids::ReqId;

    fn spec(id: u64, prompt_len: u32) -> RequestSpec {
        RequestSpec::new(id, prompt_len, 1)
    }

    fn token(id: u64) -> [Response; 1] {
        [Response {
            id: ReqId(id),
            new_tokens: 1,
            last_token: 7,
            generated: 1,
            finish: None,
            logprobs: None,
        }]
    }

    fn costs(processes: u32) -> FrontendCosts {
        FrontendCosts {
            processes,
            request_us: 1.0,
            prompt_token_ns: 10.0,
            output_token_ns: 500.0,
        }
    }

    #[test]
    fn requests_at_once_leave_one_service_apart_on_one_process() {
        let mut door = Frontend::new(costs(1), 1.0);
        let waits: Vec<u64> = (1..=3)
            .map(|id| {
                let a = door.admit(0, spec(id, 100));
                assert!(a.passed.is_none());
                assert_eq!(a.service_ns, 2_000);
                a.queue_ns
            })
            .collect();
        assert_eq!(waits, [0, 2_000, 4_000]);
        let mut out = Vec::new();
        let mut at = Vec::new();
        while let Some(t) = door.poll_timeout() {
            door.release(t, |passed| match passed {
                Passed::Request(spec) => out.push(spec),
                other => panic!("only requests, got {other:?}"),
            });
            at.push(t);
        }
        assert_eq!(at, [2_000, 4_000, 6_000]);
        assert_eq!(out.len(), 3);
        let s = door.summary(12_000);
        assert_eq!(s.peak_queue, 3);
        assert!((s.utilization - 0.5).abs() < 1e-9, "{s:?}");
    }

    #[test]
    fn tokens_compete_with_new_requests_on_their_process_only() {
        let mut door = Frontend::new(costs(2), 1.0);
        // Request 1 on process 0, request 2 on process 1.
        door.admit(0, spec(1, 0));
        door.admit(0, spec(2, 0));
        door.release(1_000, |_| {});
        // A token of request 1 delays request 3 (process 0), not request 4 (process 1).
        assert!(!door.emit(1_000, &token(1)));
        assert_eq!(door.admit(1_000, spec(3, 0)).queue_ns, 500);
        assert_eq!(door.admit(1_000, spec(4, 0)).queue_ns, 0);
    }

    #[test]
    fn a_free_door_passes_everything_at_once() {
        let mut door = Frontend::free();
        let a = door.admit(5, spec(1, 8192));
        assert!(a.passed.is_some() && a.queue_ns == 0 && a.service_ns == 0);
        assert!(door.emit(5, &token(1)));
        assert_eq!(door.poll_timeout(), None);
        // The scale multiplies every cost: at scale 0 a costly door is free too.
        let mut scaled = Frontend::new(costs(1), 0.0);
        assert!(scaled.admit(0, spec(1, 8192)).passed.is_some());
    }

    /// Two requests on two processes, three iterations of one token each: the door
    /// serves them as one job per iteration and process whether it gets the responses
    /// one iteration at a time or as a stretch's token run; the run comes out at the
    /// same times, in order, and only once nothing else is due first.
    #[test]
    fn a_token_run_passes_as_its_iterations_would() {
        let ends = [10_000, 20_000, 30_000];
        // One iteration at a time: when each job of each process is done.
        let mut each = Frontend::new(costs(2), 1.0);
        let mut times = vec![Vec::new(); 2];
        for &t in &ends {
            let responses = [token(1)[0].clone(), token(2)[0].clone()];
            assert!(!each.emit(t, &responses));
            while let Some(due) = each.next_due().filter(|&d| d <= t + 5_000) {
                each.release(due, |passed| match passed {
                    Passed::Responses { responses, due } => {
                        for r in responses {
                            times[(r.id.0 - 1) as usize].push(due);
                        }
                    }
                    other => panic!("only responses, got {other:?}"),
                });
            }
        }
        // As a run: served per iteration, held once, handed on at the end.
        let mut run_door = Frontend::new(costs(2), 1.0);
        let mut dues = vec![Vec::new(); 2];
        for &t in &ends {
            run_door.serve_tokens(t, &[1, 1], &mut dues);
        }
        run_door.hold_tokens(
            TokenRun {
                ids: vec![ReqId(1), ReqId(2)],
                steps: 3,
                tokens: vec![7, 7, 7, 7, 7, 7],
            },
            dues,
        );
        // Plain tokens never make the door due; they wait for what else comes.
        assert_eq!(run_door.poll_timeout(), None);
        let mut run_times = vec![Vec::new(); 2];
        run_door.release_tokens(u64::MAX, |passed| match passed {
            Passed::Tokens { run, steps, dues } => {
                assert_eq!(steps, 0..3);
                for id in &run.ids {
                    run_times[(id.0 - 1) as usize].extend_from_slice(dues);
                }
            }
            other => panic!("only tokens, got {other:?}"),
        });
        assert_eq!(run_times, times);
        assert_eq!(run_door.next_due(), None);
        assert_eq!(run_door.summary(40_000), each.summary(40_000));
    }
}
