//! Read-only endpoints: `/v1/models`, `/health`, `/health_generate`,
//! `/server_info`, `/get_load` (SGLang's array shape) and `/metrics`.

use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use handoff_engine::request::{GenerateRequest, SamplingParams};
use serde_json::{json, Value};

use crate::http::errors::ApiError;
use crate::state::AppState;
use crate::worker::generation::Generation;

/// How long `/health_generate` waits for its one token.
pub const HEALTH_GENERATE_TIMEOUT: Duration = Duration::from_secs(20);

/// `GET /v1/models`.
pub async fn models(State(state): State<AppState>) -> Json<Value> {
    let info = state.engine.model();
    Json(json!({
        "object": "list",
        "data": [{
            "id": info.served_name,
            "object": "model",
            "created": state.started_unix,
            "owned_by": "handoff",
            "root": info.model_path,
            "max_model_len": info.context_length,
        }],
    }))
}

/// `GET /health`: the server is up.
pub async fn health() -> &'static str {
    ""
}

/// `GET /health_generate`: generate one token end to end. A PD worker
/// cannot generate alone (it needs its peer and a router): it answers as
/// `/health` does.
pub async fn health_generate(State(state): State<AppState>) -> Result<&'static str, ApiError> {
    if state.engine.mode() != "null" {
        return Ok("");
    }
    let tok = state.engine.tokenizer();
    let first = tok.bos_id().or(tok.eos_id()).unwrap_or(0);
    let req = GenerateRequest {
        prompt_ids: vec![first],
        sampling: SamplingParams {
            max_new_tokens: 1,
            ignore_eos: true,
            ..SamplingParams::default()
        },
        arrived: Instant::now(),
        output_so_far: Vec::new(),
        class: Default::default(),
    };
    let rid = crate::worker::request_ids::new_request_id("health");
    let gen =
        Generation::submit(&state, req, "/health_generate", &Default::default(), &rid).await?;
    match tokio::time::timeout(HEALTH_GENERATE_TIMEOUT, gen.collect()).await {
        Ok(Ok(_)) => Ok(""),
        Ok(Err(e)) => Err(ApiError::new(
            503,
            "unhealthy",
            format!("health generation failed: {}", e.message),
        )),
        Err(_) => Err(ApiError::new(
            503,
            "unhealthy",
            format!(
                "health generation produced no token within {} s",
                HEALTH_GENERATE_TIMEOUT.as_secs()
            ),
        )),
    }
}

/// `GET /server_info` (also `/get_server_info`, SGLang's older name).
pub async fn server_info(State(state): State<AppState>) -> Json<Value> {
    let info = state.engine.model();
    let load = state.engine.load();
    Json(json!({
        "served_model_name": info.served_name,
        "model_path": info.model_path,
        "context_length": info.context_length,
        "page_size": info.page_size,
        "vocab_size": info.vocab_size,
        "kv_pages_total": load.pages_total,
        "kv_dtype": info.kv_dtype,
        "kv_bytes": info.kv_bytes,
        "weight_bytes": info.weight_bytes,
        "weight_bytes_mapped": info.weight_bytes_mapped,
        "weight_cache": info.weight_cache,
        "architecture": info.architecture,
        "max_total_num_tokens": load.pages_total * info.page_size,
        "disaggregation_mode": state.engine.mode(),
        "version": env!("CARGO_PKG_VERSION"),
        "internal_states": [{
            "num_running_reqs": load.running,
            "num_waiting_reqs": load.waiting,
            "kv_pages_used": load.pages_used,
            "kv_pages_cached": load.pages_cached,
        }],
    }))
}

/// `GET /get_model_info` (and `/model_info`): SGLang's model description,
/// which routers read when a worker registers.
pub async fn model_info(State(state): State<AppState>) -> Json<Value> {
    let info = state.engine.model();
    // Hugging Face's class names for the GGUF architectures we run.
    let class = match info.architecture.as_str() {
        "qwen2" => "Qwen2ForCausalLM",
        "qwen3" => "Qwen3ForCausalLM",
        "gemma3" => "Gemma3ForCausalLM",
        "mistral" => "MistralForCausalLM",
        _ => "LlamaForCausalLM",
    };
    Json(json!({
        "model_path": info.model_path,
        "tokenizer_path": info.model_path,
        "is_generation": true,
        "preferred_sampling_params": null,
        "weight_version": "default",
        "has_image_understanding": false,
        "has_audio_understanding": false,
        "model_type": info.architecture,
        "architectures": [class],
    }))
}

/// `POST`/`GET /flush_cache`: empty the prefix cache of every page no
/// request reads, and say how many pages that freed.
pub async fn flush_cache(State(state): State<AppState>) -> Result<String, ApiError> {
    let pages = state.engine.flush_cache().await?;
    Ok(format!("Cache flushed: {pages} KV pages freed.\n"))
}

/// `GET /get_load`: one object per data-parallel rank (one rank here), in
/// SGLang's shape, plus the totals a router sums into its `sglang:` metrics
/// (`model_name`, `max_total_num_tokens`, `gen_throughput`,
/// `generation_tokens`, `prompt_tokens`).
pub async fn get_load(State(state): State<AppState>) -> Json<Value> {
    let load = state.engine.load();
    let page = state.engine.model().page_size;
    let field = state.metrics.field();
    Json(json!([{
        "dp_rank": 0,
        "num_reqs": load.running + load.waiting,
        "num_waiting_reqs": load.waiting,
        "num_tokens": load.pages_used * page,
        "max_total_num_tokens": load.pages_total * page,
        "model_name": state.engine.model().served_name,
        "gen_throughput": field.throughput(),
        "generation_tokens": field.generated(),
        "prompt_tokens": field.prompt_tokens(),
    }]))
}

/// `GET /metrics`: Prometheus text exposition.
pub async fn metrics(State(state): State<AppState>) -> Response {
    let transfer = state.engine.transfer_snapshot().await;
    let body = state.metrics.render(&state.engine.load(), transfer);
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        body,
    )
        .into_response()
}
