//! `handoff bench` against `handoff serve` on the tiny model: exact request
//! and token counts in the JSON report, and a precise error for an
//! unreachable URL.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

fn handoff() -> Command {
    Command::new(env!("CARGO_BIN_EXE_handoff"))
}

/// Kills the server when the test ends, pass or fail.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn unreachable_url_is_one_precise_line() {
    let out = handoff()
        .args(["bench", "--url", "http://127.0.0.1:1", "--requests", "1"])
        .output()
        .expect("run handoff");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("cannot reach http://127.0.0.1:1 : connection refused"),
        "{stderr}"
    );
}

#[test]
fn bad_flags_are_precise() {
    let out = handoff()
        .args(["bench", "--url", "http://x", "--prompt-len", "uniform:9-3"])
        .output()
        .expect("run handoff");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("uniform:A-B needs A <= B, got 9-3"),
        "{stderr}"
    );
    let out = handoff()
        .args([
            "bench",
            "--url",
            "http://x",
            "--rate",
            "2",
            "--concurrency",
            "2",
        ])
        .output()
        .expect("run handoff");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot be used with"));
    let out = handoff()
        .args([
            "bench",
            "--url",
            "http://x",
            "--mix",
            "1:8/4",
            "--output-len",
            "3",
        ])
        .output()
        .expect("run handoff");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot be used with"));
    let out = handoff()
        .args(["bench", "--url", "http://x", "--mix", "8/4"])
        .output()
        .expect("run handoff");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("a mix class is WEIGHT:PROMPT/OUTPUT"));
}

#[cfg(unix)]
#[test]
fn bench_against_serve_counts_every_request_and_token() {
    let dir = std::env::temp_dir().join(format!("handoff-bench-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("tiny.gguf");
    handoff_model::tiny::write_tiny_gguf(&model, 3).expect("tiny GGUF");
    let mut child = handoff()
        .args(["serve", "--port", "0", "--kv-pages", "64"])
        .arg("--model")
        .arg(&model)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let stderr = child.stderr.take().unwrap();
    let _server = Server(child);
    let mut lines = BufReader::new(stderr).lines();
    let mut addr = None;
    for line in lines.by_ref() {
        let line = line.unwrap();
        // `serve` is router + prefill + decode; the workers' lines start
        // with their role in brackets.
        if line.starts_with('[') {
            continue;
        }
        if let Some(i) = line.find("listening on http://") {
            addr = Some(line[i + "listening on http://".len()..].trim().to_string());
            break;
        }
    }
    let addr = addr.expect("server logs its address");
    // Keep draining the server's log so it never blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));

    let json = dir.join("out.json");
    let out = handoff()
        .args(["bench", "--url", &format!("http://{addr}")])
        .args(["--requests", "6", "--concurrency", "2"])
        .args(["--prompt-len", "32", "--output-len", "8"])
        // The tiny vocabulary is small: stay inside it.
        .args(["--min-token-id", "3", "--max-token-id", "200"])
        .arg("--json")
        .arg(&json)
        .output()
        .expect("run bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("TTFT p99 (ms)"), "{stdout}");

    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let run = &doc["runs"][0];
    assert_eq!(run["ok"], 6, "{run:#}");
    assert_eq!(run["failed"], 0, "{run:#}");
    assert_eq!(run["total_output_tokens"], 48, "{run:#}");
    assert_eq!(run["total_prompt_tokens"], 6 * 32, "{run:#}");
    for metric in ["ttft_ms", "itl_ms", "e2e_ms"] {
        for p in ["p50", "p90", "p99"] {
            let v = run[metric][p].as_f64();
            assert!(v.is_some_and(|v| v > 0.0), "{metric}.{p} = {v:?}");
        }
    }
    assert_eq!(run["requests"].as_array().map(Vec::len), Some(6));
    assert!(run["request_throughput"].as_f64().unwrap() > 0.0);

    // Two classes: every request gets its class's exact output length.
    let out = handoff()
        .args(["bench", "--url", &format!("http://{addr}")])
        .args(["--requests", "8", "--concurrency", "2", "--seed", "3"])
        .args(["--mix", "1:8/2", "--mix", "1:24/5"])
        .args(["--min-token-id", "3", "--max-token-id", "200"])
        .arg("--json")
        .arg(&json)
        .output()
        .expect("run bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("[1] TTFT p50 (ms)"), "{stdout}");
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let run = &doc["runs"][0];
    assert_eq!(run["ok"], 8, "{run:#}");
    let reqs = run["requests"].as_array().unwrap();
    let mut per_class = [0, 0];
    for r in reqs {
        let (class, prompt, output) = match r["class"].as_u64() {
            Some(0) => (0, 8, 2),
            Some(1) => (1, 24, 5),
            other => panic!("class {other:?}"),
        };
        per_class[class] += 1;
        assert_eq!(r["prompt_tokens"], prompt, "{r}");
        assert_eq!(r["output_tokens"], output, "{r}");
    }
    assert!(per_class[0] > 0 && per_class[1] > 0, "{per_class:?}");
    assert_eq!(run["per_class"][1]["ok"], per_class[1]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `handoff bench-transfer --json` on a 4 MiB workload with `args`: its
/// report (the command must succeed).
fn bench_transfer_json(args: &[&str]) -> serde_json::Value {
    let out = handoff()
        .args(["bench-transfer", "--bytes", "4194304", "--json"])
        .args(args)
        .output()
        .expect("run handoff bench-transfer");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON report")
}

/// The latency part of `bench-transfer` on a small pool: every latency
/// figure is there, the tcp/ping-pong ratio is the ratio of the two medians
/// printed (also in each pinned placement), and a bad `--pin` is refused
/// with the values it takes.
#[test]
fn bench_transfer_latency_report_is_complete() {
    let r = bench_transfer_json(&["--only", "latency", "--latency-iters", "20"]);
    let med = |k: &str| r[k]["median_us"].as_f64().unwrap_or(0.0);
    for k in [
        "latency_4k",
        "latency_4k_raw_tcp",
        "latency_4k_shm",
        "latency_4k_off_runtime",
        "abort_release",
    ] {
        assert!(med(k) > 0.0, "{k}: {}", r[k]);
        assert!(r[k]["p99_us"].as_f64().unwrap_or(0.0) >= med(k), "{k}");
    }
    let ratio = r["latency_4k_vs_raw_tcp"].as_f64().expect("ratio");
    assert!(
        (ratio - med("latency_4k") / med("latency_4k_raw_tcp")).abs() < 1e-9,
        "{ratio}"
    );
    assert_eq!(r["cases"].as_array().map(Vec::len), Some(0), "latency only");
    // Unpinned, the comparison is made again with both processes pinned
    // apart and together (this machine has CPUs 0 and 1).
    let placed = r["latency_4k_placed"].as_array().expect("placed latencies");
    if std::thread::available_parallelism().map_or(1, |n| n.get()) >= 2 {
        let names: Vec<&str> = placed
            .iter()
            .filter_map(|p| p["placement"].as_str())
            .collect();
        assert_eq!(names, ["split", "same"]);
        for p in placed {
            let (tcp, raw) = (
                p["tcp"]["median_us"].as_f64().unwrap_or(0.0),
                p["raw_tcp"]["median_us"].as_f64().unwrap_or(0.0),
            );
            assert!(tcp > 0.0 && raw > 0.0, "{p}");
            let ratio = p["tcp_vs_raw_tcp"].as_f64().expect("placed ratio");
            assert!((ratio - tcp / raw).abs() < 1e-9, "{p}");
        }
    }

    let out = handoff()
        .args(["bench-transfer", "--pin", "both"])
        .output()
        .expect("run handoff bench-transfer");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("invalid value 'both' for '--pin <PIN>'") && err.contains("same, split"),
        "{err}"
    );
}

/// The bandwidth part of `bench-transfer` on a small pool: every page case
/// has both transports and their baselines (memcpy for shm, raw TCP for
/// tcp), each with one verified rate and CPU time per timed run and the
/// median of those rates; each of ours carries its ratio to its baseline.
#[test]
fn bench_transfer_bandwidth_report_pairs_each_transport_with_its_baseline() {
    let r = bench_transfer_json(&["--runs", "3", "--latency-iters", "20"]);
    let cases = r["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 16, "{cases:?}");
    let find = |transport: &str, page: &str| {
        cases
            .iter()
            .find(|c| c["transport"] == transport && c["page"] == page)
            .unwrap_or_else(|| panic!("no {transport} {page} case"))
    };
    for page in ["contiguous", "4KiB", "64KiB", "256KiB"] {
        for (ours, base) in [("shm", "memcpy"), ("tcp", "raw_tcp")] {
            let (o, b) = (find(ours, page), find(base, page));
            for c in [o, b] {
                assert_eq!(c["bytes"], 4194304, "{c}");
                assert_eq!(c["verified"], true, "{c}");
                let mut runs: Vec<f64> = c["gbps_runs"]
                    .as_array()
                    .expect("gbps_runs")
                    .iter()
                    .filter_map(|x| x.as_f64())
                    .collect();
                assert_eq!(runs.len(), 3, "{c}");
                assert!(runs.iter().all(|g| *g > 0.0), "{c}");
                runs.sort_by(f64::total_cmp);
                assert_eq!(c["gbps_median"].as_f64(), Some(runs[1]), "{c}");
                assert_eq!(c["cpu_s_runs"].as_array().map(Vec::len), Some(3), "{c}");
            }
            assert!(b["ratio"].is_null(), "{b}");
            let want = o["gbps_median"].as_f64().unwrap() / b["gbps_median"].as_f64().unwrap();
            let ratio = o["ratio"].as_f64().expect("ratio");
            assert!(
                (ratio - want).abs() < 1e-9,
                "{ours} {page}: {ratio} vs {want}"
            );
        }
    }
}
