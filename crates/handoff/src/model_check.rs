//! The model file is checked before any worker starts: a file handoff
//! cannot serve as its authors meant it (an architecture, tensor, metadata
//! key or tokenizer it does not implement) is refused in one line naming
//! what, with its own exit status, rather than after "starting the engine"
//! as a "model execution failed".

use std::path::Path;

use candle_core::quantized::gguf_file::Content;
use handoff_model::ModelError;

/// Exit status of a command refused because of its model file.
pub const EXIT_UNSUPPORTED_MODEL: u8 = 3;

/// A model file handoff refuses to serve; the message names the file and
/// what is unsupported.
#[derive(Debug, thiserror::Error)]
#[error("cannot serve {path}: {reason}")]
pub struct UnsupportedModel {
    path: String,
    reason: String,
}

/// What the check learned of a model file that planning needs.
#[derive(Debug, Clone)]
pub struct CheckedModel {
    /// Its hyper-parameters.
    pub config: handoff_model::LlamaConfig,
    /// The file's header, for estimates that depend on flags.
    pub header: std::sync::Arc<Content>,
}

impl CheckedModel {
    /// About how many bytes of weights a worker holds, and how many it
    /// maps from the file, once it loads this model in `formats`
    /// ([`handoff_model::estimate_weights`]); `cached`: its Q8_0 copies
    /// are mapped from the weight cache.
    pub fn weights(
        &self,
        formats: handoff_model::PhaseFormats,
        cached: bool,
    ) -> handoff_model::WeightEstimate {
        handoff_model::estimate_weights(&self.config, &self.header, formats, cached)
    }
}

/// Read the GGUF header of `path` and check that handoff implements all of
/// it (architecture, metadata keys, tensors, tokenizer, chat template)
/// without loading a weight.
pub fn check(path: &Path) -> anyhow::Result<CheckedModel> {
    let refuse = |reason: String| UnsupportedModel {
        path: path.display().to_string(),
        reason,
    };
    let mut f = std::fs::File::open(path).map_err(|e| refuse(format!("cannot open it: {e}")))?;
    let content =
        Content::read(&mut f).map_err(|e| refuse(format!("not a readable GGUF file: {e}")))?;
    let config = match handoff_model::check_gguf(&content) {
        Ok(c) => c,
        Err(e @ (ModelError::Unsupported(_) | ModelError::UnsupportedArchitecture(_))) => {
            return Err(refuse(e.to_string()).into())
        }
        Err(e) => return Err(refuse(format!("malformed model: {e}")).into()),
    };
    handoff_model::tokenizer::Tokenizer::from_gguf(&content)
        .map_err(|e| refuse(format!("tokenizer: {e}")))?;
    handoff_model::chat_template::ChatTemplate::from_gguf(&content)
        .map_err(|e| refuse(format!("chat template: {e}")))?;
    Ok(CheckedModel {
        config,
        header: std::sync::Arc::new(content),
    })
}

/// The exit status for an error a command ended with: 3 when the model was
/// refused, 1 otherwise.
pub fn exit_status(e: &anyhow::Error) -> u8 {
    if e.chain().any(|c| c.is::<UnsupportedModel>()) {
        EXIT_UNSUPPORTED_MODEL
    } else {
        1
    }
}
