//! Structured output: a request's grammar, compiled by
//! `llguidance` (the constrained-decoding library vLLM and SGLang use), masks
//! the tokens the sampler may pick at every step, so the output always
//! matches a JSON schema, a regular expression or a grammar.
//!
//! One [`Grammars`] per tokenizer builds llguidance's token trie once (on
//! first use: a worker that never sees a constrained request never pays for
//! it) and compiles each request's [`GrammarSpec`] into a [`Grammar`]: a
//! matcher that yields the allowed-token mask for the next position and
//! takes each token appended. Compiling happens where the request is
//! prepared (off the engine thread); an invalid schema or grammar is an
//! error there, before anything is queued.
//!
//! In PD both workers compile the same spec from the same request: the
//! prefill masks the first token with a fresh matcher, decode feeds its
//! matcher that first token and masks every later one.

use std::sync::{Arc, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{self, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};

use handoff_model::tokenizer::Tokenizer;

/// What a request's output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object (OpenAI `response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid under this JSON schema.
    JsonSchema(serde_json::Value),
    /// Text matching this regular expression, whole.
    Regex(String),
    /// Text in the language of this grammar: Lark syntax as llguidance
    /// reads it, or GBNF (`rule ::= ...`, as SGLang's `ebnf` and
    /// llama.cpp take), translated to Lark first.
    Grammar(String),
    /// Exactly one of these strings (vLLM's `guided_choice`).
    Choice(Vec<String>),
    /// A grammar in llguidance's Lark as is (built by handoff, e.g. for
    /// tool calls: never read as GBNF).
    Lark(String),
}

/// Why a spec could not be compiled, or a matcher failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct GrammarError(pub String);

/// The JSON layout a schema's output takes: compact separators with one
/// space, no free whitespace. llguidance's default lets whitespace go
/// anywhere, and a small model then fills `max_tokens` with newlines
/// inside an unfinished object (vLLM turns free whitespace off the same way,
/// `disable_any_whitespace`).
fn json_layout() -> serde_json::Value {
    serde_json::json!({
        "whitespace_flexible": false,
        "item_separator": ", ",
        "key_separator": ": ",
    })
}

impl GrammarSpec {
    fn top_level(&self) -> Result<TopLevelGrammar, GrammarError> {
        Ok(match self {
            GrammarSpec::JsonObject => TopLevelGrammar::from_json_schema(serde_json::json!({
                "type": "object",
                "x-guidance": json_layout(),
            })),
            GrammarSpec::JsonSchema(schema) => {
                let mut schema = schema.clone();
                match &mut schema {
                    serde_json::Value::Object(o) => {
                        o.entry("x-guidance").or_insert_with(json_layout);
                    }
                    serde_json::Value::Bool(_) => {}
                    _ => {
                        return Err(GrammarError(
                            "a JSON schema must be an object or a boolean".into(),
                        ))
                    }
                }
                TopLevelGrammar::from_json_schema(schema)
            }
            GrammarSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            GrammarSpec::Grammar(g) => TopLevelGrammar::from_lark(lark_of(g)?),
            GrammarSpec::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
            GrammarSpec::Choice(choices) => {
                if choices.is_empty() {
                    return Err(GrammarError("a choice needs at least one string".into()));
                }
                let alternatives: Vec<String> = choices.iter().map(|c| lark_string(c)).collect();
                TopLevelGrammar::from_lark(format!("start: {}", alternatives.join(" | ")))
            }
        })
    }
}

/// `s` as a Lark string literal.
fn lark_string(s: &str) -> String {
    // A JSON string literal is a Lark one (same escapes).
    serde_json::Value::String(s.to_string()).to_string()
}

/// `g` in llguidance's Lark: GBNF (it defines rules with `::=`) is
/// translated, anything else is taken as Lark already.
fn lark_of(g: &str) -> Result<String, GrammarError> {
    if g.trim().is_empty() {
        return Err(GrammarError("the grammar is empty".into()));
    }
    if g.contains("::=") {
        crate::gbnf::to_lark(g).map_err(GrammarError)
    } else {
        Ok(g.to_string())
    }
}

/// llguidance's view of handoff's tokenizer.
struct TokEnv {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for TokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<toktrie::TokenId> {
        // The model's own tokenization for text; bytes that are not UTF-8
        // have none, and get the trie's greedy one.
        match std::str::from_utf8(s).map(|t| self.tokenizer.encode(t, false)) {
            Ok(Ok(ids)) => ids,
            _ => self.trie.greedy_tokenize(s),
        }
    }
}

/// Compiles grammars for one tokenizer.
pub struct Grammars {
    tokenizer: Arc<Tokenizer>,
    factory: OnceLock<Result<ParserFactory, GrammarError>>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("ready", &self.factory.get().is_some())
            .finish()
    }
}

impl Grammars {
    /// Grammars over `tokenizer`'s vocabulary (nothing is built until the
    /// first compile).
    pub fn new(tokenizer: Arc<Tokenizer>) -> Self {
        Self {
            tokenizer,
            factory: OnceLock::new(),
        }
    }

    fn factory(&self) -> Result<&ParserFactory, GrammarError> {
        self.factory
            .get_or_init(|| build_factory(&self.tokenizer))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Compile `spec`: an error names what is wrong with it.
    pub fn compile(&self, spec: GrammarSpec) -> Result<Grammar, GrammarError> {
        let factory = self.factory()?;
        let parser = factory
            .create_parser(spec.top_level()?)
            .map_err(|e| GrammarError(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError(e));
        }
        Ok(Grammar {
            spec: Arc::new(spec),
            matcher,
            eos: factory.tok_env().tok_trie().eos_token(),
            extra_eos: self.tokenizer.eog_ids().to_vec(),
        })
    }
}

fn build_factory(tokenizer: &Arc<Tokenizer>) -> Result<ParserFactory, GrammarError> {
    let n = tokenizer.vocab_size();
    let eos = tokenizer
        .eos_id()
        .or_else(|| tokenizer.eog_ids().first().copied())
        .ok_or_else(|| {
            GrammarError("the model names no end-of-sequence token: no grammar can end".into())
        })?;
    // Control tokens are spelled with llguidance's marker byte first, so
    // no text ever matches them.
    let words: Vec<Vec<u8>> = (0..n as u32)
        .map(|id| {
            let bytes = tokenizer.token_bytes(id, false).unwrap_or_default();
            if tokenizer.is_special(id) {
                let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                w.extend_from_slice(bytes);
                w
            } else {
                bytes.to_vec()
            }
        })
        .collect();
    let info = TokRxInfo::new(n as u32, eos);
    let trie = TokTrie::from(&info, &words);
    let env: toktrie::TokEnv = Arc::new(TokEnv {
        trie,
        tokenizer: tokenizer.clone(),
    });
    let mut factory = ParserFactory::new_simple(&env).map_err(|e| GrammarError(e.to_string()))?;
    factory.quiet();
    Ok(factory)
}

/// A request's compiled grammar and where its output stands in it.
pub struct Grammar {
    spec: Arc<GrammarSpec>,
    matcher: Matcher,
    /// The end-of-sequence token the matcher's mask carries.
    eos: u32,
    /// Every end-of-generation token: allowed wherever the grammar allows
    /// its end-of-sequence token.
    extra_eos: Vec<u32>,
}

impl Clone for Grammar {
    fn clone(&self) -> Self {
        Self {
            spec: self.spec.clone(),
            matcher: self.matcher.deep_clone(),
            eos: self.eos,
            extra_eos: self.extra_eos.clone(),
        }
    }
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar").field("spec", &self.spec).finish()
    }
}

/// Two grammars are equal when they were compiled from the same spec.
impl PartialEq for Grammar {
    fn eq(&self, other: &Self) -> bool {
        self.spec == other.spec
    }
}

/// The tokens allowed at a position: a bit per token id.
#[derive(Debug, Clone)]
pub struct Allowed(toktrie::SimpleVob);

impl Allowed {
    /// Whether token `id` may come next.
    pub fn contains(&self, id: u32) -> bool {
        (id as usize) < self.0.len() && self.0.is_allowed(id)
    }

    /// The mask's words (bit `i % 32` of word `i / 32` is token `i`).
    pub fn words(&self) -> &[u32] {
        self.0.as_slice()
    }
}

impl Grammar {
    /// What the output must match.
    pub fn spec(&self) -> &GrammarSpec {
        &self.spec
    }

    /// The tokens that may come next: those that keep the output a prefix
    /// of the language, and the end-of-generation tokens once it is a whole
    /// sentence of it.
    pub fn allowed(&mut self) -> Result<Allowed, GrammarError> {
        let mut m = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| GrammarError(format!("the grammar failed: {e}")))?;
        if m.is_allowed(self.eos) {
            for &id in &self.extra_eos {
                if (id as usize) < m.len() {
                    m.allow_token(id);
                }
            }
        }
        Ok(Allowed(m))
    }

    /// Append token `id` to the output. An end-of-generation token ends it
    /// (it is not fed to the matcher).
    pub fn accept(&mut self, id: u32) -> Result<(), GrammarError> {
        if self.extra_eos.contains(&id) {
            return Ok(());
        }
        self.matcher
            .consume_token(id)
            .map_err(|e| GrammarError(format!("token {id} does not fit the grammar: {e}")))
    }

    /// Whether the output is a whole sentence and nothing may follow it.
    pub fn finished(&self) -> bool {
        self.matcher.is_stopped() && self.matcher.get_error().is_none()
    }
}
