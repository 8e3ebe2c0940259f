//! Reading a streamed OpenAI answer: server-sent events split into their `data`
//! payloads as bytes arrive ([`SseParser`]), and each payload read as an OpenAI chunk
//! ([`interpret`]).

use serde_json::Value;

/// Splits a byte stream of server-sent events into the `data` of each event, whatever
/// the boundaries of the pieces it arrives in. Lines end in `\n` or `\r\n`; an event
/// ends at a blank line; several `data:` lines of one event join with `\n`; comments
/// (`:` lines) and other fields are skipped.
#[derive(Debug, Default)]
pub struct SseParser {
    /// Bytes of a line not yet ended.
    line: Vec<u8>,
    /// The data of the event being read, if it has any.
    data: Option<String>,
}

impl SseParser {
    /// Feeds `bytes`; the data of every event they complete goes to `out`.
    pub fn push(&mut self, bytes: &[u8], out: &mut Vec<String>) {
        let mut rest = bytes;
        while let Some(pos) = rest.iter().position(|&b| b == b'\n') {
            self.line.extend_from_slice(&rest[..pos]);
            rest = &rest[pos + 1..];
            let mut line = std::mem::take(&mut self.line);
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            self.on_line(&line, out);
        }
        self.line.extend_from_slice(rest);
    }

    /// The stream ended: an event left without its blank line still counts.
    pub fn finish(&mut self, out: &mut Vec<String>) {
        if !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            self.on_line(&line, out);
        }
        if let Some(d) = self.data.take() {
            out.push(d);
        }
    }

    fn on_line(&mut self, line: &[u8], out: &mut Vec<String>) {
        if line.is_empty() {
            if let Some(d) = self.data.take() {
                out.push(d);
            }
            return;
        }
        let Some(value) = line.strip_prefix(b"data:") else {
            // A comment (`:` keep-alive) or another field (`event:`, `id:`, `retry:`).
            return;
        };
        let value = value.strip_prefix(b" ").unwrap_or(value);
        let value = String::from_utf8_lossy(value);
        match &mut self.data {
            Some(d) => {
                d.push('\n');
                d.push_str(&value);
            }
            None => self.data = Some(value.into_owned()),
        }
    }
}

/// What one event's data says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Chunk {
    /// `[DONE]`: the answer is complete.
    Done,
    /// A chunk: the text it carries (empty: none, e.g. a chat chunk naming the role, or
    /// the final chunk with the finish reason or the usage) and the usage's
    /// `completion_tokens`, when it has one.
    Data {
        /// Text of the first choice (`text`, or `delta.content` in chat).
        text: String,
        /// `usage.completion_tokens`.
        completion_tokens: Option<u64>,
    },
    /// An error object in the stream (`{"error": {"message": ...}}`): its message.
    Error(String),
    /// Not JSON, or not an object: the reason.
    Unreadable(String),
}

/// Reads one event's data.
pub fn interpret(data: &str) -> Chunk {
    let data = data.trim();
    if data == "[DONE]" {
        return Chunk::Done;
    }
    let v: Value = match serde_json::from_str(data) {
        Ok(v) => v,
        Err(e) => return Chunk::Unreadable(format!("a chunk is not JSON ({e}): {}", short(data))),
    };
    if !v.is_object() {
        return Chunk::Unreadable(format!("a chunk is not a JSON object: {}", short(data)));
    }
    if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
        return Chunk::Error(error_message(err));
    }
    let choice = v.get("choices").and_then(|c| c.get(0));
    let text = choice
        .and_then(|c| {
            c.get("text")
                .or_else(|| c.get("delta").and_then(|d| d.get("content")))
        })
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let completion_tokens = v
        .get("usage")
        .and_then(|u| u.get("completion_tokens"))
        .and_then(Value::as_u64);
    Chunk::Data {
        text,
        completion_tokens,
    }
}

/// The message of an OpenAI error object (`{"message": ...}`, or a bare string), or the
/// object itself, shortened.
pub fn error_message(err: &Value) -> String {
    err.get("message")
        .and_then(Value::as_str)
        .or_else(|| err.as_str())
        .map_or_else(|| short(&err.to_string()), str::to_string)
}

/// The reason a non-2xx answer gives: its OpenAI error message (`error.message`, or a
/// top-level `message` / `detail` as some servers send), or the body itself, shortened.
pub fn http_error_reason(status: u16, body: &str) -> String {
    let message = serde_json::from_str::<Value>(body).ok().and_then(|v| {
        v.get("error")
            .filter(|e| !e.is_null())
            .map(error_message)
            .or_else(|| v.get("message").and_then(Value::as_str).map(String::from))
            .or_else(|| {
                v.get("detail").map(|d| {
                    d.as_str()
                        .map_or_else(|| short(&d.to_string()), String::from)
                })
            })
    });
    let message = message.unwrap_or_else(|| short(body.trim()));
    if message.is_empty() {
        format!("HTTP {status}")
    } else {
        format!("HTTP {status}: {message}")
    }
}

fn short(text: &str) -> String {
    if text.len() > 200 {
        format!("{}...", &text[..text.floor_char_boundary(200)])
    } else {
        text.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_split_whatever_the_pieces() {
        let stream = b": keep-alive\r\n\r\ndata: {\"a\":1}\r\n\r\ndata: x\ndata: y\n\nevent: e\ndata:[DONE]\n\n";
        let whole = {
            let mut p = SseParser::default();
            let mut out = Vec::new();
            p.push(stream, &mut out);
            p.finish(&mut out);
            out
        };
        assert_eq!(whole, ["{\"a\":1}", "x\ny", "[DONE]"]);
        // Byte by byte gives the same events.
        let mut p = SseParser::default();
        let mut out = Vec::new();
        for b in stream {
            p.push(std::slice::from_ref(b), &mut out);
        }
        p.finish(&mut out);
        assert_eq!(out, whole);
        // An event cut off without its blank line still counts at the end.
        let mut p = SseParser::default();
        let mut out = Vec::new();
        p.push(b"data: last", &mut out);
        assert!(out.is_empty());
        p.finish(&mut out);
        assert_eq!(out, ["last"]);
    }

    #[test]
    fn chunks_read_text_usage_errors_and_done() {
        assert_eq!(interpret(" [DONE] "), Chunk::Done);
        assert_eq!(
            interpret(r#"{"choices":[{"index":0,"text":" lorem","finish_reason":null}]}"#),
            Chunk::Data {
                text: " lorem".into(),
                completion_tokens: None
            }
        );
        assert_eq!(
            interpret(r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#),
            Chunk::Data {
                text: String::new(),
                completion_tokens: None
            }
        );
        assert_eq!(
            interpret(r#"{"choices":[{"delta":{"content":"hi"}}]}"#),
            Chunk::Data {
                text: "hi".into(),
                completion_tokens: None
            }
        );
        assert_eq!(
            interpret(r#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":16}}"#),
            Chunk::Data {
                text: String::new(),
                completion_tokens: Some(16)
            }
        );
        assert_eq!(
            interpret(r#"{"error":{"message":"out of KV","type":"server_error"}}"#),
            Chunk::Error("out of KV".into())
        );
        assert!(matches!(interpret("{oops"), Chunk::Unreadable(_)));
        assert!(matches!(interpret("[1]"), Chunk::Unreadable(_)));
    }

    #[test]
    fn http_errors_name_the_status_and_the_message() {
        assert_eq!(
            http_error_reason(
                401,
                r#"{"error":{"message":"missing or wrong API key","code":"invalid_api_key"}}"#
            ),
            "HTTP 401: missing or wrong API key"
        );
        assert_eq!(
            http_error_reason(400, r#"{"object":"error","message":"bad max_tokens"}"#),
            "HTTP 400: bad max_tokens"
        );
        assert_eq!(
            http_error_reason(422, r#"{"detail":"field required"}"#),
            "HTTP 422: field required"
        );
        assert_eq!(
            http_error_reason(502, "Bad Gateway"),
            "HTTP 502: Bad Gateway"
        );
        assert_eq!(http_error_reason(503, ""), "HTTP 503");
    }
}
