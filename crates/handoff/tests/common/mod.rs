//! Helpers the process-level tests share (each test crate uses some of
//! them, hence the allow).
#![allow(dead_code)]

use serde_json::Value;

/// A greedy `/generate` of 6 tokens after a 40-token prompt (one of many,
/// by `prompt`) at `url`: its status and JSON body.
pub async fn generate(url: &str, prompt: u32) -> (u16, Value) {
    let body = serde_json::json!({
        "input_ids": (0..40u32).map(|i| 30 + (i * 7 + prompt) % 150).collect::<Vec<_>>(),
        "sampling_params": {"max_new_tokens": 6, "temperature": 0},
    });
    let r = reqwest::Client::new()
        .post(format!("{url}/generate"))
        .json(&body)
        .send()
        .await
        .expect("answers");
    let s = r.status().as_u16();
    (s, r.json::<Value>().await.unwrap_or(Value::Null))
}

/// The router's `/workers` list at `url`.
pub async fn workers(url: &str) -> Vec<Value> {
    reqwest::get(format!("{url}/workers"))
        .await
        .expect("workers")
        .json::<Value>()
        .await
        .expect("JSON")
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// Read `child`'s standard error (piped) until its own line (not a
/// `[role]`-prefixed child's) says the address it listens on: `before` sees
/// every line up to that one, then `after` every later line, on a thread
/// that drains the log so the child never blocks on a full pipe. `None` if
/// it exited first.
pub fn follow_log(
    child: &mut std::process::Child,
    mut before: impl FnMut(&str),
    mut after: impl FnMut(String) + Send + 'static,
) -> Option<String> {
    use std::io::{BufRead, BufReader};
    let mut lines = BufReader::new(child.stderr.take().expect("stderr piped")).lines();
    let mut url = None;
    for line in lines.by_ref() {
        let line = line.expect("log line");
        before(&line);
        if line.starts_with('[') {
            continue;
        }
        if let Some(i) = line.find("listening on http://") {
            url = Some(format!(
                "http://{}",
                line[i + "listening on http://".len()..].trim()
            ));
            break;
        }
    }
    std::thread::spawn(move || lines.map_while(Result::ok).for_each(&mut after));
    url
}

/// [`follow_log`] seeing only the lines up to the listening one.
pub fn listening_url(child: &mut std::process::Child, each: impl FnMut(&str)) -> Option<String> {
    follow_log(child, each, drop)
}

/// [`follow_log`] keeping every line of the log (before and after).
pub fn listening_url_logged(
    child: &mut std::process::Child,
) -> (
    Option<String>,
    std::sync::Arc<std::sync::Mutex<Vec<String>>>,
) {
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let l = log.clone();
    let url = follow_log(
        child,
        |line| log.lock().unwrap().push(line.to_string()),
        move |line| l.lock().unwrap().push(line),
    );
    (url, log)
}

/// A `handoff serve` process, stopped with SIGTERM (then SIGKILL) on drop.
pub struct Serve {
    pub child: std::process::Child,
    /// Its public URL.
    pub url: String,
    /// Its `worker process started` lines: (role, pid).
    pub workers: std::sync::Arc<std::sync::Mutex<Vec<(String, u32)>>>,
}

impl Serve {
    /// SIGKILL its first worker process of `role`; its pid.
    pub fn kill_first(&self, role: &str) -> u32 {
        let pid = self
            .workers
            .lock()
            .unwrap()
            .iter()
            .find(|(r, _)| r == role)
            .map(|(_, pid)| *pid)
            .unwrap_or_else(|| panic!("no {role} pid"));
        assert!(std::process::Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .unwrap()
            .success());
        pid
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        use std::time::{Duration, Instant};
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The value of `name=` in a log line.
pub fn log_field(line: &str, name: &str) -> Option<String> {
    let i = line.find(&format!("{name}="))?;
    let rest = &line[i + name.len() + 1..];
    Some(
        rest.split_whitespace()
            .next()?
            .trim_matches('"')
            .to_string(),
    )
}

/// Start `handoff serve --port 0 --kv-pages 256 --model MODEL ARGS` with
/// `envs`, and wait until it listens; its worker starts are recorded all
/// along.
pub fn serve(model: &std::path::Path, args: &[&str], envs: &[(&str, &str)]) -> Serve {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_handoff"))
        .args(["serve", "--port", "0", "--kv-pages", "256"])
        .args(args)
        .arg("--model")
        .arg(model)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .envs(envs.iter().copied())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn handoff serve");
    let workers = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = |line: &str, workers: &std::sync::Mutex<Vec<(String, u32)>>| {
        if line.contains("worker process started") {
            if let (Some(role), Some(pid)) = (log_field(line, "role"), log_field(line, "pid")) {
                workers
                    .lock()
                    .unwrap()
                    .push((role, pid.parse().expect("pid")));
            }
        }
    };
    let w = workers.clone();
    let url = follow_log(
        &mut child,
        |line| record(line, &workers),
        move |line| record(&line, &w),
    );
    Serve {
        child,
        url: url.expect("serve never listened"),
        workers,
    }
}

/// Whether `etcd` is on PATH; without it a test skips (saying so), unless
/// `HANDOFF_REQUIRE_ETCD` is set, which makes its absence a failure.
pub fn etcd_on_path() -> bool {
    let found = std::process::Command::new("etcd")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            std::env::var_os("HANDOFF_REQUIRE_ETCD").is_none(),
            "HANDOFF_REQUIRE_ETCD is set but there is no etcd on PATH (apt-get install etcd-server)"
        );
        eprintln!("skipping: no etcd on PATH (apt-get install etcd-server)");
    }
    found
}
