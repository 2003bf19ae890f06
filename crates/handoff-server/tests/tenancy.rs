//! Priorities and fair share over HTTP (issue 32 item 4): a key file's keys
//! are tenants; a worker orders its waiting requests by `priority`, then by
//! each tenant's share, then by arrival; a key's priority limit is enforced
//! (403); a tenant cannot be claimed with another tenant's key; the router
//! checks the limit and tells its workers whom each request is for.

mod common;

use std::time::{Duration, Instant};

use axum::extract::Request;
use axum::routing;
use handoff_server::http::auth::ApiKey;
use handoff_server::router::build_router;
use handoff_server::router::PrefillSpec;
use handoff_server::RouterConfig;
use serde_json::{json, Value};

const KEYS: &str = "\
# the cluster's key first, then the tenants
cluster c-key
alice a-key
bob b-key -10
carol k-key
";

fn keys() -> ApiKey {
    ApiKey::from_file(KEYS, &[]).expect("key file")
}

async fn post(
    base: &str,
    key: &str,
    extra: &[(&str, &str)],
    body: &Value,
) -> (u16, Value, Duration) {
    let sent = Instant::now();
    let mut req = reqwest::Client::new()
        .post(format!("{base}/generate"))
        .bearer_auth(key)
        .json(body);
    for (h, v) in extra {
        req = req.header(*h, *v);
    }
    let resp = req.send().await.expect("request");
    let status = resp.status().as_u16();
    let v: Value = resp.json().await.expect("json");
    (status, v, sent.elapsed())
}

fn short(priority: Option<i32>, salt: usize) -> Value {
    let mut b = json!({
        "text": format!("request number {salt}"),
        "sampling_params": {"max_new_tokens": 64, "ignore_eos": true},
    });
    if let Some(p) = priority {
        b["priority"] = json!(p);
    }
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_serves_by_priority_then_tenant_share_and_keys_cannot_be_forged() {
    // One request runs at a time, so the order they are admitted in is the
    // order they finish in.
    let engine = common::start_engine_with(|c| c.max_batch = 1);
    let state = handoff_server::AppState::new(engine.clone());
    let base = common::serve_on_thread(move |listener| async move {
        let app = handoff_server::http::auth::require_api_key(
            handoff_server::app_with_state(state),
            Some(keys()),
        );
        axum::serve(listener, app).await.expect("serve");
    });

    // bob's key allows at most -10.
    let (status, v, _) = post(&base, "b-key", &[], &short(Some(0), 0)).await;
    common::assert_error(
        status,
        &v,
        403,
        "priority_not_allowed",
        "priority 0 is above -10, the highest this API key may ask",
    );
    let (status, v, _) = post(&base, "a-key", &[], &short(Some(1001), 0)).await;
    common::assert_error(
        status,
        &v,
        400,
        "invalid_value",
        "priority must be an integer in -1000..=1000",
    );

    // alice's long request takes the batch while the rest queue.
    let long = reqwest::Client::new()
        .post(format!("{base}/generate"))
        .bearer_auth("a-key")
        .json(&json!({
            "text": "count", "stream": true,
            "sampling_params": {"max_new_tokens": 8000, "ignore_eos": true},
        }))
        .send()
        .await
        .expect("long request");
    assert_eq!(long.status(), 200);
    let mut long = long;
    assert!(long.chunk().await.expect("chunk").is_some());

    // (name, key, forged tenant header, priority)
    let queued: [(&str, &str, Option<&str>, Option<i32>); 5] = [
        ("a1", "a-key", None, None),
        ("a2", "a-key", None, None),
        ("a-high", "a-key", None, Some(5)),
        // carol claims to be alice: she is carol all the same.
        ("c1", "k-key", Some("alice"), None),
        // bob's requests default to his limit, -10.
        ("b1", "b-key", None, None),
    ];
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (i, (name, key, forged, priority)) in queued.into_iter().enumerate() {
        let base = base.clone();
        tasks.push(tokio::spawn(async move {
            let extra: Vec<(&str, &str)> = forged
                .map(|t| vec![("x-handoff-tenant", t)])
                .unwrap_or_default();
            let sent = started.elapsed();
            let (status, v, _) = post(&base, key, &extra, &short(priority, i)).await;
            assert_eq!(status, 200, "{name}: {v}");
            // When the server finished it, on the test's clock: independent
            // of when this task got to read the answer.
            let e2e = v["meta_info"]["e2e_latency"].as_f64().expect("e2e_latency");
            (sent + Duration::from_secs_f64(e2e), name)
        }));
        // One at a time, so arrival order is the list's.
        let deadline = Instant::now() + Duration::from_secs(60);
        while engine.load().waiting < i + 1 {
            assert!(
                Instant::now() < deadline,
                "{name} never queued: {:?}",
                engine.load()
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    drop(long);
    let mut done = Vec::new();
    for t in tasks {
        done.push(t.await.expect("task"));
    }
    done.sort();
    let order: Vec<&str> = done.into_iter().map(|(_, n)| n).collect();
    // a-high first; then carol, whose tenant has had nothing while alice had
    // two turns; then alice's in arrival order; bob's -10 last.
    assert_eq!(order, ["a-high", "c1", "a1", "a2", "b1"]);
}

/// A fake worker that answers with the tenant, key and priority it was sent.
async fn echo(req: Request) -> axum::Json<Value> {
    let h = req.headers();
    let get = |n: &str| h.get(n).and_then(|v| v.to_str().ok()).map(str::to_string);
    let tenant = get("x-handoff-tenant");
    let auth = get("authorization");
    let body = axum::body::to_bytes(req.into_body(), 1 << 20)
        .await
        .expect("body");
    let body: Value = serde_json::from_slice(&body).expect("json");
    axum::Json(json!({
        "tenant": tenant,
        "authorization": auth,
        "priority": body.get("priority"),
        "text": "", "meta_info": {},
    }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_checks_the_limit_and_names_the_tenant_to_its_workers() {
    let worker = common::serve_on_thread(|listener| async move {
        let app = axum::Router::new().route("/generate", routing::post(echo));
        axum::serve(listener, app).await.expect("serve");
    });
    let mut config = RouterConfig::new(
        vec![PrefillSpec {
            url: worker.clone(),
            bootstrap_port: None,
        }],
        vec![worker.clone()],
    );
    config.api_key = Some(keys());
    // The fake worker has no health route: never probed.
    config.health_interval = Duration::ZERO;
    let (app, _handle) = build_router(config).expect("router");
    let base = common::serve_in_task(app).await;

    let (status, v, _) = post(&base, "b-key", &[], &short(Some(-3), 0)).await;
    common::assert_error(
        status,
        &v,
        403,
        "priority_not_allowed",
        "priority -3 is above -10",
    );

    // (key, tenant header sent, priority asked, tenant and priority the
    // worker gets)
    type Case = (
        &'static str,
        Option<&'static str>,
        Option<i32>,
        &'static str,
        Value,
    );
    let cases: [Case; 4] = [
        // A tenant's key names its tenant, whatever header it sends.
        ("a-key", Some("carol"), Some(7), "alice", json!(7)),
        // A limit is the default priority.
        ("b-key", None, None, "bob", json!(-10)),
        ("k-key", None, None, "carol", Value::Null),
        // The cluster's key may speak for a tenant.
        ("c-key", Some("dave"), None, "dave", Value::Null),
    ];
    for (key, header, priority, tenant, sent_priority) in cases {
        let extra: Vec<(&str, &str)> = header
            .map(|t| vec![("x-handoff-tenant", t)])
            .unwrap_or_default();
        let (status, v, _) = post(&base, key, &extra, &short(priority, 0)).await;
        assert_eq!(status, 200, "{key}: {v}");
        assert_eq!(v["tenant"], json!(tenant), "{key}: {v}");
        assert_eq!(v["priority"], sent_priority, "{key}: {v}");
        assert_eq!(v["authorization"], json!("Bearer c-key"), "{key}: {v}");
    }
}
