//! Workload generators: closed loop, open loop (Poisson), multi-round conversations and
//! trace replay. The simulator pulls arrivals with [`Workload::pop_due`] and reports each
//! request's end with [`Workload::on_finished`].
//!
//! Everything is deterministic from (config, seed): one `ChaCha8Rng` is drawn in issue
//! order, ids are assigned when a request is issued, and pending arrivals are ordered by
//! (time, submission order).

mod config;
#[cfg(test)]
mod tests;
mod trace;

use std::collections::{BTreeMap, VecDeque};
use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use lockstep_actors::ids::{ConvId, ReqId};
use lockstep_actors::kv::mix;
use lockstep_actors::request::RequestSpec;

pub use config::{
    ConversationConfig, DEFAULT_TRACE_BLOCK_TOKENS, LenSpec, TraceConfig, TraceFormat,
    WorkloadConfig, WorkloadKind,
};
use trace::TraceRecord;
pub use trace::{TraceSummary, summarize as summarize_trace};

/// An error building a workload.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// A config value is out of range, missing, or does not apply to the kind.
    #[error("{field}: {message}")]
    Invalid {
        /// The key, e.g. `workload.concurrency`.
        field: &'static str,
        /// What is wrong, including the value.
        message: String,
    },
    /// The trace file could not be read.
    #[error("cannot read trace `{path}`: {source}")]
    TraceRead {
        /// The resolved path.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// A trace line is malformed.
    #[error("{path}:{line}: {message}")]
    TraceParse {
        /// The resolved path.
        path: String,
        /// 1-based line number.
        line: usize,
        /// What is wrong, naming the field and value.
        message: String,
    },
}

/// One request arrival.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arrival {
    /// When the request arrives (ns since the start of the run).
    pub at_ns: u64,
    /// The request.
    pub spec: RequestSpec,
}

/// Shared-prefix blocks get the tag in bits 48.. so they never equal a unique block's
/// input `id << 20 | i` (mix is a bijection, so distinct inputs give distinct hashes).
const SHARED_TAG: u64 = 0x5EED << 48;

fn shared_hash(i: u64) -> u64 {
    mix(SHARED_TAG ^ i)
}

fn unique_hash(id: u64, i: u64) -> u64 {
    mix((id << 20) | i)
}

/// What a pending entry will become when it is issued. Lengths and ids are drawn at
/// issue so the stream is consumed in issue order.
#[derive(Debug, Clone, Copy)]
enum Pending {
    /// A synthetic request outside any conversation.
    Single,
    /// The first round of a new conversation with this many rounds.
    ConvStart { rounds: u32 },
    /// The next round of a conversation in flight.
    ConvNext { conv: ConvId },
    /// Trace record `index`.
    Trace { index: usize },
    /// A warm-up request (sent alone, before the measured load).
    Warmup,
}

/// A conversation between rounds: what the next round builds on.
#[derive(Debug, Clone)]
struct ConvState {
    rounds_left: u32,
    prompt_len: u32,
    output_len: u32,
    block_hashes: Vec<u64>,
    /// Whether the last round completed; a failed round contributes no output.
    completed: bool,
}

/// The workload as the simulator sees it.
#[derive(Debug, Clone)]
pub struct Workload {
    cfg: WorkloadConfig,
    rng: ChaCha8Rng,
    tokens_per_block: u32,
    think_ns: u64,
    /// Requests this workload issues in total.
    total: u64,
    /// Requests issued so far.
    issued: u64,
    /// Requests scheduled so far (pending or issued); only for single synthetic requests.
    scheduled: u64,
    /// Pending arrivals keyed by (time, submission number).
    pending: BTreeMap<(u64, u64), Pending>,
    submissions: u64,
    next_id: u64,
    next_conv: u64,
    /// Round counts of the conversations not started yet, drawn up front so that
    /// `total` is known and the last one is cut to end at exactly `num_requests`.
    conv_queue: VecDeque<u32>,
    convs: BTreeMap<ConvId, ConvState>,
    /// Issued and not finished: the conversation each belongs to.
    in_flight: BTreeMap<ReqId, Option<ConvId>>,
    /// Open loop: arrival time of the latest Poisson arrival, on the unramped clock
    /// (relative to the measured load's start).
    last_open_ns: u64,
    records: Vec<TraceRecord>,
    /// Warm-up requests still to send.
    warmup_left: u32,
    /// When the measured load started (after the warm-up), `None` before.
    load_start_ns: Option<u64>,
}

impl Workload {
    /// Validates the config (every bad value is a [`WorkloadError::Invalid`] naming
    /// `workload.<key>` and the value), reads the trace if any, and prepares the stream.
    /// `tokens_per_block` is the servers' KV block size (for block hashes); `seed` is the
    /// run's seed; `base_dir` resolves a relative trace path (the scenario file's folder).
    pub fn new(
        cfg: &WorkloadConfig,
        tokens_per_block: u32,
        seed: u64,
        base_dir: &Path,
    ) -> Result<Workload, WorkloadError> {
        cfg.validate(tokens_per_block)?;
        let mut w = Workload {
            cfg: cfg.clone(),
            rng: ChaCha8Rng::seed_from_u64(cfg.seed.unwrap_or(seed)),
            tokens_per_block,
            think_ns: (cfg.think_time_ms * 1e6).round() as u64,
            total: 0,
            issued: 0,
            scheduled: 0,
            pending: BTreeMap::new(),
            submissions: 0,
            next_id: 1,
            next_conv: 1,
            conv_queue: VecDeque::new(),
            convs: BTreeMap::new(),
            in_flight: BTreeMap::new(),
            last_open_ns: 0,
            records: Vec::new(),
            warmup_left: cfg.warmup_requests,
            load_start_ns: None,
        };
        if cfg.kind == WorkloadKind::Trace {
            let tcfg = cfg.trace.as_ref().expect("validated");
            w.records = trace::load(tcfg, base_dir, cfg.num_requests)?;
            w.total = w.records.len() as u64;
        } else {
            let n = cfg.num_requests.expect("validated");
            w.total = n;
            if let Some(conv) = &cfg.conversation {
                let mut left = n;
                while left > 0 {
                    let r = u64::from(conv.rounds.draw(&mut w.rng)).min(left);
                    w.conv_queue.push_back(r as u32);
                    left -= r;
                }
            }
        }
        w.total += u64::from(cfg.warmup_requests);
        if w.warmup_left > 0 {
            w.warmup_left -= 1;
            w.submit(0, Pending::Warmup);
        } else {
            w.start_load(0);
        }
        Ok(w)
    }

    /// Starts the measured load at `t0`.
    fn start_load(&mut self, t0: u64) {
        self.load_start_ns = Some(t0);
        match self.cfg.kind {
            WorkloadKind::Trace => {
                // Records are non-decreasing in time, so one pending record at a time
                // keeps them in order.
                let at = self.load_time(self.records[0].at_ns);
                self.submit(at, Pending::Trace { index: 0 });
            }
            WorkloadKind::ClosedLoop => {
                let c = self.cfg.concurrency.expect("validated");
                let ramp_ns = self.cfg.ramp_s * 1e9;
                for i in 0..c {
                    // Client i starts i/c of the way through the ramp.
                    let offset = (ramp_ns * i as f64 / c as f64).round() as u64;
                    if !self.schedule_fresh(t0.saturating_add(offset)) {
                        break;
                    }
                }
            }
            WorkloadKind::OpenLoop => self.schedule_open(),
        }
    }

    /// The arrival time of an event `u_ns` into the measured load at full rate, with the
    /// ramp: the rate rises linearly over `ramp_s`, so the cumulative arrivals by time t
    /// are `rate·t²/2R` (t < R), then `rate·(t − R/2)`; inverting keeps every arrival.
    fn load_time(&self, u_ns: u64) -> u64 {
        let t0 = self.load_start_ns.unwrap_or(0);
        let r = self.cfg.ramp_s * 1e9;
        let u = u_ns as f64;
        let t = if r <= 0.0 {
            u
        } else if u < r / 2.0 {
            (2.0 * r * u).sqrt()
        } else {
            u + r / 2.0
        };
        t0.saturating_add(t.round() as u64)
    }

    /// Requests of the measured load (the total without the warm-up).
    fn load_total(&self) -> u64 {
        self.total - u64::from(self.cfg.warmup_requests)
    }

    /// The (prompt, output) lengths this workload's requests can take, as few as tell
    /// whether any of them could be served: synthetic requests are easiest at the
    /// shortest prompt and output (one shape); a trace gives each record's.
    pub fn request_shapes(&self) -> Box<dyn Iterator<Item = (u32, u32)> + '_> {
        match self.cfg.kind {
            WorkloadKind::Trace => {
                Box::new(self.records.iter().map(|r| (r.prompt_len, r.output_len)))
            }
            _ => Box::new(std::iter::once((
                self.cfg.input_len.min(),
                self.cfg.output_len.min(),
            ))),
        }
    }

    /// The most positions (prompt + output tokens) one request of this workload can
    /// take: a trace's longest record; a synthetic request's longest prompt and output;
    /// a conversation's last round at the most rounds, every round at its longest.
    pub fn longest_request(&self) -> u64 {
        match self.cfg.kind {
            WorkloadKind::Trace => self
                .records
                .iter()
                .map(|r| u64::from(r.prompt_len) + u64::from(r.output_len))
                .max()
                .unwrap_or(0),
            _ => {
                let output = u64::from(self.cfg.output_len.max());
                let first = u64::from(self.cfg.input_len.max()) + output;
                match &self.cfg.conversation {
                    None => first,
                    Some(c) => {
                        let later = u64::from(c.rounds.max()).saturating_sub(1);
                        first + later * (u64::from(c.new_tokens_per_round.max()) + output)
                    }
                }
            }
        }
    }

    /// Warm-up requests, sent first: ids `1..=warmup_requests()`.
    pub fn warmup_requests(&self) -> u64 {
        u64::from(self.cfg.warmup_requests)
    }

    /// When the measured load started (after the warm-up); `None` before.
    pub fn load_start_ns(&self) -> Option<u64> {
        self.load_start_ns
    }

    /// Total requests this workload will submit. Always known up front: `num_requests`
    /// for closed and open loop (with conversations too: the last conversation is cut
    /// short), or the trace's records capped by `num_requests`.
    pub fn total(&self) -> Option<u64> {
        Some(self.total)
    }

    /// Time of the earliest pending arrival.
    pub fn next_arrival_ns(&self) -> Option<u64> {
        self.pending.first_key_value().map(|(&(at, _), _)| at)
    }

    /// Pops the earliest pending arrival if it is due (`at_ns <= now_ns`); ties leave in
    /// submission order.
    pub fn pop_due(&mut self, now_ns: u64) -> Option<Arrival> {
        let (&(at_ns, _), _) = self.pending.first_key_value()?;
        if at_ns > now_ns {
            return None;
        }
        let ((at_ns, _), what) = self.pending.pop_first().expect("peeked");
        let id = self.next_id;
        self.next_id += 1;
        self.issued += 1;
        let spec = match what {
            Pending::Single => {
                let spec = self.fresh_spec(id, None);
                self.in_flight.insert(spec.id, None);
                if self.cfg.kind == WorkloadKind::OpenLoop {
                    self.schedule_open();
                }
                spec
            }
            Pending::ConvStart { rounds } => {
                let conv = ConvId(self.next_conv);
                self.next_conv += 1;
                let spec = self.fresh_spec(id, Some(conv));
                self.convs.insert(
                    conv,
                    ConvState {
                        rounds_left: rounds - 1,
                        prompt_len: spec.prompt_len,
                        output_len: spec.max_new_tokens,
                        block_hashes: spec.block_hashes.to_vec(),
                        completed: true,
                    },
                );
                self.in_flight.insert(spec.id, Some(conv));
                if self.cfg.kind == WorkloadKind::OpenLoop {
                    self.schedule_open();
                }
                spec
            }
            Pending::ConvNext { conv } => self.next_round(id, conv),
            Pending::Warmup => {
                let spec = match self.cfg.kind {
                    WorkloadKind::Trace => self.trace_spec(id, 0),
                    _ => self.fresh_spec(id, None),
                };
                self.in_flight.insert(spec.id, None);
                spec
            }
            Pending::Trace { index } => {
                let spec = self.trace_spec(id, index);
                if let Some(next) = self.records.get(index + 1) {
                    let at = self.load_time(next.at_ns);
                    self.submit(at, Pending::Trace { index: index + 1 });
                }
                spec
            }
        };
        Some(Arrival { at_ns, spec })
    }

    /// Trace record `index` as request `id`.
    fn trace_spec(&self, id: u64, index: usize) -> RequestSpec {
        let rec = &self.records[index];
        let mut spec = RequestSpec::new(id, rec.prompt_len, rec.output_len);
        let bt = self
            .cfg
            .trace
            .as_ref()
            .map_or(DEFAULT_TRACE_BLOCK_TOKENS, TraceConfig::block_tokens);
        spec.block_hashes =
            trace::expand_hashes(&rec.hash_ids, rec.prompt_len, bt, self.tokens_per_block).into();
        spec
    }

    /// The simulator reports a request's end (`completed` false: it failed). Closed loop:
    /// the next request arrives after the think time, until `num_requests` were issued.
    /// Conversations: the next round arrives after the think time (after the last round,
    /// closed loop starts a new conversation). Open loop and trace: nothing. Ids this
    /// workload did not issue, or already reported, are ignored.
    pub fn on_finished(&mut self, id: ReqId, now_ns: u64, completed: bool) {
        let Some(conv) = self.in_flight.remove(&id) else {
            return;
        };
        if self.load_start_ns.is_none() {
            // A warm-up request ended: the next one, or the measured load, starts now.
            if self.warmup_left > 0 {
                self.warmup_left -= 1;
                self.submit(now_ns, Pending::Warmup);
            } else {
                self.start_load(now_ns);
            }
            return;
        }
        let at = now_ns.saturating_add(self.think_ns);
        match conv {
            None => {
                if self.cfg.kind == WorkloadKind::ClosedLoop {
                    self.schedule_fresh(at);
                }
            }
            Some(conv) => {
                let st = self.convs.get_mut(&conv).expect("conversation in flight");
                st.completed = completed;
                if st.rounds_left > 0 {
                    self.submit(at, Pending::ConvNext { conv });
                } else {
                    self.convs.remove(&conv);
                    if self.cfg.kind == WorkloadKind::ClosedLoop {
                        self.schedule_fresh(at);
                    }
                }
            }
        }
    }

    /// Why not every request of this workload can be delivered up front (`--preload`):
    /// later arrivals that wait on earlier requests finishing. `None`: they can.
    pub fn preload_blocker(&self) -> Option<String> {
        let cfg = &self.cfg;
        if cfg.warmup_requests > 0 {
            return Some(format!(
                "workload.warmup_requests = {} are sent one at a time before the load; run without --preload",
                cfg.warmup_requests
            ));
        }
        if cfg.conversation.is_some() {
            return Some(
                "a conversation's later rounds arrive only after the earlier ones finish; run without --preload"
                    .into(),
            );
        }
        match (cfg.kind, cfg.concurrency, cfg.num_requests) {
            (WorkloadKind::ClosedLoop, Some(c), Some(n)) if c < n => Some(format!(
                "a closed loop releases more requests only as earlier ones finish: workload.concurrency {c} < workload.num_requests {n}; set workload.concurrency >= workload.num_requests or run without --preload"
            )),
            _ => None,
        }
    }

    /// Whether every request has been issued: nothing is pending and nothing more will
    /// be generated.
    pub fn exhausted(&self) -> bool {
        self.issued >= self.total
    }

    fn submit(&mut self, at_ns: u64, what: Pending) {
        self.pending.insert((at_ns, self.submissions), what);
        self.submissions += 1;
    }

    /// Schedules a new request, or a new conversation, at `at_ns` if any is left.
    fn schedule_fresh(&mut self, at_ns: u64) -> bool {
        if self.cfg.conversation.is_some() {
            match self.conv_queue.pop_front() {
                Some(rounds) => self.submit(at_ns, Pending::ConvStart { rounds }),
                None => return false,
            }
        } else {
            if self.scheduled >= self.load_total() {
                return false;
            }
            self.scheduled += 1;
            self.submit(at_ns, Pending::Single);
        }
        true
    }

    /// Open loop: the next Poisson arrival, one exponential gap after the previous one.
    fn schedule_open(&mut self) {
        // No draw once everything is scheduled, so the stream holds no trailing waste.
        let more = if self.cfg.conversation.is_some() {
            !self.conv_queue.is_empty()
        } else {
            self.scheduled < self.load_total()
        };
        if !more {
            return;
        }
        let rate = self.cfg.rate.expect("validated");
        let u: f64 = self.rng.random();
        let gap_ns = (-(1.0 - u).ln() / rate * 1e9).round() as u64;
        self.last_open_ns = self.last_open_ns.saturating_add(gap_ns);
        let at = self.load_time(self.last_open_ns);
        self.schedule_fresh(at);
    }

    /// A synthetic request with a drawn prompt: shared prefix blocks first, then blocks
    /// unique to this request.
    fn fresh_spec(&mut self, id: u64, conv: Option<ConvId>) -> RequestSpec {
        let prompt_len = self.cfg.input_len.draw(&mut self.rng);
        let output_len = self.cfg.output_len.draw(&mut self.rng);
        let tpb = self.tokens_per_block;
        let shared = u64::from(self.cfg.shared_prefix_tokens / tpb);
        let mut spec = RequestSpec::new(id, prompt_len, output_len);
        spec.conversation = conv;
        spec.block_hashes = (0..u64::from(prompt_len / tpb))
            .map(|i| {
                if i < shared {
                    shared_hash(i)
                } else {
                    unique_hash(id, i)
                }
            })
            .collect();
        spec
    }

    /// A later round: the previous prompt and output (if it completed) plus new tokens;
    /// the previous round's block hashes stay a prefix, so its KV can be reused.
    fn next_round(&mut self, id: u64, conv: ConvId) -> RequestSpec {
        let ccfg = self.cfg.conversation.as_ref().expect("conversation round");
        let new_tokens = ccfg.new_tokens_per_round.draw(&mut self.rng);
        let output_len = self.cfg.output_len.draw(&mut self.rng);
        let tpb = self.tokens_per_block;
        let st = self.convs.get_mut(&conv).expect("conversation in flight");
        let carried = if st.completed { st.output_len } else { 0 };
        let prompt_len = st
            .prompt_len
            .saturating_add(carried)
            .saturating_add(new_tokens);
        let mut hashes = std::mem::take(&mut st.block_hashes);
        let full = u64::from(prompt_len / tpb);
        hashes.extend((hashes.len() as u64..full).map(|i| unique_hash(id, i)));
        st.rounds_left -= 1;
        st.prompt_len = prompt_len;
        st.output_len = output_len;
        let mut spec = RequestSpec::new(id, prompt_len, output_len);
        spec.conversation = Some(conv);
        spec.block_hashes = hashes.as_slice().into();
        st.block_hashes = hashes;
        self.in_flight.insert(ReqId(id), Some(conv));
        spec
    }
}
