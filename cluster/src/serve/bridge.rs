//! The external client: in `lockstep serve` it stands where the workload client stands
//! in `lockstep run` — on the caller's thread of the threads driver, sending
//! [`ClientItem`]s to the front host and taking the responses it passes on — but its
//! requests come from the HTTP handlers over a channel, and each request's tokens go
//! back to its handler over a channel of its own.

use std::collections::HashMap;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender, never, select};
use tokio::sync::mpsc::UnboundedSender;

use lockstep_actors::executor::{Finish, Response};
use lockstep_actors::ids::ReqId;
use lockstep_actors::request::RequestSpec;

use super::metrics::Metrics;
use crate::runtime::client::ClientItem;

/// What an HTTP handler tells the bridge.
#[derive(Debug)]
pub enum BridgeMsg {
    /// A new request; its events go to `events`.
    Submit {
        /// Prompt tokens.
        prompt_tokens: u32,
        /// Output tokens.
        max_tokens: u32,
        /// When the HTTP server received it.
        received: Instant,
        /// Where its events go.
        events: UnboundedSender<Event>,
    },
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
    Failed(String),
}

struct Open {
    events: UnboundedSender<Event>,
    received: Instant,
    first_token: bool,
}

/// Runs until the front closes its channel (every server stopped): requests from
/// `http` go to the front as [`ClientItem::Request`]s, the responses from the front go
/// to each request's handler; [`BridgeMsg::Shutdown`] (or every sender gone) sends the
/// front the client's shutdown, after which the servers drain and stop. Returns the
/// requests served.
pub fn run(
    http: Receiver<BridgeMsg>,
    to_front: Sender<ClientItem>,
    from_front: Receiver<Vec<Response>>,
    metrics: &Metrics,
) -> u64 {
    let mut open: HashMap<ReqId, Open> = HashMap::new();
    let mut next_id = 0u64;
    let mut http = Some(http);
    loop {
        let from_http = http.as_ref().map_or(never(), Clone::clone);
        select! {
            recv(from_http) -> m => match m {
                Ok(BridgeMsg::Submit { prompt_tokens, max_tokens, received, events }) => {
                    next_id += 1;
                    let id = ReqId(next_id);
                    metrics.prompt_tokens.inc_by(u64::from(prompt_tokens));
                    let spec = RequestSpec::new(next_id, prompt_tokens, max_tokens);
                    if to_front.send(ClientItem::Request(spec)).is_err() {
                        metrics.request_failure.inc();
                        let _ = events.send(Event::Failed(
                            "every server has stopped".into(),
                        ));
                        continue;
                    }
                    metrics.waiting.inc();
                    open.insert(id, Open { events, received, first_token: false });
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
                        deliver(&mut open, r, metrics);
                    }
                }
                Err(_) => break,
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
        let _ = o.events.send(Event::Failed(
            "the servers stopped before the request finished".into(),
        ));
    }
    next_id
}

fn deliver(open: &mut HashMap<ReqId, Open>, r: Response, metrics: &Metrics) {
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
        Some(Finish::Failed(why)) => Event::Failed(why),
        Some(Finish::Cancelled) => Event::Failed("cancelled".into()),
    };
    let Some(o) = open.remove(&r.id) else {
        return;
    };
    if o.first_token {
        metrics.running.dec();
    } else {
        metrics.waiting.dec();
    }
    if end == Event::Completed {
        metrics.request_success.inc();
        metrics.e2e.observe(o.received.elapsed().as_secs_f64());
    } else {
        metrics.request_failure.inc();
    }
    let _ = o.events.send(end);
}
