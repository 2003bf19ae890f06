//! What every handler shares: the engine, metrics, the requests in flight,
//! the trust and grammar settings.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use crate::http::errors::ApiError;
use crate::http::metrics::Metrics;
use crate::worker::aborts::Aborts;
use crate::worker::backend::{Backend, Bootstrap};
use crate::worker::request_ids::unix_now;
use crate::worker::trust::BootstrapTrust;

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    /// The engine: colocated, or one side of a PD pair.
    pub engine: Backend,
    /// The metrics registry.
    pub metrics: Arc<Metrics>,
    /// Server start, seconds since the Unix epoch.
    pub started_unix: u64,
    /// The requests in flight by id, for `/abort_request`.
    pub aborts: Arc<Aborts>,
    /// OpenAI's `system_fingerprint`: this build serving this model.
    pub system_fingerprint: String,
    /// A generation that waits this long for its next token is ended
    /// (`stalled`) and cancelled; `None`: never.
    pub stall_timeout: Option<std::time::Duration>,
    /// The prefill endpoints a decode worker dials ([`crate::worker::trust`]):
    /// none until the embedder says which.
    pub bootstrap_trust: BootstrapTrust,
    /// Compiles requests' structured-output grammars over the model's
    /// vocabulary.
    pub grammars: Arc<handoff_engine::grammar::Grammars>,
}

/// How long a generation may wait for its next token by default
/// (`--stream-stall-timeout-secs`): longer than any prompt's prefill or
/// queueing on a healthy worker, far shorter than the 300 s that users of
/// other systems find their streams hanging for.
pub const DEFAULT_STALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("model", &self.engine.model())
            .finish_non_exhaustive()
    }
}

impl AppState {
    /// State around a running engine.
    pub fn new(engine: impl Into<Backend>) -> Self {
        let engine = engine.into();
        let model = engine.model();
        let metrics = Arc::new(Metrics::new(&model.served_name, model.page_size));
        let started_unix = unix_now();
        let system_fingerprint = fingerprint(engine.model());
        let grammars = Arc::new(handoff_engine::grammar::Grammars::new(
            engine.tokenizer().clone(),
        ));
        AppState {
            engine,
            metrics,
            started_unix,
            aborts: Arc::new(Aborts::default()),
            system_fingerprint,
            stall_timeout: Some(DEFAULT_STALL_TIMEOUT),
            bootstrap_trust: BootstrapTrust::default(),
            grammars,
        }
    }

    /// The same state trusting `trust`'s prefill endpoints.
    pub fn with_bootstrap_trust(mut self, trust: BootstrapTrust) -> Self {
        self.bootstrap_trust = trust;
        self
    }

    /// Check a request's PD fields before any other work: the ones this
    /// worker's role needs are there, and (decode) the prefill endpoint
    /// they name is one this worker may dial. Marks `b` trusted.
    pub fn check_bootstrap(&self, b: &mut Bootstrap) -> Result<(), ApiError> {
        self.engine.check_bootstrap(b)?;
        // A decode worker prefilling itself dials no one: nothing to vouch for.
        if self.engine.mode() == "decode" && !b.handover.local {
            self.bootstrap_trust.check(b, unix_now())?;
        }
        b.trusted = true;
        Ok(())
    }

    /// The same state with another stall timeout (`None`: no watchdog).
    pub fn with_stall_timeout(mut self, t: Option<std::time::Duration>) -> Self {
        self.stall_timeout = t;
        self
    }

    /// The model name reported in responses.
    pub fn served_name(&self) -> String {
        self.engine.model().served_name.clone()
    }
}

/// `fp_` and 40 bits of a hash of handoff's version and the served model
/// (name, file, architecture, context, page size): equal across the
/// workers of one deployment, different when either changes.
fn fingerprint(model: &handoff_engine::handle::ModelInfo) -> String {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    env!("CARGO_PKG_VERSION").hash(&mut h);
    model.served_name.hash(&mut h);
    model.model_path.hash(&mut h);
    model.architecture.hash(&mut h);
    model.context_length.hash(&mut h);
    model.page_size.hash(&mut h);
    format!("fp_{:010x}", h.finish() >> 24)
}
