//! Constrained decoding for lily: the output of a sequence is held to a JSON schema, to any JSON object, to a tool
//! call in the XML form the chat template teaches, to a regular expression, to one of a list of strings, to a
//! Lark grammar, or to tool calls or else an answer held to one of the others. The `llguidance` library compiles the constraint and computes, before each token, the set of tokens
//! that keep the output inside it (the token mask); the sampler then draws only from that set.
//!
//! The token trie that llguidance walks is built once per model from the model's own tokenizer ([`StructuredEnv`]);
//! a constraint is compiled once per request ([`Grammar`], where a bad schema is reported before any generation)
//! and each sequence steps its own copy ([`Constraint`]).
//!
//! Reasoning: when the prompt opens a think block, the reasoning is free text and the constraint starts after the
//! `</think>` token; the end-of-turn tokens are refused until then, so that a reply cannot end unconstrained. Right
//! after `</think>` one newline token may come first, the layout the chat template writes there (`</think>\n\n`),
//! which the output parser drops.

mod tool_grammar;

use std::sync::Arc;

use lily_chat::{token_bytes::token_bytes, Tokenizer};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value as Json};

#[derive(Debug, thiserror::Error)]
pub enum ConstraintError {
    /// The request's constraint cannot be compiled (a bad schema, regex or grammar, or an unsupported feature).
    #[error("{0}")]
    Invalid(String),
    /// The model's tokenizer cannot be turned into a token trie.
    #[error("cannot set up constrained decoding for this tokenizer: {0}")]
    Setup(String),
    /// The constraint failed while generating (a token it did not allow, or an internal limit).
    #[error("constrained decoding failed: {0}")]
    Step(String),
}

/// What the output must be.
#[derive(Debug, Clone, PartialEq)]
pub enum ConstraintSpec {
    /// JSON that the schema accepts.
    JsonSchema(Json),
    /// Any JSON object.
    JsonObject,
    /// One or more tool calls (`at_most_one`: exactly one) to the given tools, OpenAI's `tools` entries, with
    /// arguments their `parameters` schemas accept.
    ToolCalls { tools: Vec<Json>, at_most_one: bool },
    /// Text that the regular expression (Rust `regex` syntax) matches in full.
    Regex(String),
    /// Exactly one of the strings.
    Choice(Vec<String>),
    /// Text of a grammar in llguidance's Lark syntax.
    Lark(String),
    /// One or more tool calls as in `ToolCalls`, or else an answer held to `answer` (any constraint but this one):
    /// a reply that may call tools but must otherwise follow the request's `response_format`.
    ToolCallsOr {
        tools: Vec<Json>,
        at_most_one: bool,
        answer: Box<ConstraintSpec>,
    },
}

/// The JSON layout the constraint asks for: no free whitespace (a small model given free whitespace can emit it
/// forever), and `", "` and `": "` between items, as Python's `json.dumps` writes them.
fn json_layout() -> Json {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// Adds the JSON layout to a schema that does not choose its own (through llguidance's `x-guidance` key).
fn with_layout(mut schema: Json) -> Json {
    if let Some(object) = schema.as_object_mut() {
        object.entry("x-guidance").or_insert_with(json_layout);
    }
    schema
}

/// The llguidance grammars of a constraint, the start grammar first.
fn top_level(spec: &ConstraintSpec) -> Result<TopLevelGrammar, ConstraintError> {
    Ok(match spec {
        ConstraintSpec::JsonSchema(schema) => TopLevelGrammar::from_json_schema(with_layout(schema.clone())),
        ConstraintSpec::JsonObject => TopLevelGrammar::from_json_schema(with_layout(json!({"type": "object"}))),
        ConstraintSpec::ToolCalls { tools, at_most_one } => {
            TopLevelGrammar::from_lark(tool_grammar::lark(tools, *at_most_one, "start")?)
        }
        ConstraintSpec::Regex(regex) => TopLevelGrammar::from_regex(regex),
        ConstraintSpec::Choice(choices) => {
            if choices.is_empty() {
                return Err(ConstraintError::Invalid("the list of choices is empty".into()));
            }
            let alternatives: Vec<String> = choices.iter().map(|c| tool_grammar::literal(c)).collect();
            TopLevelGrammar::from_lark(format!("start: {}", alternatives.join(" | ")))
        }
        ConstraintSpec::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
        ConstraintSpec::ToolCallsOr {
            tools,
            at_most_one,
            answer,
        } => {
            if matches!(**answer, ConstraintSpec::ToolCallsOr { .. }) {
                return Err(ConstraintError::Invalid(
                    "an answer that may call tools cannot itself be one".into(),
                ));
            }
            // The answer keeps its own grammar (and lexer), which the start grammar names as `@answer`.
            let mut answer = top_level(answer)?;
            answer.grammars[0].name = Some(ANSWER_GRAMMAR.to_string());
            let calls = tool_grammar::lark(tools, *at_most_one, "tool_calls")?;
            let start = format!("start: tool_calls | @{ANSWER_GRAMMAR}\n{calls}");
            // The start grammar is left unnamed, so that a user's Lark answer can name neither it nor itself.
            let mut start = llguidance::api::GrammarWithLexer::from_lark(start);
            start.name = None;
            let mut grammars = vec![start];
            grammars.append(&mut answer.grammars);
            TopLevelGrammar {
                grammars,
                max_tokens: None,
            }
        }
    })
}

/// The name under which a `ToolCallsOr` constraint's start grammar refers to the answer's grammar.
const ANSWER_GRAMMAR: &str = "lily_tool_calls_or_answer";

/// The model's tokenizer as llguidance sees it: every token id of the model's vocabulary with its bytes.
struct LilyTokenizerEnv {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for LilyTokenizerEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie
            .tokenize_with_greedy_fallback(s, |text| self.tokenizer.encode(text, false).unwrap_or_default())
    }
}

/// Per model: the token trie and llguidance's parser factory. Building it walks the whole vocabulary, so the server
/// builds it once, when the model loads.
pub struct StructuredEnv {
    factory: ParserFactory,
    think_end: u32,
    /// The tokens made of newlines only (`\n`, `\n\n`): the layout allowed after `</think>`.
    layout: Vec<u32>,
    eos: Vec<u32>,
    vocab_size: usize,
}

impl std::fmt::Debug for StructuredEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StructuredEnv")
            .field("vocab_size", &self.vocab_size)
            .finish()
    }
}

impl StructuredEnv {
    /// `vocab_size` is the model's (the length of its logits), which may be larger than the tokenizer's: the ids
    /// past the tokenizer's last are placeholders that no constraint allows.
    pub fn new(tokenizer: Arc<Tokenizer>, vocab_size: usize) -> Result<StructuredEnv, ConstraintError> {
        let known = tokenizer.vocab_size();
        if vocab_size < known {
            return Err(ConstraintError::Setup(format!(
                "the model's vocabulary ({vocab_size}) is smaller than the tokenizer's ({known})"
            )));
        }
        let placeholder = |id: usize| {
            let mut name = format!(".<[{id}]>").into_bytes();
            name[0] = TokTrie::SPECIAL_TOKEN_MARKER;
            name
        };
        let words: Vec<Vec<u8>> = (0..vocab_size)
            .map(|id| {
                let id32 = id as u32;
                if id >= known || tokenizer.id_to_token(id32).is_none() {
                    placeholder(id)
                } else if tokenizer.is_special(id32) {
                    // Special tokens are marked, so that only a grammar that names one (`<tool_call>`) allows it.
                    let mut bytes = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    bytes.extend(token_bytes(&tokenizer, id32));
                    bytes
                } else {
                    token_bytes(&tokenizer, id32)
                }
            })
            .collect();
        let special = *tokenizer.special();
        let eos = special.eos_ids();
        let mut info = TokRxInfo::new(vocab_size as u32, special.im_end);
        info.tok_end_of_turn = Some(special.im_end);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
        let layout = ["\n", "\n\n"]
            .iter()
            .filter_map(|text| match tokenizer.encode(text, false).as_deref() {
                Ok([id]) => Some(*id),
                _ => None,
            })
            .collect();
        let env: TokEnv = Arc::new(LilyTokenizerEnv { trie, tokenizer });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| ConstraintError::Setup(e.to_string()))?;
        factory.quiet();
        Ok(StructuredEnv {
            factory,
            think_end: special.think_end,
            layout,
            eos,
            vocab_size,
        })
    }

    /// Compiles a constraint; errors name what is wrong with it.
    pub fn compile(&self, spec: &ConstraintSpec) -> Result<Grammar, ConstraintError> {
        let grammar = top_level(spec)?;
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| ConstraintError::Invalid(e.to_string()))?;
        let mut matcher = Matcher::new(Ok(parser));
        // The first mask is computed here, so that a grammar that cannot start fails now rather than mid-request.
        if let Err(e) = matcher.compute_mask() {
            return Err(ConstraintError::Invalid(e.to_string()));
        }
        Ok(Grammar {
            matcher,
            think_end: self.think_end,
            layout: self.layout.clone(),
            eos: self.eos.clone(),
            vocab_size: self.vocab_size,
        })
    }
}

/// A compiled constraint, ready to start sequences from.
#[derive(Clone)]
pub struct Grammar {
    matcher: Matcher,
    think_end: u32,
    layout: Vec<u32>,
    eos: Vec<u32>,
    vocab_size: usize,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar").finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Inside the think block: free text, but no end of turn.
    Reasoning,
    /// Right after `</think>`: the constraint holds, and one newline token may come first.
    Layout,
    /// The constraint holds.
    Constrained,
    /// The grammar has accepted its end-of-sequence token; nothing is constrained any more.
    Done,
}

/// One sequence's walk through a [`Grammar`].
pub struct Constraint {
    matcher: Matcher,
    phase: Phase,
    think_end: u32,
    layout: Vec<u32>,
    eos: Vec<u32>,
    /// The allowed tokens as a bitmask: bit `t % 32` of word `t / 32` for token `t`.
    mask: Vec<u32>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("phase", &self.phase)
            .finish_non_exhaustive()
    }
}

impl Constraint {
    /// `in_reasoning`: the prompt opened a think block, so the constraint starts after `</think>`.
    pub fn new(grammar: &Grammar, in_reasoning: bool) -> Constraint {
        let words = grammar.vocab_size.div_ceil(32);
        Constraint {
            matcher: grammar.matcher.clone(),
            phase: if in_reasoning {
                Phase::Reasoning
            } else {
                Phase::Constrained
            },
            think_end: grammar.think_end,
            layout: grammar.layout.clone(),
            eos: grammar.eos.clone(),
            mask: vec![0; words],
        }
    }

    /// The tokens allowed next, as a bitmask (bit `t % 32` of word `t / 32` allows token `t`); `None` when every
    /// token is allowed.
    pub fn mask(&mut self) -> Result<Option<&[u32]>, ConstraintError> {
        match self.phase {
            Phase::Done => Ok(None),
            Phase::Reasoning => {
                self.mask.fill(u32::MAX);
                for &token in &self.eos {
                    self.mask[token as usize / 32] &= !(1 << (token % 32));
                }
                Ok(Some(&self.mask))
            }
            Phase::Layout | Phase::Constrained => {
                let allowed = self
                    .matcher
                    .compute_mask_or_eos()
                    .map_err(|e| ConstraintError::Step(e.to_string()))?;
                if allowed.is_zero() {
                    return Err(ConstraintError::Step("the constraint allows no token here".into()));
                }
                let words = allowed.as_slice();
                let n = words.len().min(self.mask.len());
                self.mask[..n].copy_from_slice(&words[..n]);
                self.mask[n..].fill(0);
                if self.phase == Phase::Layout {
                    for &token in &self.layout {
                        self.mask[token as usize / 32] |= 1 << (token % 32);
                    }
                }
                Ok(Some(&self.mask))
            }
        }
    }

    /// Advances past the token the sampler drew.
    pub fn consume(&mut self, token: u32) -> Result<(), ConstraintError> {
        let phase = self.phase;
        match phase {
            Phase::Done => {}
            Phase::Reasoning => {
                if token == self.think_end {
                    self.phase = Phase::Layout;
                }
            }
            Phase::Layout if self.layout.contains(&token) && !self.matcher_allows(token) => {
                self.phase = Phase::Constrained;
            }
            Phase::Layout | Phase::Constrained => {
                self.phase = Phase::Constrained;
                if self.eos.contains(&token) && self.matcher.is_accepting().unwrap_or(false) {
                    self.phase = Phase::Done;
                    return Ok(());
                }
                // A grammar that is complete stops its matcher; its mask is then the end-of-turn tokens alone.
                self.matcher
                    .consume_token(token)
                    .map_err(|e| ConstraintError::Step(e.to_string()))?;
            }
        }
        Ok(())
    }

    /// Whether the grammar itself allows `token` now (a newline may be JSON whitespace or part of a regex).
    fn matcher_allows(&mut self, token: u32) -> bool {
        self.matcher
            .compute_mask()
            .map(|mask| mask.is_allowed(token))
            .unwrap_or(false)
    }

    /// True once the output is complete under the constraint (the grammar accepted its end).
    pub fn is_done(&self) -> bool {
        self.phase == Phase::Done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_types_can_cross_threads() {
        fn send_sync<T: Send + Sync>() {}
        fn send<T: Send>() {}
        send_sync::<StructuredEnv>();
        send::<Grammar>();
        send::<Constraint>();
    }
}
