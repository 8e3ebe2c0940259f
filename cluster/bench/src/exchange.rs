//! One request over HTTP: send the body, read the streamed answer, and measure it as
//! vLLM's benchmark does (TTFT at the first chunk carrying text; one inter-token sample
//! per later chunk carrying text).

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::Value;

use lockstep_actors::ids::ReqId;
use lockstep_actors::kv::mix;

use super::sse::{Chunk, SseParser, http_error_reason, interpret};

/// Where requests go.
#[derive(Debug, Clone)]
pub struct Target {
    /// The endpoint's URL (`.../v1/completions`).
    pub url: reqwest::Url,
    /// Sent as `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
}

/// What one request saw; times are ns since the run's start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exchange {
    /// The request.
    pub id: ReqId,
    /// When each chunk carrying text arrived (the first is the first token).
    pub text_chunk_ns: Vec<u64>,
    /// When the answer ended (or failed).
    pub end_ns: u64,
    /// Output tokens: the final `usage.completion_tokens`, or the chunks carrying text
    /// when the server sent no usage.
    pub output_tokens: u32,
    /// A digest of the text received.
    pub digest: u64,
    /// Why it failed (`None`: completed).
    pub failure: Option<String>,
}

/// Sends `body` to `target` and reads the answer, within `timeout`.
pub async fn play(
    client: reqwest::Client,
    target: &Target,
    id: ReqId,
    body: Value,
    start: Instant,
    timeout: Duration,
) -> Exchange {
    let mut ex = Exchange {
        id,
        text_chunk_ns: Vec::new(),
        end_ns: 0,
        output_tokens: 0,
        digest: 0,
        failure: None,
    };
    let mut usage = None;
    let result = tokio::time::timeout(
        timeout,
        exchange(&client, target, &body, start, &mut ex, &mut usage),
    )
    .await;
    ex.end_ns = ns_since(start);
    ex.failure = match result {
        Ok(Ok(())) => None,
        Ok(Err(why)) => Some(why),
        Err(_) => Some(format!(
            "no complete answer within {} s (--request-timeout-s)",
            timeout.as_secs_f64()
        )),
    };
    ex.output_tokens = usage.unwrap_or(ex.text_chunk_ns.len() as u32);
    ex
}

fn ns_since(start: Instant) -> u64 {
    u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// An HTTP client error and its causes (reqwest keeps the useful part, such as
/// "Connection refused", in the causes).
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let c_text = c.to_string();
        if !text.contains(&c_text) {
            text.push_str(": ");
            text.push_str(&c_text);
        }
        cause = c.source();
    }
    text
}

async fn exchange(
    client: &reqwest::Client,
    target: &Target,
    body: &Value,
    start: Instant,
    ex: &mut Exchange,
    usage: &mut Option<u32>,
) -> Result<(), String> {
    let mut req = client.post(target.url.clone()).json(body);
    if let Some(k) = &target.api_key {
        req = req.bearer_auth(k);
    }
    let resp = req
        .send()
        .await
        .map_err(|e| format!("sending the request: {}", error_chain(&e.without_url())))?;
    let status = resp.status();
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        return Err(http_error_reason(status.as_u16(), &text));
    }
    let mut parser = SseParser::default();
    let mut events = Vec::new();
    let mut stream = resp.bytes_stream();
    let mut chunks = 0u64;
    loop {
        let piece = stream.next().await;
        let now = ns_since(start);
        let ended = match piece {
            Some(Ok(bytes)) => {
                parser.push(&bytes, &mut events);
                false
            }
            Some(Err(e)) => {
                return Err(format!(
                    "reading the stream after {chunks} chunks: {}",
                    error_chain(&e.without_url())
                ));
            }
            None => {
                parser.finish(&mut events);
                true
            }
        };
        for data in events.drain(..) {
            chunks += 1;
            match interpret(&data) {
                Chunk::Done => return Ok(()),
                Chunk::Data {
                    text,
                    completion_tokens,
                } => {
                    if !text.is_empty() {
                        ex.text_chunk_ns.push(now);
                        for word in text.as_bytes().chunks(8) {
                            let mut w = [0u8; 8];
                            w[..word.len()].copy_from_slice(word);
                            ex.digest = mix(ex.digest ^ u64::from_le_bytes(w));
                        }
                    }
                    if let Some(n) = completion_tokens {
                        *usage = Some(u32::try_from(n).unwrap_or(u32::MAX));
                    }
                }
                Chunk::Error(message) => return Err(format!("error in the stream: {message}")),
                Chunk::Unreadable(why) => return Err(why),
            }
        }
        if ended {
            return Err(format!(
                "the stream ended without [DONE] after {chunks} chunks"
            ));
        }
    }
}
