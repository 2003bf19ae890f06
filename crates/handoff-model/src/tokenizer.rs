//! Tokenizer built from a GGUF file's own vocabulary, merges and token types:
//! byte-level BPE with llama.cpp's pre-tokenizers and its
//! special-token splitting, so that ids match `llama-tokenize` exactly.
//!
//! Encoding: the text is first partitioned around special tokens the way
//! llama.cpp does it (longest special token first, every occurrence), then each
//! plain fragment goes through the `tokenizers` crate's BPE with the
//! pre-tokenizer named by `tokenizer.ggml.pre`. Decoding maps every token back
//! to its bytes (GPT-2 byte-to-unicode table), so a stream of tokens can be
//! turned into text incrementally with [`IncrementalDecoder`].

use std::collections::HashMap;

use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::SplitDelimiterBehavior;

mod spm;

/// Why a tokenizer could not be built or could not encode/decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizerError {
    /// A required GGUF metadata key is absent.
    #[error("GGUF metadata has no `{0}`: the file carries no usable tokenizer")]
    MissingKey(String),
    /// A GGUF metadata key has the wrong type or an invalid value.
    #[error("GGUF metadata `{key}` is invalid: {reason}")]
    InvalidMetadata {
        /// The key.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// `tokenizer.ggml.model` names a tokenizer family not implemented here.
    #[error("unsupported tokenizer model `{0}` (tokenizer.ggml.model): supported are byte-level BPE (`gpt2`) and SentencePiece (`llama`)")]
    UnsupportedModel(String),
    /// `tokenizer.ggml.pre` names a pre-tokenizer not implemented here.
    #[error("unsupported pre-tokenizer `{0}` (tokenizer.ggml.pre): supported are default, gpt2, smollm, starcoder, refact, command-r, codeshell, exaone, minerva, llama-bpe, llama3, qwen2")]
    UnsupportedPreTokenizer(String),
    /// A token id outside the vocabulary was given to the decoder.
    #[error("token id {id} is out of range for a vocabulary of {vocab_size}")]
    TokenOutOfRange {
        /// The id.
        id: u32,
        /// Vocabulary size.
        vocab_size: usize,
    },
    /// The BPE model failed (should not happen with a consistent vocabulary).
    #[error("tokenization failed: {0}")]
    Bpe(String),
}

impl TokenizerError {
    /// Stable label for metrics and error bodies.
    pub fn error_type(&self) -> &'static str {
        match self {
            TokenizerError::MissingKey(_)
            | TokenizerError::InvalidMetadata { .. }
            | TokenizerError::UnsupportedModel(_)
            | TokenizerError::UnsupportedPreTokenizer(_) => "unsupported_model",
            TokenizerError::TokenOutOfRange { .. } => "invalid_token_id",
            TokenizerError::Bpe(_) => "tokenizer_error",
        }
    }

    /// HTTP status a client should see for this error.
    pub fn http_status(&self) -> u16 {
        match self {
            TokenizerError::TokenOutOfRange { .. } => 400,
            _ => 500,
        }
    }
}

/// The GGUF token types (`tokenizer.ggml.token_type`), as llama.cpp defines them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenType {
    /// An ordinary vocabulary entry.
    Normal,
    /// The unknown token.
    Unknown,
    /// A control token such as `<|im_start|>`: split out of the text only when
    /// special-token parsing is on, rendered only when asked.
    Control,
    /// A user-defined token: always split out of the text and always rendered.
    UserDefined,
    /// An unused slot.
    Unused,
    /// A byte token (`<0x0A>`), used by SentencePiece vocabularies.
    Byte,
}

impl TokenType {
    fn from_gguf(v: i64) -> TokenType {
        match v {
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => TokenType::Normal,
        }
    }
}

/// Token texts of llama.cpp's end-of-generation list (`llama-vocab.cpp`,
/// the version `scripts/` builds): a token with one of these texts ends
/// generation like EOS does, whatever its type.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// llama.cpp's fill-in-the-middle markers, also end-of-generation: the
/// first token with a text of each list (pad, repo, file separator).
const FIM_EOG_TEXTS: &[&[&str]] = &[
    &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
    &[
        "<|fim_repo|>",
        "<|repo_name|>",
        "<fim-repo>",
        "<REPO>",
        "<reponame>",
    ],
    &["<|file_sep|>"],
];

/// Digits split individually, then the GPT-2 regex (llama.cpp's starcoder family).
const PRE_DIGITS_GPT2: &[&str] = &[
    "smollm",
    "starcoder",
    "refact",
    "command-r",
    "codeshell",
    "exaone",
    "minerva",
];

const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The subword algorithm named by `tokenizer.ggml.model`.
enum Backend {
    /// `gpt2`: byte-level BPE with a regex pre-tokenizer.
    Bpe(Box<tokenizers::Tokenizer>),
    /// `llama`: SentencePiece-style merges by score with byte fallback.
    Spm {
        model: Box<spm::Spm>,
        /// Prepend a space to text at the start and after special tokens.
        add_space_prefix: bool,
    },
}

/// A tokenizer read from a GGUF file: byte-level BPE (`gpt2`) or
/// SentencePiece (`llama`) vocabularies.
pub struct Tokenizer {
    backend: Backend,
    ids: HashMap<String, u32>,
    tokens: Vec<String>,
    token_bytes: Vec<Vec<u8>>,
    token_types: Vec<TokenType>,
    /// Tokens that the partition step splits out, longest text first.
    specials: Vec<u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    eog: Vec<u32>,
    add_bos: bool,
    /// Most text bytes one token stands for (its text or its bytes, the
    /// longer; at least 1).
    max_token_len: usize,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.tokens.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("add_bos", &self.add_bos)
            .finish_non_exhaustive()
    }
}

fn meta<'a>(content: &'a Content, key: &str) -> Result<&'a Value, TokenizerError> {
    content
        .metadata
        .get(key)
        .ok_or_else(|| TokenizerError::MissingKey(key.to_string()))
}

fn invalid(key: &str, reason: impl std::fmt::Display) -> TokenizerError {
    TokenizerError::InvalidMetadata {
        key: key.to_string(),
        reason: reason.to_string(),
    }
}

fn meta_string_array(content: &Content, key: &str) -> Result<Vec<String>, TokenizerError> {
    let arr = meta(content, key)?.to_vec().map_err(|e| invalid(key, e))?;
    arr.iter()
        .map(|v| v.to_string().cloned().map_err(|e| invalid(key, e)))
        .collect()
}

fn value_as_i64(v: &Value) -> Option<i64> {
    Some(match v {
        Value::U8(x) => i64::from(*x),
        Value::I8(x) => i64::from(*x),
        Value::U16(x) => i64::from(*x),
        Value::I16(x) => i64::from(*x),
        Value::U32(x) => i64::from(*x),
        Value::I32(x) => i64::from(*x),
        Value::U64(x) => i64::try_from(*x).ok()?,
        Value::I64(x) => *x,
        _ => return None,
    })
}

fn meta_token_id(
    content: &Content,
    key: &str,
    vocab_size: usize,
) -> Result<Option<u32>, TokenizerError> {
    let Some(v) = content.metadata.get(key) else {
        return Ok(None);
    };
    let id = value_as_i64(v).ok_or_else(|| invalid(key, "not an integer"))?;
    match u32::try_from(id) {
        Ok(id) if (id as usize) < vocab_size => Ok(Some(id)),
        _ => Err(invalid(
            key,
            format!("token id {id} is outside the vocabulary of {vocab_size}"),
        )),
    }
}

/// GPT-2's byte-to-unicode table: byte `b` is written as character `table[b]`
/// in byte-level BPE vocabularies (printable bytes map to themselves).
pub fn byte_to_unicode() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
        table[b as usize] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(256 + n).unwrap_or('\u{FFFD}');
            n += 1;
            c
        };
    }
    table
}

/// The byte-level BPE of a `gpt2` vocabulary with the pre-tokenizer named by
/// `tokenizer.ggml.pre`.
fn bpe_backend(
    content: &Content,
    tokens: &[String],
) -> Result<tokenizers::Tokenizer, TokenizerError> {
    let pre = match content.metadata.get("tokenizer.ggml.pre") {
        Some(v) => v
            .to_string()
            .map_err(|e| invalid("tokenizer.ggml.pre", e))?
            .clone(),
        None => "default".to_string(),
    };
    let (pre_tok, ignore_merges) = pre_tokenizer(&pre)?;
    let merges_raw = meta_string_array(content, "tokenizer.ggml.merges")?;
    let mut merges = Vec::with_capacity(merges_raw.len());
    for (i, m) in merges_raw.iter().enumerate() {
        let (a, b) = m.split_once(' ').ok_or_else(|| {
            invalid(
                "tokenizer.ggml.merges",
                format!("entry {i} `{m}` is not two tokens separated by a space"),
            )
        })?;
        merges.push((a.to_string(), b.to_string()));
    }
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let bpe_model = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(|e| TokenizerError::Bpe(e.to_string()))?;
    let mut bpe = tokenizers::Tokenizer::new(bpe_model);
    bpe.with_pre_tokenizer(Some(pre_tok));
    Ok(bpe)
}

fn pre_tokenizer(pre: &str) -> Result<(PreTokenizerWrapper, bool), TokenizerError> {
    let byte_level = |use_regex| ByteLevel::new(false, false, use_regex);
    let split = |re: &str| -> Result<PreTokenizerWrapper, TokenizerError> {
        Split::new(
            SplitPattern::Regex(re.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map(PreTokenizerWrapper::Split)
        .map_err(|e| TokenizerError::Bpe(e.to_string()))
    };
    Ok(match pre {
        "default" | "gpt2" | "gpt-2" => (PreTokenizerWrapper::ByteLevel(byte_level(true)), false),
        p if PRE_DIGITS_GPT2.contains(&p) => (
            PreTokenizerWrapper::Sequence(Sequence::new(vec![
                PreTokenizerWrapper::Digits(Digits::new(true)),
                PreTokenizerWrapper::ByteLevel(byte_level(true)),
            ])),
            false,
        ),
        "llama3" | "llama-bpe" => (
            PreTokenizerWrapper::Sequence(Sequence::new(vec![
                split(LLAMA3_REGEX)?,
                PreTokenizerWrapper::ByteLevel(byte_level(false)),
            ])),
            true,
        ),
        "qwen2" => (
            PreTokenizerWrapper::Sequence(Sequence::new(vec![
                split(QWEN2_REGEX)?,
                PreTokenizerWrapper::ByteLevel(byte_level(false)),
            ])),
            false,
        ),
        other => return Err(TokenizerError::UnsupportedPreTokenizer(other.to_string())),
    })
}

/// A piece of the input after special-token partitioning.
enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
}

impl Tokenizer {
    /// Build the tokenizer from a GGUF file's `tokenizer.ggml.*` metadata.
    pub fn from_gguf(content: &Content) -> Result<Tokenizer, TokenizerError> {
        Self::from_metadata(&content.metadata)
    }

    /// Build the tokenizer from GGUF metadata (the `metadata` map of a
    /// [`Content`]); used by tests that build metadata in memory.
    pub fn from_metadata(metadata: &HashMap<String, Value>) -> Result<Tokenizer, TokenizerError> {
        let content = Content {
            magic: candle_core::quantized::gguf_file::VersionedMagic::GgufV3,
            metadata: metadata.clone(),
            tensor_infos: HashMap::new(),
            tensor_data_offset: 0,
        };
        Self::build(&content)
    }

    fn build(content: &Content) -> Result<Tokenizer, TokenizerError> {
        let model_key = "tokenizer.ggml.model";
        let model = meta(content, model_key)?
            .to_string()
            .map_err(|e| invalid(model_key, e))?;
        let is_spm = match model.as_str() {
            "gpt2" => false,
            "llama" => true,
            other => return Err(TokenizerError::UnsupportedModel(other.to_string())),
        };
        let tokens = meta_string_array(content, "tokenizer.ggml.tokens")?;
        let vocab_size = tokens.len();
        let types_key = "tokenizer.ggml.token_type";
        let token_types: Vec<TokenType> = match content.metadata.get(types_key) {
            Some(v) => {
                let arr = v.to_vec().map_err(|e| invalid(types_key, e))?;
                if arr.len() != vocab_size {
                    return Err(invalid(
                        types_key,
                        format!("{} entries for {vocab_size} tokens", arr.len()),
                    ));
                }
                arr.iter()
                    .map(|v| {
                        value_as_i64(v)
                            .map(TokenType::from_gguf)
                            .ok_or_else(|| invalid(types_key, "not an integer array"))
                    })
                    .collect::<Result<_, _>>()?
            }
            None => vec![TokenType::Normal; vocab_size],
        };

        let backend = if is_spm {
            let scores_key = "tokenizer.ggml.scores";
            let scores: Vec<f32> = match content.metadata.get(scores_key) {
                Some(v) => v
                    .to_vec()
                    .map_err(|e| invalid(scores_key, e))?
                    .iter()
                    .map(|x| x.to_f32().map_err(|e| invalid(scores_key, e)))
                    .collect::<Result<_, _>>()?,
                None => vec![0.0; vocab_size],
            };
            let unk = meta_token_id(content, "tokenizer.ggml.unknown_token_id", vocab_size)?;
            let add_space_prefix = match content.metadata.get("tokenizer.ggml.add_space_prefix") {
                Some(v) => v
                    .to_bool()
                    .map_err(|e| invalid("tokenizer.ggml.add_space_prefix", e))?,
                None => true,
            };
            Backend::Spm {
                model: Box::new(spm::Spm::new(&tokens, scores, unk)),
                add_space_prefix,
            }
        } else {
            Backend::Bpe(Box::new(bpe_backend(content, &tokens)?))
        };

        let table = byte_to_unicode();
        let mut decode_map: HashMap<char, u8> = HashMap::with_capacity(256);
        for (b, c) in table.iter().enumerate() {
            decode_map.insert(*c, b as u8);
        }
        let token_bytes = tokens
            .iter()
            .zip(&token_types)
            .map(|(t, ty)| match ty {
                TokenType::Byte if is_spm => match spm::byte_of(t) {
                    Some(b) => vec![b],
                    None => t.as_bytes().to_vec(),
                },
                TokenType::Normal | TokenType::Unused | TokenType::UserDefined if is_spm => {
                    t.replace(spm::SPACE_MARK, " ").into_bytes()
                }
                TokenType::Normal | TokenType::Unused => {
                    let mut out = Vec::with_capacity(t.len());
                    for c in t.chars() {
                        match decode_map.get(&c) {
                            Some(b) => out.push(*b),
                            None => {
                                let mut buf = [0u8; 4];
                                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                            }
                        }
                    }
                    out
                }
                _ => t.as_bytes().to_vec(),
            })
            .collect();

        let mut specials: Vec<u32> = (0..vocab_size as u32)
            .filter(|&i| {
                matches!(
                    token_types[i as usize],
                    TokenType::Control | TokenType::UserDefined | TokenType::Unknown
                ) && !tokens[i as usize].is_empty()
            })
            .collect();
        specials.sort_by(|a, b| {
            tokens[*b as usize]
                .len()
                .cmp(&tokens[*a as usize].len())
                .then(a.cmp(b))
        });

        let bos = meta_token_id(content, "tokenizer.ggml.bos_token_id", vocab_size)?;
        let eos = meta_token_id(content, "tokenizer.ggml.eos_token_id", vocab_size)?;
        let add_bos = match content.metadata.get("tokenizer.ggml.add_bos_token") {
            Some(v) => v
                .to_bool()
                .map_err(|e| invalid("tokenizer.ggml.add_bos_token", e))?,
            // llama.cpp's defaults: SentencePiece vocabularies start with BOS.
            None => is_spm,
        };
        let mut eog: Vec<u32> = eos.into_iter().collect();
        for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            if let Some(id) = meta_token_id(content, key, vocab_size)? {
                eog.push(id);
            }
        }
        for (i, t) in tokens.iter().enumerate() {
            if EOG_TEXTS.contains(&t.as_str()) {
                eog.push(i as u32);
            }
        }
        for texts in FIM_EOG_TEXTS {
            if let Some(i) = tokens.iter().position(|t| texts.contains(&t.as_str())) {
                eog.push(i as u32);
            }
        }
        // o200k_harmony and solar-open: `<|end|>` ends a message, not the
        // generation, when `<|return|>` / `<|flush|>` and `<|call|>` exist.
        let has = |text: &str| tokens.iter().any(|t| t == text);
        if (has("<|return|>") || has("<|flush|>")) && (has("<|call|>") || has("<|calls|>")) {
            if let Some(end) = tokens.iter().position(|t| t == "<|end|>") {
                eog.retain(|&id| id != end as u32);
            }
        }
        eog.sort_unstable();
        eog.dedup();

        let mut ids = HashMap::with_capacity(vocab_size);
        for (i, t) in tokens.iter().enumerate() {
            ids.entry(t.clone()).or_insert(i as u32);
        }
        let max_token_len = tokens
            .iter()
            .zip(&token_bytes)
            .map(|(t, b): (&String, &Vec<u8>)| t.len().max(b.len()))
            .max()
            .unwrap_or(1)
            .max(1);
        Ok(Tokenizer {
            max_token_len,
            backend,
            ids,
            tokens,
            token_bytes,
            token_types,
            specials,
            bos,
            eos,
            eog,
            add_bos,
        })
    }

    /// Split `text` around special tokens as llama.cpp's
    /// `tokenizer_st_partition` does: for each special token, longest first,
    /// every occurrence in every remaining text fragment.
    ///
    /// Inside the `plain` byte ranges of `text`, only what parsing without
    /// special tokens would split out (user-defined tokens) is split out: a
    /// control token's text there stays text.
    fn partition<'a>(
        &self,
        text: &'a str,
        parse_special: bool,
        plain: &[std::ops::Range<usize>],
    ) -> Vec<Fragment<'a>> {
        let mut frags = vec![Fragment::Text(text)];
        for &id in &self.specials {
            let ty = self.token_types[id as usize];
            let always = ty == TokenType::UserDefined;
            if !parse_special && !always {
                continue;
            }
            let needle = self.tokens[id as usize].as_str();
            if !frags
                .iter()
                .any(|f| matches!(f, Fragment::Text(t) if t.contains(needle)))
            {
                continue;
            }
            let mut next = Vec::with_capacity(frags.len() + 2);
            for f in frags {
                match f {
                    Fragment::Token(_) => next.push(f),
                    Fragment::Text(t) => {
                        // Offset of this fragment in `text`.
                        let base = t.as_ptr() as usize - text.as_ptr() as usize;
                        let mut cut = 0;
                        for (pos, _) in t.match_indices(needle) {
                            let (start, end) = (base + pos, base + pos + needle.len());
                            if !always && plain.iter().any(|r| r.start < end && start < r.end) {
                                continue;
                            }
                            if pos > cut {
                                next.push(Fragment::Text(&t[cut..pos]));
                            }
                            next.push(Fragment::Token(id));
                            cut = pos + needle.len();
                        }
                        if cut < t.len() {
                            next.push(Fragment::Text(&t[cut..]));
                        }
                    }
                }
            }
            frags = next;
        }
        frags
    }

    /// Token ids of `text`, without BOS (prepend [`Tokenizer::bos_id`] yourself
    /// when [`Tokenizer::add_bos`] says so). With `parse_special`, control
    /// tokens written in the text (`<|im_start|>`) become their ids; without
    /// it they are tokenized as plain text.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        self.encode_marked(text, parse_special, &[])
    }

    /// [`Self::encode`], reading the `plain` byte ranges of `text` as plain
    /// text even with `parse_special`: a rendered chat prompt whose message
    /// contents are user text, where only the template's own markup may
    /// yield control tokens. Outside those ranges, and wherever a text holds
    /// no control token's spelling, the ids are those of [`Self::encode`].
    pub fn encode_marked(
        &self,
        text: &str,
        parse_special: bool,
        plain: &[std::ops::Range<usize>],
    ) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::new();
        // SentencePiece: a space is prepended at the start and after every special token.
        let mut prev_special = true;
        for frag in self.partition(text, parse_special, plain) {
            match frag {
                Fragment::Token(id) => {
                    ids.push(id);
                    prev_special = true;
                }
                Fragment::Text(t) => {
                    match &self.backend {
                        Backend::Bpe(bpe) => {
                            let enc = bpe
                                .encode_fast(t, false)
                                .map_err(|e| TokenizerError::Bpe(e.to_string()))?;
                            ids.extend_from_slice(enc.get_ids());
                        }
                        Backend::Spm {
                            model,
                            add_space_prefix,
                        } => {
                            let mut escaped = String::with_capacity(t.len() + 3);
                            if *add_space_prefix && prev_special {
                                escaped.push(spm::SPACE_MARK);
                            }
                            escaped.extend(t.chars().map(|c| {
                                if c == ' ' {
                                    spm::SPACE_MARK
                                } else {
                                    c
                                }
                            }));
                            model.tokenize(&escaped, &mut ids);
                        }
                    }
                    prev_special = false;
                }
            }
        }
        Ok(ids)
    }

    /// A lower bound on the tokens `text` encodes to, found without
    /// encoding it: no token stands for more than the longest token's text,
    /// so a text far beyond the context is refused before the tokenizer
    /// spends seconds on it.
    pub fn min_tokens(&self, text: &str) -> usize {
        text.len() / self.max_token_len
    }

    /// Most text bytes one token stands for (see [`Self::min_tokens`]).
    pub fn max_token_len(&self) -> usize {
        self.max_token_len
    }

    /// The bytes token `id` stands for. Control tokens yield their text; with
    /// `skip_special` they yield nothing.
    pub fn token_bytes(&self, id: u32, skip_special: bool) -> Result<&[u8], TokenizerError> {
        let bytes = self
            .token_bytes
            .get(id as usize)
            .ok_or(TokenizerError::TokenOutOfRange {
                id,
                vocab_size: self.tokens.len(),
            })?;
        if skip_special && self.is_special(id) {
            return Ok(&[]);
        }
        Ok(bytes)
    }

    /// Text of `ids`; invalid UTF-8 (a cut multi-byte character) becomes U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend_from_slice(self.token_bytes(id, skip_special)?);
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// A decoder for streaming: feed it one token at a time.
    pub fn incremental_decoder(&self, skip_special: bool) -> IncrementalDecoder<'_> {
        IncrementalDecoder {
            tokenizer: self,
            skip_special,
            pending: Vec::new(),
        }
    }

    /// Beginning-of-sequence token, if the GGUF names one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// End-of-sequence token, if the GGUF names one.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// Every token that ends generation: EOS, EOT/EOM if named, and control
    /// tokens on llama.cpp's end-of-generation list (`<|im_end|>`, `<|endoftext|>`, ...).
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }

    /// Whether prompts should start with BOS (`tokenizer.ggml.add_bos_token`).
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// The first control token (not a user-defined one) whose text `text`
    /// holds, if any.
    pub fn spelled_control_token(&self, text: &str) -> Option<&str> {
        self.specials
            .iter()
            .filter(|&&id| self.token_types[id as usize] != TokenType::UserDefined)
            .map(|&id| self.tokens[id as usize].as_str())
            .find(|t| !t.is_empty() && text.contains(t))
    }

    /// Whether `id` is a control token (skipped by `skip_special` decoding).
    pub fn is_special(&self, id: u32) -> bool {
        self.token_types.get(id as usize) == Some(&TokenType::Control)
    }

    /// The vocabulary entry of `id` as stored in the GGUF (byte-level form).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The byte-level BPE tokenizer as Hugging Face's `tokenizer.json`, for
    /// a client that must count tokens as the server does (lm-eval's
    /// `local-completions`): the same vocabulary, merges and pre-tokenizer,
    /// with the byte-level decoder. `None` for a SentencePiece vocabulary.
    pub fn hf_json(&self) -> Option<String> {
        match &self.backend {
            Backend::Bpe(bpe) => {
                let mut t = (**bpe).clone();
                t.with_decoder(Some(tokenizers::decoders::byte_level::ByteLevel::default()));
                t.to_string(false).ok()
            }
            Backend::Spm { .. } => None,
        }
    }

    /// The id whose vocabulary entry is exactly `text`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.ids.get(text).copied()
    }
}

/// Turns a stream of token ids into text, releasing only complete UTF-8.
/// Everything it returns, concatenated with [`IncrementalDecoder::finish`],
/// equals [`Tokenizer::decode`] of the same ids.
#[derive(Debug)]
pub struct IncrementalDecoder<'a> {
    tokenizer: &'a Tokenizer,
    skip_special: bool,
    pending: Vec<u8>,
}

impl IncrementalDecoder<'_> {
    /// Add one token; returns the text that became complete (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String, TokenizerError> {
        let bytes = self.tokenizer.token_bytes(id, self.skip_special)?;
        self.pending.extend_from_slice(bytes);
        Ok(take_complete_utf8(&mut self.pending))
    }

    /// Bytes held back because they do not yet form a complete character.
    pub fn pending_bytes(&self) -> &[u8] {
        &self.pending
    }

    /// Release whatever is held back (an incomplete character becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

/// Remove and return the longest prefix of `buf` that `String::from_utf8_lossy`
/// would render the same way whatever bytes follow: valid characters, and
/// invalid sequences as U+FFFD; an incomplete character at the end stays in `buf`.
pub fn take_complete_utf8(buf: &mut Vec<u8>) -> String {
    let mut out = String::new();
    let mut start = 0;
    loop {
        match std::str::from_utf8(&buf[start..]) {
            Ok(s) => {
                out.push_str(s);
                start = buf.len();
                break;
            }
            Err(e) => {
                let valid = e.valid_up_to();
                // The prefix up to `valid` is UTF-8 by the error's contract.
                out.push_str(&String::from_utf8_lossy(&buf[start..start + valid]));
                match e.error_len() {
                    Some(n) => {
                        out.push('\u{FFFD}');
                        start += valid + n;
                    }
                    None => {
                        start += valid;
                        break;
                    }
                }
            }
        }
    }
    buf.drain(..start);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tiny::tiny_vocab_metadata;

    fn tiny() -> Tokenizer {
        Tokenizer::from_metadata(&tiny_vocab_metadata()).expect("tiny tokenizer")
    }

    #[test]
    fn byte_table_is_a_bijection() {
        let t = byte_to_unicode();
        let mut seen = std::collections::HashSet::new();
        for c in t {
            assert!(seen.insert(c));
        }
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
    }

    #[test]
    fn tiny_vocab_merges_and_specials() {
        let tok = tiny();
        assert_eq!(tok.vocab_size(), 3 + 256 + 43);
        let ids = tok.encode("Hello the world", false).unwrap();
        let texts: Vec<&str> = ids.iter().map(|&i| tok.token_text(i).unwrap()).collect();
        assert_eq!(texts, ["Hello", "Ġthe", "Ġwor", "l", "d"]);
        // Control tokens are split out only with parse_special.
        let with = tok.encode("<|im_start|>user\n", true).unwrap();
        assert_eq!(with[0], 1);
        assert_eq!(tok.decode(&with, false).unwrap(), "<|im_start|>user\n");
        assert_eq!(tok.decode(&with, true).unwrap(), "user\n");
        let without = tok.encode("<|im_start|>user\n", false).unwrap();
        assert!(!without.contains(&1));
        assert_eq!(tok.decode(&without, false).unwrap(), "<|im_start|>user\n");
        assert_eq!(tok.bos_id(), Some(1));
        assert_eq!(tok.eos_id(), Some(2));
        assert_eq!(tok.eog_ids(), &[0, 2]);
        assert!(!tok.add_bos());
        assert!(tok.is_special(0) && !tok.is_special(3));
    }

    #[test]
    fn control_token_text_in_a_plain_range_stays_text() {
        use std::ops::Range;
        let tok = tiny();
        let text = "<|im_start|>user\nhi <|im_end|> there<|im_end|>\n";
        let content = 17..36; // "hi <|im_end|> there"
        assert_eq!(&text[content.clone()], "hi <|im_end|> there");
        let marked = tok
            .encode_marked(text, true, std::slice::from_ref(&content))
            .unwrap();
        // The template's two markers are tokens; the user's is text.
        assert_eq!(marked.iter().filter(|&&id| id == 1).count(), 1);
        assert_eq!(marked.iter().filter(|&&id| id == 2).count(), 1);
        assert_eq!(tok.decode(&marked, false).unwrap(), text);
        let mut want = tok.encode("<|im_start|>user\n", true).unwrap();
        let rest = tok.encode("hi <|im_end|> there", false).unwrap();
        assert!(
            marked.windows(rest.len()).any(|w| w == rest.as_slice()),
            "{marked:?}"
        );
        want.truncate(1);
        assert_eq!(marked[..1], want[..]);
        // Without ranges every spelling is a token, as before.
        let all = tok.encode(text, true).unwrap();
        assert_eq!(all.iter().filter(|&&id| id == 2).count(), 2);
        // A range holding no control token's text changes nothing.
        let plain_text = "<|im_start|>user\nhello<|im_end|>\n";
        assert_eq!(
            tok.encode_marked(plain_text, true, &[Range { start: 17, end: 22 }])
                .unwrap(),
            tok.encode(plain_text, true).unwrap()
        );
        // A spelling that only overlaps a range's edge is not a token either.
        let edge = tok
            .encode_marked(text, true, &[Range { start: 35, end: 37 }])
            .unwrap();
        assert_eq!(edge.iter().filter(|&&id| id == 2).count(), 1);
    }

    #[test]
    fn digits_are_split_individually() {
        let tok = tiny();
        let ids = tok.encode("a 123", false).unwrap();
        let texts: Vec<&str> = ids.iter().map(|&i| tok.token_text(i).unwrap()).collect();
        assert_eq!(texts, ["a", "Ġ", "1", "2", "3"]);
    }

    #[test]
    fn unsupported_model_is_named() {
        let mut m = tiny_vocab_metadata();
        m.insert("tokenizer.ggml.model".into(), Value::String("bert".into()));
        let err = Tokenizer::from_metadata(&m).unwrap_err();
        assert_eq!(err, TokenizerError::UnsupportedModel("bert".into()));
        assert!(err.to_string().contains("`bert`"));
        let mut m = tiny_vocab_metadata();
        m.insert("tokenizer.ggml.pre".into(), Value::String("martian".into()));
        let err = Tokenizer::from_metadata(&m).unwrap_err();
        assert!(err.to_string().contains("`martian`"), "{err}");
        let mut m = tiny_vocab_metadata();
        m.remove("tokenizer.ggml.tokens");
        let err = Tokenizer::from_metadata(&m).unwrap_err();
        assert_eq!(
            err,
            TokenizerError::MissingKey("tokenizer.ggml.tokens".into())
        );
    }

    /// A small SentencePiece (`llama`) vocabulary: control tokens, the 256
    /// byte tokens, and scored pieces.
    fn spm_metadata() -> HashMap<String, Value> {
        let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
        let mut types = vec![Value::I32(2), Value::I32(3), Value::I32(3)];
        let mut scores = vec![Value::F32(0.0); 3];
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(Value::I32(6));
            scores.push(Value::F32(0.0));
        }
        let pieces = [
            ("▁", -1.0),
            ("h", -2.0),
            ("e", -2.0),
            ("l", -2.0),
            ("o", -2.0),
            ("w", -2.0),
            ("r", -2.0),
            ("d", -2.0),
            ("▁h", -3.0),
            ("he", -4.0),
            ("ll", -3.5),
            ("llo", -3.6),
            ("▁he", -3.2),
            ("▁hello", -3.0),
            ("▁w", -3.0),
            ("or", -3.0),
            ("ld", -3.0),
            ("▁wor", -3.1),
            ("▁world", -2.9),
            ("▁hellollo", -1.0),
        ];
        for (p, sc) in pieces {
            tokens.push(p.into());
            types.push(Value::I32(1));
            scores.push(Value::F32(sc));
        }
        let mut m = HashMap::new();
        m.insert("tokenizer.ggml.model".into(), Value::String("llama".into()));
        m.insert(
            "tokenizer.ggml.tokens".into(),
            Value::Array(tokens.into_iter().map(Value::String).collect()),
        );
        m.insert("tokenizer.ggml.token_type".into(), Value::Array(types));
        m.insert("tokenizer.ggml.scores".into(), Value::Array(scores));
        m.insert("tokenizer.ggml.bos_token_id".into(), Value::U32(1));
        m.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(2));
        m.insert("tokenizer.ggml.unknown_token_id".into(), Value::U32(0));
        m
    }

    #[test]
    fn sentencepiece_vocab_merges_by_score_with_space_prefix() {
        let tok = Tokenizer::from_metadata(&spm_metadata()).unwrap();
        assert!(tok.add_bos(), "SentencePiece defaults to BOS");
        let pieces = |ids: &[u32]| -> Vec<String> {
            ids.iter()
                .map(|&i| tok.token_text(i).unwrap().to_string())
                .collect()
        };
        let ids = tok.encode("hello world", true).unwrap();
        assert_eq!(pieces(&ids), ["▁hello", "▁world"]);
        assert_eq!(tok.decode(&ids, false).unwrap(), " hello world");
        // After a special token the space prefix is added again, as llama.cpp does.
        let ids = tok.encode("<s>hello", true).unwrap();
        assert_eq!(pieces(&ids), ["<s>", "▁hello"]);
        // Characters outside the vocabulary fall back to byte tokens.
        let ids = tok.encode("hé", false).unwrap();
        assert_eq!(pieces(&ids), ["▁h", "<0xC3>", "<0xA9>"]);
        assert_eq!(tok.decode(&ids, false).unwrap(), " hé");
        let mut m = spm_metadata();
        m.insert("tokenizer.ggml.add_space_prefix".into(), Value::Bool(false));
        let tok = Tokenizer::from_metadata(&m).unwrap();
        let ids = tok.encode("hello", false).unwrap();
        assert_eq!(pieces(&ids), ["he", "llo"]);
    }

    #[test]
    fn out_of_range_id_is_an_error() {
        let tok = tiny();
        let err = tok.decode(&[1_000_000], false).unwrap_err();
        assert_eq!(
            err,
            TokenizerError::TokenOutOfRange {
                id: 1_000_000,
                vocab_size: tok.vocab_size()
            }
        );
        assert_eq!(err.http_status(), 400);
    }

    #[test]
    fn incremental_decoding_holds_back_partial_characters() {
        let tok = tiny();
        let ids = tok.encode("é€", false).unwrap();
        assert_eq!(ids.len(), 5); // 2 + 3 bytes, no merges
        let mut dec = tok.incremental_decoder(false);
        let parts: Vec<String> = ids.iter().map(|&i| dec.push(i).unwrap()).collect();
        assert_eq!(parts, ["", "é", "", "", "€"]);
        assert_eq!(dec.finish(), "");
    }

    #[test]
    fn take_complete_utf8_matches_lossy() {
        let mut b = vec![b'a', 0xFF, b'b', 0xE2, 0x82];
        assert_eq!(take_complete_utf8(&mut b), "a\u{FFFD}b");
        assert_eq!(b, [0xE2, 0x82]);
    }

    mod props {
        use super::*;
        use proptest::prelude::*;
        use std::sync::OnceLock;

        fn shared() -> &'static Tokenizer {
            static T: OnceLock<Tokenizer> = OnceLock::new();
            T.get_or_init(tiny)
        }

        fn spm_shared() -> &'static Tokenizer {
            static T: OnceLock<Tokenizer> = OnceLock::new();
            T.get_or_init(|| Tokenizer::from_metadata(&spm_metadata()).expect("spm"))
        }

        proptest! {
            #[test]
            fn sentencepiece_round_trip(s in "[a-z éß€\\n]{0,24}") {
                let tok = spm_shared();
                let ids = tok.encode(&s, false).unwrap();
                prop_assert_eq!(tok.decode(&ids, false).unwrap(), format!(" {s}"));
            }

            #[test]
            fn round_trip(s in any::<String>(), special in any::<bool>()) {
                let tok = shared();
                let ids = tok.encode(&s, special).unwrap();
                prop_assert_eq!(tok.decode(&ids, false).unwrap(), s);
            }

            #[test]
            fn round_trip_with_specials(parts in proptest::collection::vec(
                prop_oneof![
                    Just("<|im_start|>".to_string()),
                    Just("<|im_end|>".to_string()),
                    Just("<|endoftext|>".to_string()),
                    "[a-z <|>\\n0-9é]{0,12}",
                ], 0..8)) {
                let tok = shared();
                let s: String = parts.concat();
                for special in [true, false] {
                    let ids = tok.encode(&s, special).unwrap();
                    prop_assert_eq!(tok.decode(&ids, false).unwrap(), s.clone());
                    if !special {
                        prop_assert!(ids.iter().all(|&i| !tok.is_special(i)));
                    }
                }
            }

            #[test]
            fn min_tokens_is_a_lower_bound(parts in proptest::collection::vec(
                prop_oneof![
                    Just("<|im_start|>".to_string()),
                    Just("<|endoftext|>".to_string()),
                    "[a-z \n]{0,40}",
                    any::<String>(),
                ], 0..12)) {
                let s: String = parts.concat();
                for tok in [shared(), spm_shared()] {
                    for special in [true, false] {
                        let n = tok.encode(&s, special).unwrap().len();
                        prop_assert!(tok.min_tokens(&s) <= n, "{} > {n}", tok.min_tokens(&s));
                    }
                }
            }

            #[test]
            fn streaming_equals_one_shot(ids in proptest::collection::vec(0u32..302, 0..40), skip in any::<bool>()) {
                let tok = shared();
                let mut dec = tok.incremental_decoder(skip);
                let mut streamed = String::new();
                for &id in &ids {
                    streamed.push_str(&dec.push(id).unwrap());
                }
                streamed.push_str(&dec.finish());
                prop_assert_eq!(streamed, tok.decode(&ids, skip).unwrap());
            }
        }
    }
}
