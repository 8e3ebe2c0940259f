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
//! - `temperature`, `top_p`, `seed`, `stop`, `presence_penalty`, `frequency_penalty`,
//!   `logit_bias`, `user` are type-checked and otherwise ignored: the zero-cost and
//!   analytic backends do not sample, and every request runs to `max_tokens`.

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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parsed {
    /// Prompt tokens by the rules above.
    pub prompt_tokens: u32,
    /// Output tokens to generate.
    pub max_tokens: u32,
    /// Server-sent events.
    pub stream: bool,
    /// A last chunk with the usage (`stream_options.include_usage`).
    pub include_usage: bool,
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

fn words(text: &str) -> u64 {
    text.split_whitespace().count() as u64
}

/// Checks a request body for `endpoint`; `model` is the served model's name and
/// `max_prompt_tokens` the longest prompt taken.
pub fn parse(
    body: &[u8],
    endpoint: Endpoint,
    model: &str,
    max_prompt_tokens: u32,
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
    let (param, prompt_tokens) = match endpoint {
        Endpoint::Completions => ("prompt", completion_prompt(obj.get("prompt"))?),
        Endpoint::Chat => ("messages", chat_prompt(obj.get("messages"))?),
    };
    if prompt_tokens == 0 {
        return Err(ApiError::field(
            param,
            format!("{param} is empty: at least one token is needed"),
        ));
    }
    if prompt_tokens > u64::from(max_prompt_tokens) {
        return Err(ApiError::field(
            param,
            format!(
                "{param} has {prompt_tokens} tokens, more than this server's limit of {max_prompt_tokens}"
            ),
        ));
    }
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
    if let Some(n) = obj.get("n")
        && !n.is_null()
        && n.as_u64() != Some(1)
    {
        return Err(ApiError::field(
            "n",
            format!("n must be 1 (one choice per request), got {}", short(n)),
        ));
    }
    // Accepted and ignored (no sampling in these backends), but of the right type.
    for (field, ok) in [
        ("temperature", Value::is_number as fn(&Value) -> bool),
        ("top_p", Value::is_number),
        ("presence_penalty", Value::is_number),
        ("frequency_penalty", Value::is_number),
        ("seed", |v: &Value| v.is_i64() || v.is_u64()),
        ("user", Value::is_string),
        ("logit_bias", Value::is_object),
        ("stop", |v: &Value| {
            v.is_string() || v.as_array().is_some_and(|a| a.iter().all(Value::is_string))
        }),
    ] {
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
    Ok(Parsed {
        prompt_tokens: prompt_tokens as u32,
        max_tokens,
        stream,
        include_usage,
    })
}

fn completion_prompt(prompt: Option<&Value>) -> Result<u64, ApiError> {
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
        Some(Value::String(s)) => Ok(words(s)),
        Some(Value::Array(items)) => {
            if let [Value::String(s)] = items.as_slice() {
                return Ok(words(s));
            }
            for t in items {
                if t.as_u64().is_none_or(|id| id > u64::from(u32::MAX)) {
                    return Err(bad(t));
                }
            }
            Ok(items.len() as u64)
        }
        Some(v) => Err(bad(v)),
    }
}

fn chat_prompt(messages: Option<&Value>) -> Result<u64, ApiError> {
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
    let mut tokens = 0;
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
        tokens += match m.get("content") {
            None | Some(Value::Null) => 0,
            Some(Value::String(s)) => words(s),
            Some(Value::Array(parts)) => {
                let mut n = 0;
                for (j, p) in parts.iter().enumerate() {
                    match p.get("text").and_then(Value::as_str) {
                        Some(t) => n += words(t),
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
                n
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
        };
    }
    Ok(tokens)
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
        parse(body.as_bytes(), e, "m", 100)
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
            c,
            Parsed {
                prompt_tokens: 3,
                max_tokens: 2,
                stream: true,
                include_usage: true
            }
        );
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
            (r#"{"prompt": "a", "n": 2}"#, "n"),
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
    fn tokens_read_as_words_separated_by_spaces() {
        assert_eq!(render(0, 1, 0), "lorem");
        assert_eq!(render(17, 1, 1), " ipsum");
        assert_eq!(render(2, 2, 0), "dolor dolor");
        let body = ApiError::field("max_tokens", "bad").body();
        assert_eq!(body["error"]["param"], "max_tokens");
        assert_eq!(body["error"]["type"], "invalid_request_error");
    }
}
