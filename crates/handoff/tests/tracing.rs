//! One trace per request across the three processes of `handoff serve`
//! (issue 32 item 6): a request carrying a W3C `traceparent` leaves spans
//! in the router, the prefill and the decode worker, all in the client's
//! trace, each worker's span a child of the router's, exported over
//! OTLP/HTTP (JSON) to the collector the test runs. Without an endpoint
//! nothing is exported (the other tests run that way).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;

/// A span as exported: service, name, ids.
#[derive(Debug, Clone)]
struct Exported {
    service: String,
    name: String,
    trace: String,
    id: String,
    parent: String,
}

/// An OTLP/HTTP collector on an ephemeral port: every span posted to
/// `/v1/traces`.
async fn collector() -> (String, Arc<Mutex<Vec<Exported>>>) {
    let spans: Arc<Mutex<Vec<Exported>>> = Arc::default();
    let sink = spans.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: axum::body::Bytes| {
            let sink = sink.clone();
            async move {
                let v: Value = serde_json::from_slice(&body).expect("OTLP JSON");
                for rs in v["resourceSpans"].as_array().into_iter().flatten() {
                    let service = rs["resource"]["attributes"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .find(|a| a["key"] == "service.name")
                        .and_then(|a| a["value"]["stringValue"].as_str())
                        .unwrap_or_default()
                        .to_string();
                    for ss in rs["scopeSpans"].as_array().into_iter().flatten() {
                        for s in ss["spans"].as_array().into_iter().flatten() {
                            let text = |k: &str| s[k].as_str().unwrap_or_default().to_string();
                            sink.lock().unwrap().push(Exported {
                                service: service.clone(),
                                name: text("name"),
                                trace: text("traceId"),
                                id: text("spanId"),
                                parent: text("parentSpanId"),
                            });
                        }
                    }
                }
                axum::Json(json!({}))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, spans)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_is_one_trace_across_router_prefill_and_decode() {
    let (otlp, spans) = collector().await;
    let dir = std::env::temp_dir().join(format!("handoff-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("tiny.gguf");
    handoff_model::tiny::write_tiny_gguf(&model, 5).expect("tiny GGUF");
    let s = common::serve(&model, &[], &[("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp)]);
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let resp = reqwest::Client::new()
        .post(format!("{}/generate", s.url))
        .header("traceparent", format!("00-{trace}-{client_span}-01"))
        .json(&json!({"input_ids": [5, 6, 7, 8, 9, 10], "stream": true,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0}}))
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status().as_u16(), 200);
    let text = resp.text().await.expect("body");
    assert!(text.contains("[DONE]"), "{text}");

    let wanted = [
        ("handoff-router", "router.request"),
        ("handoff-router", "router.queue"),
        ("handoff-router", "router.decision"),
        ("handoff-prefill", "prefill.request"),
        ("handoff-prefill", "prefill.compute"),
        ("handoff-decode", "decode.request"),
        ("handoff-decode", "decode.first_token"),
        ("handoff-decode", "decode.generate"),
    ];
    let deadline = Instant::now() + Duration::from_secs(30);
    let mine = loop {
        let mine: Vec<Exported> = spans
            .lock()
            .unwrap()
            .iter()
            .filter(|x| x.trace == trace)
            .cloned()
            .collect();
        let missing: Vec<_> = wanted
            .iter()
            .filter(|(svc, name)| !mine.iter().any(|x| x.service == *svc && x.name == *name))
            .collect();
        if missing.is_empty() {
            break mine;
        }
        assert!(
            Instant::now() < deadline,
            "spans never exported: {missing:?}; got {mine:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let one = |name: &str| {
        let all: Vec<&Exported> = mine.iter().filter(|x| x.name == name).collect();
        assert_eq!(all.len(), 1, "{name}: {all:#?}");
        all[0].clone()
    };
    let router = one("router.request");
    assert_eq!(
        router.parent, client_span,
        "the client's span is the router's parent"
    );
    for child in [
        "router.queue",
        "router.decision",
        "prefill.request",
        "decode.request",
    ] {
        assert_eq!(
            one(child).parent,
            router.id,
            "{child} hangs under router.request"
        );
    }
    let prefill = one("prefill.request");
    for stage in [
        "prefill.wait_destination",
        "prefill.compute",
        "prefill.transfer_tail",
    ] {
        assert_eq!(one(stage).parent, prefill.id, "{stage}");
    }
    let decode = one("decode.request");
    for stage in ["decode.first_token", "decode.generate"] {
        assert_eq!(one(stage).parent, decode.id, "{stage}");
    }
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}
