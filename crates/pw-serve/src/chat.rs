//! Chat templates from a Hugging Face model directory, rendered with minijinja the way
//! transformers renders them.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::ServeError;

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The text of the message.
    pub content: String,
}

/// A model's chat template with the special tokens it refers to.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: String,
    bos_token: String,
    eos_token: String,
    origin: PathBuf,
}

fn read_json(path: &Path) -> Result<Value, ServeError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ServeError::Config { path: path.to_path_buf(), message: e.to_string() })?;
    serde_json::from_str(&text)
        .map_err(|e| ServeError::Config { path: path.to_path_buf(), message: format!("not valid JSON: {e}") })
}

/// A special token as tokenizer_config.json writes it: a string or `{"content": ...}`.
fn token_text(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).unwrap_or_default().to_string(),
        _ => String::new(),
    }
}

impl ChatTemplate {
    /// Builds a template from its source and the special tokens it may print.
    pub fn new(
        source: impl Into<String>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Self {
        Self {
            source: source.into(),
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
            origin: PathBuf::from("<inline>"),
        }
    }

    /// The chat template of a model directory: `chat_template.jinja`, `chat_template.json`, or
    /// the `chat_template` of `tokenizer_config.json` (a string or a list of named templates,
    /// `default` preferred). `Ok(None)` when the directory has none.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>, ServeError> {
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg = if cfg_path.exists() { read_json(&cfg_path)? } else { Value::Null };
        let with = |source: String, origin: PathBuf| {
            Some(Self {
                source,
                bos_token: token_text(cfg.get("bos_token")),
                eos_token: token_text(cfg.get("eos_token")),
                origin,
            })
        };
        let jinja = dir.join("chat_template.jinja");
        if jinja.exists() {
            let s = std::fs::read_to_string(&jinja)
                .map_err(|e| ServeError::Config { path: jinja.clone(), message: e.to_string() })?;
            return Ok(with(s, jinja));
        }
        let json = dir.join("chat_template.json");
        if json.exists()
            && let Some(s) = read_json(&json)?.get("chat_template").and_then(Value::as_str)
        {
            return Ok(with(s.to_string(), json));
        }
        match cfg.get("chat_template") {
            Some(Value::String(s)) => Ok(with(s.clone(), cfg_path)),
            Some(Value::Array(list)) => {
                let t = list
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                    .or(list.first())
                    .and_then(|t| t.get("template"))
                    .and_then(Value::as_str)
                    .ok_or_else(|| ServeError::Config {
                        path: cfg_path.clone(),
                        message: "`chat_template` list has no usable template".into(),
                    })?;
                Ok(with(t.to_string(), cfg_path))
            }
            Some(_) => Err(ServeError::Config {
                path: cfg_path,
                message: "`chat_template` is neither a string nor a list".into(),
            }),
            None => Ok(None),
        }
    }

    /// Renders `messages`, ending with the assistant's turn when `add_generation_prompt`.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ServeError> {
        let mut env = minijinja::Environment::new();
        // transformers renders with trim_blocks and lstrip_blocks, and Python string methods.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        let err = |e: minijinja::Error| ServeError::Template {
            origin: self.origin.clone(),
            message: format!("{e:#}"),
        };
        env.add_template("chat", &self.source).map_err(err)?;
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        };
        env.get_template("chat").and_then(|t| t.render(ctx)).map_err(err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(text: &str) -> ChatMessage {
        ChatMessage { role: "user".into(), content: text.into() }
    }

    #[test]
    fn renders_a_hf_style_template() {
        let t = ChatTemplate::new(
            "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}\
            [INST] {{ m['content'].strip() }} [/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}\
            {% endfor %}",
            "<s>",
            "</s>",
        );
        let msgs =
            [user("  hi "), ChatMessage { role: "assistant".into(), content: "yo".into() }, user("more")];
        assert_eq!(t.render(&msgs, true).unwrap(), "<s>[INST] hi [/INST]yo</s>[INST] more [/INST]");
    }

    #[test]
    fn raise_exception_is_an_error() {
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}", "", "");
        let e = t.render(&[user("x")], true).unwrap_err().to_string();
        assert!(e.contains("no system role"), "{e}");
    }

    #[test]
    fn dir_lookup_prefers_default_and_reports_none() {
        let dir = tempfile::tempdir().unwrap();
        assert!(ChatTemplate::from_dir(dir.path()).unwrap().is_none());
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"bos_token": {"content": "<s>"}, "chat_template": [
                {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ bos_token }}"}]}"#,
        )
        .unwrap();
        let t = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "D<s>");
        std::fs::write(dir.path().join("tokenizer_config.json"), "{not json").unwrap();
        let e = ChatTemplate::from_dir(dir.path()).unwrap_err().to_string();
        assert!(e.contains("tokenizer_config.json"), "{e}");
    }
}
