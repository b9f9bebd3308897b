//! `lily tokenize` and `lily render`: what the tokenizer and the chat template make of an input, for when a
//! prompt misbehaves.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use lily_chat::{ChatTemplate, RenderRequest, Tokenizer};
use serde_json::Value as Json;

use crate::generate::{model_dir, ModelArgs};

#[derive(Args)]
pub struct TokenizeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The text to encode (with --decode: token ids, as a JSON list or separated by spaces or commas).
    /// Read from standard input when left out.
    text: Option<String>,
    /// Decode token ids to text instead.
    #[arg(long)]
    decode: bool,
    /// With --decode: leave special tokens (<|im_start|>, <think>, ...) out of the text.
    #[arg(long, requires = "decode")]
    skip_special: bool,
    /// Print each token's id and its vocabulary entry, one per line, instead of the JSON list of ids.
    #[arg(long, conflicts_with = "decode")]
    pieces: bool,
}

#[derive(Args)]
pub struct RenderArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// An OpenAI-style chat request body: {"messages": [...], "tools": [...], "chat_template_kwargs": {...}}
    /// (a bare list of messages is also accepted); "-" reads standard input.
    conversation: PathBuf,
    /// Render with thinking off (enable_thinking=false), overriding the body's chat_template_kwargs.
    #[arg(long, conflicts_with = "think")]
    no_think: bool,
    /// Render with thinking on (enable_thinking=true), overriding the body's chat_template_kwargs.
    #[arg(long)]
    think: bool,
    /// Leave out the assistant generation prompt (add_generation_prompt=false).
    #[arg(long)]
    no_generation_prompt: bool,
    /// Print the prompt's token ids (a JSON list) instead of its text.
    #[arg(long)]
    ids: bool,
}

fn read_input(text: Option<String>) -> Result<String> {
    match text {
        Some(text) => Ok(text),
        None => {
            let mut text = String::new();
            std::io::stdin()
                .read_to_string(&mut text)
                .context("reading standard input")?;
            Ok(text)
        }
    }
}

/// The ids as a JSON list with a space after each comma, e.g. `[760, 3841, 13]`.
fn ids_json(ids: &[u32]) -> String {
    let items: Vec<String> = ids.iter().map(u32::to_string).collect();
    format!("[{}]", items.join(", "))
}

/// Token ids given as a JSON list of integers, or as integers separated by whitespace and/or commas.
pub fn parse_ids(text: &str) -> Result<Vec<u32>> {
    let text = text.trim();
    if text.starts_with('[') {
        let value: Json = serde_json::from_str(text).context("token ids: not a valid JSON list")?;
        let Json::Array(items) = value else {
            bail!("token ids: expected a JSON list of integers")
        };
        return items
            .iter()
            .map(|item| {
                item.as_u64()
                    .and_then(|id| u32::try_from(id).ok())
                    .with_context(|| format!("token ids: {item} is not a token id (a non-negative integer)"))
            })
            .collect();
    }
    text.split(|c: char| c.is_whitespace() || c == ',')
        .filter(|item| !item.is_empty())
        .map(|item| {
            item.parse::<u32>()
                .with_context(|| format!("token ids: {item:?} is not a token id (a non-negative integer)"))
        })
        .collect()
}

pub fn run_tokenize(args: TokenizeArgs) -> Result<()> {
    let dir = model_dir(&args.model)?;
    let tokenizer = Tokenizer::from_dir(&dir)?;
    let input = read_input(args.text)?;
    let mut stdout = std::io::stdout().lock();
    if args.decode {
        let ids = parse_ids(&input)?;
        if let Some(&bad) = ids.iter().find(|&&id| tokenizer.id_to_token(id).is_none()) {
            bail!(
                "unknown token id {bad}: the vocabulary has {} tokens",
                tokenizer.vocab_size()
            );
        }
        let text = tokenizer.decode(&ids, args.skip_special)?;
        writeln!(stdout, "{text}")?;
        return Ok(());
    }
    let ids = tokenizer.encode(&input, false)?;
    if args.pieces {
        for id in ids {
            let piece = tokenizer.id_to_token(id).unwrap_or_default();
            let text = tokenizer.decode(&[id], false)?;
            writeln!(stdout, "{id}\t{}\t{}", Json::String(piece), Json::String(text))?;
        }
    } else {
        writeln!(stdout, "{}", ids_json(&ids))?;
    }
    Ok(())
}

/// Reads an OpenAI-style chat request body into a render request (messages, tools, chat_template_kwargs,
/// add_generation_prompt).
pub fn request_from_body(body: Json) -> Result<RenderRequest> {
    let mut request = RenderRequest {
        add_generation_prompt: true,
        ..Default::default()
    };
    let mut body = match body {
        Json::Array(messages) => {
            request.messages = messages;
            return Ok(request);
        }
        Json::Object(body) => body,
        _ => bail!("expected a JSON object with a \"messages\" list"),
    };
    request.messages = match body.remove("messages") {
        Some(Json::Array(messages)) => messages,
        Some(_) => bail!("\"messages\" must be a list"),
        None => bail!("no \"messages\" list"),
    };
    request.tools = match body.remove("tools") {
        None | Some(Json::Null) => None,
        Some(Json::Array(tools)) => Some(tools),
        Some(_) => bail!("\"tools\" must be a list"),
    };
    match body.remove("chat_template_kwargs") {
        None | Some(Json::Null) => {}
        Some(Json::Object(kwargs)) => request.kwargs = kwargs,
        Some(_) => bail!("\"chat_template_kwargs\" must be an object"),
    }
    match body.remove("add_generation_prompt") {
        None | Some(Json::Null) => {}
        Some(Json::Bool(add)) => request.add_generation_prompt = add,
        Some(_) => bail!("\"add_generation_prompt\" must be true or false"),
    }
    Ok(request)
}

fn read_conversation(path: &Path) -> Result<Json> {
    let text = if path.as_os_str() == "-" {
        read_input(None)?
    } else {
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?
    };
    let name = if path.as_os_str() == "-" {
        "standard input".to_string()
    } else {
        path.display().to_string()
    };
    serde_json::from_str(&text).with_context(|| format!("{name} is not valid JSON"))
}

pub fn run_render(args: RenderArgs) -> Result<()> {
    let dir = model_dir(&args.model)?;
    let body = read_conversation(&args.conversation)?;
    let mut request =
        request_from_body(body).with_context(|| format!("{} is not a chat request", args.conversation.display()))?;
    if let Some(thinking) = crate::chat::thinking_flag(args.think, args.no_think) {
        request.kwargs.insert("enable_thinking".into(), Json::Bool(thinking));
    }
    if args.no_generation_prompt {
        request.add_generation_prompt = false;
    }
    let template = ChatTemplate::from_dir(&dir)?;
    let prompt = template.render(&request)?;
    let mut stdout = std::io::stdout().lock();
    if args.ids {
        let tokenizer = Tokenizer::from_dir(&dir)?;
        writeln!(stdout, "{}", ids_json(&tokenizer.encode(&prompt, false)?))?;
    } else {
        write!(stdout, "{prompt}")?;
    }
    stdout.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_in_any_separator() {
        assert_eq!(parse_ids("[1, 2,3]").unwrap(), [1, 2, 3]);
        assert_eq!(parse_ids(" 1 2,3 ,, 4\n").unwrap(), [1, 2, 3, 4]);
        assert!(parse_ids("[1, -2]").is_err());
        assert!(parse_ids("[1, \"a\"]").is_err());
        assert!(parse_ids("1 x").is_err());
        assert!(parse_ids("{}").is_err());
        assert_eq!(ids_json(&[760, 3841]), "[760, 3841]");
    }

    #[test]
    fn bodies() {
        let body = serde_json::json!({
            "model": "x",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": null,
            "chat_template_kwargs": {"enable_thinking": false}
        });
        let request = request_from_body(body).unwrap();
        assert_eq!(request.messages.len(), 1);
        assert!(request.tools.is_none());
        assert_eq!(request.kwargs.get("enable_thinking"), Some(&Json::Bool(false)));
        assert!(request.add_generation_prompt);
        assert!(request_from_body(serde_json::json!({"messages": {}})).is_err());
        assert!(request_from_body(serde_json::json!({"messages": [], "tools": 1})).is_err());
        assert!(request_from_body(serde_json::json!("hi")).is_err());
    }
}
