//! The external client: in `lockstep serve` it stands where the workload client stands
//! in `lockstep run` — on the caller's thread of the threads driver, sending
//! [`ClientItem`]s to the front host and taking the responses it passes on — but its
//! requests come from the HTTP handlers over a channel, and each request's tokens go
//! back to its handler over a channel of its own.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender, never, select};
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
    /// [`Pending`] for it; the bridge gives the place back when the request ends.
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
    },
    /// The handler of a request is gone before the request ended (its client
    /// disconnected): the request is cancelled on its rank, and its KV freed.
    Cancel(ReqId),
    /// A stop string ended the request's answer: the rest is cancelled on its rank (its
    /// KV freed) and the request counts as a success, as vLLM counts a stop.
    Stop(ReqId),
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
}

/// Requests accepted and not ended: handlers reserve a place before submitting (and
/// answer 429 past the bound), the bridge frees it when the request ends.
#[derive(Debug, Clone, Default)]
pub struct Pending(Arc<AtomicUsize>);

impl Pending {
    /// Takes a place if fewer than `bound` are taken.
    pub fn reserve(&self, bound: usize) -> bool {
        self.0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < bound).then_some(n + 1)
            })
            .is_ok()
    }

    /// Gives a place back.
    pub fn release(&self) {
        let _ = self
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }

    /// Places taken.
    pub fn taken(&self) -> usize {
        self.0.load(Ordering::Acquire)
    }
}

struct Open {
    events: UnboundedSender<Event>,
    received: Instant,
    first_token: bool,
    cancelled: bool,
    /// Cancelled because a stop string ended its answer (a success).
    stopped: bool,
}

const STOPPED: &str = "the servers stopped before the request finished";

/// Runs until the front closes its channel (every server stopped): requests from
/// `http` go to the front as [`ClientItem::Request`]s, the responses from the front go
/// to each request's handler; [`BridgeMsg::Shutdown`] (or every sender gone) sends the
/// front the client's shutdown, after which the servers drain and stop. Returns the
/// requests taken.
pub fn run(
    http: Receiver<BridgeMsg>,
    to_front: Sender<ClientItem>,
    from_front: Receiver<Vec<Response>>,
    metrics: &Metrics,
    pending: &Pending,
) -> u64 {
    let mut open: HashMap<ReqId, Open> = HashMap::new();
    let mut taken = 0u64;
    let mut http = Some(http);
    loop {
        let from_http = http.as_ref().map_or(never(), Clone::clone);
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
                }) => {
                    taken += 1;
                    metrics.prompt_tokens.inc_by(u64::from(prompt_tokens));
                    let mut spec = RequestSpec::new(id.0, prompt_tokens, max_tokens);
                    spec.block_hashes = block_hashes;
                    spec.prompt_tokens = prompt_ids;
                    spec.sampling = sampling;
                    spec.logit_bias = logit_bias;
                    spec.end_ids = end_ids;
                    if to_front.send(ClientItem::Request(spec)).is_err() {
                        metrics.request_failure.inc();
                        pending.release();
                        let _ = events.send(Event::Failed {
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
                            received,
                            first_token: false,
                            cancelled: false,
                            stopped: false,
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
                Ok(BridgeMsg::Shutdown) | Err(_) => {
                    http = None;
                    // The front may be gone already (every server stopped).
                    let _ = to_front.send(ClientItem::Shutdown);
                }
            },
            recv(from_front) -> batch => match batch {
                Ok(batch) => {
                    for r in batch {
                        deliver(&mut open, r, metrics, pending);
                    }
                }
                Err(_) => break,
            },
        }
    }
    // The servers stopped: whatever is still open will never finish.
    for (_, o) in open.drain() {
        metrics.request_failure.inc();
        pending.release();
        if o.first_token {
            metrics.running.dec();
        } else {
            metrics.waiting.dec();
        }
        let _ = o.events.send(Event::Failed {
            why: STOPPED.into(),
            kind: FailureKind::Unavailable,
        });
    }
    taken
}

fn deliver(open: &mut HashMap<ReqId, Open>, r: Response, metrics: &Metrics, pending: &Pending) {
    let Some(o) = open.get_mut(&r.id) else {
        return;
    };
    if r.new_tokens > 0 {
        if !o.first_token {
            o.first_token = true;
            metrics.waiting.dec();
            metrics.running.inc();
            metrics.ttft.observe(o.received.elapsed().as_secs_f64());
        }
        metrics.generation_tokens.inc_by(u64::from(r.new_tokens));
        // A handler that left (its client disconnected) has nothing to do with them.
        let _ = o.events.send(Event::Tokens {
            last: r.last_token,
            count: r.new_tokens,
            generated: r.generated,
        });
    }
    let end = match r.finish {
        None | Some(Finish::ContextDone) => return,
        Some(Finish::Completed) => Event::Completed,
        Some(Finish::Failed(why)) => Event::Failed {
            kind: why.kind(),
            why: why.to_string(),
        },
        Some(Finish::Cancelled) => Event::Failed {
            why: "cancelled".into(),
            kind: FailureKind::Cancelled,
        },
    };
    let Some(o) = open.remove(&r.id) else {
        return;
    };
    pending.release();
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
    let _ = o.events.send(end);
}
