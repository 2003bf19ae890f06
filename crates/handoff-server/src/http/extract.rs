//! A JSON body extractor whose rejections are [`ApiError`]s (OpenAI error
//! bodies naming the field at fault), instead of axum's plain-text ones.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use serde::de::DeserializeOwned;

use crate::http::errors::ApiError;
use crate::http::listen::BodyDeadline;

/// Largest request body accepted (bytes).
pub const MAX_BODY_BYTES: usize = 16 * 1024 * 1024;

/// Bodies larger than this are parsed on tokio's blocking pool, so that a
/// client sending megabytes of JSON never holds a runtime thread.
const PARSE_INLINE_BYTES: usize = 64 * 1024;

/// Refuse a body not sent as JSON: `Content-Type` must be
/// `application/json` (parameters such as `charset` allowed) or another
/// `application/*+json`. A browser page can send `text/plain` or a form to
/// a server on localhost without asking first (no CORS preflight); it cannot
/// send `application/json` without one, so this keeps other sites out.
pub fn check_json_content_type(headers: &axum::http::HeaderMap) -> Result<(), ApiError> {
    let ct = headers
        .get(axum::http::header::CONTENT_TYPE)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    let essence = ct
        .as_deref()
        .and_then(|c| c.split(';').next())
        .map(|e| e.trim().to_ascii_lowercase());
    let json = essence.as_deref().is_some_and(|e| {
        e == "application/json"
            || e.strip_prefix("application/")
                .is_some_and(|sub| sub.ends_with("+json"))
    });
    if json {
        return Ok(());
    }
    let got = ct.map_or_else(|| "no Content-Type".to_string(), |c| format!("`{c}`"));
    Err(ApiError::new(
        415,
        "unsupported_media_type",
        format!("the request body must be sent as JSON with `Content-Type: application/json` (got {got})"),
    ))
}

/// `Json<T>` with OpenAI-style errors; the content type must be JSON
/// ([`check_json_content_type`]).
#[derive(Debug)]
pub struct JsonBody<T>(pub T);

impl<S, T> FromRequest<S> for JsonBody<T>
where
    S: Send + Sync,
    T: DeserializeOwned + Send + 'static,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        check_json_content_type(req.headers())?;
        let bytes = read_body(req, state).await?;
        if bytes.len() <= PARSE_INLINE_BYTES {
            return parse_json(&bytes).map(JsonBody);
        }
        crate::worker::prompt::off_runtime(move || parse_json(&bytes))
            .await
            .map(JsonBody)
    }
}

/// Read a request's body within the [`BodyDeadline`] that
/// [`crate::http::listen::serve`] gave it (none when served otherwise): a client
/// that sends its headers and then trickles or stops its body gets a 408
/// instead of holding the request.
pub async fn read_body<S: Send + Sync>(req: Request, state: &S) -> Result<Bytes, ApiError> {
    let deadline = req.extensions().get::<BodyDeadline>().copied();
    let read = Bytes::from_request(req, state);
    let read = match deadline {
        Some(BodyDeadline(limit)) => match tokio::time::timeout(limit, read).await {
            Ok(r) => r,
            Err(_) => {
                return Err(ApiError::new(
                    408,
                    "request_timeout",
                    format!(
                        "the request body did not arrive within {} s",
                        limit.as_secs_f64()
                    ),
                ))
            }
        },
        None => read.await,
    };
    read.map_err(|e| {
        ApiError::new(
            e.status().as_u16(),
            "invalid_body",
            format!("could not read the request body: {}", e.body_text()),
        )
    })
}

/// Parse `bytes` as `T`, describing failures in words a client can act on.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad_request(
            "invalid_json",
            "the request body is empty: send a JSON object",
        ));
    }
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    match serde_path_to_error::deserialize::<_, T>(de) {
        Ok(v) => Ok(v),
        Err(err) => {
            let path = err.path().to_string();
            let inner = err.into_inner();
            use serde_json::error::Category;
            match inner.classify() {
                Category::Syntax | Category::Eof | Category::Io => Err(ApiError::bad_request(
                    "invalid_json",
                    format!("the request body is not valid JSON: {inner}"),
                )),
                Category::Data => {
                    let mut e = if path.is_empty() || path == "." {
                        ApiError::bad_request(
                            "invalid_type",
                            format!("invalid request body: {inner}"),
                        )
                    } else {
                        ApiError::bad_request(
                            "invalid_type",
                            format!("invalid value for `{path}`: {inner}"),
                        )
                    };
                    if !path.is_empty() && path != "." {
                        e.param = Some(path);
                    }
                    Err(e)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Req {
        max_tokens: Option<i64>,
    }

    #[test]
    fn syntax_error_is_invalid_json() {
        let e = parse_json::<Req>(b"{\"max_tokens\": ").unwrap_err();
        assert_eq!((e.status, e.code), (400, "invalid_json"));
        assert!(e.message.contains("not valid JSON"), "{}", e.message);
    }

    #[test]
    fn wrong_type_names_the_field() {
        let e = parse_json::<Req>(b"{\"max_tokens\": \"ten\"}").unwrap_err();
        assert_eq!((e.status, e.code), (400, "invalid_type"));
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert!(e.message.contains("`max_tokens`"), "{}", e.message);
    }

    #[test]
    fn only_json_content_types_are_accepted() {
        use axum::http::{header::CONTENT_TYPE, HeaderMap, HeaderValue};
        let with = |ct: Option<&'static str>| {
            let mut h = HeaderMap::new();
            if let Some(ct) = ct {
                h.insert(CONTENT_TYPE, HeaderValue::from_static(ct));
            }
            check_json_content_type(&h)
        };
        for ok in [
            "application/json",
            "application/json; charset=utf-8",
            "Application/JSON",
            "application/vnd.api+json",
        ] {
            assert!(with(Some(ok)).is_ok(), "{ok}");
        }
        for (bad, named) in [
            (Some("text/plain"), "`text/plain`"),
            (
                Some("text/plain;charset=UTF-8"),
                "`text/plain;charset=UTF-8`",
            ),
            (Some("application/x-www-form-urlencoded"), "form-urlencoded"),
            (Some("multipart/form-data; boundary=x"), "multipart"),
            (Some("application/jsonx"), "jsonx"),
            (None, "no Content-Type"),
        ] {
            let e = with(bad).unwrap_err();
            assert_eq!((e.status, e.code), (415, "unsupported_media_type"));
            assert!(e.message.contains(named), "{}", e.message);
        }
    }

    #[test]
    fn empty_body() {
        let e = parse_json::<Req>(b" ").unwrap_err();
        assert!(e.message.contains("empty"));
    }
}
