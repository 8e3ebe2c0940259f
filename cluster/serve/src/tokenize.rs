//! vLLM's `/tokenize` and `/detokenize` (`serve --model`): a prompt, or a chat rendered
//! through the model's chat format, to the model's token ids, and ids back to text. A
//! field vLLM takes that lockstep does not implement is refused naming it, never
//! ignored. Without a model there is no tokenizer (a text prompt's length is its words):
//! both routes then answer 400 saying so.

use serde_json::{Map, Value, json};

use super::api::{self, ApiError};
use super::model_text::ModelText;

/// Fields of vLLM's tokenize requests lockstep does not implement.
const NOT_IMPLEMENTED: [&str; 6] = [
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "mm_processor_kwargs",
    "documents",
];

/// The answer to a `/tokenize` body: `count`, `max_model_len`, `tokens`, and `token_strs`
/// where `return_token_strs` asks. `max_prompt_tokens` bounds the text as it bounds a
/// prompt's (refused before it is encoded).
pub fn tokenize(
    text: &ModelText,
    body: &[u8],
    model: &str,
    max_model_len: Option<u32>,
    max_prompt_tokens: u32,
) -> Result<Value, ApiError> {
    let obj = object(body)?;
    api::check_model(&obj, model)?;
    if let Some(field) = NOT_IMPLEMENTED.iter().find(|f| obj.contains_key(**f)) {
        return Err(ApiError::field(
            field,
            format!("{field} is not implemented by lockstep's /tokenize"),
        ));
    }
    let flag = |name: &str, default: bool| match obj.get(name) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(ApiError::field(
            name,
            format!("{name} must be true or false, got {other}"),
        )),
    };
    let return_token_strs = flag("return_token_strs", false)?;
    let (rendered, add_special_tokens, param) = match (obj.get("prompt"), obj.get("messages")) {
        (Some(_), Some(_)) => {
            return Err(ApiError::field(
                "messages",
                "give either prompt or messages, not both",
            ));
        }
        (Some(Value::String(prompt)), None) => {
            // A plain prompt gets the tokenizer's special tokens, as `/v1/completions`
            // gives it (vLLM's default `add_special_tokens: true`).
            (prompt.clone(), flag("add_special_tokens", true)?, "prompt")
        }
        (Some(other), None) => {
            return Err(ApiError::field(
                "prompt",
                format!("prompt must be a string, got {other}"),
            ));
        }
        (None, Some(Value::Array(list))) => {
            // The chat format always ends where the assistant's answer starts.
            if !flag("add_generation_prompt", true)? {
                return Err(ApiError::field(
                    "add_generation_prompt",
                    "add_generation_prompt: false is not implemented: the chat format ends where the assistant's answer starts",
                ));
            }
            let rendered = text.chat_text(list)?;
            // A rendered chat holds its own special tokens (vLLM's default for a chat:
            // `add_special_tokens: false`).
            (rendered, flag("add_special_tokens", false)?, "messages")
        }
        (None, Some(other)) => {
            return Err(ApiError::field(
                "messages",
                format!("messages must be an array, got {other}"),
            ));
        }
        (None, None) => {
            return Err(ApiError::field(
                "prompt",
                "prompt (or messages) is required",
            ));
        }
    };
    let tokens = text.encode(param, &rendered, add_special_tokens, max_prompt_tokens)?;
    let tokenizer = text.tokenizer();
    let token_strs = if return_token_strs {
        let strs: Vec<Value> = tokens
            .iter()
            .map(|&id| tokenizer.token_string(id).map_or(Value::Null, Value::from))
            .collect();
        Value::Array(strs)
    } else {
        Value::Null
    };
    Ok(json!({
        "count": tokens.len(),
        "max_model_len": max_model_len,
        "tokens": tokens,
        "token_strs": token_strs,
    }))
}

/// The answer to a `/detokenize` body: `{"prompt": TEXT}`, the ids' text with their
/// special tokens written out (vLLM decodes them so).
pub fn detokenize(text: &ModelText, body: &[u8], model: &str) -> Result<Value, ApiError> {
    let obj = object(body)?;
    api::check_model(&obj, model)?;
    let Some(Value::Array(items)) = obj.get("tokens") else {
        return Err(ApiError::field(
            "tokens",
            "tokens must be an array of token ids",
        ));
    };
    let vocab = text.vocab();
    let mut ids = Vec::with_capacity(items.len());
    for item in items {
        match item.as_u64().and_then(|t| u32::try_from(t).ok()) {
            Some(id) if id < vocab => ids.push(id),
            _ => {
                return Err(ApiError::field(
                    "tokens",
                    format!(
                        "tokens: {item} is not a token id of this model (0 to {})",
                        vocab.saturating_sub(1)
                    ),
                ));
            }
        }
    }
    let prompt = text
        .tokenizer()
        .decode_with_special(&ids)
        .map_err(|e| ApiError::field("tokens", format!("tokens: {e}")))?;
    Ok(json!({ "prompt": prompt }))
}

/// The body as a JSON object, or a 400 saying what it is.
fn object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(obj)) => Ok(obj),
        Ok(other) => Err(ApiError::status(
            400,
            "invalid_request_error",
            format!("the body must be a JSON object, got {other}"),
        )),
        Err(e) => Err(ApiError::status(
            400,
            "invalid_request_error",
            format!("the body is not valid JSON: {e}"),
        )),
    }
}
