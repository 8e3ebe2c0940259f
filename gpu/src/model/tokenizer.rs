//! Text in and out: `tokenizer.json` through the `tokenizers` crate, and the model's
//! chat template where `tokenizer_config.json` gives one.

use std::path::{Path, PathBuf};

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

    /// The id of a token spelled `token`, if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Tokens in the vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    fn error(&self, message: String) -> ModelError {
        ModelError::Tokenizer {
            path: self.path.clone(),
            message,
        }
    }
}
