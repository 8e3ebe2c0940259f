//! The actix-web application: the OpenAI routes, `/v1/models`, `/health`, `/metrics`;
//! the API key, the body limit, and server-sent events.

use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use actix_web::http::StatusCode;
use actix_web::http::header::{AUTHORIZATION, CONTENT_LENGTH};
use actix_web::web::{self, Bytes};
use actix_web::{HttpRequest, HttpResponse};
use crossbeam_channel::Sender;
use futures_util::StreamExt;
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use super::api::{self, ApiError, Endpoint, Parsed};
use super::bridge::{BridgeMsg, Event};

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
    /// The metrics.
    pub registry: Arc<Registry>,
    /// When the server started (`/v1/models`' `created`).
    pub created: u64,
}

/// The routes.
pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route("/health", web::get().to(health))
        .route("/metrics", web::get().to(metrics))
        .route("/v1/models", web::get().to(models))
        .route("/v1/completions", web::post().to(completions))
        .route("/v1/chat/completions", web::post().to(chat));
}

fn error(e: &ApiError) -> HttpResponse {
    HttpResponse::build(StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST))
        .json(e.body())
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

async fn metrics(state: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("application/openmetrics-text; version=1.0.0; charset=utf-8")
        .body(super::metrics::render(&state.registry))
}

async fn models(req: HttpRequest, state: web::Data<AppState>) -> HttpResponse {
    if let Err(e) = authorized(&req, &state) {
        return error(&e);
    }
    HttpResponse::Ok().json(json!({
        "object": "list",
        "data": [{
            "id": state.model,
            "object": "model",
            "created": state.created,
            "owned_by": "lockstep",
        }],
    }))
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
    let parsed = match api::parse(&body, endpoint, &state.model, state.max_prompt_tokens) {
        Ok(p) => p,
        Err(e) => return error(&e),
    };
    let (events, rx) = unbounded_channel();
    let submit = BridgeMsg::Submit {
        prompt_tokens: parsed.prompt_tokens,
        max_tokens: parsed.max_tokens,
        received,
        events,
    };
    if state.bridge.send(submit).is_err() {
        return error(&ApiError::status(
            503,
            "server_error",
            "the servers have stopped",
        ));
    }
    let shape = Shape {
        endpoint,
        id: format!(
            "{}-{}",
            match endpoint {
                Endpoint::Completions => "cmpl",
                Endpoint::Chat => "chatcmpl",
            },
            NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ),
        created: now_s(),
        model: state.model.clone(),
        parsed,
    };
    if parsed.stream {
        stream(shape, rx)
    } else {
        whole(shape, rx).await
    }
}

static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// What every answer of one request repeats.
struct Shape {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    parsed: Parsed,
}

impl Shape {
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

    /// A streamed choice carrying `text` (and `finish`, if it ends).
    fn delta(&self, text: Option<&str>, finish: Option<&str>, first: bool) -> Value {
        match self.endpoint {
            Endpoint::Completions => json!([{
                "index": 0,
                "text": text.unwrap_or(""),
                "logprobs": null,
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
                    "index": 0,
                    "delta": delta,
                    "logprobs": null,
                    "finish_reason": finish,
                }])
            }
        }
    }
}

async fn whole(shape: Shape, mut rx: UnboundedReceiver<Event>) -> HttpResponse {
    let mut text = String::new();
    let mut generated = 0;
    loop {
        match rx.recv().await {
            Some(Event::Tokens { last, count, .. }) => {
                text.push_str(&api::render(last, count, generated));
                generated += count;
            }
            Some(Event::Completed) => break,
            Some(Event::Failed(why)) => {
                return error(&ApiError::status(500, "server_error", why));
            }
            None => {
                return error(&ApiError::status(
                    500,
                    "server_error",
                    "the servers stopped before the request finished",
                ));
            }
        }
    }
    let choices = match shape.endpoint {
        Endpoint::Completions => json!([{
            "index": 0, "text": text, "logprobs": null, "finish_reason": "length",
        }]),
        Endpoint::Chat => json!([{
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": null,
            "finish_reason": "length",
        }]),
    };
    HttpResponse::Ok().json(shape.wrap(
        false,
        choices,
        api::usage(shape.parsed.prompt_tokens, generated),
    ))
}

fn sse(v: &Value) -> Result<Bytes, actix_web::Error> {
    Ok(Bytes::from(format!("data: {v}\n\n")))
}

/// Server-sent events: `data: {chunk}` per step, the usage chunk if asked, `data: [DONE]`.
fn stream(shape: Shape, rx: UnboundedReceiver<Event>) -> HttpResponse {
    struct St {
        shape: Shape,
        rx: UnboundedReceiver<Event>,
        generated: u32,
        first: bool,
        done: bool,
        tail: Vec<Bytes>,
    }
    let st = St {
        shape,
        rx,
        generated: 0,
        first: true,
        done: false,
        tail: Vec::new(),
    };
    let body = futures_util::stream::unfold(st, |mut st| async move {
        if let Some(b) = st.tail.pop() {
            return Some((Ok(b), st));
        }
        if st.done {
            return None;
        }
        let usage = |st: &St| {
            let v = st.shape.wrap(
                true,
                json!([]),
                api::usage(st.shape.parsed.prompt_tokens, st.generated),
            );
            Bytes::from(format!("data: {v}\n\n"))
        };
        let done = Bytes::from_static(b"data: [DONE]\n\n");
        match st.rx.recv().await {
            Some(Event::Tokens { last, count, .. }) => {
                let text = api::render(last, count, st.generated);
                st.generated += count;
                let chunk = st.shape.wrap(
                    true,
                    st.shape.delta(Some(&text), None, st.first),
                    Value::Null,
                );
                st.first = false;
                Some((sse(&chunk), st))
            }
            Some(Event::Completed) => {
                st.done = true;
                st.tail.push(done);
                if st.shape.parsed.include_usage {
                    st.tail.push(usage(&st));
                }
                let chunk = st.shape.wrap(
                    true,
                    st.shape.delta(None, Some("length"), st.first),
                    Value::Null,
                );
                Some((sse(&chunk), st))
            }
            other => {
                let why = match other {
                    Some(Event::Failed(why)) => why,
                    _ => "the servers stopped before the request finished".into(),
                };
                st.done = true;
                st.tail.push(done);
                let e = ApiError::status(500, "server_error", why);
                Some((sse(&e.body()), st))
            }
        }
    });
    HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header(("Cache-Control", "no-cache"))
        .streaming(body)
}
