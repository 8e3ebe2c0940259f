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
//! - ids are drawn from a [`PromptIds`] set: by default [`TOKEN_ID_MIN`]`..=`
//!   [`TOKEN_ID_MAX`], clear of the special tokens at the bottom of common vocabularies
//!   and inside every common vocabulary's size; with a tokenizer (`--tokenizer`), every
//!   id of its vocabulary that is not an added or special token (within `--prompt-ids`
//!   when given, which must then fit the vocabulary: [`PromptIds::from_tokenizer`]);
//! - every request streams (`stream_options.include_usage`), asks for exactly the
//!   spec's output length (`max_tokens`, and, where the server honours them, vLLM's
//!   `min_tokens` and `ignore_eos`, so a real model does not stop early at an
//!   end-of-sequence token) and samples greedily.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use lockstep_actors::kv::mix;
use lockstep_actors::request::RequestSpec;

use lockstep_openai::Endpoint;

/// The smallest prompt token id sent.
pub const TOKEN_ID_MIN: u32 = 1000;
/// The largest prompt token id sent.
pub const TOKEN_ID_MAX: u32 = 30_000;

/// Why the prompt ids cannot be drawn.
#[derive(Debug, thiserror::Error)]
pub enum PromptIdsError {
    /// `--prompt-ids` is not `MIN-MAX` with `MIN <= MAX`.
    #[error("--prompt-ids `{given}`: expected MIN-MAX with MIN <= MAX (e.g. 1000-30000)")]
    BadRange {
        /// As given.
        given: String,
    },
    /// The tokenizer could not be read.
    #[error("--tokenizer {}: {why}", path.display())]
    Tokenizer {
        /// The `tokenizer.json` read.
        path: PathBuf,
        /// What went wrong.
        why: String,
    },
    /// The range asks for ids past the tokenizer's vocabulary.
    #[error(
        "--prompt-ids {min}-{max} does not fit the vocabulary of {} ({vocab} ids, \
         0..={}): give a MAX below {vocab}",
        path.display(),
        vocab.saturating_sub(1)
    )]
    OutsideVocab {
        /// The range's least id.
        min: u32,
        /// The range's largest id.
        max: u32,
        /// The vocabulary's size (largest id + 1).
        vocab: u32,
        /// The `tokenizer.json` read.
        path: PathBuf,
    },
    /// Every id of the range is an added or special token.
    #[error(
        "--prompt-ids {min}-{max}: every id in it is an added or special token of {}",
        path.display()
    )]
    OnlySpecial {
        /// The range's least id.
        min: u32,
        /// The range's largest id.
        max: u32,
        /// The `tokenizer.json` read.
        path: PathBuf,
    },
}

/// The token ids prompts are drawn from (sorted, no repeats, never empty).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptIds {
    ids: Vec<u32>,
}

impl Default for PromptIds {
    /// [`TOKEN_ID_MIN`]`..=`[`TOKEN_ID_MAX`].
    fn default() -> Self {
        PromptIds {
            ids: (TOKEN_ID_MIN..=TOKEN_ID_MAX).collect(),
        }
    }
}

/// `MIN-MAX` (inclusive) from `--prompt-ids`.
pub fn parse_range(given: &str) -> Result<(u32, u32), PromptIdsError> {
    let bad = || PromptIdsError::BadRange {
        given: given.to_string(),
    };
    let (a, b) = given.trim().split_once('-').ok_or_else(bad)?;
    let (min, max) = (
        a.trim().parse::<u32>().map_err(|_| bad())?,
        b.trim().parse::<u32>().map_err(|_| bad())?,
    );
    if min > max {
        return Err(bad());
    }
    Ok((min, max))
}

fn tokenizer_file(path: &Path) -> std::path::PathBuf {
    if path.is_dir() {
        path.join("tokenizer.json")
    } else {
        path.to_path_buf()
    }
}

/// The tokenizer at `path`: a `tokenizer.json`, or a directory holding one.
pub fn load_tokenizer(path: &Path) -> Result<tokenizers::Tokenizer, PromptIdsError> {
    let file = tokenizer_file(path);
    tokenizers::Tokenizer::from_file(&file).map_err(|e| PromptIdsError::Tokenizer {
        path: file.clone(),
        why: e.to_string(),
    })
}

impl PromptIds {
    /// Every id of `min..=max` (no tokenizer to check it against).
    pub fn range(min: u32, max: u32) -> Result<Self, PromptIdsError> {
        if min > max {
            return Err(PromptIdsError::BadRange {
                given: format!("{min}-{max}"),
            });
        }
        Ok(PromptIds {
            ids: (min..=max).collect(),
        })
    }

    /// The ids of the tokenizer at `path` (a `tokenizer.json`, or a directory holding
    /// one): every id of its vocabulary that is not an added or special token, within
    /// `range` when given. A range whose largest id is past the vocabulary is an error
    /// naming both.
    pub fn from_tokenizer(path: &Path, range: Option<(u32, u32)>) -> Result<Self, PromptIdsError> {
        let tokenizer = load_tokenizer(path)?;
        let file = tokenizer_file(path);
        let added = tokenizer.get_added_tokens_decoder();
        let vocab = tokenizer
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&m| m.saturating_add(1));
        let (min, max) = range.unwrap_or((0, vocab.saturating_sub(1)));
        if vocab == 0 || max >= vocab {
            return Err(PromptIdsError::OutsideVocab {
                min,
                max,
                vocab,
                path: file,
            });
        }
        let mut ids: Vec<u32> = tokenizer
            .get_vocab(false)
            .into_values()
            .filter(|id| (min..=max).contains(id) && !added.contains_key(id))
            .collect();
        ids.sort_unstable();
        ids.dedup();
        if ids.is_empty() {
            return Err(PromptIdsError::OnlySpecial {
                min,
                max,
                path: file,
            });
        }
        Ok(PromptIds { ids })
    }

    /// The least and the largest id.
    pub fn bounds(&self) -> (u32, u32) {
        (self.ids[0], self.ids[self.ids.len() - 1])
    }

    /// How many ids there are.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Never: a set is never empty.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Whether `id` is one of them.
    pub fn contains(&self, id: u32) -> bool {
        self.ids.binary_search(&id).is_ok()
    }

    fn pick(&self, v: u64) -> u32 {
        self.ids[(v % self.ids.len() as u64) as usize]
    }
}

/// What every request body carries besides its prompt.
#[derive(Debug, Clone)]
pub struct BodyRules {
    /// The model named.
    pub model: String,
    /// The KV block size prompts are built in.
    pub tokens_per_block: u32,
    /// The ids completions prompts are drawn from.
    pub prompt_ids: PromptIds,
    /// Whether vLLM's `ignore_eos` and `min_tokens` are sent.
    pub ignore_eos: bool,
}

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

/// The prompt of `spec` as token ids: exactly `prompt_len` of them, each one of `ids`.
pub fn prompt_token_ids(spec: &RequestSpec, tokens_per_block: u32, ids: &PromptIds) -> Vec<u32> {
    position_values(spec, tokens_per_block)
        .map(|v| ids.pick(v))
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

/// The JSON body of `spec` for `endpoint`, under `rules`.
pub fn request_body(spec: &RequestSpec, endpoint: Endpoint, rules: &BodyRules) -> Value {
    let n = spec.max_new_tokens;
    let mut body = json!({
        "model": rules.model,
        "max_tokens": n,
        "temperature": 0.0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if rules.ignore_eos {
        body["min_tokens"] = json!(n);
        body["ignore_eos"] = json!(true);
    }
    let tpb = rules.tokens_per_block;
    match endpoint {
        Endpoint::Completions => {
            body["prompt"] = json!(prompt_token_ids(spec, tpb, &rules.prompt_ids));
        }
        Endpoint::Chat => {
            body["messages"] = json!([{
                "role": "user",
                "content": prompt_words(spec, tpb),
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
        s.block_hashes = hashes.into();
        s
    }

    fn rules(ignore_eos: bool) -> BodyRules {
        BodyRules {
            model: "m".into(),
            tokens_per_block: 32,
            prompt_ids: PromptIds::default(),
            ignore_eos,
        }
    }

    /// A word-level `tokenizer.json` of ids 0..=5 where 3 is an added special token
    /// and 5 an added plain one, in a fresh directory.
    fn tiny_tokenizer(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("lockstep-bench-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let added = |id: u32, content: &str, special: bool| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": special})
        };
        let t = json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [added(3, "<s>", true), added(5, "<extra>", false)],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "unk_token": "a",
                      "vocab": {"a": 0, "b": 1, "c": 2, "<s>": 3, "d": 4}},
        });
        std::fs::write(dir.join("tokenizer.json"), t.to_string()).unwrap();
        dir
    }

    #[test]
    fn prompts_have_the_asked_length_and_safe_ids() {
        let ids = PromptIds::default();
        assert_eq!(ids.bounds(), (TOKEN_ID_MIN, TOKEN_ID_MAX));
        for len in [1, 31, 32, 33, 100] {
            let s = spec(5, len, &[11, 12, 13][..(len / 32) as usize]);
            let got = prompt_token_ids(&s, 32, &ids);
            assert_eq!(got.len(), len as usize);
            assert!(
                got.iter()
                    .all(|&t| (TOKEN_ID_MIN..=TOKEN_ID_MAX).contains(&t))
            );
            assert_eq!(
                prompt_words(&s, 32).split_whitespace().count(),
                len as usize
            );
        }
        // A small set is used whole, and nothing outside it.
        let small = PromptIds::range(10, 13).unwrap();
        let got = prompt_token_ids(&spec(1, 400, &[]), 32, &small);
        let mut seen = got.clone();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen, [10, 11, 12, 13]);
    }

    #[test]
    fn a_tokenizer_gives_its_plain_ids_and_a_range_must_fit_it() {
        let dir = tiny_tokenizer("vocab");
        // The directory or the file; the added tokens (special or not) are left out.
        for path in [dir.clone(), dir.join("tokenizer.json")] {
            let ids = PromptIds::from_tokenizer(&path, None).unwrap();
            assert_eq!(ids.ids, [0, 1, 2, 4]);
        }
        let ids = PromptIds::from_tokenizer(&dir, Some((1, 3))).unwrap();
        assert_eq!(ids.ids, [1, 2]);
        let got = prompt_token_ids(&spec(2, 300, &[]), 32, &ids);
        assert!(got.iter().all(|&t| t == 1 || t == 2));
        // Past the vocabulary (ids 0..=5): an error naming both numbers.
        let e = PromptIds::from_tokenizer(&dir, Some((1000, 30_000)))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--prompt-ids 1000-30000") && e.contains("6 ids") && e.contains("0..=5"),
            "{e}"
        );
        assert!(PromptIds::from_tokenizer(&dir, Some((2, 6))).is_err());
        assert!(PromptIds::from_tokenizer(&dir, Some((2, 5))).is_ok());
        let e = PromptIds::from_tokenizer(&dir, Some((3, 3)))
            .unwrap_err()
            .to_string();
        assert!(e.contains("added or special"), "{e}");
        let e = PromptIds::from_tokenizer(&dir.join("nope.json"), None)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("--tokenizer ") && e.contains("nope.json"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn ranges_parse_inclusive() {
        assert_eq!(parse_range("1000-30000").unwrap(), (1000, 30_000));
        assert_eq!(parse_range(" 5 - 5 ").unwrap(), (5, 5));
        for bad in ["9-3", "1000", "a-b", "-3", "1-"] {
            let e = parse_range(bad).unwrap_err().to_string();
            assert!(e.contains("--prompt-ids") && e.contains(bad), "{e}");
        }
    }

    #[test]
    fn shared_blocks_give_shared_tokens_and_tails_differ() {
        let ids = PromptIds::default();
        let p = |s: &RequestSpec| prompt_token_ids(s, 32, &ids);
        // Two requests sharing their first block, then differing.
        let a = p(&spec(1, 80, &[100, 200]));
        let b = p(&spec(2, 80, &[100, 300]));
        assert_eq!(a[..32], b[..32], "the shared block");
        assert_ne!(a[32..64], b[32..64], "different blocks");
        assert_ne!(a[64..], b[64..], "tails come from the request id");
        // A later round keeps the earlier round's blocks as its prefix.
        let next = p(&spec(3, 100, &[100, 200, 400]));
        assert_eq!(a[..64], next[..64]);
        // Hashes past the prompt's full blocks are not used.
        let short = p(&spec(1, 40, &[100, 200]));
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
        let b = request_body(&s, Endpoint::Completions, &rules(true));
        assert_eq!(b["model"], "m");
        assert_eq!(b["max_tokens"], 7);
        assert_eq!(b["min_tokens"], 7);
        assert_eq!(b["ignore_eos"], true);
        assert_eq!(b["stream"], true);
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(b["prompt"].as_array().map(Vec::len), Some(3));
        let c = request_body(&s, Endpoint::Chat, &rules(true));
        assert_eq!(c["max_completion_tokens"], 7);
        assert_eq!(c["messages"][0]["role"], "user");
        let words = c["messages"][0]["content"].as_str().unwrap();
        assert_eq!(words.split(' ').count(), 3);
        // Without the vLLM extension: neither field, the rest the same.
        for endpoint in [Endpoint::Completions, Endpoint::Chat] {
            let plain = request_body(&s, endpoint, &rules(false));
            assert!(plain.get("ignore_eos").is_none() && plain.get("min_tokens").is_none());
            assert_eq!(plain["max_tokens"], 7);
        }
    }
}
