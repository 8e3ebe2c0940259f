//! The model's chat template: the Jinja program a Hugging Face checkpoint ships, in
//! `chat_template.jinja` or as `chat_template` in `tokenizer_config.json`. It is rendered
//! the way `transformers` renders it — blocks trimmed and left-stripped, Python's string
//! methods available (`.strip()`, `.startswith()`, ...), `raise_exception` failing the
//! render with the template's own message — with the conversation as `messages`,
//! `add_generation_prompt` true and the tokenizer's `bos_token` and `eos_token`.
//! `strftime_now` is left undefined, so a template that dates its system prompt takes its
//! own fallback date and a prompt stays a pure function of the conversation.

use std::path::{Path, PathBuf};

use minijinja::{Environment, Error, ErrorKind, Value, syntax::SyntaxConfig};
use serde_json::Value as Json;

use super::error::{ModelError, Result};

const NAME: &str = "chat";

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    path: PathBuf,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source` (read from `path`, which errors name).
    pub fn new(
        source: &str,
        path: &Path,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<ChatTemplate> {
        let err = |e: Error| ModelError::ChatTemplate {
            path: path.to_path_buf(),
            message: e.to_string(),
        };
        let mut env = Environment::new();
        env.set_syntax(
            SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(err)?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> std::result::Result<Value, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned(NAME, source.to_string())
            .map_err(err)?;
        Ok(ChatTemplate {
            env,
            path: path.to_path_buf(),
            bos_token: bos_token.unwrap_or_default(),
            eos_token: eos_token.unwrap_or_default(),
        })
    }

    /// The directory's template, if it has one: `chat_template.jinja` first (where newer
    /// checkpoints keep it), then `chat_template` of `tokenizer_config.json` (`config`,
    /// read from `config_path`): a string, or a list of named templates of which the one
    /// named `default` (else the first) is used.
    pub fn of_dir(
        dir: &Path,
        config: Option<&Json>,
        config_path: &Path,
    ) -> Result<Option<ChatTemplate>> {
        let token = |name: &str| {
            config.and_then(|c| match c.get(name)? {
                Json::String(s) => Some(s.clone()),
                // Older configs wrap special tokens: {"content": "<s>", ...}.
                Json::Object(o) => o.get("content")?.as_str().map(str::to_string),
                _ => None,
            })
        };
        let (bos, eos) = (token("bos_token"), token("eos_token"));
        let file = dir.join("chat_template.jinja");
        if file.exists() {
            let source = std::fs::read_to_string(&file).map_err(|source| ModelError::Io {
                path: file.clone(),
                source,
            })?;
            return ChatTemplate::new(&source, &file, bos, eos).map(Some);
        }
        let source = match config.and_then(|c| c.get("chat_template")) {
            None | Some(Json::Null) => return Ok(None),
            Some(Json::String(s)) => s.clone(),
            Some(Json::Array(named)) => {
                let chosen = named
                    .iter()
                    .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                    .or_else(|| named.first())
                    .and_then(|t| t.get("template"))
                    .and_then(Json::as_str);
                match chosen {
                    Some(s) => s.to_string(),
                    None => {
                        return Err(ModelError::ChatTemplate {
                            path: config_path.to_path_buf(),
                            message: "chat_template is a list without a template".into(),
                        });
                    }
                }
            }
            Some(other) => {
                return Err(ModelError::ChatTemplate {
                    path: config_path.to_path_buf(),
                    message: format!("chat_template must be a string or a list, got {other}"),
                });
            }
        };
        ChatTemplate::new(&source, config_path, bos, eos).map(Some)
    }

    /// The prompt for a conversation of `(role, content)` messages, ending where the
    /// assistant's answer starts. A template that rejects the conversation (it raised,
    /// or failed on it) is an error carrying its message.
    pub fn render(&self, messages: &[(String, String)]) -> Result<String> {
        let messages: Vec<Value> = messages
            .iter()
            .map(|(role, content)| {
                Value::from(std::collections::BTreeMap::from([
                    ("role", Value::from(role.as_str())),
                    ("content", Value::from(content.as_str())),
                ]))
            })
            .collect();
        let context = minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        };
        self.env
            .get_template(NAME)
            .and_then(|t| t.render(context))
            .map_err(|e| ModelError::ChatTemplate {
                path: self.path.clone(),
                message: e.to_string(),
            })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// A template in the Llama 3 format: the BOS token, a header per message, contents
    /// stripped with Python's `.strip()`, alternation enforced with `raise_exception`.
    /// Written as checkpoints write theirs: indented, with `{%-` and `{{-` eating the
    /// layout, and a trailing newline that `trim_blocks` removes.
    const HEADERS: &str = r#"{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('Unknown role: ' + message['role']) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'].strip() + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"#;

    fn conversation(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(r, c)| (r.to_string(), c.to_string()))
            .collect()
    }

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("lockstep-chat-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_template_renders_with_trimmed_blocks_python_methods_and_the_special_tokens() {
        let path = Path::new("tokenizer_config.json");
        let t = ChatTemplate::new(HEADERS, path, Some("<|begin_of_text|>".into()), None)
            .expect("compiles");
        let prompt = t
            .render(&conversation(&[
                ("system", "  be brief "),
                ("user", "hi\n"),
            ]))
            .expect("renders");
        assert_eq!(
            prompt,
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nbe brief<|eot_id|>\
             <|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );
    }

    #[test]
    fn block_tags_take_their_lines_with_them_as_in_transformers() {
        let layout = "{% for m in messages %}\n    {% if m['role'] == 'user' %}\n{{ m['content'] }};\n    {% endif %}\n{% endfor %}";
        let t = ChatTemplate::new(layout, Path::new("t"), None, None).expect("compiles");
        let prompt = t
            .render(&conversation(&[
                ("user", "a"),
                ("system", "s"),
                ("user", "b"),
            ]))
            .expect("renders");
        assert_eq!(prompt, "a;\nb;\n");
    }

    #[test]
    fn a_conversation_the_template_rejects_is_an_error_with_its_message() {
        let path = Path::new("/m/tokenizer_config.json");
        let t = ChatTemplate::new(HEADERS, path, None, None).expect("compiles");
        let err = t
            .render(&conversation(&[("tool", "42")]))
            .expect_err("raises")
            .to_string();
        assert!(err.contains("/m/tokenizer_config.json"), "{err}");
        assert!(err.contains("Unknown role: tool"), "{err}");
        let bad = ChatTemplate::new("{% for m in messages %}", path, None, None)
            .expect_err("does not compile")
            .to_string();
        assert!(
            bad.contains("/m/tokenizer_config.json: chat template"),
            "{bad}"
        );
    }

    #[test]
    fn the_template_is_found_where_checkpoints_keep_it() {
        let d = dir("where");
        let config_path = d.join("tokenizer_config.json");
        let one = conversation(&[("user", "x")]);
        // A list of named templates: the one named `default`; wrapped special tokens.
        let config = json!({
            "bos_token": {"content": "<s>", "lstrip": false},
            "chat_template": [
                {"name": "tool_use", "template": "tools"},
                {"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"},
            ],
        });
        let t = ChatTemplate::of_dir(&d, Some(&config), &config_path)
            .unwrap()
            .expect("a template");
        assert_eq!(t.render(&one).unwrap(), "<s>x");
        // chat_template.jinja wins over the config's.
        std::fs::write(
            d.join("chat_template.jinja"),
            "[{{ messages[0]['content'] }}]",
        )
        .unwrap();
        let t = ChatTemplate::of_dir(&d, Some(&config), &config_path)
            .unwrap()
            .expect("a template");
        assert_eq!(t.render(&one).unwrap(), "[x]");
        std::fs::remove_file(d.join("chat_template.jinja")).unwrap();
        // None at all; and a chat_template of the wrong type is named.
        assert!(
            ChatTemplate::of_dir(&d, Some(&json!({})), &config_path)
                .unwrap()
                .is_none()
        );
        let err = ChatTemplate::of_dir(&d, Some(&json!({"chat_template": 3})), &config_path)
            .expect_err("a number is no template")
            .to_string();
        assert!(err.contains("must be a string or a list, got 3"), "{err}");
        let _ = std::fs::remove_dir_all(&d);
    }
}
