//! The `handoff` binary: precise CLI errors, and `serve` on the tiny model
//! answering HTTP and shutting down cleanly on SIGTERM.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;

fn handoff() -> Command {
    Command::new(env!("CARGO_BIN_EXE_handoff"))
}

fn fails_with(args: &[&str], needle: &str) {
    let out = handoff().args(args).output().expect("run handoff");
    assert!(!out.status.success(), "{args:?} should fail");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(needle),
        "{args:?}: stderr lacks {needle:?}:\n{stderr}"
    );
}

#[test]
fn cli_errors_are_precise() {
    // A bench flag that a mode would ignore is refused by name.
    fails_with(
        &["bench-transfer", "--only", "latency", "--runs", "5"],
        "the argument '--only <ONLY>' cannot be used with '--runs <RUNS>'",
    );
    fails_with(
        &["serve", "--threads", "0"],
        "invalid value '0' for '--threads <THREADS>'",
    );
    fails_with(
        &["serve", "--port", "70000"],
        "invalid value '70000' for '--port <PORT>'",
    );
    fails_with(
        &["serve", "--kv-pages", "10", "--kv-memory-mb", "10"],
        "the argument '--kv-pages <KV_PAGES>' cannot be used with '--kv-memory-mb <KV_MEMORY_MB>'",
    );
    fails_with(
        &["serve", "--kv-dtype", "bf16"],
        "invalid value 'bf16' for '--kv-dtype <KV_DTYPE>': unknown KV dtype \"bf16\": handoff stores K and V as f16 or f32",
    );
    fails_with(
        &["serve", "--model", "/nonexistent/model.gguf"],
        "model file /nonexistent/model.gguf does not exist",
    );
    fails_with(&["serve", "--api-key", " "], "the API key is empty");
    fails_with(
        &[
            "router",
            "--prefill",
            "http://127.0.0.1:1",
            "--decode",
            "http://127.0.0.1:2",
            "--api-key-file",
            "/nonexistent/key",
        ],
        "reading the API key file /nonexistent/key",
    );
    fails_with(
        &["serve", "--api-key", "k", "--open-path", "health"],
        "open path \"health\" does not start with /",
    );
    fails_with(
        &["decode", "--transfer-tcp-streams", "0"],
        "invalid value '0' for '--transfer-tcp-streams <TRANSFER_TCP_STREAMS>': 0 is not in 1..=16",
    );
    fails_with(
        &["serve", "--transfer-io-threads", "65"],
        "invalid value '65' for '--transfer-io-threads <TRANSFER_IO_THREADS>': 65 is not in 1..=64",
    );
    fails_with(
        &["serve", "--allow-origin", "chat.example.com"],
        "invalid value 'chat.example.com' for '--allow-origin <ORIGIN>': `chat.example.com` is not an origin: it does not start with http:// or https://",
    );
    fails_with(
        &[
            "router",
            "--prefill",
            "http://x",
            "--decode",
            "http://y",
            "--allow-origin",
            "https://a.example/app",
        ],
        "`https://a.example/app` is not an origin: an origin is a scheme, a host and a port only",
    );
    fails_with(&["frobnicate"], "unrecognized subcommand 'frobnicate'");
    fails_with(
        &["serve", "--log-level", "loud"],
        "unknown log level \"loud\": use error, warning, info, debug or trace",
    );
    fails_with(
        &["serve", "--tp-size", "2"],
        "tensor parallelism (2 ranks) is not implemented in the engine",
    );
}

#[test]
fn router_cli_errors_are_precise() {
    fails_with(
        &["router", "--prefill", "http://x", "99999", "--decode", "http://y"],
        "invalid bootstrap port '99999' for '--prefill http://x': expected an integer from 1 to 65535",
    );
    fails_with(
        &[
            "router",
            "--prefill",
            "http://x",
            "0",
            "--decode",
            "http://y",
        ],
        "invalid bootstrap port '0'",
    );
    fails_with(
        &["router", "--prefill", "http://x"],
        "the following required arguments were not provided:\n  --decode <URL>",
    );
    fails_with(
        &["router", "--decode", "http://y"],
        "--prefill <URL> [BOOTSTRAP_PORT]",
    );
    fails_with(
        &[
            "router",
            "--prefill",
            "localhost:30001",
            "--decode",
            "http://y",
        ],
        "worker URL `localhost:30001` is invalid: it has no http:// scheme",
    );
    fails_with(
        &[
            "router",
            "--prefill",
            "http://x",
            "--decode",
            "http://y",
            "--policy",
            "random",
        ],
        "unknown policy `random` (expected round_robin, least_load, power_of_two or cache_aware)",
    );
    fails_with(
        &[
            "router",
            "--prefill",
            "http://x",
            "1",
            "2",
            "--decode",
            "http://y",
        ],
        "unexpected argument '2'",
    );
}

#[cfg(unix)]
#[test]
fn router_answers_and_stops_on_sigterm() {
    // Workers on closed ports: the router runs, is alive and not ready.
    let closed = || {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let (p, d) = (closed(), closed());
    let mut child = handoff()
        .args([
            "router",
            "--port",
            "0",
            "--pd-disaggregation",
            "--prefill",
            &p,
            "9000",
            "--decode",
            &d,
            "--log-level",
            "info",
        ])
        .env("RUST_LOG", "error")
        .env("NO_COLOR", "1")
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut addr = None;
    for line in lines.by_ref() {
        let line = line.unwrap();
        if let Some(i) = line.find("listening on http://") {
            addr = Some(line[i + "listening on http://".len()..].trim().to_string());
            break;
        }
    }
    let addr = addr.expect("router logs its address");
    assert!(http_get(&addr, "/health").starts_with("HTTP/1.1 200"));
    let ready = http_get(&addr, "/readiness");
    assert!(ready.starts_with("HTTP/1.1 503"), "{ready}");
    assert!(
        ready.contains("no prefill and no decode worker is healthy"),
        "{ready}"
    );
    let workers = http_get(&addr, "/workers");
    assert!(workers.contains("\"bootstrap_port\":9000"), "{workers}");

    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let exit = child.wait().unwrap();
    assert!(exit.success(), "exit status {exit:?}; log tail {rest:?}");
    assert!(
        rest.iter().any(|l| l.contains("SIGTERM received")),
        "{rest:?}"
    );
}

fn http_get(addr: &str, path: &str) -> String {
    http_get_with(addr, path, None)
}

/// `Authorization: Bearer KEY` when `key` is given.
fn auth_header(key: Option<&str>) -> String {
    key.map(|k| format!("Authorization: Bearer {k}\r\n"))
        .unwrap_or_default()
}

fn http_get_with(addr: &str, path: &str, key: Option<&str>) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\n{}Connection: close\r\n\r\n",
        auth_header(key)
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[cfg(unix)]
#[test]
fn serve_answers_and_stops_on_sigterm() {
    serve_answers_and_stops(&["--colocated"], "colocated");
}

/// The default `handoff serve`: router + prefill + decode processes; a
/// completion goes through all three, and SIGTERM stops the workers too.
#[cfg(unix)]
#[test]
fn serve_pd_answers_and_stops_its_workers_on_sigterm() {
    // The prefill worker's transfer endpoint on the port asked for.
    let port = free_port().to_string();
    serve_answers_and_stops(&["--disaggregation-bootstrap-port", &port], "pd");
}

/// The tiny model written for the test `label`.
fn tiny_model(label: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("handoff-cli-test-{}-{label}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("tiny.gguf");
    handoff_model::tiny::write_tiny_gguf(&model, 3).expect("tiny GGUF");
    model
}

/// A loopback port free a moment ago.
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// A bootstrap port already taken: `handoff serve` stops with the prefill
/// worker's bind error and says which worker failed.
#[cfg(unix)]
#[test]
fn serve_pd_with_a_taken_bootstrap_port_fails_clearly() {
    let model = tiny_model("busy");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let out = handoff()
        .args(["serve", "--port", "0", "--kv-pages", "64"])
        .args(["--disaggregation-bootstrap-port", &port])
        .arg("--model")
        .arg(&model)
        .env("NO_COLOR", "1")
        .output()
        .expect("run handoff serve");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("the prefill worker exited") && err.contains(&format!(":{port}")),
        "{err}"
    );
}

/// The generated text of a completion response (ids and times differ).
fn body_of(resp: &str) -> String {
    let body = resp.split("\r\n\r\n").nth(1).unwrap_or_default();
    // Chunked or not, the JSON object is the part between the braces.
    let start = body.find('{').unwrap_or(0);
    let end = body.rfind('}').map(|i| i + 1).unwrap_or(body.len());
    let v: serde_json::Value = serde_json::from_str(&body[start..end]).expect("JSON body");
    v["choices"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// The origin `serve_answers_and_stops` allows.
const UI_ORIGIN: &str = "http://ui.localhost:8080";

/// A browser's CORS preflight for a JSON POST from `origin`; the raw answer.
fn http_preflight(addr: &str, origin: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    write!(
        s,
        "OPTIONS /v1/completions HTTP/1.1\r\nHost: x\r\nOrigin: {origin}\r\nAccess-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: content-type\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

fn http_post(addr: &str, path: &str, body: &str) -> String {
    http_post_with(addr, path, body, None)
}

fn http_post_with(addr: &str, path: &str, body: &str, key: Option<&str>) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        auth_header(key),
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// Kills the server if the test panics, so no process outlives a failure
/// (its workers exit when their parent does).
struct KillOnPanic(u32);

impl Drop for KillOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let _ = Command::new("kill")
                .args(["-9", &self.0.to_string()])
                .status();
        }
    }
}

#[cfg(unix)]
fn serve_answers_and_stops(mode: &[&str], label: &str) {
    let model = tiny_model(label);
    // The PD serve runs with an API key, given through the environment: the
    // router requires it and hands it to its workers.
    let key = (label == "pd").then_some("cli-test-key");
    let mut cmd = handoff();
    if let Some(k) = key {
        cmd.env("HANDOFF_API_KEY", k);
    }
    let mut child = cmd
        .args([
            "serve",
            "--port",
            "0",
            "--kv-pages",
            "64",
            "--served-model-name",
            "tiny-cli",
            "--allow-origin",
            UI_ORIGIN,
        ])
        .args(mode)
        .arg("--model")
        .arg(&model)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let _reap = KillOnPanic(child.id());
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut addr = None;
    let mut bootstrap = None;
    let mut prefill_pid = None;
    let mut decode_port = None;
    let mut serve_log = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        serve_log.push(line.clone());
        // Worker processes' lines are prefixed with their role.
        if line.starts_with('[') {
            continue;
        }
        if line.contains("worker process started") && line.contains("role=\"decode\"") {
            decode_port = line
                .split_whitespace()
                .find_map(|w| w.strip_prefix("port="))
                .map(str::to_string);
        }
        if line.contains("worker process started") && line.contains("role=\"prefill\"") {
            prefill_pid = line
                .split_whitespace()
                .find_map(|w| w.strip_prefix("pid="))
                .map(str::to_string);
        }
        if let Some(w) = line
            .split_whitespace()
            .find(|w| w.starts_with("bootstrap="))
        {
            bootstrap = Some(w["bootstrap=".len()..].to_string());
        }
        if let Some(i) = line.find("listening on http://") {
            addr = Some(line[i + "listening on http://".len()..].trim().to_string());
            break;
        }
    }
    let addr = addr.expect("server logs its address");
    // `--disaggregation-bootstrap-port P` is where the prefill worker's
    // transfer endpoint listens.
    if let Some(i) = mode
        .iter()
        .position(|a| *a == "--disaggregation-bootstrap-port")
    {
        let port = mode[i + 1];
        assert_eq!(bootstrap.as_deref(), Some(port));
        assert!(TcpStream::connect(("127.0.0.1", port.parse::<u16>().unwrap())).is_ok());
    }
    // `--allow-origin` reaches the public port (the router, in PD): a page
    // of that origin may call it, a page of another may not.
    let granted = http_preflight(&addr, UI_ORIGIN).to_ascii_lowercase();
    assert!(
        granted.contains(&format!("access-control-allow-origin: {UI_ORIGIN}")),
        "{granted}"
    );
    let refused = http_preflight(&addr, "http://other.localhost").to_ascii_lowercase();
    assert!(
        !refused.contains("access-control-allow-origin"),
        "{refused}"
    );
    let models = http_get_with(&addr, "/v1/models", key);
    assert!(models.starts_with("HTTP/1.1 200"), "{models}");
    assert!(models.contains("\"id\":\"tiny-cli\""), "{models}");
    let request = r#"{"prompt":"hello","max_tokens":5,"temperature":0,"ignore_eos":true}"#;
    if key.is_some() {
        let refused = http_post(&addr, "/v1/completions", request);
        assert!(refused.starts_with("HTTP/1.1 401"), "{refused}");
        assert!(
            refused.contains("\"code\":\"invalid_api_key\""),
            "{refused}"
        );
        let wrong = http_post_with(&addr, "/v1/completions", request, Some("guess"));
        assert!(wrong.starts_with("HTTP/1.1 401"), "{wrong}");
        let health = http_get(&addr, "/health");
        assert!(health.starts_with("HTTP/1.1 200"), "open path: {health}");
        let metrics = http_get(&addr, "/metrics");
        assert!(metrics.starts_with("HTTP/1.1 200"), "open path: {metrics}");
        let workers = http_get(&addr, "/workers");
        assert!(workers.starts_with("HTTP/1.1 401"), "{workers}");
        // The workers behind the router require the key too.
        let worker = format!(
            "127.0.0.1:{}",
            decode_port.clone().expect("decode port logged")
        );
        let direct = http_get(&worker, "/v1/models");
        assert!(direct.starts_with("HTTP/1.1 401"), "{direct}");
        let direct = http_get_with(&worker, "/v1/models", key);
        assert!(direct.starts_with("HTTP/1.1 200"), "{direct}");
    }
    let done = http_post_with(&addr, "/v1/completions", request, key);
    assert!(done.starts_with("HTTP/1.1 200"), "{done}");
    assert!(done.contains("\"completion_tokens\":5"), "{done}");
    if label == "pd" {
        // A prefill worker killed with SIGKILL is started again and the
        // next requests are served.
        let pid = prefill_pid.expect("serve logs the prefill worker's pid");
        assert!(Command::new("kill")
            .args(["-9", &pid])
            .status()
            .unwrap()
            .success());
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            std::thread::sleep(Duration::from_millis(200));
            let again = http_post_with(&addr, "/v1/completions", request, key);
            if again.starts_with("HTTP/1.1 200") {
                assert_eq!(body_of(&again), body_of(&done));
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "not served after the prefill was killed: {again}"
            );
        }
    }

    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let exit = child.wait().unwrap();
    assert!(exit.success(), "exit status {exit:?}; log tail {rest:?}");
    assert!(
        rest.iter().any(|l| l.contains("SIGTERM received")),
        "{rest:?}"
    );
    if label == "pd" {
        assert!(
            rest.iter()
                .any(|l| l.contains("worker exited: starting it again")),
            "{rest:?}"
        );
        assert!(
            serve_log
                .iter()
                .any(|l| l.contains("transfer handshakes authenticated with a fresh secret")),
            "{serve_log:?}"
        );
        for role in ["[prefill]", "[decode]"] {
            assert!(
                rest.iter()
                    .any(|l| l.starts_with(role) && l.contains("shut down")),
                "{role} did not shut down: {rest:?}"
            );
        }
    }
    std::thread::sleep(Duration::from_millis(10));
}

/// A working directory a hostile user prepared: a `scripts/fetch-model.sh`
/// (what `handoff serve` used to run) and Python modules named like those
/// pip and the unpacking import, each leaving a mark if it runs.
fn hostile_dir(label: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("handoff-hostile-{label}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("scripts")).expect("mkdir");
    let mark = |name: &str| {
        format!(
            "open({:?}, 'w').write('ran')\n",
            dir.join(name).display().to_string()
        )
    };
    for module in ["pip.py", "zipfile.py", "shutil.py", "runpy.py"] {
        std::fs::write(dir.join(module), mark(&format!("RAN_{module}"))).expect("write");
    }
    std::fs::write(
        dir.join("scripts/fetch-model.sh"),
        format!(
            "#!/bin/sh\ntouch {}\n",
            dir.join("RAN_fetch-model.sh").display()
        ),
    )
    .expect("write");
    dir
}

fn marks(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .expect("read dir")
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("RAN_"))
        .collect()
}

#[test]
fn the_default_model_is_fetched_into_the_cache_running_nothing_from_the_working_directory() {
    let cwd = hostile_dir("fetch");
    let home = cwd.join("home");
    // `handoff fetch-model` started in the hostile directory.
    let fetch = || {
        handoff()
            .arg("fetch-model")
            .current_dir(&cwd)
            .env("HANDOFF_HOME", &home)
            .output()
            .expect("run handoff")
    };
    let out = fetch();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "fetch-model failed:\n{stderr}");
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let want = home.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert_eq!(path, want.display().to_string());
    assert_eq!(
        std::fs::metadata(&want).expect("the model").len(),
        98_362_432
    );
    assert_eq!(
        marks(&cwd),
        Vec::<String>::new(),
        "code from the working directory ran"
    );
    // Nothing but the model is left in the cache.
    let left: Vec<_> = std::fs::read_dir(home.join("models"))
        .expect("models dir")
        .filter_map(Result::ok)
        .map(|e| e.file_name())
        .collect();
    assert_eq!(left.len(), 1, "{left:?}");

    // A cached file that is not the model is refused, not served.
    std::fs::write(&want, b"something else").expect("overwrite");
    let out = fetch();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("is not the expected file: delete it to fetch it again")
            && stderr.contains("expected b179c952"),
        "{stderr}"
    );
    assert_eq!(marks(&cwd), Vec::<String>::new());
    let _ = std::fs::remove_dir_all(&cwd);
}

#[test]
fn a_prefill_reachable_from_other_hosts_needs_a_transfer_secret() {
    let model = tiny_model("exposure");
    let model = model.to_str().expect("utf-8 path");
    let args = [
        "prefill",
        "--host",
        "0.0.0.0",
        "--port",
        "0",
        "--disaggregation-bootstrap-port",
        "0",
        "--kv-pages",
        "16",
        "--model",
        model,
    ];
    let out = handoff()
        .args(args)
        .env_remove("HANDOFF_TRANSFER_SECRET")
        .output()
        .expect("run handoff");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("which other hosts can reach, without a secret"),
        "{stderr}"
    );
    // With the secret in the environment it starts.
    let mut child = handoff()
        .args(args)
        .env("HANDOFF_TRANSFER_SECRET", "a shared secret")
        .env("NO_COLOR", "1")
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let _reap = KillOnPanic(child.id());
    let lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut started = false;
    for line in lines.map_while(Result::ok) {
        if line.contains("prefill transfer endpoint listening") {
            started = true;
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(started, "the prefill did not start with a secret");
}

/// A model file asking for something handoff does not implement is
/// refused before any worker starts: one line naming what, exit status 3
/// (not "model execution failed" after "starting the engine"), for every
/// command that loads a model.
#[test]
fn an_unsupported_model_is_refused_in_one_line_with_exit_status_3() {
    let dir = std::env::temp_dir().join(format!("handoff-refuse-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cases = [
        (
            "llama-extra-tensor",
            format!(
                "tensor {} is not used by handoff's llama implementation",
                handoff_testmodels::EXTRA_TENSOR_NAME
            ),
        ),
        (
            "llama-bad-rope-scaling",
            format!(
                "rope scaling type {:?}",
                handoff_testmodels::BAD_ROPE_SCALING_TYPE
            ),
        ),
    ];
    for (preset, needle) in cases {
        let path = dir.join(format!("{preset}.gguf"));
        handoff_testmodels::write_preset(&path, preset).unwrap();
        let model = path.to_str().unwrap();
        for cmd in [
            vec!["serve", "--model", model, "--port", "0"],
            vec!["serve", "--colocated", "--model", model, "--port", "0"],
            vec!["decode", "--model", model, "--port", "0"],
        ] {
            let out = handoff()
                .args(&cmd)
                .stdin(Stdio::null())
                .output()
                .expect("run handoff");
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(3), "{cmd:?}: {stderr}");
            let lines: Vec<&str> = stderr.lines().collect();
            assert_eq!(lines.len(), 1, "{cmd:?}: one line, got:\n{stderr}");
            assert!(
                lines[0].starts_with(&format!("Error: cannot serve {model}: unsupported model: ")),
                "{cmd:?}: {stderr}"
            );
            assert!(
                lines[0].contains(&needle),
                "{cmd:?}: lacks {needle:?}: {stderr}"
            );
        }
    }
    // A file that is no GGUF at all is refused the same way.
    let junk = dir.join("junk.gguf");
    std::fs::write(&junk, b"not a model").unwrap();
    let out = handoff()
        .args(["serve", "--model", junk.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a readable GGUF file"));
    std::fs::remove_dir_all(&dir).ok();
}

/// Discovery flags `handoff serve`'s own pair would not honour are refused,
/// not accepted and ignored (the disaggregated serve registers nothing in
/// etcd and its router does not watch it).
#[test]
fn serve_refuses_discovery_flags_it_would_ignore() {
    fails_with(
        &["serve", "--discovery", "etcd://127.0.0.1:2379"],
        "--discovery is not read by `handoff serve`'s own prefill/decode pair (only by a prefill worker, a decode worker): `handoff serve`'s own workers are not registered",
    );
    fails_with(
        &["serve", "--prefill-allow", "127.0.0.1:8998"],
        "--prefill-allow is not read by `handoff serve`'s own prefill/decode pair (only by a decode worker)",
    );
    fails_with(
        &["serve", "--advertise-host", "10.1.2.3"],
        "the following required arguments were not provided",
    );
    fails_with(
        &["decode", "--discovery-ttl-secs", "5"],
        "--discovery <etcd://HOST:PORT[/PREFIX]>",
    );
    // A worker refuses the flags of the other role, and a colocated serve
    // those of PD (flag_scope.rs has the whole table).
    fails_with(
        &["prefill", "--prefill-allow", "127.0.0.1:8998"],
        "--prefill-allow is not read by a prefill worker (only by a decode worker): drop it",
    );
    fails_with(
        &["serve", "--colocated", "--decode-replicas", "2"],
        "--decode-replicas is not read by a colocated engine",
    );
}

/// A KV pool that cannot fit the machine is a clear error at start, not an
/// OOM kill (the default shrinking to what fits is not tested here: it
/// needs a model larger than the machine allows).
#[test]
fn a_kv_pool_that_cannot_fit_is_refused_at_start() {
    let model = tiny_model("kv-fit");
    let m = model.to_str().unwrap();
    for cmd in [
        vec!["serve", "--colocated", "--model", m, "--port", "0"],
        vec!["serve", "--model", m, "--port", "0"],
    ] {
        let mut args = cmd.clone();
        args.extend(["--kv-pages", "4000000000"]);
        let t = std::time::Instant::now();
        let out = handoff().args(&args).output().expect("run handoff");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(
            stderr.contains("KV pages each") && stderr.contains("of memory is available"),
            "{args:?}: {stderr}"
        );
        assert!(t.elapsed() < std::time::Duration::from_secs(20), "{args:?}");
    }
}

/// A worker told to move KV a way it cannot refuses to start, saying why:
/// NIXL in a build without the `nixl` feature, and on a prefill a transport
/// it would ignore (a prefill serves whatever each decode asks for).
#[test]
fn transfer_choices_a_worker_cannot_honour_are_refused_at_start() {
    let model = tiny_model("transfer-refused");
    let m = model.to_str().unwrap();
    if !cfg!(feature = "nixl") {
        for role in ["prefill", "decode"] {
            let out = handoff()
                .args([role, "--model", m, "--port", "0", "--transfer", "nixl"])
                .output()
                .expect("run handoff");
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{role}: {stderr}");
            assert!(
                stderr.contains("--transfer nixl") && stderr.contains("built without NIXL"),
                "{role}: {stderr}"
            );
        }
    }
    let out = handoff()
        .args(["prefill", "--model", m, "--port", "0", "--transfer", "tcp"])
        .output()
        .expect("run handoff");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("--transfer tcp on a prefill worker")
            && stderr.contains("takes only --transfer nixl"),
        "{stderr}"
    );
}
