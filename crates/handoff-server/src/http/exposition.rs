//! The Prometheus text exposition of a registry, whole or as a part of a
//! larger answer.

use prometheus_client::registry::Registry;

/// The last line of an OpenMetrics exposition.
pub const EOF: &str = "# EOF\n";

/// The exposition of `registry` without its `# EOF` line, so that several
/// registries (handoff's prefixed one, SGLang's names) make one answer.
pub fn encode_part(registry: &Registry) -> String {
    let mut out = encode(registry);
    if out.ends_with(EOF) {
        out.truncate(out.len() - EOF.len());
    }
    out
}

/// The Prometheus text exposition of `registry` (empty if encoding fails).
pub fn encode(registry: &Registry) -> String {
    let mut out = String::new();
    if prometheus_client::encoding::text::encode(&mut out, registry).is_err() {
        out.clear();
    }
    out
}
