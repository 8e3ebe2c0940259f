//! Text in and out: `tokenizer.json` through the `tokenizers` crate, and the model's
//! chat template where `tokenizer_config.json` gives one.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::chat_template::ChatTemplate;
use super::error::{ModelError, Result};

/// A loaded tokenizer and the model's chat template, if any.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    chat_template: Option<ChatTemplate>,
    /// `add_bos_token` of `tokenizer_config.json` with the BOS id, where it says: it
    /// overrides the post-processor, as transformers' fast Llama tokenizer does.
    add_bos: Option<(bool, u32)>,
    /// The most bytes of text one token stands for, where the tokenizer bounds it.
    max_bytes_per_token: Option<usize>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("path", &self.path)
            .field("chat_template", &self.chat_template)
            .finish()
    }
}

impl TextTokenizer {
    /// Loads `DIR/tokenizer.json`, and the chat template (`DIR/chat_template.jinja`, or
    /// that of `DIR/tokenizer_config.json`) when there is one.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let bytes = std::fs::read(&path).map_err(|source| ModelError::Io {
            path: path.clone(),
            source,
        })?;
        let inner =
            tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| ModelError::Tokenizer {
                path: path.clone(),
                message: e.to_string(),
            })?;
        let max_bytes_per_token = serde_json::from_slice::<Value>(&bytes)
            .ok()
            .and_then(|json| max_bytes_per_token(&json));
        let config_path = dir.join("tokenizer_config.json");
        let config = match std::fs::read_to_string(&config_path) {
            Ok(text) => Some(
                serde_json::from_str::<serde_json::Value>(&text).map_err(|e| ModelError::Json {
                    path: config_path.clone(),
                    message: e.to_string(),
                })?,
            ),
            Err(_) => None,
        };
        let chat_template = ChatTemplate::of_dir(dir, config.as_ref(), &config_path)?;
        let add_bos = config.as_ref().and_then(|c| {
            let add = c.get("add_bos_token")?.as_bool()?;
            let bos = c.get("bos_token")?;
            let spelled = bos
                .as_str()
                .or_else(|| bos.get("content").and_then(|c| c.as_str()))?;
            Some((add, inner.token_to_id(spelled)?))
        });
        Ok(TextTokenizer {
            inner,
            path,
            chat_template,
            add_bos,
            max_bytes_per_token,
        })
    }

    /// Whether the model ships a chat template.
    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// The prompt for one user message: through the chat template when the model has
    /// one, the message itself otherwise.
    pub fn chat_prompt(&self, user_message: &str) -> Result<String> {
        self.chat_prompt_messages(&[("user".into(), user_message.into())])
    }

    /// The ids that end an answer: the model's `eos_token_id` and the chat format's
    /// end-of-turn token, where the vocabulary has them.
    pub fn end_of_answer_ids(&self, eos_token_ids: &[u32]) -> Vec<u32> {
        let mut ids: Vec<u32> = eos_token_ids.to_vec();
        for id in ["<|im_end|>", "<|eot_id|>"]
            .iter()
            .filter_map(|t| self.token_id(t))
        {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        ids
    }

    /// The prompt for a conversation of `(role, content)` messages, ending where the
    /// assistant's answer starts: the model's chat template rendered, or without one the
    /// contents one per line. A conversation the template rejects is an error with the
    /// template's message.
    pub fn chat_prompt_messages(&self, messages: &[(String, String)]) -> Result<String> {
        match &self.chat_template {
            Some(template) => template.render(messages),
            None => Ok(messages
                .iter()
                .map(|(_, content)| content.as_str())
                .collect::<Vec<_>>()
                .join("\n")),
        }
    }

    /// Token ids of a plain-text prompt, with the special tokens the model expects around
    /// one: the post-processor's (`add_special_tokens`, e.g. a BOS), adjusted to
    /// `add_bos_token` where `tokenizer_config.json` gives it. (A rendered chat template
    /// writes its own BOS: encode it with [`TextTokenizer::encode`].)
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, true)
            .map_err(|e| self.error(e.to_string()))?;
        let mut ids = encoding.get_ids().to_vec();
        match self.add_bos {
            Some((true, bos)) if ids.first() != Some(&bos) => ids.insert(0, bos),
            // Only a BOS the post-processor added goes, not one the text spells.
            Some((false, bos))
                if ids.first() == Some(&bos) && self.encode(text)?.first() != Some(&bos) =>
            {
                ids.remove(0);
            }
            _ => {}
        }
        Ok(ids)
    }

    /// Token ids of `text` as written: no special tokens added (those written in the
    /// text are recognised).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| self.error(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `ids`, special tokens left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| self.error(e.to_string()))
    }

    /// The text of `ids`, special tokens written out (what `/detokenize` answers, as
    /// vLLM decodes).
    pub fn decode_with_special(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| self.error(e.to_string()))
    }

    /// A token as the vocabulary spells it (`Ġthe` for a byte-level BPE's ` the`: what
    /// transformers' `convert_ids_to_tokens` gives), if `id` is in it.
    pub fn token_string(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// One token's own text, special tokens shown (what a `logprobs` entry names it).
    pub fn token_text(&self, id: u32) -> Result<String> {
        self.inner
            .decode(&[id], false)
            .map_err(|e| self.error(e.to_string()))
    }

    /// The id of a token spelled `token`, if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Tokens in the vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The most bytes of text one token can stand for, where this tokenizer bounds it
    /// (`None`: it does not, and only encoding tells a text's length in tokens). A text
    /// of more than `n` times this many bytes is more than `n` tokens, however it
    /// encodes, special tokens added or not.
    pub fn max_bytes_per_token(&self) -> Option<usize> {
        self.max_bytes_per_token
    }

    fn error(&self, message: String) -> ModelError {
        ModelError::Tokenizer {
            path: self.path.clone(),
            message,
        }
    }
}

/// The most bytes of text one token can stand for under `tokenizer.json` (`json`), or
/// `None` where no bound holds.
///
/// Every token spells at least the bytes of normalized text it stands for: byte-level
/// BPE writes each byte as one character of one or two bytes, SentencePiece-style BPE a
/// space as the three bytes of `▁` and an unknown byte as `<0xNN>`, and an added token is
/// its content. So `L`, the longest entry of the vocabulary and of the added tokens,
/// bounds what one token covers of the normalized text, and `f × L` what it covers of
/// the text as given, `f` being the most the normalizer can shrink text by. That holds
/// only where no step drops text, so anything else is `None`: a model other than BPE
/// (WordPiece, WordLevel and Unigram turn a whole unknown word into one unknown token),
/// BPE that cannot spell every byte (neither a byte-level pre-tokenizer with all 256
/// byte characters nor byte fallback with all 256 `<0xNN>` tokens: it drops or fuses
/// what it cannot spell), a pre-tokenizer that removes text (`Whitespace`, a `Split`
/// that removes its matches, ...), a normalizer that deletes (`Strip`, `StripAccents`,
/// BERT's, SentencePiece's precompiled map), an added token that swallows the
/// whitespace around it (`lstrip`/`rstrip`), and truncation.
fn max_bytes_per_token(json: &Value) -> Option<usize> {
    if !json.get("truncation").is_none_or(Value::is_null) {
        return None;
    }
    let model = json.get("model")?;
    if model.get("type")?.as_str()? != "BPE" {
        return None;
    }
    let vocab = model.get("vocab")?.as_object()?;
    let pre_tokenizer = json.get("pre_tokenizer").unwrap_or(&Value::Null);
    if !pre_tokenizer_keeps_text(pre_tokenizer) {
        return None;
    }
    let byte_level = has_byte_level(pre_tokenizer)
        && super::init::byte_to_char()
            .iter()
            .all(|c| vocab.contains_key(c.to_string().as_str()));
    let byte_fallback = model.get("byte_fallback").and_then(Value::as_bool) == Some(true)
        && (0..=255u8).all(|b| vocab.contains_key(format!("<0x{b:02X}>").as_str()));
    if !(byte_level || byte_fallback) {
        return None;
    }
    let mut longest = vocab.keys().map(String::len).max()?;
    for added in json
        .get("added_tokens")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let strips = |k: &str| added.get(k).and_then(Value::as_bool) == Some(true);
        if strips("lstrip") || strips("rstrip") {
            return None;
        }
        longest = longest.max(added.get("content")?.as_str()?.len());
    }
    longest.checked_mul(normalizer_shrink(
        json.get("normalizer").unwrap_or(&Value::Null),
    )?)
}

/// Whether a pre-tokenizer keeps every byte of its input (it may split it, or add to
/// it).
fn pre_tokenizer_keeps_text(p: &Value) -> bool {
    if p.is_null() {
        return true;
    }
    let removes = p.get("behavior").and_then(Value::as_str) == Some("Removed");
    match p.get("type").and_then(Value::as_str) {
        Some("ByteLevel" | "Metaspace" | "Digits") => true,
        Some("Split" | "Punctuation") => !removes,
        Some("Sequence") => p
            .get("pretokenizers")
            .and_then(Value::as_array)
            .is_some_and(|all| all.iter().all(pre_tokenizer_keeps_text)),
        _ => false,
    }
}

fn has_byte_level(p: &Value) -> bool {
    match p.get("type").and_then(Value::as_str) {
        Some("ByteLevel") => true,
        Some("Sequence") => p
            .get("pretokenizers")
            .and_then(Value::as_array)
            .is_some_and(|all| all.iter().any(has_byte_level)),
        _ => false,
    }
}

/// The most a normalizer can shrink text by (bytes in over bytes out), where it is
/// bounded. Unicode normalization never deletes a character: canonical forms shrink a
/// character at most threefold (KELVIN SIGN, 3 bytes, is `K`; a Hangul syllable's three
/// jamo, 9 bytes, compose to 3), compatibility forms fourfold (a 4-byte mathematical
/// letter is its ASCII letter); lowercasing at most threefold (KELVIN SIGN to `k`).
fn normalizer_shrink(n: &Value) -> Option<usize> {
    if n.is_null() {
        return Some(1);
    }
    match n.get("type")?.as_str()? {
        "Prepend" => Some(1),
        "NFC" | "NFD" | "Lowercase" => Some(3),
        "NFKC" | "NFKD" => Some(4),
        "Replace" => {
            let from = n.get("pattern")?.get("String")?.as_str()?.len();
            let to = n.get("content")?.as_str()?.len();
            (to > 0).then(|| from.div_ceil(to).max(1))
        }
        "Sequence" => n
            .get("normalizers")?
            .as_array()?
            .iter()
            .try_fold(1usize, |f, each| f.checked_mul(normalizer_shrink(each)?)),
        _ => None,
    }
}
