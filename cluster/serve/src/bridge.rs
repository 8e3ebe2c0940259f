//! The external client: in `lockstep serve` it stands where the workload client stands
//! in `lockstep run` — on the caller's thread of the threads driver, sending
//! [`ClientItem`]s to the front host and taking the responses it passes on — but its
//! requests come from the HTTP handlers over a channel, and each request's tokens go
//! back to its handler over a channel of its own. What waits in that channel is
//! bounded for a client that takes nothing: past `--stream-buffer` events, with its
//! connection waiting on it, the request is cancelled rather than buffered further.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, at, never, select};
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::mpsc::UnboundedSender;

use lockstep_actors::ids::ReqId;
use lockstep_actors::request::RequestSpec;
use lockstep_actors::vocab::{FailureKind, Finish, Response};

use super::metrics::Metrics;
use lockstep_runtime::client::ClientItem;

/// What an HTTP handler tells the bridge.
#[derive(Debug)]
pub enum BridgeMsg {
    /// A new request; its events go to `events`. Its handler reserved a place in
    /// [`Pending`] for it: the bridge holds it until the request ends on its rank.
    Submit {
        /// Its id (the handler's, unique in this server's life).
        id: ReqId,
        /// Prompt tokens.
        prompt_tokens: u32,
        /// Output tokens.
        max_tokens: u32,
        /// The prompt's block hashes.
        block_hashes: Vec<u64>,
        /// `--model`: the prompt's token ids (empty otherwise).
        prompt_ids: Vec<u32>,
        /// `--model`: the request's own sampling, if its body gave any.
        sampling: Option<lockstep_actors::request::RequestSampling>,
        /// `--model`: its `logit_bias` (empty: none).
        logit_bias: Vec<lockstep_actors::request::TokenBias>,
        /// `--model`: the ids masked before its `min_tokens` (empty: none).
        end_ids: Vec<u32>,
        /// When the HTTP server received it.
        received: Instant,
        /// Where its events go.
        events: UnboundedSender<Event>,
        /// How far behind its handler is.
        backlog: Arc<Backlog>,
        /// Its place in `--max-pending`.
        place: Place,
    },
    /// The handler of a request is gone before the request ended (its client
    /// disconnected): the request is cancelled on its rank, and its KV freed.
    Cancel(ReqId),
    /// A stop string ended the request's answer: the rest is cancelled on its rank (its
    /// KV freed) and the request counts as a success, as vLLM counts a stop.
    Stop(ReqId),
    /// The server is draining (SIGTERM): requests still running at this instant are
    /// cut — cancelled on their ranks, and their handlers told ([`Event::Cut`]).
    Drain(Instant),
    /// The HTTP server stopped: no request will come.
    Shutdown,
}

/// What a handler hears about its request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// `count` new tokens, the last with id `last`; `generated` in all so far.
    Tokens {
        /// The last new token's id.
        last: u32,
        /// New tokens.
        count: u32,
        /// Output tokens so far.
        generated: u32,
        /// The last token's log-probabilities, when the request asked for them.
        logprobs: Option<lockstep_actors::vocab::TokenLogprobs>,
    },
    /// The request reached its length.
    Completed,
    /// The request failed.
    Failed {
        /// Why.
        why: String,
        /// What kind of failure: the servers have stopped (`Unavailable`, 503: try
        /// again later, elsewhere); no server could run it (`Refused`, 400); the
        /// request failed on them (anything else, 500).
        kind: FailureKind,
    },
    /// The drain timeout passed before the request finished: it was cancelled on its
    /// rank.
    Cut,
}

/// Requests accepted and not yet both ended and delivered: handlers reserve a
/// [`Place`] before submitting (and answer 429 past the bound); the place is given back
/// when the bridge (the request ended on its rank) and the handler (its answer was
/// handed to the connection, or the connection dropped) have both let go of it. Its
/// value is `/metrics`' `lockstep_num_requests_pending`.
#[derive(Debug, Clone, Default)]
pub struct Pending(Gauge);

impl Pending {
    /// Takes a place if fewer than `bound` are taken.
    pub fn reserve(&self, bound: usize) -> Option<Place> {
        let bound = i64::try_from(bound).unwrap_or(i64::MAX);
        self.0
            .inner()
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < bound).then_some(n + 1)
            })
            .ok()
            .map(|_| Place(Arc::new(Taken(self.clone()))))
    }

    /// The gauge `/metrics` shows.
    pub fn gauge(&self) -> Gauge {
        self.0.clone()
    }
}

/// A request's events sent and not yet taken by its handler, and since when the
/// handler's connection has held bytes for its client without asking for more (the
/// client is not reading): what the bridge needs to tell a client that stopped reading
/// from an HTTP worker that is merely behind, and what the handler's write watchdog
/// reads.
#[derive(Debug, Default)]
pub struct Backlog {
    queued: AtomicUsize,
    /// Nanoseconds since [`epoch`], plus one; 0 while not blocked.
    blocked_since: AtomicU64,
}

/// The instant [`Backlog`]'s times count from.
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

impl Backlog {
    fn sent(&self) {
        self.queued.fetch_add(1, Ordering::Relaxed);
    }

    /// The handler took an event.
    pub fn took(&self) {
        self.queued.fetch_sub(1, Ordering::Relaxed);
    }

    /// Events waiting for the handler.
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }

    /// The connection took bytes from the handler and holds them for the client.
    pub fn block(&self) {
        let ns = u64::try_from(epoch().elapsed().as_nanos()).unwrap_or(u64::MAX - 1);
        self.blocked_since.store(ns + 1, Ordering::Relaxed);
    }

    /// The connection asked for more: what it held was taken.
    pub fn unblock(&self) {
        self.blocked_since.store(0, Ordering::Relaxed);
    }

    /// How long the connection has held bytes for its client without asking for more.
    pub fn blocked_for(&self) -> Option<Duration> {
        match self.blocked_since.load(Ordering::Relaxed) {
            0 => None,
            t => Some(
                epoch()
                    .elapsed()
                    .saturating_sub(Duration::from_nanos(t - 1)),
            ),
        }
    }
}

/// How long a stream's connection must have waited on its client, with more than
/// `--stream-buffer` events behind it, for the client to count as not reading (an HTTP
/// worker that is merely behind asks for more within microseconds).
pub const CLIENT_STALLED: Duration = Duration::from_secs(1);

/// One place in [`Pending`], shared by the request's handler and the bridge: given back
/// when the last clone drops.
#[derive(Debug, Clone)]
pub struct Place(#[allow(dead_code)] Arc<Taken>);

#[derive(Debug)]
struct Taken(Pending);

impl Drop for Taken {
    fn drop(&mut self) {
        self.0.0.dec();
    }
}

struct Open {
    events: UnboundedSender<Event>,
    backlog: Arc<Backlog>,
    received: Instant,
    first_token: bool,
    cancelled: bool,
    /// Cancelled because a stop string ended its answer (a success).
    stopped: bool,
    /// Cancelled because its client took nothing while a whole buffer waited.
    overflowed: bool,
    /// Held until the request ends here.
    _place: Place,
}

const STOPPED: &str = "the servers stopped before the request finished";

/// Runs until the front closes its channel (every server stopped): requests from
/// `http` go to the front as [`ClientItem::Request`]s, the responses from the front go
/// to each request's handler; [`BridgeMsg::Shutdown`] (or every sender gone) sends the
/// front the client's shutdown, after which the servers drain and stop;
/// [`BridgeMsg::Drain`] sets when the requests still running are cut. Returns the
/// requests taken.
pub fn run(
    http: Receiver<BridgeMsg>,
    to_front: Sender<ClientItem>,
    from_front: Receiver<Vec<Response>>,
    metrics: &Metrics,
    stream_buffer: usize,
) -> u64 {
    let mut open: HashMap<ReqId, Open> = HashMap::new();
    let mut taken = 0u64;
    let mut http = Some(http);
    // The drain's deadline, until it passes; then `cut` (a request coming later is cut
    // at once).
    let mut drain_until: Option<Instant> = None;
    let mut cut = false;
    loop {
        let from_http = http.as_ref().map_or(never(), Clone::clone);
        let deadline = drain_until.map_or(never(), at);
        select! {
            recv(from_http) -> m => match m {
                Ok(BridgeMsg::Submit {
                    id,
                    prompt_tokens,
                    max_tokens,
                    block_hashes,
                    prompt_ids,
                    sampling,
                    logit_bias,
                    end_ids,
                    received,
                    events,
                    backlog,
                    place,
                }) => {
                    taken += 1;
                    if cut {
                        metrics.request_failure.inc();
                        send(&events, &backlog, Event::Cut);
                        continue;
                    }
                    metrics.prompt_tokens.inc_by(u64::from(prompt_tokens));
                    let mut spec = RequestSpec::new(id.0, prompt_tokens, max_tokens);
                    spec.block_hashes = block_hashes.into();
                    spec.prompt_tokens = prompt_ids;
                    spec.sampling = sampling;
                    spec.logit_bias = logit_bias;
                    spec.end_ids = end_ids;
                    if to_front.send(ClientItem::Request(spec)).is_err() {
                        metrics.request_failure.inc();
                        send(&events, &backlog, Event::Failed {
                            why: "every server has stopped".into(),
                            kind: FailureKind::Unavailable,
                        });
                        continue;
                    }
                    metrics.waiting.inc();
                    open.insert(
                        id,
                        Open {
                            events,
                            backlog,
                            received,
                            first_token: false,
                            cancelled: false,
                            stopped: false,
                            overflowed: false,
                            _place: place,
                        },
                    );
                }
                Ok(msg @ (BridgeMsg::Cancel(id) | BridgeMsg::Stop(id))) => {
                    // A request that ended meanwhile has nothing to cancel.
                    if let Some(o) = open.get_mut(&id)
                        && !o.cancelled
                    {
                        o.cancelled = true;
                        o.stopped = matches!(msg, BridgeMsg::Stop(_));
                        if o.stopped {
                            // Its answer ended now, not when the cancel comes back.
                            metrics.e2e.observe(o.received.elapsed().as_secs_f64());
                        }
                        let _ = to_front.send(ClientItem::Cancel(id));
                    }
                }
                Ok(BridgeMsg::Drain(until)) => {
                    if !cut {
                        drain_until = Some(until);
                    }
                }
                Ok(BridgeMsg::Shutdown) | Err(_) => {
                    http = None;
                    // The front may be gone already (every server stopped).
                    let _ = to_front.send(ClientItem::Shutdown);
                }
            },
            recv(from_front) -> batch => match batch {
                Ok(batch) => {
                    for r in batch {
                        deliver(&mut open, r, metrics, &to_front, stream_buffer);
                    }
                }
                Err(_) => break,
            },
            recv(deadline) -> _ => {
                drain_until = None;
                cut = true;
                cut_all(&mut open, metrics, &to_front);
            },
        }
    }
    // The servers stopped: whatever is still open will never finish.
    for (_, o) in open.drain() {
        metrics.request_failure.inc();
        if o.first_token {
            metrics.running.dec();
        } else {
            metrics.waiting.dec();
        }
        send(
            &o.events,
            &o.backlog,
            Event::Failed {
                why: STOPPED.into(),
                kind: FailureKind::Unavailable,
            },
        );
    }
    taken
}

/// Sends a handler an event, counting it in its backlog (a handler that left has
/// nothing to do with it).
fn send(events: &UnboundedSender<Event>, backlog: &Backlog, event: Event) {
    if events.send(event).is_ok() {
        backlog.sent();
    }
}

/// The drain's deadline passed: every request still running is cancelled on its rank
/// and its handler told (it answers 503, or a stream's error event); each counts as a
/// failure. One already cancelled ends as it would have.
fn cut_all(open: &mut HashMap<ReqId, Open>, metrics: &Metrics, to_front: &Sender<ClientItem>) {
    open.retain(|&id, o| {
        if o.cancelled {
            return true;
        }
        let _ = to_front.send(ClientItem::Cancel(id));
        metrics.request_failure.inc();
        if o.first_token {
            metrics.running.dec();
        } else {
            metrics.waiting.dec();
        }
        send(&o.events, &o.backlog, Event::Cut);
        false
    });
}

fn deliver(
    open: &mut HashMap<ReqId, Open>,
    mut r: Response,
    metrics: &Metrics,
    to_front: &Sender<ClientItem>,
    stream_buffer: usize,
) {
    let Some(o) = open.get_mut(&r.id) else {
        return;
    };
    if r.new_tokens > 0 && !o.overflowed {
        if !o.first_token {
            o.first_token = true;
            metrics.waiting.dec();
            metrics.running.inc();
            metrics.ttft.observe(o.received.elapsed().as_secs_f64());
        }
        metrics.generation_tokens.inc_by(u64::from(r.new_tokens));
        send(
            &o.events,
            &o.backlog,
            Event::Tokens {
                last: r.last_token,
                count: r.new_tokens,
                generated: r.generated,
                logprobs: r.logprobs.take(),
            },
        );
        // More than a buffer behind, and its connection waiting on its client: the
        // client is not reading. It gets no more, and its request is cancelled (the end
        // says why). An HTTP worker merely behind a fast fleet buffers on.
        if !o.cancelled
            && o.backlog.queued() > stream_buffer
            && o.backlog.blocked_for().is_some_and(|d| d >= CLIENT_STALLED)
        {
            o.overflowed = true;
            o.cancelled = true;
            let _ = to_front.send(ClientItem::Cancel(r.id));
        }
    }
    let end = match r.finish {
        None | Some(Finish::ContextDone) => return,
        Some(Finish::Completed) => Event::Completed,
        Some(Finish::Failed(why)) => Event::Failed {
            kind: why.kind(),
            why: why.to_string(),
        },
        Some(Finish::Cancelled) if o.overflowed => Event::Failed {
            why: format!(
                "cancelled: the client read nothing while more than {stream_buffer} output events waited for it (--stream-buffer)"
            ),
            kind: FailureKind::Cancelled,
        },
        Some(Finish::Cancelled) => Event::Failed {
            why: "cancelled".into(),
            kind: FailureKind::Cancelled,
        },
    };
    let Some(o) = open.remove(&r.id) else {
        return;
    };
    if o.first_token {
        metrics.running.dec();
    } else {
        metrics.waiting.dec();
    }
    match &end {
        _ if o.stopped => {
            metrics.request_success.inc();
        }
        Event::Completed => {
            metrics.request_success.inc();
            metrics.e2e.observe(o.received.elapsed().as_secs_f64());
        }
        // Cancelled by its client, or failed on its own after the client left.
        _ if o.cancelled => {
            metrics.request_cancelled.inc();
        }
        _ => {
            metrics.request_failure.inc();
        }
    }
    send(&o.events, &o.backlog, end);
}
