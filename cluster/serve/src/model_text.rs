//! `serve --model`: text through the model's tokenizer. A prompt becomes the model's
//! token ids (a chat in the model's chat format), which travel with the request to the
//! rank; output ids become text incrementally, a byte-level token that ends inside a
//! UTF-8 character held back until the character is whole.

use std::sync::Arc;

use lockstep_gpu::model::TextTokenizer;
use serde_json::Value;

use super::api::{ApiError, Endpoint};
use lockstep_plan::model_backend::{ModelBackend, ModelBackendError};

/// The served model's text rules.
pub struct ModelText {
    /// The model directory (`/v1/models`' `root`).
    dir: std::path::PathBuf,
    tokenizer: Arc<TextTokenizer>,
    vocab: u32,
    max_positions: u32,
    /// Ids that end an answer: `eos_token_id`, and the chat format's end of turn.
    eos: Arc<Vec<u32>>,
    /// The server's sampling (`--temperature`, `--top-p`, `--top-k`, `--seed`).
    defaults: lockstep_gpu::model_tokens::ModelSampling,
    /// The weights (shared with the ranks of this process): a prompt's
    /// log-probabilities ([`ModelText::prompt_logprobs`]).
    model: Arc<lockstep_gpu::model::Model>,
}

impl ModelText {
    /// The text rules of `backend`, which needs a `tokenizer.json`.
    pub fn new(backend: &ModelBackend) -> Result<ModelText, ModelBackendError> {
        let tokenizer =
            backend
                .tokenizer
                .clone()
                .ok_or_else(|| ModelBackendError::Unsupported {
                    server: "(serve)".into(),
                    why: format!(
                        "{} has no tokenizer.json: serving text needs one",
                        backend.dir.display()
                    ),
                })?;
        let config = &backend.model.config;
        let eos = tokenizer.end_of_answer_ids(&config.eos_token_ids);
        Ok(ModelText {
            model: backend.model.clone(),
            dir: backend.dir.clone(),
            defaults: backend.sampling,
            eos: Arc::new(eos),
            tokenizer,
            vocab: u32::try_from(config.vocab_size).unwrap_or(u32::MAX),
            max_positions: u32::try_from(config.max_position_embeddings).unwrap_or(u32::MAX),
        })
    }

    /// The prompt's token ids, from a body `api::parse` already checked; a text too long
    /// to be `max_prompt_tokens` tokens is refused before it is encoded (encoding costs
    /// memory and time in proportion to it).
    pub fn prompt_ids(
        &self,
        body: &[u8],
        endpoint: Endpoint,
        max_prompt_tokens: u32,
    ) -> Result<Vec<u32>, ApiError> {
        let value: Value = serde_json::from_slice(body)
            .map_err(|e| ApiError::status(400, "invalid_request_error", e.to_string()))?;
        let encode = |param: &str, text: &str| {
            // A plain prompt gets the special tokens the tokenizer adds (a BOS); a chat's
            // rendered template already holds its own, so it is encoded as written.
            self.encode(param, text, param == "prompt", max_prompt_tokens)
        };
        match endpoint {
            Endpoint::Completions => match value.get("prompt") {
                Some(Value::String(s)) => encode("prompt", s),
                Some(Value::Array(items)) => match items.as_slice() {
                    [Value::String(s)] => encode("prompt", s),
                    _ => {
                        let ids: Vec<u32> = items
                            .iter()
                            .filter_map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                            .collect();
                        if let Some(bad) = ids.iter().find(|&&t| t >= self.vocab) {
                            return Err(ApiError::field(
                                "prompt",
                                format!(
                                    "prompt: token id {bad} is outside the model's vocabulary of {}",
                                    self.vocab
                                ),
                            ));
                        }
                        Ok(ids)
                    }
                },
                _ => Err(ApiError::field("prompt", "prompt is required")),
            },
            Endpoint::Chat => {
                let list = value.get("messages").and_then(Value::as_array);
                let prompt = self.chat_text(list.map_or(&[][..], Vec::as_slice))?;
                encode("messages", &prompt)
            }
        }
    }

    /// `text`'s token ids (with the special tokens the tokenizer adds around a prompt
    /// where `special`), refused first, naming `param`, when too long in bytes to be
    /// `max_prompt_tokens` tokens ([`ModelText::check_prompt_bytes`]).
    pub fn encode(
        &self,
        param: &str,
        text: &str,
        special: bool,
        max_prompt_tokens: u32,
    ) -> Result<Vec<u32>, ApiError> {
        self.check_prompt_bytes(param, text.len(), max_prompt_tokens)?;
        let ids = if special {
            self.tokenizer.encode_prompt(text)
        } else {
            self.tokenizer.encode(text)
        };
        ids.map_err(|e| ApiError::field(param, format!("{param}: {e}")))
    }

    /// A chat's `messages` (each a `role`, "user" where absent, and a string or text-part
    /// `content`) rendered in the model's chat format, ending where the assistant's answer
    /// starts: the prompt of a chat completion, and what `/tokenize` encodes.
    pub fn chat_text(&self, messages: &[Value]) -> Result<String, ApiError> {
        let messages: Vec<(String, String)> = messages
            .iter()
            .map(|m| {
                let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
                (role.to_string(), content_text(m.get("content")))
            })
            .collect();
        self.tokenizer
            .chat_prompt_messages(&messages)
            .map_err(|e| ApiError::field("messages", format!("messages: {e}")))
    }

    /// A text of `bytes` bytes is refused when it cannot be `max_prompt_tokens` tokens
    /// or fewer: past `max_prompt_tokens` times the most bytes one token of this
    /// tokenizer stands for ([`TextTokenizer::max_bytes_per_token`], where it bounds
    /// that), so no prompt that fits is ever refused here.
    pub fn check_prompt_bytes(
        &self,
        param: &str,
        bytes: usize,
        max_prompt_tokens: u32,
    ) -> Result<(), ApiError> {
        let Some(per_token) = self.tokenizer.max_bytes_per_token() else {
            return Ok(());
        };
        let most = (max_prompt_tokens as usize).saturating_mul(per_token);
        if bytes > most {
            return Err(ApiError::field(
                param,
                format!(
                    "{param} is {bytes} bytes, more than this server's limit of {max_prompt_tokens} tokens can hold: one token of this model stands for at most {per_token} bytes, so {max_prompt_tokens} tokens hold at most {most} bytes"
                ),
            ));
        }
        Ok(())
    }

    /// The model's tokenizer.
    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    /// Token ids the model has (`vocab_size`).
    pub fn vocab(&self) -> u32 {
        self.vocab
    }

    /// The model directory served.
    pub fn root(&self) -> &std::path::Path {
        &self.dir
    }

    /// The model's positions (`max_position_embeddings`).
    pub fn max_positions(&self) -> u32 {
        self.max_positions
    }

    /// Request `id`'s own sampling, when its body gave any of the fields (or a
    /// `min_tokens`): the server's setting fills the others; without a `seed`, the
    /// server's seed mixed with the id (the stream a request without them gets).
    /// Sequence `index` of `n` with a `seed` samples with `seed + index` (wrapping), as
    /// vLLM seeds its `n` children: each sequence is reproducible, and sequence `i` is
    /// what `n: 1` with `seed + i` gives. Without one, each request id seeds its own.
    pub fn sampling_of(
        &self,
        parsed: &super::api::Parsed,
        id: u64,
        index: u32,
    ) -> Option<lockstep_actors::request::RequestSampling> {
        let fields = &parsed.sampling;
        (fields.any() || parsed.min_tokens > 0 || parsed.logprobs.is_some()).then(|| {
            let d = self.defaults;
            lockstep_actors::request::RequestSampling {
                temperature: fields.temperature.unwrap_or(d.params.temperature),
                top_p: fields.top_p.unwrap_or(d.params.top_p),
                top_k: fields
                    .top_k
                    .unwrap_or(u32::try_from(d.params.top_k).unwrap_or(u32::MAX)),
                seed: fields
                    .seed
                    .map_or(d.seed ^ lockstep_actors::kv::mix(id), |s| {
                        s.wrapping_add(u64::from(index))
                    }),
                presence_penalty: fields.presence_penalty.unwrap_or(0.0),
                frequency_penalty: fields.frequency_penalty.unwrap_or(0.0),
                repetition_penalty: fields.repetition_penalty.unwrap_or(1.0),
                min_tokens: parsed.min_tokens,
                logprobs: parsed.logprobs,
            }
        })
    }

    /// The ids the rank masks before `min_tokens`: the ones that would end the answer
    /// (`stop_token_ids` always; the end of sequence unless `ignore_eos`, where it ends
    /// nothing, as in vLLM).
    pub fn end_ids_of(&self, parsed: &super::api::Parsed) -> Vec<u32> {
        if parsed.min_tokens == 0 {
            return Vec::new();
        }
        let mut ids = parsed.stop_token_ids.clone();
        if !parsed.ignore_eos {
            ids.extend(self.eos.iter());
        }
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// A `stop_token_ids` id outside the vocabulary is refused, naming it (vLLM's rule).
    pub fn check_stop_token_ids(&self, ids: &[u32]) -> Result<(), ApiError> {
        match ids.iter().find(|&&t| t >= self.vocab) {
            Some(t) => Err(ApiError::field(
                "stop_token_ids",
                format!(
                    "stop_token_ids: token id {t} is outside the model's vocabulary of {}",
                    self.vocab
                ),
            )),
            None => Ok(()),
        }
    }

    /// A `logit_bias` id outside the vocabulary is refused, naming it (vLLM's rule).
    pub fn check_logit_bias(
        &self,
        bias: &[lockstep_actors::request::TokenBias],
    ) -> Result<(), ApiError> {
        match bias.iter().find(|b| b.token >= self.vocab) {
            Some(b) => Err(ApiError::field(
                "logit_bias",
                format!(
                    "logit_bias: token id {} is outside the model's vocabulary of {}",
                    b.token, self.vocab
                ),
            )),
            None => Ok(()),
        }
    }

    /// What completions' `echo` puts before the answer: the prompt as the body gave it
    /// (a text), or the text of its token ids.
    pub fn prompt_text(&self, body: &[u8], ids: &[u32]) -> String {
        let value: Value = serde_json::from_slice(body).unwrap_or_default();
        match value.get("prompt") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(items)) if matches!(items.as_slice(), [Value::String(_)]) => {
                items[0].as_str().unwrap_or_default().to_string()
            }
            _ => self.tokenizer.decode(ids).unwrap_or_default(),
        }
    }

    /// The prompt's log-probabilities for completions' `echo` with `logprobs` (vLLM's
    /// `prompt_logprobs`): each token after the first given those before it, with the
    /// `top` most likely there. The ranks' forward produces logits at each entry's last
    /// position only, so this runs one forward of the same weights over the whole
    /// prompt here, beside serving (the caller runs it off the async threads).
    pub fn prompt_logprobs(
        &self,
        ids: &[u32],
        top: u32,
    ) -> Result<Vec<lockstep_actors::vocab::TokenLogprobs>, String> {
        lockstep_gpu::model::prompt_logprobs(&self.model, ids, top as usize)
            .map_err(|e| e.to_string())
    }

    /// A decoder for one answer.
    pub fn decoder(&self) -> Decoder {
        Decoder {
            eos: self.eos.clone(),
            tokenizer: self.tokenizer.clone(),
            ids: Vec::new(),
            emitted: 0,
        }
    }
}

/// A message's text: a string, or the text parts of an array, one after another.
fn content_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

/// Output ids to text, incrementally.
pub struct Decoder {
    eos: Arc<Vec<u32>>,
    tokenizer: Arc<TextTokenizer>,
    ids: Vec<u32>,
    /// Bytes of the decoded text handed out so far.
    emitted: usize,
}

impl Decoder {
    /// Whether `id` ends the answer (the model's end of sequence or of its turn).
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos.contains(&id)
    }

    /// One token's own text, as a `logprobs` entry names it (a byte-level piece of a
    /// character reads as U+FFFD, as in vLLM).
    pub fn token_text(&self, id: u32) -> String {
        self.tokenizer.token_text(id).unwrap_or_default()
    }

    /// The text `id` adds to the answer (empty while it ends inside a character).
    pub fn push(&mut self, id: u32) -> String {
        self.ids.push(id);
        let Ok(text) = self.tokenizer.decode(&self.ids) else {
            return String::new();
        };
        if text.ends_with('\u{FFFD}') {
            return String::new();
        }
        let new = text.get(self.emitted..).unwrap_or_default().to_string();
        self.emitted = text.len();
        new
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockstep_gpu::model::{InitOptions, SamplingParams, write_random_model};

    fn text_rules(name: &str) -> (ModelText, std::path::PathBuf) {
        let dir =
            std::env::temp_dir().join(format!("lockstep-model-text-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        write_random_model(&dir, &InitOptions::default()).expect("init");
        let backend = ModelBackend::load(&dir, SamplingParams::default(), 0).expect("load");
        (ModelText::new(&backend).expect("a tokenizer"), dir)
    }

    #[test]
    fn a_conversation_the_models_template_rejects_is_a_400_naming_messages() {
        let dir =
            std::env::temp_dir().join(format!("lockstep-model-text-raise-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        write_random_model(&dir, &InitOptions::default()).expect("init");
        std::fs::write(
            dir.join("chat_template.jinja"),
            "{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first message must be the user\\'s') }}{% endif %}{{ messages[0]['content'] }}",
        )
        .expect("a template");
        let backend = ModelBackend::load(&dir, SamplingParams::default(), 0).expect("load");
        let text = ModelText::new(&backend).expect("a tokenizer");
        let err = text
            .prompt_ids(
                br#"{"messages": [{"role": "assistant", "content": "hi"}]}"#,
                Endpoint::Chat,
                u32::MAX,
            )
            .expect_err("the template raises");
        assert_eq!(err.param.as_deref(), Some("messages"));
        assert!(
            err.message.contains("the first message must be the user's"),
            "{err}"
        );
        let ids = text
            .prompt_ids(
                br#"{"messages": [{"role": "user", "content": "hi"}]}"#,
                Endpoint::Chat,
                u32::MAX,
            )
            .expect("the template renders");
        assert_eq!(ids, text.tokenizer.encode("hi").expect("encode"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A text prompt gets the BOS the tokenizer's post-processor adds; a chat, rendered
    /// by a template that writes its own BOS, gets no second one; token ids stay as given.
    #[test]
    fn a_text_prompt_gets_the_tokenizers_bos_and_a_chat_only_its_templates() {
        let dir =
            std::env::temp_dir().join(format!("lockstep-model-text-bos-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        write_random_model(&dir, &InitOptions::default()).expect("init");
        let bos = "<|endoftext|>";
        let path = dir.join("tokenizer.json");
        let mut tokenizer: Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
        tokenizer["post_processor"] = serde_json::json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [256], "tokens": [bos]}},
        });
        std::fs::write(&path, tokenizer.to_string()).expect("write");
        std::fs::write(
            dir.join("chat_template.jinja"),
            "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
        )
        .expect("a template");
        let mut config: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("tokenizer_config.json")).expect("read"),
        )
        .expect("json");
        config["bos_token"] = bos.into();
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).expect("write");
        let backend = ModelBackend::load(&dir, SamplingParams::default(), 0).expect("load");
        let text = ModelText::new(&backend).expect("a tokenizer");
        let plain = text.tokenizer.encode("hi").expect("encode");
        let ids = text
            .prompt_ids(br#"{"prompt": "hi"}"#, Endpoint::Completions, u32::MAX)
            .expect("a prompt");
        assert_eq!(ids[0], 256, "{ids:?}");
        assert_eq!(&ids[1..], &plain[..]);
        let chat = text
            .prompt_ids(
                br#"{"messages": [{"role": "user", "content": "hi"}]}"#,
                Endpoint::Chat,
                u32::MAX,
            )
            .expect("a chat");
        assert_eq!(chat, ids, "one BOS, the template's");
        let given = text
            .prompt_ids(br#"{"prompt": [5, 6]}"#, Endpoint::Completions, u32::MAX)
            .expect("ids");
        assert_eq!(given, vec![5, 6]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn decoding_token_by_token_holds_back_split_characters_and_adds_up_to_the_whole() {
        let (text, dir) = text_rules("decode");
        let words = "héllo wörld — ünïcödé 漢字 ok";
        let ids = text.tokenizer.encode(words).expect("encode");
        // Byte-level BPE splits some of these characters over several tokens.
        assert!(ids.len() > words.chars().count() / 2, "{ids:?}");
        let mut d = text.decoder();
        let mut out = String::new();
        for &id in &ids {
            let piece = d.push(id);
            assert!(
                !piece.contains('\u{FFFD}'),
                "a split character leaked: {piece:?}"
            );
            out.push_str(&piece);
        }
        assert_eq!(out, text.tokenizer.decode(&ids).expect("decode"));
        assert_eq!(out, words);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_chat_prompt_is_the_models_chat_format_and_token_ids_are_checked() {
        let (text, dir) = text_rules("prompt");
        let body = br#"{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}"#;
        let ids = text
            .prompt_ids(body, Endpoint::Chat, u32::MAX)
            .expect("ids");
        let expected = text
            .tokenizer
            .encode("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
            .expect("encode");
        assert_eq!(ids, expected);
        let ids = text
            .prompt_ids(br#"{"prompt": [1, 2, 3]}"#, Endpoint::Completions, u32::MAX)
            .expect("ids");
        assert_eq!(ids, vec![1, 2, 3]);
        let err = text
            .prompt_ids(
                br#"{"prompt": [1, 99999]}"#,
                Endpoint::Completions,
                u32::MAX,
            )
            .expect_err("outside the vocabulary");
        assert_eq!(err.param.as_deref(), Some("prompt"));
        assert!(err.message.contains("99999"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A prompt longer in bytes than `max_prompt_tokens` tokens can hold is a 400 naming
    /// the field and both numbers, from the byte count alone (`prompt_ids` would
    /// otherwise encode it); one at the bound is encoded.
    #[test]
    fn a_prompt_too_long_for_the_token_limit_is_refused_before_it_is_encoded() {
        let (text, dir) = text_rules("bytes");
        let per_token = text
            .tokenizer
            .max_bytes_per_token()
            .expect("a byte-level BPE bounds it");
        let max = 4u32;
        let most = 4 * per_token;
        // One word, so the word count `api::parse` checks first lets it through.
        let long = "x".repeat(most + 1);
        let body = serde_json::json!({"prompt": long}).to_string();
        let err = text
            .prompt_ids(body.as_bytes(), Endpoint::Completions, max)
            .expect_err("too long to fit");
        assert_eq!((err.status, err.param.as_deref()), (400, Some("prompt")));
        assert!(
            err.message
                .contains(&format!("prompt is {} bytes", most + 1))
                && err.message.contains("limit of 4 tokens")
                && err.message.contains(&format!("at most {most} bytes")),
            "{err}"
        );
        let body = serde_json::json!({"messages": [{"role": "user", "content": long}]}).to_string();
        let err = text
            .prompt_ids(body.as_bytes(), Endpoint::Chat, max)
            .expect_err("too long to fit");
        assert_eq!(err.param.as_deref(), Some("messages"), "{err}");
        assert!(err.message.starts_with("messages is "), "{err}");
        // At the bound it is encoded (and its token count checked after, as before).
        let body = serde_json::json!({"prompt": "x".repeat(most)}).to_string();
        let ids = text
            .prompt_ids(body.as_bytes(), Endpoint::Completions, max)
            .expect("encoded");
        assert!(!ids.is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The bound never refuses a text that fits: over texts built from the vocabulary's
    /// own tokens (its longest ones repeated, special tokens, multi-byte characters, runs
    /// of spaces), every text of `b` bytes encodes to at least `b / max_bytes_per_token`
    /// tokens.
    #[test]
    fn the_byte_bound_never_refuses_a_text_that_fits() {
        let (text, dir) = text_rules("fits");
        let tokenizer = &text.tokenizer;
        let per_token = tokenizer.max_bytes_per_token().expect("bounded");
        let mut pieces: Vec<String> = (0..tokenizer.vocab_size() as u32)
            .filter_map(|id| tokenizer.decode(&[id]).ok())
            .filter(|t| !t.is_empty() && !t.contains('\u{FFFD}'))
            .collect();
        pieces.sort_by_key(|t| std::cmp::Reverse(t.len()));
        let longest = pieces[0].clone();
        pieces.extend(
            [
                "<|im_start|>",
                "<|im_end|>",
                "<|endoftext|>",
                "é",
                "漢字",
                "🦀",
                "    ",
                "\n",
            ]
            .map(String::from),
        );
        // The longest entry is an added token, one token wherever the text spells it:
        // the bound is reached, so no smaller one would do.
        let mut texts: Vec<String> = vec![
            "<|endoftext|>".repeat(20),
            longest.repeat(50),
            " ".repeat(300),
            "\n".repeat(40),
        ];
        let mut state = 29u64;
        for _ in 0..400 {
            let mut t = String::new();
            for _ in 0..1 + state % 40 {
                state = lockstep_actors::kv::mix(state);
                t.push_str(&pieces[state as usize % pieces.len()]);
            }
            texts.push(t);
        }
        let mut tightest = f64::INFINITY;
        for t in &texts {
            for tokens in [
                tokenizer.encode(t).expect("encode").len(),
                tokenizer.encode_prompt(t).expect("encode").len(),
            ] {
                assert!(
                    t.len() <= tokens * per_token,
                    "{} bytes in {tokens} tokens, over {per_token} per token: {t:?}",
                    t.len()
                );
                tightest = tightest.min((tokens * per_token) as f64 / t.len() as f64);
            }
        }
        assert_eq!(per_token, "<|endoftext|>".len());
        assert!(tightest <= 1.0, "no text reached the bound: {tightest}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A tokenizer that can drop or fuse text has no bound (every prompt is encoded, as
    /// before); a normalizer that may shrink text widens it by its factor.
    #[test]
    fn the_byte_bound_holds_only_where_no_step_drops_text() {
        use lockstep_gpu::model::TextTokenizer;
        use serde_json::json;
        let dir =
            std::env::temp_dir().join(format!("lockstep-model-text-kinds-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        write_random_model(&dir, &InitOptions::default()).expect("init");
        let path = dir.join("tokenizer.json");
        let original: Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
        let base = TextTokenizer::load(&dir)
            .expect("load")
            .max_bytes_per_token()
            .expect("bounded");
        let cases: [(&str, Value, Option<usize>); 7] = [
            ("normalizer", json!({"type": "NFKC"}), Some(4 * base)),
            (
                "normalizer",
                json!({"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Lowercase"}]}),
                Some(9 * base),
            ),
            (
                "normalizer",
                json!({"type": "Replace", "pattern": {"String": "  "}, "content": " "}),
                Some(2 * base),
            ),
            (
                "normalizer",
                json!({"type": "Replace", "pattern": {"String": " "}, "content": ""}),
                None,
            ),
            ("normalizer", json!({"type": "StripAccents"}), None),
            ("pre_tokenizer", json!({"type": "Whitespace"}), None),
            (
                "truncation",
                json!({"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}),
                None,
            ),
        ];
        for (field, value, expected) in cases {
            let mut changed = original.clone();
            changed[field] = value.clone();
            std::fs::write(&path, changed.to_string()).expect("write");
            let got = TextTokenizer::load(&dir)
                .expect("load")
                .max_bytes_per_token();
            assert_eq!(got, expected, "{field}: {value}");
        }
        // An added token that swallows the whitespace beside it stands for any length.
        let mut changed = original.clone();
        changed["added_tokens"][0]["lstrip"] = true.into();
        std::fs::write(&path, changed.to_string()).expect("write");
        assert_eq!(
            TextTokenizer::load(&dir)
                .expect("load")
                .max_bytes_per_token(),
            None
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
