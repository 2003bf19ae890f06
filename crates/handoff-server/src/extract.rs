//! A JSON body extractor whose rejections are [`ApiError`]s (OpenAI error
//! bodies naming the field at fault), instead of axum's plain-text ones.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use serde::de::DeserializeOwned;

use crate::errors::ApiError;

/// Largest request body accepted (bytes).
pub const MAX_BODY_BYTES: usize = 16 * 1024 * 1024;

/// `Json<T>` with OpenAI-style errors. Any content type is accepted as JSON.
#[derive(Debug)]
pub struct JsonBody<T>(pub T);

impl<S, T> FromRequest<S> for JsonBody<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            ApiError::new(
                e.status().as_u16(),
                "invalid_body",
                format!("could not read the request body: {}", e.body_text()),
            )
        })?;
        parse_json(&bytes).map(JsonBody)
    }
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
    fn empty_body() {
        let e = parse_json::<Req>(b" ").unwrap_err();
        assert!(e.message.contains("empty"));
    }
}
