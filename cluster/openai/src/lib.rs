//! The OpenAI request bodies `lockstep serve` takes, checked field by field (an error
//! names the field), the rules that turn prompt text into a token count and output
//! token ids into text, and the JSON shapes of the answers.
//!
//! Rules (written down in README "Serving over HTTP"):
//! - a text prompt counts one token per whitespace-separated word; a prompt given as
//!   token ids counts one token per id; a chat prompt counts the words of every
//!   message's content;
//! - an output token with id `t` reads as the word `WORDS[t % WORDS.len()]`, words
//!   separated by one space; the tokens of one step that carries several (a speculative
//!   step names only its last token id) all read as the word of that last id;
//! - `stop` (a string or up to four, each of at most [`MAX_STOP_STRING_BYTES`] bytes)
//!   ends the output before the first stop string in its text (`finish_reason: "stop"`;
//!   see `stop.rs`);
//! - `temperature` (0 or more), `top_p` (in (0, 1]), `top_k` (-1 or more), `seed`,
//!   `presence_penalty` and `frequency_penalty` (in [-2, 2]), `repetition_penalty`
//!   (above 0), `logit_bias` (token id strings to numbers in [-100, 100]; vLLM clamps
//!   past ±100, lockstep refuses, as OpenAI does) and `min_tokens` (at most the output's
//!   length) are checked; a model backend (`--model`) samples by them, the server's
//!   `--temperature`, `--top-p`, `--top-k` and `--seed` standing in for any of the first
//!   four not given; the zero-cost and analytic backends do not sample (there
//!   `min_tokens` only keeps stop strings from ending an answer before it). `user` is
//!   type-checked and otherwise ignored;
//! - `logprobs` (completions: 0 to 20 top tokens; chat: `true`, with `top_logprobs`
//!   0 to 20) and completions' `echo` are checked (`echo` with `logprobs` gives the
//!   prompt's log-probabilities too); chat's `echo` is refused;
//! - a field lockstep does not implement is refused (400 naming it) rather than
//!   answered as if it were not there: `response_format` other than text, `tools`/`functions`, `tool_choice` that asks
//!   for a tool, `suffix`, `best_of` other than `n`; `ignore_eos` is implemented
//!   (the end of sequence no longer ends the answer);
//! - `n` (1 or more) asks for that many sequences of one prompt (`n × max_tokens` at
//!   most [`MAX_TOKENS_LIMIT`]; the server bounds `n` by `--max-pending` too);
//!   `stop_token_ids` (token ids) end an answer as the end of sequence does;
//! - with `--model` the model's tokenizer replaces the word rules: the prompt is its
//!   token ids (a chat in the model's chat format), the output its decoded text, and the
//!   model's end of sequence ends an answer with `finish_reason: "stop"`
//!   (`model_text.rs`).

#![forbid(unsafe_code)]

use lockstep_actors::request::TokenBias;
use serde_json::{Value, json};

/// The words output token ids read as.
pub const WORDS: [&str; 16] = [
    "lorem",
    "ipsum",
    "dolor",
    "sit",
    "amet",
    "consectetur",
    "adipiscing",
    "elit",
    "sed",
    "do",
    "eiusmod",
    "tempor",
    "incididunt",
    "ut",
    "labore",
    "et",
];

/// `max_tokens` when a request gives none (OpenAI's default for completions).
pub const DEFAULT_MAX_TOKENS: u32 = 16;

/// The largest `max_tokens` taken.
pub const MAX_TOKENS_LIMIT: u32 = 1 << 20;

/// Which endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/chat/completions`.
    Chat,
}

/// A checked request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parsed {
    /// Prompt tokens by the rules above.
    pub prompt_tokens: u32,
    /// One content hash per full block of the prompt (the fleet's `tokens_per_block`
    /// tokens): prompts that share a prefix share these, so the KV-aware router and the
    /// prefix cache see HTTP traffic as they see a workload's.
    pub block_hashes: Vec<u64>,
    /// Output tokens to generate.
    pub max_tokens: u32,
    /// The field that gave them (`max_tokens`, or a chat's `max_completion_tokens`), for
    /// errors about them.
    pub max_tokens_param: &'static str,
    /// Server-sent events.
    pub stream: bool,
    /// A last chunk with the usage (`stream_options.include_usage`).
    pub include_usage: bool,
    /// Stop strings.
    pub stop: Vec<String>,
    /// The sampling fields the body gave (a model backend uses them; `None`: not given).
    pub sampling: SamplingFields,
    /// Whether the body gave `max_tokens` (or `max_completion_tokens`): a model's chat
    /// without one runs to the end of the context, as vLLM's does.
    pub max_tokens_given: bool,
    /// `ignore_eos`: the model's end of sequence does not end the answer.
    pub ignore_eos: bool,
    /// `min_tokens`: neither the end of sequence nor a stop string ends the answer
    /// before this many output tokens (0: no floor).
    pub min_tokens: u32,
    /// `logit_bias`, by token id (empty: none). A model backend checks the ids against
    /// its vocabulary and adds each bias to its token's logit.
    pub logit_bias: Vec<TokenBias>,
    /// Log-probabilities asked for: each output token's, with this many most likely
    /// tokens' (completions' `logprobs: k`; chat's `logprobs: true` with
    /// `top_logprobs`). `None`: not asked.
    pub logprobs: Option<u32>,
    /// Completions' `echo`: the prompt's text begins the answer.
    pub echo: bool,
    /// `n`: sequences generated for the prompt (1 or more; `n × max_tokens` at most
    /// [`MAX_TOKENS_LIMIT`]; the server bounds it further by `--max-pending`).
    pub n: u32,
    /// `stop_token_ids`: ids that end the answer as the end of sequence does (sorted,
    /// deduplicated; a model backend checks them against its vocabulary).
    pub stop_token_ids: Vec<u32>,
}

/// `temperature`, `top_p`, `top_k`, `seed` and the penalties as the body gave them, each
/// checked.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SamplingFields {
    /// 0 or more.
    pub temperature: Option<f32>,
    /// In (0, 1].
    pub top_p: Option<f32>,
    /// 0 or more (-1, vLLM's "all", reads as 0).
    pub top_k: Option<u32>,
    /// Any integer (a negative one is taken modulo 2^64).
    pub seed: Option<u64>,
    /// In [-2, 2].
    pub presence_penalty: Option<f32>,
    /// In [-2, 2].
    pub frequency_penalty: Option<f32>,
    /// Above 0 (1: none).
    pub repetition_penalty: Option<f32>,
}

// Every float is checked finite.
impl Eq for SamplingFields {}

impl SamplingFields {
    /// Whether the body gave any of them.
    pub fn any(&self) -> bool {
        self.temperature.is_some()
            || self.top_p.is_some()
            || self.top_k.is_some()
            || self.seed.is_some()
            || self.presence_penalty.is_some()
            || self.frequency_penalty.is_some()
            || self.repetition_penalty.is_some()
    }
}

/// The sampling fields of `obj`, each checked in range (the error names the field).
fn sampling_fields(obj: &serde_json::Map<String, Value>) -> Result<SamplingFields, ApiError> {
    let given = |k: &str| obj.get(k).filter(|v| !v.is_null());
    let mut f = SamplingFields::default();
    if let Some(v) = given("temperature") {
        match v.as_f64() {
            // Checked as the f32 the sampler gets: 1e308 passes as an f64 and is inf
            // as an f32, which the rank would refuse mid-collective.
            Some(t) if (t as f32).is_finite() && t >= 0.0 => f.temperature = Some(t as f32),
            _ => {
                return Err(ApiError::field(
                    "temperature",
                    format!(
                        "temperature must be a number of 0 or more, got {}",
                        short(v)
                    ),
                ));
            }
        }
    }
    if let Some(v) = given("top_p") {
        match v.as_f64() {
            // As an f32: 1e-50 is 0 there.
            Some(p) if (p as f32) > 0.0 && p <= 1.0 => f.top_p = Some(p as f32),
            _ => {
                return Err(ApiError::field(
                    "top_p",
                    format!("top_p must be a number in (0, 1], got {}", short(v)),
                ));
            }
        }
    }
    if let Some(v) = given("top_k") {
        match v.as_i64() {
            Some(-1) => f.top_k = Some(0),
            Some(k) if (0..=i64::from(u32::MAX)).contains(&k) => f.top_k = Some(k as u32),
            _ => {
                return Err(ApiError::field(
                    "top_k",
                    format!("top_k must be an integer of -1 or more, got {}", short(v)),
                ));
            }
        }
    }
    if let Some(v) = given("seed") {
        match (v.as_u64(), v.as_i64()) {
            (Some(s), _) => f.seed = Some(s),
            (None, Some(s)) => f.seed = Some(s as u64),
            _ => {
                return Err(ApiError::field(
                    "seed",
                    format!("seed must be an integer, got {}", short(v)),
                ));
            }
        }
    }
    // vLLM's ranges. Each is checked as the f32 the sampler gets.
    for (field, slot) in [
        ("presence_penalty", &mut f.presence_penalty),
        ("frequency_penalty", &mut f.frequency_penalty),
    ] {
        if let Some(v) = given(field) {
            match v.as_f64() {
                Some(x) if (-2.0..=2.0).contains(&x) => *slot = Some(x as f32),
                _ => {
                    return Err(ApiError::field(
                        field,
                        format!("{field} must be a number in [-2, 2], got {}", short(v)),
                    ));
                }
            }
        }
    }
    if let Some(v) = given("repetition_penalty") {
        match v.as_f64() {
            Some(x) if (x as f32) > 0.0 && (x as f32).is_finite() => {
                f.repetition_penalty = Some(x as f32);
            }
            _ => {
                return Err(ApiError::field(
                    "repetition_penalty",
                    format!(
                        "repetition_penalty must be a finite number above 0 (as a 32-bit float), got {}",
                        short(v)
                    ),
                ));
            }
        }
    }
    Ok(f)
}

/// The largest `logit_bias` magnitude (OpenAI's bound; vLLM clamps to it, lockstep
/// refuses past it, as OpenAI does).
pub const MAX_LOGIT_BIAS: f64 = 100.0;

/// `logit_bias`: an object of token id strings to numbers in
/// [-[`MAX_LOGIT_BIAS`], [`MAX_LOGIT_BIAS`]], sorted by token id (an error names the key
/// and the value).
fn logit_bias(v: Option<&Value>) -> Result<Vec<TokenBias>, ApiError> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(Vec::new());
    };
    let Some(map) = v.as_object() else {
        return Err(ApiError::field(
            "logit_bias",
            format!(
                "logit_bias must be an object of token ids to biases, got {}",
                short(v)
            ),
        ));
    };
    let mut biases = Vec::with_capacity(map.len());
    for (key, value) in map {
        let Ok(token) = key.parse::<u32>() else {
            return Err(ApiError::field(
                "logit_bias",
                format!("logit_bias: key {key:?} is not a token id"),
            ));
        };
        match value.as_f64() {
            Some(b) if (-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(&b) => biases.push(TokenBias {
                token,
                bias: b as f32,
            }),
            _ => {
                return Err(ApiError::field(
                    "logit_bias",
                    format!(
                        "logit_bias: the bias of token {key} must be a number in [-100, 100], got {}",
                        short(value)
                    ),
                ));
            }
        }
    }
    biases.sort_by_key(|b| b.token);
    Ok(biases)
}

/// `min_tokens` may not exceed the output's length (vLLM's rule); the chat of a model
/// gets its length after parsing, so the check runs again then.
pub fn check_min_tokens(parsed: &Parsed) -> Result<(), ApiError> {
    if parsed.min_tokens > parsed.max_tokens {
        return Err(ApiError::field(
            "min_tokens",
            format!(
                "min_tokens {} must be at most {} {}",
                parsed.min_tokens, parsed.max_tokens_param, parsed.max_tokens
            ),
        ));
    }
    Ok(())
}

/// An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    /// The HTTP status.
    pub status: u16,
    /// What went wrong, naming the field and the value.
    pub message: String,
    /// The field, if one is at fault.
    pub param: Option<String>,
    /// OpenAI's `type`.
    pub kind: &'static str,
    /// OpenAI's `code`.
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400 naming `param`.
    pub fn field(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: 400,
            message: message.into(),
            param: Some(param.to_string()),
            kind: "invalid_request_error",
            code: None,
        }
    }

    /// Another status, no field.
    pub fn status(status: u16, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            param: None,
            kind,
            code: None,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 60 {
        format!("{}...", &s[..s.floor_char_boundary(60)])
    } else {
        s
    }
}

/// Appends one content key per word of `text` (a word's key hashes its bytes).
fn words(text: &str, keys: &mut Vec<u64>) {
    for w in text.split_whitespace() {
        let key = w
            .bytes()
            .fold(lockstep_actors::kv::mix(w.len() as u64), |h, b| {
                lockstep_actors::kv::mix(h ^ u64::from(b))
            });
        keys.push(key);
    }
}

/// The content hash of each full block of `tokens_per_block` token keys (none when
/// `tokens_per_block` is 0). Token ids and words never collide: words' keys are mixed
/// with a tag.
pub fn block_hashes(keys: &[u64], tokens_per_block: u32) -> Vec<u64> {
    if tokens_per_block == 0 {
        return Vec::new();
    }
    keys.chunks_exact(tokens_per_block as usize)
        .map(|block| {
            block
                .iter()
                .fold(0x000B_10C4_u64, |h, &k| lockstep_actors::kv::mix(h ^ k))
        })
        .collect()
}

/// A body's `model`, where it names one: the served model's name, or 404
/// `model_not_found` (as vLLM); anything but a string is a 400 naming the field.
pub fn check_model(obj: &serde_json::Map<String, Value>, model: &str) -> Result<(), ApiError> {
    if let Some(m) = obj.get("model") {
        match m.as_str() {
            Some(name) if name == model => {}
            Some(name) => {
                return Err(ApiError {
                    status: 404,
                    message: format!("model: `{name}` is not served here; the model is `{model}`"),
                    param: Some("model".into()),
                    kind: "invalid_request_error",
                    code: Some("model_not_found"),
                });
            }
            None => {
                return Err(ApiError::field(
                    "model",
                    format!("model must be a string, got {}", short(m)),
                ));
            }
        }
    }
    Ok(())
}

/// Checks a request body for `endpoint`; `model` is the served model's name,
/// `max_prompt_tokens` the longest prompt taken, `tokens_per_block` the fleet's KV block
/// size (the prompt's block hashes are computed with it).
pub fn parse(
    body: &[u8],
    endpoint: Endpoint,
    model: &str,
    max_prompt_tokens: u32,
    tokens_per_block: u32,
) -> Result<Parsed, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::status(
            400,
            "invalid_request_error",
            format!("the body is not valid JSON: {e}"),
        )
    })?;
    let Some(obj) = value.as_object() else {
        return Err(ApiError::status(
            400,
            "invalid_request_error",
            format!("the body must be a JSON object, got {}", short(&value)),
        ));
    };
    check_model(obj, model)?;
    let mut keys = Vec::new();
    match endpoint {
        Endpoint::Completions => completion_prompt(obj.get("prompt"), &mut keys)?,
        Endpoint::Chat => chat_prompt(obj.get("messages"), &mut keys)?,
    }
    let prompt_tokens = keys.len();
    check_prompt_tokens(endpoint, prompt_tokens, max_prompt_tokens)?;
    let max_param = match endpoint {
        Endpoint::Chat if obj.contains_key("max_completion_tokens") => "max_completion_tokens",
        _ => "max_tokens",
    };
    let max_tokens = match obj.get(max_param) {
        None | Some(Value::Null) => DEFAULT_MAX_TOKENS,
        Some(v) => match v.as_u64() {
            Some(n) if (1..=u64::from(MAX_TOKENS_LIMIT)).contains(&n) => n as u32,
            _ => {
                return Err(ApiError::field(
                    max_param,
                    format!(
                        "{max_param} must be an integer from 1 to {MAX_TOKENS_LIMIT}, got {}",
                        short(v)
                    ),
                ));
            }
        },
    };
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            return Err(ApiError::field(
                "stream",
                format!("stream must be a boolean, got {}", short(v)),
            ));
        }
    };
    let include_usage = match obj.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => {
            if !stream {
                return Err(ApiError::field(
                    "stream_options",
                    "stream_options is only allowed when stream is true",
                ));
            }
            match o.get("include_usage") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(v) => {
                    return Err(ApiError::field(
                        "stream_options.include_usage",
                        format!(
                            "stream_options.include_usage must be a boolean, got {}",
                            short(v)
                        ),
                    ));
                }
            }
        }
        Some(v) => {
            return Err(ApiError::field(
                "stream_options",
                format!("stream_options must be an object, got {}", short(v)),
            ));
        }
    };
    let n = n_and_best_of(obj, max_tokens, max_param)?;
    // Used by a model backend only, but always checked.
    let sampling = sampling_fields(obj)?;
    refuse_unimplemented(obj)?;
    let (logprobs, echo) = logprobs_and_echo(obj, endpoint)?;
    let ignore_eos = match obj.get("ignore_eos") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            return Err(ApiError::field(
                "ignore_eos",
                format!("ignore_eos must be a boolean, got {}", short(v)),
            ));
        }
    };
    // Accepted and ignored, but of the right type.
    for (field, ok) in [("user", Value::is_string as fn(&Value) -> bool)] {
        if let Some(v) = obj.get(field)
            && !v.is_null()
            && !ok(v)
        {
            return Err(ApiError::field(
                field,
                format!("{field} has the wrong type: {}", short(v)),
            ));
        }
    }
    let stop = stop_strings(obj.get("stop"))?;
    let logit_bias = logit_bias(obj.get("logit_bias"))?;
    let stop_token_ids = stop_token_ids(obj.get("stop_token_ids"))?;
    let min_tokens = match obj.get("min_tokens") {
        None | Some(Value::Null) => 0,
        Some(v) => match v.as_u64() {
            Some(n) if n <= u64::from(MAX_TOKENS_LIMIT) => n as u32,
            _ => {
                return Err(ApiError::field(
                    "min_tokens",
                    format!(
                        "min_tokens must be an integer from 0 to {MAX_TOKENS_LIMIT}, got {}",
                        short(v)
                    ),
                ));
            }
        },
    };
    let parsed = Parsed {
        prompt_tokens: prompt_tokens as u32,
        max_tokens_param: max_param,
        block_hashes: block_hashes(&keys, tokens_per_block),
        max_tokens,
        stream,
        include_usage,
        stop,
        sampling,
        max_tokens_given: obj.get(max_param).is_some_and(|v| !v.is_null()),
        ignore_eos,
        min_tokens,
        logit_bias,
        logprobs,
        echo,
        n,
        stop_token_ids,
    };
    // A model's chat without a length gets it later (`check_min_tokens` runs then).
    if parsed.max_tokens_given || endpoint == Endpoint::Completions {
        check_min_tokens(&parsed)?;
    }
    Ok(parsed)
}

/// vLLM's `max_logprobs` default: the most top tokens a request may ask for.
pub const MAX_LOGPROBS: u32 = 20;

/// `logprobs` / `top_logprobs` and `echo`, each checked: completions take `logprobs: k`
/// and `echo` (both: the prompt's log-probabilities too); chat takes `logprobs: true`
/// with `top_logprobs: k` (k at most [`MAX_LOGPROBS`]).
fn logprobs_and_echo(
    obj: &serde_json::Map<String, Value>,
    endpoint: Endpoint,
) -> Result<(Option<u32>, bool), ApiError> {
    let given = |k: &str| obj.get(k).filter(|v| !v.is_null());
    let count = |field: &str, v: &Value| match v.as_u64() {
        Some(k) if k <= u64::from(MAX_LOGPROBS) => Ok(k as u32),
        _ => Err(ApiError::field(
            field,
            format!(
                "{field} must be an integer from 0 to {MAX_LOGPROBS}, got {}",
                short(v)
            ),
        )),
    };
    let flag = |field: &str| match given(field) {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(ApiError::field(
            field,
            format!("{field} must be a boolean, got {}", short(v)),
        )),
    };
    match endpoint {
        Endpoint::Completions => {
            if let Some(v) = given("top_logprobs")
                && v.as_u64() != Some(0)
            {
                return Err(ApiError::field(
                    "top_logprobs",
                    format!(
                        "top_logprobs {} is a chat field: /v1/completions takes logprobs: k",
                        short(v)
                    ),
                ));
            }
            let logprobs = match given("logprobs") {
                None | Some(Value::Bool(false)) => None,
                Some(v) => Some(count("logprobs", v)?),
            };
            Ok((logprobs, flag("echo")?))
        }
        Endpoint::Chat => {
            if let Some(v) = given("echo")
                && v != &Value::Bool(false)
            {
                return Err(ApiError::field(
                    "echo",
                    format!(
                        "echo {} is not supported by lockstep on chat completions",
                        short(v)
                    ),
                ));
            }
            let wanted = flag("logprobs")?;
            let top = given("top_logprobs")
                .map(|v| count("top_logprobs", v))
                .transpose()?;
            // OpenAI's rule: top tokens come only with the sampled token's own.
            if top.is_some_and(|k| k > 0) && !wanted {
                return Err(ApiError::field(
                    "top_logprobs",
                    "top_logprobs needs logprobs: true",
                ));
            }
            Ok((wanted.then_some(top.unwrap_or(0)), false))
        }
    }
}

/// Refuses the fields lockstep does not implement when they ask for something (their
/// defaults pass): answering as if they were absent would be a silent wrong 200.
fn refuse_unimplemented(obj: &serde_json::Map<String, Value>) -> Result<(), ApiError> {
    let given = |k: &str| obj.get(k).filter(|v| !v.is_null());
    let refuse = |field: &str, v: &Value, why: &str| {
        Err(ApiError::field(
            field,
            format!("{field} {} is not supported by lockstep: {why}", short(v)),
        ))
    };
    if let Some(v) = given("response_format")
        && v.get("type").and_then(Value::as_str) != Some("text")
    {
        return refuse(
            "response_format",
            v,
            "only {\"type\": \"text\"} is produced",
        );
    }
    for field in ["tools", "functions"] {
        if let Some(v) = given(field)
            && v.as_array().is_none_or(|a| !a.is_empty())
        {
            return refuse(field, v, "tool calls are not implemented");
        }
    }
    // With no tools given, "auto" and "none" both mean plain text.
    for field in ["tool_choice", "function_call"] {
        if let Some(v) = given(field)
            && !(v == "none" || v == "auto")
        {
            return refuse(field, v, "tool calls are not implemented");
        }
    }
    if let Some(v) = given("suffix")
        && v.as_str() != Some("")
    {
        return refuse("suffix", v, "insertion after a suffix is not implemented");
    }
    Ok(())
}

/// `n` (1 or more, `n × max_tokens` at most [`MAX_TOKENS_LIMIT`]) and `best_of`, which
/// may only equal `n`: choosing the best of more sequences than are returned is not
/// implemented, and fewer than `n` is vLLM's error too.
fn n_and_best_of(
    obj: &serde_json::Map<String, Value>,
    max_tokens: u32,
    max_param: &str,
) -> Result<u32, ApiError> {
    let n = match obj.get("n").filter(|v| !v.is_null()) {
        None => 1,
        Some(v) => match v.as_u64() {
            Some(n) if (1..=u64::from(MAX_TOKENS_LIMIT)).contains(&n) => n as u32,
            _ => {
                return Err(ApiError::field(
                    "n",
                    format!("n must be an integer of 1 or more, got {}", short(v)),
                ));
            }
        },
    };
    if u64::from(n) * u64::from(max_tokens) > u64::from(MAX_TOKENS_LIMIT) {
        return Err(ApiError::field(
            "n",
            format!(
                "n {n} times {max_param} {max_tokens} is more than the {MAX_TOKENS_LIMIT} output tokens one request may ask for"
            ),
        ));
    }
    if let Some(v) = obj.get("best_of").filter(|v| !v.is_null())
        && v.as_u64() != Some(u64::from(n))
    {
        let why = match v.as_u64() {
            Some(b) if b < u64::from(n) => format!("best_of must be at least n ({n})"),
            Some(_) => format!(
                "choosing the best of more sequences than n ({n}) is not implemented; best_of may only equal n"
            ),
            None => "best_of must be an integer".to_string(),
        };
        return Err(ApiError::field(
            "best_of",
            format!("best_of {} is not supported by lockstep: {why}", short(v)),
        ));
    }
    Ok(n)
}

/// `stop_token_ids`: absent, or an array of token ids (sorted and deduplicated; the
/// error names the field and the bad item).
fn stop_token_ids(v: Option<&Value>) -> Result<Vec<u32>, ApiError> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(Vec::new());
    };
    let Some(items) = v.as_array() else {
        return Err(ApiError::field(
            "stop_token_ids",
            format!(
                "stop_token_ids must be an array of token ids, got {}",
                short(v)
            ),
        ));
    };
    let mut ids = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        match item.as_u64() {
            Some(id) if id <= u64::from(u32::MAX) => ids.push(id as u32),
            _ => {
                return Err(ApiError::field(
                    "stop_token_ids",
                    format!(
                        "stop_token_ids[{i}] must be a token id, got {}",
                        short(item)
                    ),
                ));
            }
        }
    }
    ids.sort_unstable();
    ids.dedup();
    Ok(ids)
}

/// The field a prompt comes in.
pub fn prompt_param(endpoint: Endpoint) -> &'static str {
    match endpoint {
        Endpoint::Completions => "prompt",
        Endpoint::Chat => "messages",
    }
}

/// A prompt of `count` tokens must have one and at most `max_prompt_tokens` (the error
/// names the field).
pub fn check_prompt_tokens(
    endpoint: Endpoint,
    count: usize,
    max_prompt_tokens: u32,
) -> Result<(), ApiError> {
    let param = prompt_param(endpoint);
    if count == 0 {
        return Err(ApiError::field(
            param,
            format!("{param} is empty: at least one token is needed"),
        ));
    }
    if count as u64 > u64::from(max_prompt_tokens) {
        return Err(ApiError::field(
            param,
            format!(
                "{param} has {count} tokens, more than this server's limit of {max_prompt_tokens}"
            ),
        ));
    }
    Ok(())
}

/// Stop strings at most, as OpenAI's API allows (and TGI's `--max-stop-sequences`
/// default).
pub const MAX_STOP_STRINGS: usize = 4;

/// The longest stop string taken, in bytes. lockstep's own bound: neither OpenAI's API
/// reference nor vLLM documents one, and TGI bounds only the count. Stop strings in use
/// are short markers (`"\n\n"`, `"###"`, an end-of-turn tag); a stream holds back the
/// longest one's length less one byte, and each new piece of text is searched together
/// with that many bytes before it, so a long one costs every token of the answer (four
/// of 262,144 bytes once took 35.6 s of an HTTP worker's CPU for one request). 1 KiB is
/// far past any marker and keeps that work to a few KiB per token.
pub const MAX_STOP_STRING_BYTES: usize = 1024;

/// `stop`: absent, a string, or an array of up to [`MAX_STOP_STRINGS`] non-empty strings
/// of at most [`MAX_STOP_STRING_BYTES`] bytes.
fn stop_strings(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let bad = |v: &Value| {
        ApiError::field(
            "stop",
            format!(
                "stop must be a non-empty string or an array of up to {MAX_STOP_STRINGS} of them, got {}",
                short(v)
            ),
        )
    };
    let stops: Vec<String> = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.len() <= MAX_STOP_STRINGS => a
            .iter()
            .map(|s| s.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .ok_or_else(|| bad(v.unwrap_or(&Value::Null)))?,
        Some(other) => return Err(bad(other)),
    };
    if stops.iter().any(String::is_empty) {
        return Err(bad(v.unwrap_or(&Value::Null)));
    }
    if let Some((i, s)) = stops
        .iter()
        .enumerate()
        .find(|(_, s)| s.len() > MAX_STOP_STRING_BYTES)
    {
        let which = if matches!(v, Some(Value::Array(_))) {
            format!("stop[{i}]")
        } else {
            "stop".to_string()
        };
        return Err(ApiError::field(
            "stop",
            format!(
                "{which} is {} bytes long, more than the limit of {MAX_STOP_STRING_BYTES} bytes per stop string",
                s.len()
            ),
        ));
    }
    Ok(stops)
}

/// Token ids are their own keys; words get a tag so that a word never reads as an id.
const WORD_TAG: u64 = 1 << 40;

fn completion_prompt(prompt: Option<&Value>, keys: &mut Vec<u64>) -> Result<(), ApiError> {
    let bad = |v: &Value| {
        ApiError::field(
            "prompt",
            format!(
                "prompt must be a string or an array of token ids (one prompt per request), got {}",
                short(v)
            ),
        )
    };
    match prompt {
        None | Some(Value::Null) => Err(ApiError::field("prompt", "prompt is required")),
        Some(Value::String(s)) => {
            words(s, keys);
            tag_words(keys);
            Ok(())
        }
        Some(Value::Array(items)) => {
            if let [Value::String(s)] = items.as_slice() {
                words(s, keys);
                tag_words(keys);
                return Ok(());
            }
            for t in items {
                match t.as_u64() {
                    Some(id) if id <= u64::from(u32::MAX) => keys.push(id),
                    _ => return Err(bad(t)),
                }
            }
            Ok(())
        }
        Some(v) => Err(bad(v)),
    }
}

fn tag_words(keys: &mut [u64]) {
    for k in keys {
        *k |= WORD_TAG;
    }
}

fn chat_prompt(messages: Option<&Value>, keys: &mut Vec<u64>) -> Result<(), ApiError> {
    let Some(messages) = messages else {
        return Err(ApiError::field("messages", "messages is required"));
    };
    let Some(list) = messages.as_array().filter(|l| !l.is_empty()) else {
        return Err(ApiError::field(
            "messages",
            format!(
                "messages must be a non-empty array, got {}",
                short(messages)
            ),
        ));
    };
    for (i, m) in list.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str);
        if !matches!(
            role,
            Some("system" | "developer" | "user" | "assistant" | "tool")
        ) {
            return Err(ApiError::field(
                &format!("messages[{i}].role"),
                format!(
                    "messages[{i}].role must be one of system, developer, user, assistant, tool; got {}",
                    m.get("role").map_or("nothing".into(), short)
                ),
            ));
        }
        match m.get("content") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => words(s, keys),
            Some(Value::Array(parts)) => {
                for (j, p) in parts.iter().enumerate() {
                    match p.get("text").and_then(Value::as_str) {
                        Some(t) => words(t, keys),
                        None => {
                            return Err(ApiError::field(
                                &format!("messages[{i}].content[{j}]"),
                                format!(
                                    "messages[{i}].content[{j}] must be a text part {{\"type\": \"text\", \"text\": ...}}, got {}",
                                    short(p)
                                ),
                            ));
                        }
                    }
                }
            }
            Some(v) => {
                return Err(ApiError::field(
                    &format!("messages[{i}].content"),
                    format!(
                        "messages[{i}].content must be a string or an array of text parts, got {}",
                        short(v)
                    ),
                ));
            }
        }
    }
    tag_words(keys);
    Ok(())
}

/// The text of `count` output tokens whose last id is `last`, the output so far holding
/// `before` tokens (the first token of an output has no leading space).
pub fn render(last: u32, count: u32, before: u32) -> String {
    let word = WORDS[last as usize % WORDS.len()];
    let mut text = String::new();
    for i in 0..count {
        if before + i > 0 {
            text.push(' ');
        }
        text.push_str(word);
    }
    text
}

/// The `usage` object.
pub fn usage(prompt: u32, completion: u32) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(body: &str, e: Endpoint) -> Result<Parsed, ApiError> {
        parse(body.as_bytes(), e, "m", 100, 2)
    }

    #[test]
    fn fields_lockstep_does_not_implement_are_refused_naming_them() {
        let refused = [
            (r#""logprobs": 21"#, "logprobs"),
            (r#""logprobs": true"#, "logprobs"),
            (r#""top_logprobs": 3"#, "top_logprobs"),
            (r#""echo": 1"#, "echo"),
            (
                r#""response_format": {"type": "json_object"}"#,
                "response_format",
            ),
            (
                r#""tools": [{"type": "function", "function": {"name": "f"}}]"#,
                "tools",
            ),
            (r#""tool_choice": "required""#, "tool_choice"),
            (r#""suffix": "end""#, "suffix"),
            (r#""best_of": 3"#, "best_of"),
            (r#""n": 2, "best_of": 3"#, "best_of"),
            (r#""n": 3, "best_of": 2"#, "best_of"),
            (r#""n": 0"#, "n"),
        ];
        for (field, name) in refused {
            let body = format!(r#"{{"prompt": "a b", {field}}}"#);
            let e = p(&body, Endpoint::Completions).expect_err(field);
            assert_eq!((e.status, e.param.as_deref()), (400, Some(name)), "{field}");
            assert!(e.message.starts_with(name), "{field}: {}", e.message);
        }
        // Their defaults pass: a client that sends them spelled out is served.
        let neutral = r#"{"prompt": "a b", "logprobs": null, "top_logprobs": 0, "echo": false,
            "logit_bias": {}, "frequency_penalty": 0, "presence_penalty": 0.0,
            "repetition_penalty": 1, "response_format": {"type": "text"}, "tools": [],
            "tool_choice": "auto", "suffix": "", "best_of": 1, "n": 1, "min_tokens": 0}"#;
        let parsed = p(neutral, Endpoint::Completions).expect("the defaults pass");
        assert!(!parsed.ignore_eos && !parsed.max_tokens_given);
        assert!(parsed.logit_bias.is_empty() && parsed.min_tokens == 0);
        assert_eq!((parsed.logprobs, parsed.echo), (None, false));
    }

    #[test]
    fn logprobs_top_logprobs_and_echo_are_read_per_endpoint_and_bounded_by_20() {
        let c = |body: &str| p(body, Endpoint::Completions);
        let chat = |extra: &str| {
            p(
                &format!(r#"{{"messages": [{{"role": "user", "content": "a"}}]{extra}}}"#),
                Endpoint::Chat,
            )
        };
        let got = c(r#"{"prompt": "a", "logprobs": 20}"#).unwrap();
        assert_eq!((got.logprobs, got.echo), (Some(20), false));
        assert_eq!(
            c(r#"{"prompt": "a", "logprobs": 0}"#).unwrap().logprobs,
            Some(0)
        );
        assert!(c(r#"{"prompt": "a", "echo": true}"#).unwrap().echo);
        assert_eq!(chat(r#", "logprobs": true"#).unwrap().logprobs, Some(0));
        assert_eq!(
            chat(r#", "logprobs": true, "top_logprobs": 5"#)
                .unwrap()
                .logprobs,
            Some(5)
        );
        assert_eq!(
            chat(r#", "logprobs": false, "top_logprobs": 0"#)
                .unwrap()
                .logprobs,
            None
        );
        // Past 20, or of the wrong kind: a 400 naming the field and the value.
        for (result, field, value) in [
            (c(r#"{"prompt": "a", "logprobs": 21}"#), "logprobs", "21"),
            (c(r#"{"prompt": "a", "logprobs": -1}"#), "logprobs", "-1"),
            (
                chat(r#", "logprobs": true, "top_logprobs": 21"#),
                "top_logprobs",
                "21",
            ),
            (chat(r#", "logprobs": 3"#), "logprobs", "3"),
        ] {
            let e = result.expect_err(field);
            assert_eq!((e.status, e.param.as_deref()), (400, Some(field)));
            assert!(e.message.contains(value), "{}", e.message);
        }
        // Top tokens without logprobs, echo on chat: refused; echo with logprobs on
        // completions: both read (the prompt's log-probabilities too).
        let e = chat(r#", "top_logprobs": 2"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("top_logprobs"));
        assert_eq!(
            chat(r#", "echo": true"#).unwrap_err().param.as_deref(),
            Some("echo")
        );
        let both =
            c(r#"{"prompt": "a", "echo": true, "logprobs": 1}"#).expect("echo with logprobs");
        assert!(both.echo);
        assert_eq!(both.logprobs, Some(1));
    }

    #[test]
    fn logit_bias_penalties_and_min_tokens_are_read_and_checked_naming_field_and_value() {
        let c = p(
            r#"{"prompt": "a", "max_tokens": 8, "min_tokens": 8, "logit_bias": {"7": -100, "3": 2.5},
                "presence_penalty": -2, "frequency_penalty": 0.5, "repetition_penalty": 1.3}"#,
            Endpoint::Completions,
        )
        .unwrap();
        assert_eq!(c.min_tokens, 8);
        assert_eq!(
            c.logit_bias,
            [
                TokenBias {
                    token: 3,
                    bias: 2.5
                },
                TokenBias {
                    token: 7,
                    bias: -100.0
                }
            ],
            "sorted by token id"
        );
        assert_eq!(
            (
                c.sampling.presence_penalty,
                c.sampling.frequency_penalty,
                c.sampling.repetition_penalty
            ),
            (Some(-2.0), Some(0.5), Some(1.3))
        );
        assert!(
            c.sampling.any(),
            "a penalty alone is the request's own sampling"
        );
        let bad = [
            (r#""logit_bias": {"x": 1}"#, "logit_bias", "\"x\""),
            (r#""logit_bias": {"-3": 1}"#, "logit_bias", "\"-3\""),
            (r#""logit_bias": {"5": 100.5}"#, "logit_bias", "100.5"),
            (r#""logit_bias": {"5": "up"}"#, "logit_bias", "\"up\""),
            (r#""logit_bias": [1]"#, "logit_bias", "[1]"),
            (r#""presence_penalty": 2.5"#, "presence_penalty", "2.5"),
            (r#""frequency_penalty": -3"#, "frequency_penalty", "-3"),
            (r#""frequency_penalty": "x""#, "frequency_penalty", "\"x\""),
            (r#""repetition_penalty": 0"#, "repetition_penalty", "0"),
            (
                r#""repetition_penalty": 1e300"#,
                "repetition_penalty",
                "1e+300",
            ),
            (r#""min_tokens": -1"#, "min_tokens", "-1"),
            (r#""min_tokens": 17"#, "min_tokens", "17"),
            (r#""max_tokens": 4, "min_tokens": 5"#, "min_tokens", "5"),
        ];
        for (field, name, value) in bad {
            let body = format!(r#"{{"prompt": "a b", {field}}}"#);
            let e = p(&body, Endpoint::Completions).expect_err(field);
            assert_eq!((e.status, e.param.as_deref()), (400, Some(name)), "{field}");
            assert!(e.message.contains(value), "{field}: {}", e.message);
        }
        // A chat without a length gets one later (a model's context): checked then.
        let chat = p(
            r#"{"messages": [{"role": "user", "content": "x"}], "min_tokens": 40}"#,
            Endpoint::Chat,
        )
        .expect("no length given yet");
        assert_eq!(chat.min_tokens, 40);
        assert_eq!(
            check_min_tokens(&chat).unwrap_err().param.as_deref(),
            Some("min_tokens")
        );
    }

    #[test]
    fn n_best_of_equal_to_n_and_stop_token_ids_are_read() {
        let c = p(
            r#"{"prompt": "a", "n": 3, "best_of": 3, "stop_token_ids": [9, 2, 9]}"#,
            Endpoint::Completions,
        )
        .unwrap();
        assert_eq!((c.n, c.stop_token_ids.as_slice()), (3, &[2, 9][..]));
        let c = p(r#"{"prompt": "a"}"#, Endpoint::Completions).unwrap();
        assert_eq!((c.n, c.stop_token_ids.len()), (1, 0));
        // n × max_tokens past the bound: refused naming n and the bound.
        let e = p(
            r#"{"prompt": "a", "n": 2, "max_tokens": 1048576}"#,
            Endpoint::Completions,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("n"));
        assert!(e.message.contains("1048576"), "{e}");
        let e = p(
            r#"{"prompt": "a", "stop_token_ids": [4, "x"]}"#,
            Endpoint::Completions,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stop_token_ids"));
        assert!(e.message.contains("stop_token_ids[1]"), "{e}");
    }

    #[test]
    fn ignore_eos_and_whether_max_tokens_was_given_are_read() {
        let c = p(
            r#"{"messages": [{"role": "user", "content": "x"}], "ignore_eos": true}"#,
            Endpoint::Chat,
        )
        .unwrap();
        assert!(c.ignore_eos && !c.max_tokens_given);
        let c = p(
            r#"{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 3}"#,
            Endpoint::Chat,
        )
        .unwrap();
        assert!(!c.ignore_eos && c.max_tokens_given);
        let e = p(r#"{"prompt": "a", "ignore_eos": 1}"#, Endpoint::Completions).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("ignore_eos"));
    }

    #[test]
    fn text_prompts_count_words_and_ids_count_ids() {
        let c = p(
            r#"{"prompt": "a b  c\nd", "max_tokens": 3}"#,
            Endpoint::Completions,
        )
        .unwrap();
        assert_eq!((c.prompt_tokens, c.max_tokens, c.stream), (4, 3, false));
        let c = p(r#"{"prompt": [5, 6, 7]}"#, Endpoint::Completions).unwrap();
        assert_eq!((c.prompt_tokens, c.max_tokens), (3, DEFAULT_MAX_TOKENS));
        let c = p(
            r#"{"model": "m", "messages": [{"role": "system", "content": "x y"}, {"role": "user", "content": [{"type": "text", "text": "z"}]}], "stream": true, "stream_options": {"include_usage": true}, "max_completion_tokens": 2}"#,
            Endpoint::Chat,
        )
        .unwrap();
        assert_eq!(
            (c.prompt_tokens, c.max_tokens, c.stream, c.include_usage),
            (3, 2, true, true)
        );
        // Three tokens in blocks of two: one full block.
        assert_eq!(c.block_hashes.len(), 1);
    }

    #[test]
    fn prompts_that_share_a_prefix_share_its_block_hashes() {
        let hashes = |body: &str| p(body, Endpoint::Completions).unwrap().block_hashes;
        let a = hashes(r#"{"prompt": [1, 2, 3, 4, 5]}"#);
        let b = hashes(r#"{"prompt": [1, 2, 3, 9, 5]}"#);
        assert_eq!(a.len(), 2);
        assert_eq!(a[0], b[0], "the shared first block");
        assert_ne!(a[1], b[1], "the second block differs");
        let words = hashes(r#"{"prompt": "a b c d"}"#);
        let same = hashes(r#"{"prompt": "a b c e"}"#);
        assert_eq!(words[0], same[0]);
        assert_ne!(words[1], same[1]);
        assert!(!a.contains(&words[0]), "words never read as token ids");
        // No block size: no hashes.
        let none = parse(
            br#"{"prompt": [1, 2, 3, 4]}"#,
            Endpoint::Completions,
            "m",
            100,
            0,
        )
        .unwrap();
        assert!(none.block_hashes.is_empty());
    }

    #[test]
    fn bad_fields_are_named() {
        let cases = [
            (r#"{"prompt": "a", "max_tokens": 0}"#, "max_tokens"),
            (r#"{"prompt": "a", "max_tokens": "5"}"#, "max_tokens"),
            (r#"{"prompt": {"x": 1}}"#, "prompt"),
            (r#"{"prompt": [1, -2]}"#, "prompt"),
            (r#"{"prompt": "   "}"#, "prompt"),
            (r#"{}"#, "prompt"),
            (r#"{"prompt": "a", "stream": "yes"}"#, "stream"),
            (r#"{"prompt": "a", "stream_options": {}}"#, "stream_options"),
            (r#"{"prompt": "a", "temperature": "hot"}"#, "temperature"),
            (r#"{"prompt": "a", "temperature": 1e308}"#, "temperature"),
            (r#"{"prompt": "a", "top_p": 1e-50}"#, "top_p"),
            (r#"{"prompt": "a", "n": 0}"#, "n"),
            (r#"{"prompt": "a", "n": 1.5}"#, "n"),
            (
                r#"{"prompt": "a", "stop_token_ids": [1, -2]}"#,
                "stop_token_ids",
            ),
            (r#"{"prompt": "a", "stop_token_ids": 7}"#, "stop_token_ids"),
            (r#"{"prompt": "a", "model": 3}"#, "model"),
        ];
        for (body, field) in cases {
            let e = p(body, Endpoint::Completions).unwrap_err();
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(field), "{body}: {e}");
            assert!(e.message.contains(field), "{body}: {e}");
        }
        let e = p(
            r#"{"messages": [{"role": "robot", "content": "a"}]}"#,
            Endpoint::Chat,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        let long = format!(r#"{{"prompt": "{}"}}"#, "w ".repeat(101));
        let e = p(&long, Endpoint::Completions).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        assert!(e.message.contains("101 tokens"), "{e}");
        let e = p(
            r#"{"prompt": "a", "model": "other"}"#,
            Endpoint::Completions,
        )
        .unwrap_err();
        assert_eq!((e.status, e.code), (404, Some("model_not_found")));
        let e = p("not json", Endpoint::Completions).unwrap_err();
        assert_eq!(e.status, 400);
    }

    #[test]
    fn a_stop_string_past_the_length_limit_is_refused_naming_stop_and_its_length() {
        let at_limit = "x".repeat(MAX_STOP_STRING_BYTES);
        let body = json!({"prompt": "a", "stop": [at_limit.as_str(), "y"]}).to_string();
        let parsed = p(&body, Endpoint::Completions).expect("at the limit");
        assert_eq!(parsed.stop[0].len(), MAX_STOP_STRING_BYTES);
        // Bytes, not characters: 513 two-byte characters are over.
        let over = "é".repeat(MAX_STOP_STRING_BYTES / 2 + 1);
        for (stop, named) in [
            (json!(over), "stop is 1026 bytes"),
            (json!(["a", over]), "stop[1] is 1026 bytes"),
        ] {
            let body = json!({"prompt": "a", "stop": stop}).to_string();
            let e = p(&body, Endpoint::Completions).expect_err("over the limit");
            assert_eq!((e.status, e.param.as_deref()), (400, Some("stop")), "{e}");
            assert!(
                e.message.contains(named) && e.message.contains("1024"),
                "{e}"
            );
        }
    }

    #[test]
    fn tokens_read_as_words_separated_by_spaces() {
        assert_eq!(render(0, 1, 0), "lorem");
        assert_eq!(render(17, 1, 1), " ipsum");
        assert_eq!(render(2, 2, 0), "dolor dolor");
        let body = ApiError::field("max_tokens", "bad").body();
        assert_eq!(body["error"]["param"], "max_tokens");
        assert_eq!(body["error"]["type"], "invalid_request_error");
    }
}
