//! Text in and out: `tokenizer.json` through the `tokenizers` crate, and the model's
//! chat template where `tokenizer_config.json` gives one.

use std::path::{Path, PathBuf};

use super::error::{ModelError, Result};

/// The chat formats recognised in a `chat_template`. Templates are Jinja programs; rather
/// than embed a Jinja engine, the two formats nearly every Llama / Qwen2 checkpoint
/// uses are recognised by their markers and formatted here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChatFormat {
    /// `<|im_start|>role\ncontent<|im_end|>\n` (Qwen2, and `lockstep model init`).
    ChatMl,
    /// `<|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>` (Llama 3).
    Llama3,
}

/// A loaded tokenizer and the model's chat format, if any.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    chat_format: Option<ChatFormat>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("path", &self.path)
            .field("chat_format", &self.chat_format)
            .finish()
    }
}

impl TextTokenizer {
    /// Loads `DIR/tokenizer.json`, and the chat template of `DIR/tokenizer_config.json`
    /// when that file exists.
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
        let chat_format = match std::fs::read_to_string(&config_path) {
            Ok(text) => {
                let value: serde_json::Value =
                    serde_json::from_str(&text).map_err(|e| ModelError::Json {
                        path: config_path.clone(),
                        message: e.to_string(),
                    })?;
                value
                    .get("chat_template")
                    .and_then(|t| t.as_str())
                    .and_then(chat_format_of)
            }
            Err(_) => None,
        };
        Ok(TextTokenizer {
            inner,
            path,
            chat_format,
        })
    }

    /// The chat format the model's template uses, if one was recognised.
    pub fn chat_format(&self) -> Option<ChatFormat> {
        self.chat_format
    }

    /// The prompt for one user message: wrapped in the chat format when the model has
    /// one, the message itself otherwise.
    pub fn chat_prompt(&self, user_message: &str) -> String {
        self.chat_prompt_messages(&[("user".into(), user_message.into())])
    }

    /// The ids that end an answer: the model's `eos_token_id` and the chat format's
    /// end-of-turn token, where the vocabulary has them.
    pub fn end_of_answer_ids(&self, eos_token_id: Option<u32>) -> Vec<u32> {
        let mut ids: Vec<u32> = eos_token_id.into_iter().collect();
        ids.extend(
            ["<|im_end|>", "<|eot_id|>"]
                .iter()
                .filter_map(|t| self.token_id(t)),
        );
        ids
    }

    /// The prompt for a conversation of `(role, content)` messages, ending where the
    /// assistant's answer starts: each message in the chat format when the model has
    /// one, the contents one per line otherwise.
    pub fn chat_prompt_messages(&self, messages: &[(String, String)]) -> String {
        let mut text = String::new();
        for (role, content) in messages {
            match self.chat_format {
                Some(ChatFormat::ChatMl) => {
                    text.push_str(&format!("<|im_start|>{role}\n{content}<|im_end|>\n"));
                }
                Some(ChatFormat::Llama3) => text.push_str(&format!(
                    "<|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>"
                )),
                None => {
                    if !text.is_empty() {
                        text.push('\n');
                    }
                    text.push_str(content);
                }
            }
        }
        match self.chat_format {
            Some(ChatFormat::ChatMl) => text.push_str("<|im_start|>assistant\n"),
            Some(ChatFormat::Llama3) => {
                text.push_str("<|start_header_id|>assistant<|end_header_id|>\n\n");
            }
            None => {}
        }
        text
    }

    /// Token ids of `text` (special tokens written in the text are recognised).
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

fn chat_format_of(template: &str) -> Option<ChatFormat> {
    if template.contains("<|im_start|>") {
        Some(ChatFormat::ChatMl)
    } else if template.contains("<|start_header_id|>") {
        Some(ChatFormat::Llama3)
    } else {
        None
    }
}
