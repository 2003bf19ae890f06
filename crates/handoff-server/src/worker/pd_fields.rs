//! The PD fields every generation API takes: SGLang's `bootstrap_*` and
//! handoff's own router-set fields, one struct flattened into each request
//! type (`/v1/chat/completions`, `/v1/completions`, `/generate`).
//!
//! Every field is raw JSON here and checked by name in
//! [`PdFields::bootstrap`]: a flattened field of a concrete type would lose
//! its name in serde's error (measured: `invalid type: string "x", expected
//! ...` with the path `.`), and a bad value must be a 400 naming its field.

use serde::Deserialize;
use serde_json::Value;

use crate::http::errors::ApiError;
use crate::worker::backend::{Bootstrap, Handover};
use crate::worker::sampling_fields::typed;

/// The PD fields of a generation request (all set by a router).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct PdFields {
    /// The prefill's host.
    #[serde(default)]
    pub bootstrap_host: Option<Value>,
    /// The prefill's bootstrap (transfer) port.
    #[serde(default)]
    pub bootstrap_port: Option<Value>,
    /// The room pairing prefill and decode.
    #[serde(default)]
    pub bootstrap_room: Option<Value>,
    /// The router's signature of the bootstrap fields.
    #[serde(default)]
    pub bootstrap_sig: Option<Value>,
    /// When the router signed them (Unix seconds).
    #[serde(default)]
    pub bootstrap_ts: Option<Value>,
    /// handoff: output ids another decode worker already streamed; this
    /// one continues after them.
    #[serde(default)]
    pub resume_output_ids: Option<Value>,
    /// handoff: a decode worker prefills this prompt itself, with no
    /// prefill worker.
    #[serde(default)]
    pub local_prefill: Option<Value>,
    /// handoff: what a decode worker does when the KV transfer fails
    /// (`recompute` or `fail`).
    #[serde(default)]
    pub on_transfer_failure: Option<Value>,
    /// handoff: mark each streamed event with the ids of its tokens.
    #[serde(default)]
    pub stream_marks: Option<Value>,
}

impl PdFields {
    /// The fields, checked: each bad value is a 400 naming its field.
    pub fn bootstrap(&self) -> Result<Bootstrap, ApiError> {
        let host: Option<String> = typed("", "bootstrap_host", self.bootstrap_host.as_ref())?;
        let sig: Option<String> = typed("", "bootstrap_sig", self.bootstrap_sig.as_ref())?;
        let bootstrap = Bootstrap::parse(
            host.as_ref(),
            self.bootstrap_port.as_ref(),
            self.bootstrap_room.as_ref(),
            sig.as_ref(),
            self.bootstrap_ts.as_ref(),
        )?;
        Ok(bootstrap.with_handover(Handover::parse(
            self.resume_output_ids.as_ref(),
            self.local_prefill.as_ref(),
            self.on_transfer_failure.as_ref(),
            self.stream_marks.as_ref(),
        )?))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// A request type with the fields flattened in, as the API types have
    /// them: they are taken out of the body before the `extra` map sees
    /// it, and each bad value is refused by its own name.
    #[derive(Debug, Deserialize)]
    struct Body {
        #[serde(default)]
        #[allow(dead_code)]
        prompt: Option<String>,
        #[serde(flatten)]
        pd: PdFields,
        #[serde(flatten)]
        extra: serde_json::Map<String, Value>,
    }

    #[test]
    fn pd_fields_leave_the_rest_and_name_each_bad_value() {
        let b: Body = crate::http::extract::parse_json(
            br#"{"prompt": "p", "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998,
                 "bootstrap_room": 7, "stream_marks": true, "user": "u"}"#,
        )
        .unwrap();
        assert_eq!(b.extra.keys().collect::<Vec<_>>(), ["user"]);
        let pd = b.pd.bootstrap().unwrap();
        assert_eq!(
            (pd.host.as_deref(), pd.port, pd.room),
            (Some("10.0.0.1"), Some(8998), Some(7))
        );
        for (field, value, want) in [
            (
                "bootstrap_host",
                json!(5),
                "invalid value for `bootstrap_host`: invalid type: integer `5`, expected a string",
            ),
            (
                "bootstrap_sig",
                json!([1]),
                "invalid value for `bootstrap_sig`: invalid type: sequence, expected a string",
            ),
            (
                "bootstrap_port",
                json!("x"),
                "bootstrap_port must be an integer",
            ),
            (
                "bootstrap_room",
                json!(-1),
                "bootstrap_room must be an integer",
            ),
            (
                "local_prefill",
                json!("yes"),
                "local_prefill must be true or false",
            ),
            (
                "on_transfer_failure",
                json!(3),
                "on_transfer_failure must be",
            ),
        ] {
            let body = json!({ "prompt": "p", field: value }).to_string();
            let b: Body = crate::http::extract::parse_json(body.as_bytes()).unwrap();
            let e = b.pd.bootstrap().expect_err(field);
            assert!(e.message.contains(want), "{field}: {}", e.message);
            assert_eq!(e.param.as_deref(), Some(field));
        }
    }
}
