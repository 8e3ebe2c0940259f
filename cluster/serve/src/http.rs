//! The actix-web application: the OpenAI routes, `/v1/models`, `/health`, `/ping`,
//! `/version`, `/metrics`;
//! the API key, the body limit, and server-sent events.

use std::cell::Cell;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use actix_web::http::StatusCode;
use actix_web::http::header::{AUTHORIZATION, CONTENT_LENGTH, RETRY_AFTER};
use actix_web::web::{self, Bytes};
use actix_web::{HttpRequest, HttpResponse};
use crossbeam_channel::Sender;
use futures_util::{Stream, StreamExt};
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use tokio::sync::Notify;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use super::api::{self, ApiError, Endpoint, Parsed};
use super::bridge::{Backlog, BridgeMsg, Event, Pending, Place};
use super::stop::{Released, StopWatch};
use lockstep_actors::config::RequestShape;
use lockstep_actors::ids::ReqId;
use lockstep_actors::vocab::FailureKind;
use lockstep_plan::fleet::ShapeCheck;

/// What every handler shares.
pub struct AppState {
    /// To the bridge.
    pub bridge: Sender<BridgeMsg>,
    /// The served model's name.
    pub model: String,
    /// The key `/v1/*` requires, if any.
    pub api_key: Option<String>,
    /// The largest body taken, in bytes.
    pub max_body_bytes: usize,
    /// The longest prompt taken, in tokens.
    pub max_prompt_tokens: u32,
    /// `--max-model-len`: the most prompt plus `max_tokens` tokens of one request.
    pub max_model_len: Option<u32>,
    /// What the fleet's times are (`/v1/models`' `lockstep_time_base`).
    pub time_base: lockstep_plan::report::TimeBase,
    /// The metrics.
    pub registry: Arc<Registry>,
    /// When the server started (`/v1/models`' `created`).
    pub created: u64,
    /// The next request's id.
    pub next_id: AtomicU64,
    /// Requests accepted and not both ended and delivered.
    pub pending: Pending,
    /// More pending than this answers 429.
    pub max_pending: usize,
    /// How long an answer may wait on a client that takes none of it.
    pub write_timeout: Duration,
    /// Counts the streams closed for `write_timeout`.
    pub stalled: prometheus_client::metrics::counter::Counter,
    /// The drain, once it began.
    pub drain: Arc<Drain>,
    /// The fleet's KV block size (for the prompt's block hashes).
    pub tokens_per_block: u32,
    /// Whether some server could run a request of a given size.
    pub shapes: ShapeCheck,
    /// Counts the 429s.
    pub rejected: prometheus_client::metrics::counter::Counter,
    /// The front door's service of each request accepted (`/metrics`).
    pub front_service: prometheus_client::metrics::histogram::Histogram,
    /// The front door's time on output tokens (`/metrics`).
    pub front_output: FrontOutput,
    /// `--model`: the model's tokenizer makes the prompt ids and the output text.
    pub text: Option<Arc<super::model_text::ModelText>>,
}

/// Seconds the front door spent on output tokens.
pub type FrontOutput =
    prometheus_client::metrics::counter::Counter<f64, std::sync::atomic::AtomicU64>;

/// The drain (SIGTERM): its deadline once it began, and the answers it cut.
#[derive(Debug, Default)]
pub struct Drain {
    deadline: OnceLock<Instant>,
    cut: AtomicU64,
}

impl Drain {
    /// The drain began; answers not sent by `deadline` are cut.
    pub fn begin(&self, deadline: Instant) {
        let _ = self.deadline.set(deadline);
    }

    /// Answers cut: requests still running at the deadline, and answers still on their
    /// way to a client when the server closed their connections.
    pub fn cut(&self) -> u64 {
        self.cut.load(Ordering::Acquire)
    }

    fn past_deadline(&self) -> bool {
        self.deadline.get().is_some_and(|d| Instant::now() >= *d)
    }

    fn count_cut(&self) {
        self.cut.fetch_add(1, Ordering::AcqRel);
    }
}

/// What a request cut at the drain timeout is answered.
fn cut_error() -> ApiError {
    ApiError::status(
        503,
        "server_error",
        "the server is shutting down, and its drain timeout (--drain-timeout-s) passed before this request finished: it was cancelled",
    )
}

/// The routes. Each path is one resource: a method it does not take is answered 405
/// with an `Allow` header, not 404 (as vLLM's FastAPI server).
pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.service(resource("/health", "GET").route(web::get().to(health)))
        // vLLM's liveness route (SageMaker's `/ping`, GET or POST) and its version.
        .service(
            resource("/ping", "GET, POST")
                .route(web::get().to(health))
                .route(web::post().to(health)),
        )
        .service(resource("/version", "GET").route(web::get().to(version)))
        .service(resource("/metrics", "GET").route(web::get().to(metrics)))
        .service(resource("/v1/models", "GET").route(web::get().to(models)))
        .service(resource("/v1/completions", "POST").route(web::post().to(completions)))
        .service(resource("/v1/chat/completions", "POST").route(web::post().to(chat)))
        .service(resource("/tokenize", "POST").route(web::post().to(tokenize)))
        .service(resource("/detokenize", "POST").route(web::post().to(detokenize)));
}

/// A path whose routes take the methods `allow` lists; any other method gets 405.
fn resource(path: &'static str, allow: &'static str) -> actix_web::Resource {
    web::resource(path).default_service(web::to(move |req: HttpRequest| async move {
        let e = ApiError::status(
            405,
            "invalid_request_error",
            format!(
                "method {} is not allowed on {path}: it takes {allow}",
                req.method()
            ),
        );
        let mut answer = error(&e);
        answer.headers_mut().insert(
            actix_web::http::header::ALLOW,
            actix_web::http::header::HeaderValue::from_static(allow),
        );
        answer
    }))
}

fn error(e: &ApiError) -> HttpResponse {
    let mut answer =
        HttpResponse::build(StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST));
    // Overloaded or stopping: the client may try again (another replica, or later).
    if matches!(e.status, 429 | 503) {
        answer.insert_header((RETRY_AFTER, RETRY_AFTER_S.to_string()));
    }
    answer.json(e.body())
}

/// Seconds a 429 or 503 asks the client to wait.
const RETRY_AFTER_S: u32 = 1;

/// Cancels its request when dropped armed: a handler (or a stream) dropped before its
/// request ended means the client went away.
struct CancelOnDrop {
    id: ReqId,
    bridge: Sender<BridgeMsg>,
    armed: bool,
}

impl CancelOnDrop {
    fn disarm(&mut self) {
        self.armed = false;
    }

    /// A stop string ended the output: the rest of the request is not wanted.
    fn stop(&mut self) {
        if self.armed {
            self.armed = false;
            let _ = self.bridge.send(BridgeMsg::Stop(self.id));
        }
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.bridge.send(BridgeMsg::Cancel(self.id));
        }
    }
}

/// A duplicate of a connection's socket (set when the connection opens), through
/// which a handler waiting for a whole answer notices that its client left: actix-web
/// does not drop a running handler when the peer closes, and vLLM users expect an
/// abandoned request to stop taking GPU time.
#[derive(Clone)]
pub struct Peer(Arc<socket2::Socket>);

impl Peer {
    /// The peer of a new connection (`HttpServer::on_connect`), if it is TCP.
    pub fn of(connection: &dyn std::any::Any) -> Option<Peer> {
        let tcp = connection.downcast_ref::<actix_web::rt::net::TcpStream>()?;
        socket2::SockRef::from(tcp)
            .try_clone()
            .ok()
            .map(|s| Peer(Arc::new(s)))
    }

    /// Whether the client has closed its sending half (or the connection broke). The
    /// socket is non-blocking (tokio's): a peek finds data, nothing yet, the end, or an
    /// error.
    fn departed(&self) -> Option<Departure> {
        let mut byte = [std::mem::MaybeUninit::uninit(); 1];
        match self.0.peek(&mut byte) {
            Ok(0) => Some(Departure::HalfClosed),
            Ok(_) => None,
            Err(e) => (!matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
            ))
            .then_some(Departure::Broken),
        }
    }

    /// Returns once the client has closed its sending half, or the connection broke.
    async fn departure(&self) -> Departure {
        loop {
            tokio::time::sleep(PEER_CHECK_EVERY).await;
            if let Some(d) = self.departed() {
                return d;
            }
        }
    }

    /// Closes the connection under its server (whose writes then fail), with a reset:
    /// what it had buffered for the client is dropped.
    fn close(socket: &socket2::Socket) {
        let _ = socket.set_linger(Some(Duration::ZERO));
        let _ = socket.shutdown(std::net::Shutdown::Both);
    }
}

/// How a client waiting for a whole answer left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Departure {
    /// It sent its end of file: it closed its socket, or only its sending half (and
    /// still reads), which no peek can tell apart.
    HalfClosed,
    /// The connection broke (a reset).
    Broken,
}

/// What an answer's body and its watchdog share (on one worker thread).
struct Flow {
    /// Each sequence's events not yet taken, and since when the connection has held the
    /// body's bytes without asking for more (shared with the bridge).
    backlogs: Vec<Arc<Backlog>>,
    /// The body ended, or was dropped.
    over: Notify,
    /// A drain cut was answered or counted for this answer.
    cut_counted: Cell<bool>,
}

impl Flow {
    fn new(backlogs: Vec<Arc<Backlog>>) -> Rc<Flow> {
        Rc::new(Flow {
            backlogs,
            over: Notify::new(),
            cut_counted: Cell::new(false),
        })
    }

    fn block(&self) {
        self.backlogs.iter().for_each(|b| b.block());
    }

    fn unblock(&self) {
        self.backlogs.iter().for_each(|b| b.unblock());
    }

    /// All are blocked and unblocked together: the longest is the connection's.
    fn blocked_for(&self) -> Option<Duration> {
        self.backlogs.iter().filter_map(|b| b.blocked_for()).max()
    }
}

/// An answer's body on its way to the client: it holds the request's `--max-pending`
/// place until its last byte is handed to the connection (or the connection drops it),
/// and its watchdog closes the connection of a client that takes nothing for the write
/// timeout — a stalled client cannot hold a place, a buffer or its request's KV beyond
/// that.
struct Delivery {
    body: Pin<Box<dyn Stream<Item = Result<Bytes, actix_web::Error>>>>,
    flow: Rc<Flow>,
    drain: Arc<Drain>,
    finished: bool,
    _places: Vec<Place>,
}

impl Delivery {
    /// `body`, sent over `req`'s connection, watched; a stall cancels requests `ids`
    /// (the `n` sequences of one answer).
    fn new(
        state: &AppState,
        req: &HttpRequest,
        ids: Vec<ReqId>,
        places: Vec<Place>,
        flow: Rc<Flow>,
        body: impl Stream<Item = Result<Bytes, actix_web::Error>> + 'static,
    ) -> Delivery {
        if let Some(peer) = req.conn_data::<Peer>() {
            actix_web::rt::spawn(watchdog(
                flow.clone(),
                state.write_timeout,
                Arc::downgrade(&peer.0),
                state.stalled.clone(),
                state.bridge.clone(),
                ids,
            ));
        }
        Delivery {
            body: Box::pin(body),
            flow,
            drain: state.drain.clone(),
            finished: false,
            _places: places,
        }
    }
}

impl Stream for Delivery {
    type Item = Result<Bytes, actix_web::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        // Asked for more: what it gave last has been taken.
        this.flow.unblock();
        match this.body.as_mut().poll_next(cx) {
            Poll::Ready(Some(item)) => {
                this.flow.block();
                Poll::Ready(Some(item))
            }
            Poll::Ready(None) => {
                this.finished = true;
                this.flow.over.notify_one();
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Drop for Delivery {
    fn drop(&mut self) {
        self.flow.over.notify_one();
        // Closed under it at the end of the drain: an answer its client never got.
        if !self.finished && self.drain.past_deadline() && !self.flow.cut_counted.replace(true) {
            self.drain.count_cut();
        }
    }
}

/// Watches an answer's body until it ends: once the connection has held bytes for its
/// client for `timeout` without asking the body for more (the client reads nothing),
/// it counts a stall, cancels requests `ids` and closes the connection.
async fn watchdog(
    flow: Rc<Flow>,
    timeout: Duration,
    peer: Weak<socket2::Socket>,
    stalled: prometheus_client::metrics::counter::Counter,
    bridge: Sender<BridgeMsg>,
    ids: Vec<ReqId>,
) {
    let mut wait = timeout;
    loop {
        tokio::select! {
            () = flow.over.notified() => return,
            () = tokio::time::sleep(wait) => {}
        }
        wait = match flow.blocked_for() {
            Some(d) if d >= timeout => break,
            Some(d) => timeout - d,
            None => timeout,
        };
    }
    stalled.inc();
    for id in ids {
        let _ = bridge.send(BridgeMsg::Cancel(id));
    }
    if let Some(socket) = peer.upgrade() {
        Peer::close(&socket);
    }
}

/// How often a handler waiting for a whole answer checks its client is still there.
const PEER_CHECK_EVERY: std::time::Duration = std::time::Duration::from_millis(200);

/// The context a request must fit, its prompt and `max_tokens` together, and what sets
/// it: the smaller of the model's positions (`max_position_embeddings`, with `--model`)
/// and `--max-model-len` (the model's on a tie). `None` when neither is given. What
/// `/v1/models` shows, a chat's default `max_tokens` fills, and [`check_size`] holds.
fn context_limit(state: &AppState) -> Option<(u32, &'static str)> {
    let model = state
        .text
        .as_ref()
        .map(|t| (t.max_positions(), "max_position_embeddings"));
    let flag = state.max_model_len.map(|l| (l, "--max-model-len"));
    match (model, flag) {
        (Some(m), Some(f)) => Some(if f.0 < m.0 { f } else { m }),
        (m, f) => m.or(f),
    }
}

/// Refuses a request no server could ever run (400, as vLLM refuses a prompt past
/// `max_model_len`): past the context ([`context_limit`], the prompt alone or with its
/// `max_tokens`), or past what the fleet's servers can hold.
fn check_size(state: &AppState, parsed: &Parsed, endpoint: Endpoint) -> Result<(), ApiError> {
    if let Some((limit, named)) = context_limit(state) {
        let want = u64::from(parsed.prompt_tokens) + u64::from(parsed.max_tokens);
        if !lockstep_gpu::model::ModelConfig::holds_positions(limit as usize, want) {
            let param = if parsed.prompt_tokens >= limit {
                api::prompt_param(endpoint)
            } else {
                parsed.max_tokens_param
            };
            let mut e = ApiError::field(
                param,
                format!(
                    "{param}: this model's maximum context length is {limit} tokens ({named}); the request asks for {want} ({} prompt tokens + max_tokens {})",
                    parsed.prompt_tokens, parsed.max_tokens
                ),
            );
            e.code = Some("context_length_exceeded");
            return Err(e);
        }
    }
    let (param, why) = if let Some(why) = fleet_refusal(state, parsed.prompt_tokens, 1) {
        (api::prompt_param(endpoint), why)
    } else if let Some(why) = fleet_refusal(state, parsed.prompt_tokens, parsed.max_tokens) {
        (parsed.max_tokens_param, why)
    } else {
        return Ok(());
    };
    let mut e = ApiError::field(
        param,
        format!(
            "{param}: a request of {} prompt tokens and max_tokens {} cannot run on this fleet: {why}",
            parsed.prompt_tokens, parsed.max_tokens
        ),
    );
    e.code = Some("context_length_exceeded");
    Err(e)
}

/// Why no server of the fleet could run a request of `prompt` tokens and
/// `max_new_tokens` (`None`: some can): the fleet's own check (`ShapeCheck`).
fn fleet_refusal(
    state: &AppState,
    prompt: u32,
    max_new_tokens: u32,
) -> Option<lockstep_actors::config::Unservable> {
    state.shapes.refusal(RequestShape {
        prompt_len: prompt,
        max_new_tokens,
        draft_len: 0,
        pinned_rank: None,
    })
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Constant-time comparison of the presented key.
fn authorized(req: &HttpRequest, state: &AppState) -> Result<(), ApiError> {
    let Some(key) = &state.api_key else {
        return Ok(());
    };
    let given = req
        .headers()
        .get(AUTHORIZATION)
        .and_then(|h| h.to_str().ok())
        .and_then(|h| h.strip_prefix("Bearer "))
        .unwrap_or("");
    let same = given.len() == key.len()
        && given
            .bytes()
            .zip(key.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0;
    if same {
        Ok(())
    } else {
        Err(ApiError {
            status: 401,
            message: "missing or wrong API key: send `Authorization: Bearer KEY`".into(),
            param: None,
            kind: "invalid_request_error",
            code: Some("invalid_api_key"),
        })
    }
}

async fn health() -> HttpResponse {
    HttpResponse::Ok().finish()
}

async fn version() -> HttpResponse {
    HttpResponse::Ok().json(json!({"version": env!("CARGO_PKG_VERSION")}))
}

async fn metrics(state: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("application/openmetrics-text; version=1.0.0; charset=utf-8")
        .body(super::metrics::render(&state.registry))
}

async fn models(req: HttpRequest, state: web::Data<AppState>) -> HttpResponse {
    if let Err(e) = authorized(&req, &state) {
        return error(&e);
    }
    // As vLLM: `root` is what is served (the model directory), `max_model_len` its
    // context (null without a model: the fleet's limits are per server, not one number).
    let root = match &state.text {
        Some(text) => text.root().display().to_string(),
        None => state.model.clone(),
    };
    let max_model_len = context_limit(&state).map(|(l, _)| l);
    HttpResponse::Ok().json(json!({
        "object": "list",
        "data": [{
            "id": state.model,
            "object": "model",
            "created": state.created,
            "owned_by": "lockstep",
            "root": root,
            "parent": null,
            "max_model_len": max_model_len,
            // lockstep's own: whether this server's times model anything (a client's
            // throughput against a zero-cost fleet measures the control plane only).
            "lockstep_time_base": state.time_base,
        }],
    }))
}

/// `/tokenize` (vLLM's): the prompt's, or the chat's, token ids.
async fn tokenize(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> HttpResponse {
    tokenizer_route(req, payload, state, |text, body, state| {
        let max_model_len = context_limit(state).map(|(l, _)| l);
        super::tokenize::tokenize(
            text,
            body,
            &state.model,
            max_model_len,
            state.max_prompt_tokens,
        )
    })
    .await
}

/// `/detokenize` (vLLM's): token ids back to text.
async fn detokenize(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> HttpResponse {
    tokenizer_route(req, payload, state, |text, body, state| {
        super::tokenize::detokenize(text, body, &state.model)
    })
    .await
}

/// A tokenizer route: behind the API key as the generating routes (encoding a long text
/// costs the server as a prompt does), its body within the body limit, answered by
/// `answer` with the model's text rules, or a 400 without `--model`.
async fn tokenizer_route(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
    answer: impl FnOnce(
        &super::model_text::ModelText,
        &[u8],
        &AppState,
    ) -> Result<serde_json::Value, ApiError>,
) -> HttpResponse {
    if let Err(e) = authorized(&req, &state) {
        return error(&e);
    }
    let body = match read_body(&req, payload, state.max_body_bytes).await {
        Ok(body) => body,
        Err(e) => return error(&e),
    };
    let Some(text) = &state.text else {
        return error(&no_tokenizer());
    };
    match answer(text, &body, &state) {
        Ok(answer) => HttpResponse::Ok().json(answer),
        Err(e) => error(&e),
    }
}

/// What the tokenizer routes answer without `--model`.
fn no_tokenizer() -> ApiError {
    ApiError::status(
        400,
        "invalid_request_error",
        "this server has no tokenizer: /tokenize and /detokenize need `serve --model` (without one, a text prompt's length is its count of words)",
    )
}

/// The body, refused past the limit (by its declared length, or as it arrives).
async fn read_body(
    req: &HttpRequest,
    mut payload: web::Payload,
    limit: usize,
) -> Result<Vec<u8>, ApiError> {
    let too_large = || {
        ApiError::status(
            413,
            "invalid_request_error",
            format!("the request body is larger than this server's limit of {limit} bytes"),
        )
    };
    let declared = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    let mut body = Vec::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|e| {
            ApiError::status(
                400,
                "invalid_request_error",
                format!("reading the body: {e}"),
            )
        })?;
        if body.len() + chunk.len() > limit {
            return Err(too_large());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

async fn completions(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> HttpResponse {
    generate(req, payload, state, Endpoint::Completions).await
}

async fn chat(req: HttpRequest, payload: web::Payload, state: web::Data<AppState>) -> HttpResponse {
    generate(req, payload, state, Endpoint::Chat).await
}

async fn generate(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
    endpoint: Endpoint,
) -> HttpResponse {
    if let Err(e) = authorized(&req, &state) {
        return error(&e);
    }
    let received = Instant::now();
    let body = match read_body(&req, payload, state.max_body_bytes).await {
        Ok(b) => b,
        Err(e) => return error(&e),
    };
    let mut parsed = match api::parse(
        &body,
        endpoint,
        &state.model,
        state.max_prompt_tokens,
        state.tokens_per_block,
    ) {
        Ok(p) => p,
        Err(e) => return error(&e),
    };
    let mut prompt_ids = Vec::new();
    let mut echo = None;
    let mut echo_logprobs = None;
    if let Some(text) = &state.text {
        match model_prompt(text, &body, endpoint, &mut parsed, &state) {
            Ok(ids) => prompt_ids = ids,
            Err(e) => return error(&e),
        }
        if parsed.echo {
            echo = Some(text.prompt_text(&body, &prompt_ids));
        }
        if parsed.echo
            && let Some(top) = parsed.logprobs
        {
            match prompt_logprob_items(text, &prompt_ids, top).await {
                Ok(items) => echo_logprobs = Some(items),
                Err(e) => return error(&e),
            }
        }
    } else if let Err(e) = no_forward(&parsed) {
        return error(&e);
    }
    // Against the final length (a model's chat gets its length above).
    if let Err(e) = api::check_min_tokens(&parsed) {
        return error(&e);
    }
    if let Err(e) = check_size(&state, &parsed, endpoint) {
        return error(&e);
    }
    if let Err(e) = check_n(&state, &parsed) {
        return error(&e);
    }
    // Never waits: past the bound the answer is 429 at once. Each of the `n` sequences
    // holds a place, so `n` of them are reserved, or none.
    let mut places = Vec::with_capacity(parsed.n as usize);
    for _ in 0..parsed.n {
        let Some(place) = state.pending.reserve(state.max_pending) else {
            state.rejected.inc();
            let mut e = ApiError::status(
                429,
                "rate_limit_error",
                format!(
                    "{} requests are pending, this server's limit (--max-pending); retry after {RETRY_AFTER_S} s",
                    state.max_pending
                ),
            );
            e.code = Some("rate_limit_exceeded");
            return error(&e);
        };
        places.push(place);
    }
    let block_hashes = std::mem::take(&mut parsed.block_hashes);
    let logit_bias = std::mem::take(&mut parsed.logit_bias);
    let streamed = parsed.stream;
    let created = now_s();
    let mut answers = Vec::with_capacity(places.len());
    let mut ids = Vec::with_capacity(places.len());
    let mut submits = Vec::with_capacity(places.len());
    for (index, place) in (0u32..).zip(&places) {
        let id = ReqId(state.next_id.fetch_add(1, Ordering::Relaxed));
        // Only a model samples: the other backends get none of these.
        let (sampling, logit_bias, end_ids) = match &state.text {
            Some(t) => (
                t.sampling_of(&parsed, id.0, index),
                logit_bias.clone(),
                t.end_ids_of(&parsed),
            ),
            None => (None, Vec::new(), Vec::new()),
        };
        let (events, rx) = unbounded_channel();
        let backlog = Arc::new(Backlog::default());
        submits.push(BridgeMsg::Submit {
            id,
            prompt_tokens: parsed.prompt_tokens,
            max_tokens: parsed.max_tokens,
            block_hashes: block_hashes.clone(),
            prompt_ids: prompt_ids.clone(),
            sampling,
            logit_bias,
            end_ids,
            received,
            events,
            backlog: backlog.clone(),
            place: place.clone(),
        });
        // The first sequence names the answer.
        let answer_id = ids.first().copied().unwrap_or(id);
        let shape = Shape {
            endpoint,
            index,
            id: format!(
                "{}-{}",
                match endpoint {
                    Endpoint::Completions => "cmpl",
                    Endpoint::Chat => "chatcmpl",
                },
                answer_id.0
            ),
            created,
            model: state.model.clone(),
            text_offset: echo.as_deref().map_or(0, |e: &str| e.chars().count()),
            echo: echo.clone(),
            echo_logprobs: echo_logprobs.clone(),
            parsed: parsed.clone(),
            decoder: state.text.as_ref().map(|t| t.decoder()),
        };
        answers.push(Answer {
            shape,
            rx,
            backlog,
            guard: CancelOnDrop {
                id,
                bridge: state.bridge.clone(),
                armed: true,
            },
            generated: 0,
            logprobs: Vec::new(),
            front_output: state.front_output.clone(),
            deferred: Vec::new(),
        });
        ids.push(id);
    }
    // The first sequence goes now; the others once it has its first token, when its
    // prompt's full blocks are computed and registered: with block reuse on
    // (`enable_block_reuse`) they then share them on its rank rather than each
    // computing the prompt in the same batch. With it off each computes the prompt.
    let mut submits = submits.into_iter();
    let first = submits.next();
    answers[0].deferred = submits.collect();
    if first.is_none_or(|m| state.bridge.send(m).is_err()) {
        return error(&ApiError::status(
            503,
            "server_error",
            "the servers have stopped",
        ));
    }
    // The front door's part of this request ends here: the executor has it.
    state
        .front_service
        .observe(received.elapsed().as_secs_f64());
    if streamed {
        stream(answers, &state, &req, ids, places)
    } else {
        whole(answers, &state, &req, ids, places).await
    }
}

/// `n` is bounded by `--max-pending` (each sequence takes a place: a larger `n` could
/// never be served) and, with the final `max_tokens` (a model's chat gets its own),
/// `n × max_tokens` by what one request may ask for.
fn check_n(state: &AppState, parsed: &Parsed) -> Result<(), ApiError> {
    if parsed.n as usize > state.max_pending {
        return Err(ApiError::field(
            "n",
            format!(
                "n {} is more than this server's bound of {} sequences per request (--max-pending {}: each sequence takes a pending place)",
                parsed.n, state.max_pending, state.max_pending
            ),
        ));
    }
    let total = u64::from(parsed.n) * u64::from(parsed.max_tokens);
    if total > u64::from(api::MAX_TOKENS_LIMIT) {
        return Err(ApiError::field(
            "n",
            format!(
                "n {} times {} {} is more than the {} output tokens one request may ask for",
                parsed.n,
                parsed.max_tokens_param,
                parsed.max_tokens,
                api::MAX_TOKENS_LIMIT
            ),
        ));
    }
    Ok(())
}

/// A request's answer in the making: its events, and what turns them into text.
struct Answer {
    shape: Shape,
    rx: UnboundedReceiver<Event>,
    /// Its events not yet taken.
    backlog: Arc<Backlog>,
    /// Armed until the request ends: dropped armed, it cancels the request.
    guard: CancelOnDrop,
    /// Output tokens so far.
    generated: u32,
    /// A whole answer's tokens' log-probabilities so far (when asked for).
    logprobs: Vec<TokenLogprob>,
    front_output: FrontOutput,
    /// The other sequences of an `n` > 1 request, submitted at this one's first event.
    deferred: Vec<BridgeMsg>,
}

/// Without `--model` no forward runs, so there are no log-probabilities (and no
/// tokenizer to echo a prompt with, no vocabulary for `stop_token_ids`): a 400 rather
/// than made-up numbers.
fn no_forward(parsed: &Parsed) -> Result<(), ApiError> {
    let field = if parsed.logprobs.is_some() {
        "logprobs"
    } else if parsed.echo {
        "echo"
    } else if !parsed.stop_token_ids.is_empty() {
        // No model, no vocabulary: its token ids would be checked against nothing.
        "stop_token_ids"
    } else {
        return Ok(());
    };
    Err(ApiError::field(
        field,
        format!("{field} needs a model: this server models no forward (start it with --model)"),
    ))
}

/// The prompt's tokens as `echo` with `logprobs` shows them (vLLM's `prompt_logprobs`):
/// the first with none, each other with its log-probability given those before it and
/// the `top` most likely there; offsets count the tokens' texts from the answer's start.
/// One forward over the prompt, off the async threads.
async fn prompt_logprob_items(
    text: &Arc<super::model_text::ModelText>,
    ids: &[u32],
    top: u32,
) -> Result<Vec<TokenLogprob>, ApiError> {
    let (model, owned) = (text.clone(), ids.to_vec());
    let computed = web::block(move || model.prompt_logprobs(&owned, top))
        .await
        .map_err(|e| e.to_string())
        .and_then(|r| r);
    let logprobs = computed.map_err(|why| {
        ApiError::status(
            500,
            "internal_error",
            format!("the prompt's log-probabilities: {why}"),
        )
    })?;
    let decoder = text.decoder();
    let mut offset = 0;
    let mut items = Vec::with_capacity(ids.len());
    for (i, &id) in ids.iter().enumerate() {
        let (logprob, top) = match i.checked_sub(1).and_then(|j| logprobs.get(j)) {
            Some(l) => (
                Some(l.logprob),
                l.top
                    .iter()
                    .map(|&(t, lp)| (decoder.token_text(t), lp))
                    .collect(),
            ),
            None => (None, Vec::new()),
        };
        let token = decoder.token_text(id);
        let chars = token.chars().count();
        items.push(TokenLogprob {
            token,
            logprob,
            top,
            offset,
        });
        offset += chars;
    }
    Ok(items)
}

/// One output token's log-probabilities as an answer shows them.
#[derive(Clone)]
struct TokenLogprob {
    /// Its text.
    token: String,
    /// `None` for the prompt's first token (`echo`), which nothing precedes.
    logprob: Option<f32>,
    /// The most likely tokens' texts and log-probabilities, most likely first.
    top: Vec<(String, f32)>,
    /// Where its text begins in the answer's text (completions' `text_offset`).
    offset: usize,
}

/// A log-probability as JSON: vLLM's -9999 stands for minus infinity, which JSON lacks.
fn logprob_value(l: f32) -> Value {
    json!(if l.is_finite() { l } else { -9999.0 })
}

/// The `logprobs` object of a choice carrying `items` (`null` when none were asked).
fn logprobs_json(endpoint: Endpoint, asked: bool, items: &[TokenLogprob]) -> Value {
    if !asked {
        return Value::Null;
    }
    match endpoint {
        // The sampled token is always among the top ones (OpenAI's rule: up to k + 1).
        Endpoint::Completions => json!({
            "tokens": items.iter().map(|i| i.token.as_str()).collect::<Vec<_>>(),
            "token_logprobs": items.iter().map(|i| i.logprob.map_or(Value::Null, logprob_value)).collect::<Vec<_>>(),
            "top_logprobs": items.iter().map(|i| {
                let Some(own) = i.logprob else {
                    return Value::Null;
                };
                let mut top: serde_json::Map<String, Value> = i
                    .top
                    .iter()
                    .map(|(t, l)| (t.clone(), logprob_value(*l)))
                    .collect();
                top.entry(i.token.clone()).or_insert_with(|| logprob_value(own));
                Value::Object(top)
            }).collect::<Vec<_>>(),
            "text_offset": items.iter().map(|i| i.offset).collect::<Vec<_>>(),
        }),
        Endpoint::Chat => {
            let entry = |token: &str, l: f32| json!({"token": token, "logprob": logprob_value(l), "bytes": token.as_bytes()});
            json!({
                "content": items.iter().map(|i| {
                    let mut e = entry(&i.token, i.logprob.unwrap_or(f32::NEG_INFINITY));
                    e["top_logprobs"] = i.top.iter().map(|(t, l)| entry(t, *l)).collect();
                    e
                }).collect::<Vec<_>>(),
            })
        }
    }
}

/// The error a failed request answers with.
fn failure(why: String, kind: FailureKind) -> ApiError {
    match kind {
        FailureKind::Unavailable => ApiError::status(503, "server_error", why),
        // No server can run it (the front's rule, which `check_size` applies first).
        FailureKind::Refused => ApiError::status(400, "invalid_request_error", why),
        _ => ApiError::status(500, "server_error", why),
    }
}

/// `--model`: the prompt as the model's token ids; the count, the block hashes (over the
/// ids, so equal prefixes share blocks) and the length check follow them.
fn model_prompt(
    text: &super::model_text::ModelText,
    body: &[u8],
    endpoint: Endpoint,
    parsed: &mut Parsed,
    state: &AppState,
) -> Result<Vec<u32>, ApiError> {
    let ids = text.prompt_ids(body, endpoint, state.max_prompt_tokens)?;
    api::check_prompt_tokens(endpoint, ids.len(), state.max_prompt_tokens)?;
    parsed.prompt_tokens = ids.len() as u32;
    if endpoint == Endpoint::Chat && !parsed.max_tokens_given {
        // vLLM's default: what the context leaves after the prompt (here also what the
        // fleet's KV can hold), rather than OpenAI's 16 for completions.
        let positions = context_limit(state).map_or(text.max_positions(), |(l, _)| l);
        parsed.max_tokens = context_left(state, parsed, positions);
    }
    text.check_logit_bias(&parsed.logit_bias)?;
    text.check_stop_token_ids(&parsed.stop_token_ids)?;
    let keys: Vec<u64> = ids.iter().map(|&t| u64::from(t)).collect();
    parsed.block_hashes = api::block_hashes(&keys, state.tokens_per_block);
    Ok(ids)
}

/// The most output tokens a request of `parsed.prompt_tokens` can ask for: the model's
/// positions left after the prompt, and no more than some server of the fleet takes
/// (the refusal grows with `max_new_tokens`, so a bisection finds the edge). At least 1,
/// so that a prompt that fills the context is refused by the length check naming it.
fn context_left(state: &AppState, parsed: &Parsed, max_positions: u32) -> u32 {
    let positions_left = max_positions
        .saturating_sub(parsed.prompt_tokens)
        .clamp(1, api::MAX_TOKENS_LIMIT);
    let fits =
        |max_new_tokens| fleet_refusal(state, parsed.prompt_tokens, max_new_tokens).is_none();
    if fits(positions_left) || !fits(1) {
        return positions_left;
    }
    let (mut ok, mut too_many) = (1, positions_left);
    while too_many - ok > 1 {
        let mid = ok + (too_many - ok) / 2;
        if fits(mid) {
            ok = mid;
        } else {
            too_many = mid;
        }
    }
    ok
}

/// What every answer of one request repeats.
struct Shape {
    endpoint: Endpoint,
    /// Which of the request's `n` sequences (its choices' `index`).
    index: u32,
    id: String,
    created: u64,
    model: String,
    parsed: Parsed,
    /// `--model`: output ids to text.
    decoder: Option<super::model_text::Decoder>,
    /// `echo`: the prompt's text, until the first piece of the answer carries it.
    echo: Option<String>,
    /// `echo` with `logprobs`: the prompt's tokens' log-probabilities, until the first
    /// piece of the answer carries them.
    echo_logprobs: Option<Vec<TokenLogprob>>,
    /// Where the next token's text begins in the answer (in characters, as vLLM
    /// counts: its `text_offset`).
    text_offset: usize,
}

impl Shape {
    /// What a step's `count` tokens, the last of id `last`, `before` tokens in, let the
    /// answer send: their text through the stop-string watch, or, at the model's end of
    /// sequence or one of `stop_token_ids` (`--model`), the end of the answer as at a stop string (the token is
    /// counted, not shown). Before `min_tokens` output tokens no stop string is looked
    /// for (vLLM's rule; the rank masks the end of sequence there).
    fn release(&mut self, watch: &mut StopWatch, last: u32, count: u32, before: u32) -> Released {
        let text = match &mut self.decoder {
            // `stop_token_ids` end it even with `ignore_eos`, as in vLLM.
            Some(d)
                if (d.is_eos(last) && !self.parsed.ignore_eos)
                    || self.parsed.stop_token_ids.binary_search(&last).is_ok() =>
            {
                return watch.end_of_sequence();
            }
            Some(d) => d.push(last),
            None => api::render(last, count, before),
        };
        if before + count < self.parsed.min_tokens {
            watch.push_unwatched(&text)
        } else {
            watch.push(&text)
        }
    }

    /// `items` with the echoed prompt's log-probabilities before them, the first time
    /// only.
    fn with_echo_logprobs(&mut self, items: Vec<TokenLogprob>) -> Vec<TokenLogprob> {
        match self.echo_logprobs.take() {
            Some(mut prompt) => {
                prompt.extend(items);
                prompt
            }
            None => items,
        }
    }

    /// `text` with the echoed prompt before it, the first time only.
    fn with_echo(&mut self, text: String) -> String {
        match self.echo.take() {
            Some(mut prompt) => {
                prompt.push_str(&text);
                prompt
            }
            None => text,
        }
    }

    /// A token's log-probabilities as the answer shows them (its text, special tokens
    /// shown, as vLLM names them), advancing the text offset.
    fn logprob_of(&mut self, l: &lockstep_actors::vocab::TokenLogprobs) -> TokenLogprob {
        let text = |id: u32| match &self.decoder {
            Some(d) => d.token_text(id),
            None => String::new(),
        };
        let item = TokenLogprob {
            token: text(l.token),
            logprob: Some(l.logprob),
            top: l.top.iter().map(|&(id, lp)| (text(id), lp)).collect(),
            offset: self.text_offset,
        };
        self.text_offset += item.token.chars().count();
        item
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
        }
    }

    fn wrap(&self, chunk: bool, choices: Value, usage: Value) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if !usage.is_null() || !chunk {
            v["usage"] = usage;
        }
        v
    }

    /// A streamed choice carrying `text` (and `finish`, if it ends) and its tokens'
    /// log-probabilities (`null` unless asked for).
    fn delta(
        &self,
        text: Option<&str>,
        finish: Option<&str>,
        first: bool,
        items: &[TokenLogprob],
    ) -> Value {
        let logprobs = logprobs_json(
            self.endpoint,
            self.parsed.logprobs.is_some() && !items.is_empty(),
            items,
        );
        match self.endpoint {
            Endpoint::Completions => json!([{
                "index": self.index,
                "text": text.unwrap_or(""),
                "logprobs": logprobs,
                "finish_reason": finish,
            }]),
            Endpoint::Chat => {
                let mut delta = serde_json::Map::new();
                if first {
                    delta.insert("role".into(), "assistant".into());
                }
                if let Some(t) = text {
                    delta.insert("content".into(), t.into());
                }
                json!([{
                    "index": self.index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                }])
            }
        }
    }
}

/// How a whole answer's wait ended.
#[derive(Clone)]
enum WholeEnd {
    /// The answer is complete.
    Done,
    /// The request failed.
    Failed(ApiError),
    /// The drain timeout cut it.
    Cut,
}

impl Answer {
    /// The request's next event (`None`: the bridge is gone). Cancel-safe.
    async fn next(&mut self) -> Option<Event> {
        let event = self.rx.recv().await;
        if event.is_some() {
            self.backlog.took();
            for m in self.deferred.drain(..) {
                // Refused (the bridge is gone): that sequence's events end, and it
                // answers that the servers stopped.
                let _ = self.guard.bridge.send(m);
            }
        }
        event
    }

    /// Takes the request's events until it ends, gathering the text into `text`.
    /// Cancel-safe: dropped while waiting, it loses nothing, and may be called again.
    async fn gather(&mut self, text: &mut String, watch: &mut StopWatch) -> WholeEnd {
        loop {
            match self.next().await {
                Some(Event::Tokens {
                    last,
                    count,
                    logprobs,
                    ..
                }) => {
                    let began = Instant::now();
                    if let Some(l) = &logprobs {
                        let item = self.shape.logprob_of(l);
                        self.logprobs.push(item);
                    }
                    let released = self.shape.release(watch, last, count, self.generated);
                    text.push_str(&released.text);
                    self.generated += count;
                    self.front_output.inc_by(began.elapsed().as_secs_f64());
                    if released.stopped {
                        self.guard.stop();
                        return WholeEnd::Done;
                    }
                }
                Some(Event::Completed) => {
                    text.push_str(&watch.finish());
                    self.guard.disarm();
                    return WholeEnd::Done;
                }
                Some(Event::Failed { why, kind }) => {
                    self.guard.disarm();
                    return WholeEnd::Failed(failure(why, kind));
                }
                Some(Event::Cut) => {
                    self.guard.disarm();
                    return WholeEnd::Cut;
                }
                None => {
                    self.guard.disarm();
                    return WholeEnd::Failed(failure(STOPPED.into(), FailureKind::Unavailable));
                }
            }
        }
    }

    /// This sequence's choice in the whole answer.
    fn choice_json(&mut self, text: String, watch: &StopWatch) -> Value {
        let finish = if watch.stopped() { "stop" } else { "length" };
        let text = self.shape.with_echo(text);
        let items = self
            .shape
            .with_echo_logprobs(std::mem::take(&mut self.logprobs));
        let logprobs = logprobs_json(
            self.shape.endpoint,
            self.shape.parsed.logprobs.is_some(),
            &items,
        );
        match self.shape.endpoint {
            Endpoint::Completions => json!({
                "index": self.shape.index, "text": text, "logprobs": logprobs, "finish_reason": finish,
            }),
            Endpoint::Chat => json!({
                "index": self.shape.index,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish,
            }),
        }
    }
}

/// One sequence of a whole answer: its answer, its text so far, and how it ended.
struct Seq {
    answer: Answer,
    text: String,
    watch: StopWatch,
    end: Option<WholeEnd>,
}

impl Seq {
    fn new(answer: Answer) -> Seq {
        let watch = StopWatch::new(answer.shape.parsed.stop.clone());
        Seq {
            answer,
            text: String::new(),
            watch,
            end: None,
        }
    }

    /// Gathers until the sequence ends. Cancel-safe, and a no-op once it ended.
    async fn run(&mut self) {
        if self.end.is_none() {
            let end = self.answer.gather(&mut self.text, &mut self.watch).await;
            self.end = Some(end);
        }
    }
}

/// Every sequence, to its end. Cancel-safe.
async fn run_all(seqs: &mut [Seq]) {
    futures_util::future::join_all(seqs.iter_mut().map(Seq::run)).await;
}

/// The whole answer of ended sequences: one choice each, the usage counting the prompt
/// once and every sequence's tokens; or the first failure.
fn whole_answer(seqs: &mut [Seq]) -> Whole {
    for seq in seqs.iter() {
        match &seq.end {
            Some(WholeEnd::Failed(e)) => return Whole::Failed(e.clone()),
            Some(WholeEnd::Cut) => return Whole::Cut,
            _ => {}
        }
    }
    let generated: u32 = seqs.iter().map(|s| s.answer.generated).sum();
    let choices: Vec<Value> = seqs
        .iter_mut()
        .map(|s| s.answer.choice_json(std::mem::take(&mut s.text), &s.watch))
        .collect();
    let shape = &seqs[0].answer.shape;
    Whole::Done(shape.wrap(
        false,
        Value::Array(choices),
        api::usage(shape.parsed.prompt_tokens, generated),
    ))
}

/// How a whole answer of `n` sequences ended.
enum Whole {
    Done(Value),
    Failed(ApiError),
    Cut,
}

const STOPPED: &str = "the servers stopped before the request finished";

/// The whole answer, once the request ended. While it waits, the client's connection is
/// watched: a reset cancels the request (the armed guard, dropped). An end of file
/// cannot tell a client that closed its socket from one that only closed its sending
/// half and still reads (HTTP/1.1 allows it), so it commits the answer: a 200 whose
/// JSON body is preceded by a space every `PEER_CHECK_EVERY` — the first writes make a
/// closed socket answer with a reset, which fails the next and cancels the request; a
/// half-closed client reads the spaces (JSON whitespace) and then its answer, or the
/// error object if the request fails after all.
async fn whole(
    answers: Vec<Answer>,
    state: &AppState,
    req: &HttpRequest,
    ids: Vec<ReqId>,
    places: Vec<Place>,
) -> HttpResponse {
    let mut seqs: Vec<Seq> = answers.into_iter().map(Seq::new).collect();
    let peer = req.conn_data::<Peer>().cloned();
    let departure = async {
        match &peer {
            Some(p) => p.departure().await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        () = run_all(&mut seqs) => {}
        how = departure => match how {
            // Nobody reads this answer; the armed guards cancel the requests.
            Departure::Broken => {
                return error(&ApiError::status(
                    400,
                    "invalid_request_error",
                    "the client's connection broke before the answer",
                ));
            }
            Departure::HalfClosed => {
                return committed(seqs, state, req, ids, places);
            }
        }
    };
    match whole_answer(&mut seqs) {
        Whole::Done(v) => HttpResponse::Ok().json(v),
        Whole::Failed(e) => error(&e),
        Whole::Cut => {
            state.drain.count_cut();
            error(&cut_error())
        }
    }
}

/// A whole answer whose client sent its end of file: see [`whole`].
fn committed(
    seqs: Vec<Seq>,
    state: &AppState,
    req: &HttpRequest,
    ids: Vec<ReqId>,
    places: Vec<Place>,
) -> HttpResponse {
    let flow = Flow::new(seqs.iter().map(|s| s.answer.backlog.clone()).collect());
    let (cut, drain) = (flow.clone(), state.drain.clone());
    let body = futures_util::stream::unfold(Some(seqs), move |st| {
        let (cut, drain) = (cut.clone(), drain.clone());
        async move {
            let mut seqs = st?;
            tokio::select! {
                () = run_all(&mut seqs) => {}
                () = tokio::time::sleep(PEER_CHECK_EVERY) => {
                    return Some((Ok(Bytes::from_static(b" ")), Some(seqs)));
                }
            };
            let v = match whole_answer(&mut seqs) {
                Whole::Done(v) => v,
                Whole::Failed(e) => e.body(),
                Whole::Cut => {
                    cut.cut_counted.set(true);
                    drain.count_cut();
                    cut_error().body()
                }
            };
            Some((Ok(Bytes::from(v.to_string())), None))
        }
    });
    HttpResponse::Ok()
        .content_type("application/json")
        .streaming(Delivery::new(state, req, ids, places, flow, body))
}

fn sse(v: &Value) -> Result<Bytes, actix_web::Error> {
    Ok(Bytes::from(format!("data: {v}\n\n")))
}

/// Server-sent events: `data: {chunk}` per step of each of the `n` sequences (each
/// chunk carries its sequence's `index`, interleaved as they come), the usage chunk if
/// asked (the prompt once, every sequence's tokens), `data: [DONE]`. The stream dropped
/// before the requests ended (the client disconnected) cancels them all.
fn stream(
    answers: Vec<Answer>,
    state: &AppState,
    req: &HttpRequest,
    ids: Vec<ReqId>,
    places: Vec<Place>,
) -> HttpResponse {
    struct St {
        answer: Answer,
        first: bool,
        done: bool,
        watch: StopWatch,
        flow: Rc<Flow>,
        drain: Arc<Drain>,
        /// Output tokens of every sequence so far (the usage chunk's).
        generated: Rc<Cell<u32>>,
        /// A sequence failed: the stream ends with no usage chunk.
        failed: Rc<Cell<bool>>,
    }
    let flow = Flow::new(answers.iter().map(|a| a.backlog.clone()).collect());
    let generated = Rc::new(Cell::new(0u32));
    let failed = Rc::new(Cell::new(false));
    let usage = answers.first().and_then(|a| {
        let shape = &a.shape;
        shape.parsed.include_usage.then(|| {
            (
                shape.wrap(true, json!([]), Value::Null),
                shape.parsed.prompt_tokens,
            )
        })
    });
    let sequences = answers
        .into_iter()
        .map(|answer| {
            let watch = StopWatch::new(answer.shape.parsed.stop.clone());
            let st = St {
                answer,
                first: true,
                done: false,
                watch,
                flow: flow.clone(),
                drain: state.drain.clone(),
                generated: generated.clone(),
                failed: failed.clone(),
            };
            Box::pin(futures_util::stream::unfold(st, |mut st| async move {
                if st.done {
                    return None;
                }
                match st.answer.next().await {
                    Some(Event::Tokens {
                        last,
                        count,
                        logprobs,
                        ..
                    }) => {
                        let began = Instant::now();
                        let before = st.answer.generated;
                        let items: Vec<TokenLogprob> = logprobs
                            .iter()
                            .map(|l| st.answer.shape.logprob_of(l))
                            .collect();
                        let items = st.answer.shape.with_echo_logprobs(items);
                        let released = st.answer.shape.release(&mut st.watch, last, count, before);
                        let text = st.answer.shape.with_echo(released.text);
                        st.answer.generated += count;
                        st.generated.set(st.generated.get() + count);
                        let finish = if released.stopped {
                            // The answer ends here; the rest of the request is cancelled.
                            st.done = true;
                            st.answer.guard.stop();
                            Some("stop")
                        } else {
                            None
                        };
                        let shape = &st.answer.shape;
                        let chunk = shape.wrap(
                            true,
                            shape.delta(Some(&text), finish, st.first, &items),
                            Value::Null,
                        );
                        st.first = false;
                        let event = sse(&chunk);
                        st.answer.front_output.inc_by(began.elapsed().as_secs_f64());
                        Some((event, st))
                    }
                    Some(Event::Completed) => {
                        st.done = true;
                        st.answer.guard.disarm();
                        let rest = st.answer.shape.with_echo(st.watch.finish());
                        let items = st.answer.shape.with_echo_logprobs(Vec::new());
                        let shape = &st.answer.shape;
                        let chunk = shape.wrap(
                            true,
                            shape.delta(
                                (!rest.is_empty()).then_some(rest.as_str()),
                                Some("length"),
                                st.first,
                                &items,
                            ),
                            Value::Null,
                        );
                        Some((sse(&chunk), st))
                    }
                    other => {
                        let e = match other {
                            Some(Event::Failed { why, kind }) => failure(why, kind),
                            Some(Event::Cut) => {
                                // One answer cut, whichever of its sequences hears it first.
                                if !st.flow.cut_counted.replace(true) {
                                    st.drain.count_cut();
                                }
                                cut_error()
                            }
                            _ => failure(STOPPED.into(), FailureKind::Unavailable),
                        };
                        st.done = true;
                        st.failed.set(true);
                        st.answer.guard.disarm();
                        Some((sse(&e.body()), st))
                    }
                }
            }))
        })
        .collect::<Vec<_>>();
    let tail = futures_util::stream::once(async move {
        let mut tail = String::new();
        if let Some((mut chunk, prompt)) = usage.filter(|_| !failed.get()) {
            chunk["usage"] = api::usage(prompt, generated.get());
            tail.push_str(&format!("data: {chunk}\n\n"));
        }
        tail.push_str("data: [DONE]\n\n");
        Ok(Bytes::from(tail))
    });
    let body = futures_util::stream::select_all(sequences).chain(tail);
    HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header(("Cache-Control", "no-cache"))
        .streaming(Delivery::new(state, req, ids, places, flow, body))
}
