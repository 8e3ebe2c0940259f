//! The OpenAI request body of one workload request, and its synthetic prompt.
//!
//! Rules (written down in README "Benchmarking a server"):
//! - the prompt has exactly `prompt_len` tokens: for `completions` a list of token ids,
//!   for `chat` one user message of `prompt_len` words (a real tokenizer counts those
//!   words differently; lockstep serve counts one token per word);
//! - token `i` of the prompt comes from the hash of the full block of
//!   `tokens_per_block` tokens it falls in (`RequestSpec::block_hashes`), or, past the
//!   last full block, from the request id: requests that share a prefix in the workload
//!   share prompt tokens, so a real server's prefix cache can hit;
//! - ids lie in [`TOKEN_ID_MIN`]`..=`[`TOKEN_ID_MAX`], clear of the special tokens at
//!   the bottom of common vocabularies and inside every common vocabulary's size;
//! - every request streams (`stream_options.include_usage`), asks for exactly the
//!   spec's output length (`max_tokens`, and vLLM's `min_tokens` and `ignore_eos`, so a
//!   real model does not stop early at an end-of-sequence token) and samples greedily.

use serde_json::{Value, json};

use lockstep_actors::kv::mix;
use lockstep_actors::request::RequestSpec;

use lockstep_openai::Endpoint;

/// The smallest prompt token id sent.
pub const TOKEN_ID_MIN: u32 = 1000;
/// The largest prompt token id sent.
pub const TOKEN_ID_MAX: u32 = 30_000;

/// Tag of the tokens past the last full block (derived from the request id), so they
/// never come from the same input as a block's.
const TAIL_TAG: u64 = 0x7A11 << 48;

/// Words a chat prompt is made of: short, common English words, so that a real
/// tokenizer reads most of them as one token.
const WORDS: [&str; 64] = [
    "the", "of", "and", "to", "in", "is", "it", "you", "that", "he", "was", "for", "on", "are",
    "with", "as", "his", "they", "be", "at", "one", "have", "this", "from", "or", "had", "by",
    "hot", "word", "but", "what", "some", "we", "can", "out", "other", "were", "all", "there",
    "when", "up", "use", "your", "how", "said", "an", "each", "she", "which", "do", "their",
    "time", "if", "will", "way", "about", "many", "then", "them", "write", "would", "like", "so",
    "these",
];

/// A value per prompt position: from the block's hash for positions inside a full block,
/// from the request id past the last one.
fn position_values(spec: &RequestSpec, tokens_per_block: u32) -> impl Iterator<Item = u64> + '_ {
    let tpb = u64::from(tokens_per_block.max(1));
    let prompt = u64::from(spec.prompt_len);
    // Only blocks that lie wholly inside the prompt (a trace's hashes may say more).
    let full_blocks = (prompt / tpb).min(spec.block_hashes.len() as u64);
    let tail_seed = mix(TAIL_TAG ^ spec.id.0);
    (0..prompt).map(move |i| {
        let block = i / tpb;
        if block < full_blocks {
            mix(spec.block_hashes[block as usize] ^ (i % tpb))
        } else {
            mix(tail_seed ^ i)
        }
    })
}

/// The prompt of `spec` as token ids: exactly `prompt_len` of them, each in
/// `TOKEN_ID_MIN..=TOKEN_ID_MAX`.
pub fn prompt_token_ids(spec: &RequestSpec, tokens_per_block: u32) -> Vec<u32> {
    let span = u64::from(TOKEN_ID_MAX - TOKEN_ID_MIN + 1);
    position_values(spec, tokens_per_block)
        .map(|v| TOKEN_ID_MIN + (v % span) as u32)
        .collect()
}

/// The prompt of `spec` as text: exactly `prompt_len` words separated by single spaces.
pub fn prompt_words(spec: &RequestSpec, tokens_per_block: u32) -> String {
    let mut text = String::with_capacity(spec.prompt_len as usize * 5);
    for (i, v) in position_values(spec, tokens_per_block).enumerate() {
        if i > 0 {
            text.push(' ');
        }
        text.push_str(WORDS[(v % WORDS.len() as u64) as usize]);
    }
    text
}

/// The JSON body of `spec` for `endpoint`, naming `model`.
pub fn request_body(
    spec: &RequestSpec,
    endpoint: Endpoint,
    model: &str,
    tokens_per_block: u32,
) -> Value {
    let n = spec.max_new_tokens;
    let mut body = json!({
        "model": model,
        "max_tokens": n,
        "min_tokens": n,
        "ignore_eos": true,
        "temperature": 0.0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    match endpoint {
        Endpoint::Completions => {
            body["prompt"] = json!(prompt_token_ids(spec, tokens_per_block));
        }
        Endpoint::Chat => {
            body["messages"] = json!([{
                "role": "user",
                "content": prompt_words(spec, tokens_per_block),
            }]);
            body["max_completion_tokens"] = json!(n);
        }
    }
    body
}

/// The path of `endpoint` under the server's base URL.
pub fn endpoint_path(endpoint: Endpoint) -> &'static str {
    match endpoint {
        Endpoint::Completions => "v1/completions",
        Endpoint::Chat => "v1/chat/completions",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(id: u64, prompt_len: u32, hashes: &[u64]) -> RequestSpec {
        let mut s = RequestSpec::new(id, prompt_len, 7);
        s.block_hashes = hashes.to_vec();
        s
    }

    #[test]
    fn prompts_have_the_asked_length_and_safe_ids() {
        for len in [1, 31, 32, 33, 100] {
            let s = spec(5, len, &[11, 12, 13][..(len / 32) as usize]);
            let ids = prompt_token_ids(&s, 32);
            assert_eq!(ids.len(), len as usize);
            assert!(
                ids.iter()
                    .all(|&t| (TOKEN_ID_MIN..=TOKEN_ID_MAX).contains(&t))
            );
            assert_eq!(
                prompt_words(&s, 32).split_whitespace().count(),
                len as usize
            );
        }
    }

    #[test]
    fn shared_blocks_give_shared_tokens_and_tails_differ() {
        // Two requests sharing their first block, then differing.
        let a = prompt_token_ids(&spec(1, 80, &[100, 200]), 32);
        let b = prompt_token_ids(&spec(2, 80, &[100, 300]), 32);
        assert_eq!(a[..32], b[..32], "the shared block");
        assert_ne!(a[32..64], b[32..64], "different blocks");
        assert_ne!(a[64..], b[64..], "tails come from the request id");
        // A later round keeps the earlier round's blocks as its prefix.
        let next = prompt_token_ids(&spec(3, 100, &[100, 200, 400]), 32);
        assert_eq!(a[..64], next[..64]);
        // Hashes past the prompt's full blocks are not used.
        let short = prompt_token_ids(&spec(1, 40, &[100, 200]), 32);
        assert_eq!(short[..32], a[..32]);
        assert_eq!(short.len(), 40);
        let wa = prompt_words(&spec(1, 80, &[100, 200]), 32);
        let wb = prompt_words(&spec(2, 80, &[100, 300]), 32);
        let first = |t: &str| t.split(' ').take(32).collect::<Vec<_>>().join(" ");
        assert_eq!(first(&wa), first(&wb));
    }

    #[test]
    fn bodies_stream_and_ask_for_the_exact_length() {
        let s = spec(9, 3, &[]);
        let b = request_body(&s, Endpoint::Completions, "m", 32);
        assert_eq!(b["model"], "m");
        assert_eq!(b["max_tokens"], 7);
        assert_eq!(b["min_tokens"], 7);
        assert_eq!(b["ignore_eos"], true);
        assert_eq!(b["stream"], true);
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(b["prompt"].as_array().map(Vec::len), Some(3));
        let c = request_body(&s, Endpoint::Chat, "m", 32);
        assert_eq!(c["max_completion_tokens"], 7);
        assert_eq!(c["messages"][0]["role"], "user");
        let words = c["messages"][0]["content"].as_str().unwrap();
        assert_eq!(words.split(' ').count(), 3);
    }
}
