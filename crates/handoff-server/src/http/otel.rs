//! One trace per request (issue 32 item 6), with the OpenTelemetry crates:
//! W3C `traceparent` is read from each request, the router's span is the
//! parent of the workers' (it sends its own `traceparent` on), and each
//! process exports its spans over OTLP/HTTP (JSON) when an endpoint is
//! configured — `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
//! `OTEL_EXPORTER_OTLP_ENDPOINT`, the standard variables, which `handoff
//! serve`'s worker processes inherit — and nothing otherwise (the global
//! tracer is then a no-op: spans cost an allocation, no I/O).
//!
//! Spans: `router.request` (its children `router.queue`, `router.decision`,
//! `router.shed`, `router.migration`), `prefill.request` (its stages
//! `prefill.wait_destination`, `prefill.compute`, `prefill.transfer_tail`),
//! `decode.request` (`decode.first_token`: arrival to the first token,
//! which for PD is the KV transfer; `decode.generate`), `colocated.request`.

use std::time::{Duration, Instant, SystemTime};

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{SpanKind, TraceContextExt, Tracer};
use opentelemetry::{global, Context, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider};

/// The environment variables that turn export on.
const ENDPOINT_VARS: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
];

/// The exporter of this process, flushed when dropped.
#[derive(Debug)]
pub struct Export {
    provider: SdkTracerProvider,
    /// Where spans go.
    pub endpoint: String,
}

impl Drop for Export {
    fn drop(&mut self) {
        let _ = self.provider.force_flush();
        let _ = self.provider.shutdown();
    }
}

/// Start exporting spans as `service` (`OTEL_SERVICE_NAME` wins) when an
/// OTLP endpoint is configured; `Ok(None)` when none is.
pub fn init(service: &str) -> Result<Option<Export>, String> {
    let Some((var, value)) = ENDPOINT_VARS.iter().find_map(|v| {
        std::env::var(v)
            .ok()
            .filter(|s| !s.is_empty())
            .map(|s| (*v, s))
    }) else {
        return Ok(None);
    };
    // The traces variable is the whole URL; the general one is a base.
    let endpoint = if var == ENDPOINT_VARS[0] {
        value
    } else {
        format!("{}/v1/traces", value.trim_end_matches('/'))
    };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpJson)
        .with_endpoint(endpoint.clone())
        .with_timeout(Duration::from_secs(5))
        .build()
        .map_err(|e| format!("{var}={endpoint}: {e}"))?;
    let batches = BatchSpanProcessor::builder(exporter)
        .with_batch_config(
            BatchConfigBuilder::default()
                .with_scheduled_delay(Duration::from_millis(500))
                .build(),
        )
        .build();
    let name = std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| service.to_string());
    let provider = SdkTracerProvider::builder()
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name(name)
                .build(),
        )
        .with_span_processor(batches)
        .build();
    global::set_tracer_provider(provider.clone());
    Ok(Some(Export { provider, endpoint }))
}

/// The parent a request names in its `traceparent` header (an empty
/// context, so a new trace, when it names none or a malformed one).
pub fn extract(headers: &axum::http::HeaderMap) -> Context {
    TraceContextPropagator::new().extract(&opentelemetry_http::HeaderExtractor(headers))
}

/// The parent a `traceparent` value names ([`extract`] of that header).
pub fn parent_of(traceparent: Option<&str>) -> Context {
    let mut h = std::collections::HashMap::new();
    if let Some(tp) = traceparent {
        h.insert("traceparent".to_string(), tp.to_string());
    }
    TraceContextPropagator::new().extract(&h)
}

/// The `traceparent` that makes `cx`'s span the parent of the receiver's.
pub fn traceparent(cx: &Context) -> Option<String> {
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut h = axum::http::HeaderMap::new();
    TraceContextPropagator::new()
        .inject_context(cx, &mut opentelemetry_http::HeaderInjector(&mut h));
    h.get("traceparent")?.to_str().ok().map(str::to_string)
}

/// The wall-clock time of `at`.
pub fn wall(at: Instant) -> SystemTime {
    SystemTime::now() - at.elapsed()
}

/// A span `name` under `parent`, started at `start`; the returned context
/// holds it (end it with [`end`]).
pub fn start(
    parent: &Context,
    name: &'static str,
    kind: SpanKind,
    start: SystemTime,
    attrs: Vec<KeyValue>,
) -> Context {
    let tracer = global::tracer("handoff");
    let span = tracer
        .span_builder(name)
        .with_kind(kind)
        .with_start_time(start)
        .with_attributes(attrs)
        .start_with_context(&tracer, parent);
    parent.with_span(span)
}

/// A finished span `name` under `parent`, from `from` to `to`.
pub fn record(
    parent: &Context,
    name: &'static str,
    from: SystemTime,
    to: SystemTime,
    attrs: Vec<KeyValue>,
) {
    let cx = start(parent, name, SpanKind::Internal, from, attrs);
    cx.span().end_with_timestamp(to);
}

/// End `cx`'s span now with `attrs` added.
pub fn end(cx: &Context, attrs: Vec<KeyValue>) {
    let span = cx.span();
    span.set_attributes(attrs);
    span.end();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_is_read_and_a_child_of_it_is_sent_on() {
        let mut h = axum::http::HeaderMap::new();
        h.insert(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
                .parse()
                .unwrap(),
        );
        let parent = extract(&h);
        let sc = parent.span().span_context().clone();
        assert_eq!(
            format!("{}", sc.trace_id()),
            "0af7651916cd43dd8448eb211c80319c"
        );
        assert_eq!(
            traceparent(&parent).as_deref(),
            Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
        );
        // Malformed or absent: no parent, nothing sent on.
        h.insert("traceparent", "00-zz-yy-01".parse().unwrap());
        assert!(!extract(&h).span().span_context().is_valid());
        assert_eq!(traceparent(&Context::new()), None);
        let from_value = parent_of(Some(
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ));
        assert_eq!(from_value.span().span_context(), &sc);
        assert!(!parent_of(None).span().span_context().is_valid());
    }
}
