//! Helpers the process-level tests share (each test crate uses some of
//! them, hence the allow).
#![allow(dead_code)]

use serde_json::Value;

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

/// Read `child`'s standard error (piped) until it logs the address it
/// listens on; `each` sees every line up to that one. The rest of the log
/// is drained on a thread so the child never blocks on a full pipe. `None`
/// if it exited first.
pub fn listening_url(
    child: &mut std::process::Child,
    mut each: impl FnMut(&str),
) -> Option<String> {
    use std::io::{BufRead, BufReader};
    let mut lines = BufReader::new(child.stderr.take().expect("stderr piped")).lines();
    let mut url = None;
    for line in lines.by_ref() {
        let line = line.expect("log line");
        each(&line);
        if let Some(i) = line.find("listening on http://") {
            url = Some(format!(
                "http://{}",
                line[i + "listening on http://".len()..].trim()
            ));
            break;
        }
    }
    std::thread::spawn(move || for _ in lines.by_ref() {});
    url
}
