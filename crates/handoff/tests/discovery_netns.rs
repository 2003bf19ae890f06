//! Discovery across hosts (issue 15): etcd, the prefill and the decode
//! worker each in a network namespace of their own, joined by a bridge,
//! and the router in the test's namespace. The workers register with the
//! addresses of their namespaces, the router finds both through etcd, the
//! decode worker picks the tcp transport by itself (its prefill is not on
//! loopback), and the answers equal colocated serving.
//!
//! Needs root, `ip` (iproute2) and `etcd`; without them the test says so
//! and passes, unless `HANDOFF_REQUIRE_NETNS` / `HANDOFF_REQUIRE_ETCD` is
//! set (`scripts/test.sh` sets both as root).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;

mod common;
use common::{generate, workers};

/// Namespaces `e` (etcd), `p` (prefill), `d` (decode) on a bridge in a hub
/// namespace, which the test's namespace reaches over a veth pair of its
/// own. Addresses `10.233.N.1` (here), `.2` (e), `.3` (p), `.4` (d).
struct Net {
    tag: String,
    net: u32,
}

const MEMBERS: [(&str, u32); 3] = [("e", 2), ("p", 3), ("d", 4)];

impl Net {
    fn new() -> Option<Net> {
        let pid = std::process::id();
        let net = Net {
            tag: format!("hdn{}", pid % 100_000),
            net: pid % 250 + 1,
        };
        let hub = net.ns("hub");
        let mut steps: Vec<Vec<String>> = vec![
            cmd(&["ip", "netns", "add", &hub]),
            cmd(&["ip", "-n", &hub, "link", "add", "br0", "type", "bridge"]),
            cmd(&["ip", "-n", &hub, "link", "set", "br0", "up"]),
            // Our own leg: `<tag>h` here, `h-here` in the hub.
            cmd(&[
                "ip",
                "link",
                "add",
                &format!("{}h", net.tag),
                "type",
                "veth",
                "peer",
                "name",
                "h-here",
                "netns",
                &hub,
            ]),
            cmd(&[
                "ip", "-n", &hub, "link", "set", "h-here", "master", "br0", "up",
            ]),
            cmd(&[
                "ip",
                "addr",
                "add",
                &format!("{}/24", net.ip(1)),
                "dev",
                &format!("{}h", net.tag),
            ]),
            cmd(&["ip", "link", "set", &format!("{}h", net.tag), "up"]),
        ];
        for (k, host) in MEMBERS {
            let ns = net.ns(k);
            steps.extend([
                cmd(&["ip", "netns", "add", &ns]),
                cmd(&["ip", "-n", &ns, "link", "set", "lo", "up"]),
                cmd(&[
                    "ip",
                    "-n",
                    &hub,
                    "link",
                    "add",
                    &format!("h-{k}"),
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "netns",
                    &ns,
                ]),
                cmd(&[
                    "ip",
                    "-n",
                    &hub,
                    "link",
                    "set",
                    &format!("h-{k}"),
                    "master",
                    "br0",
                    "up",
                ]),
                cmd(&[
                    "ip",
                    "-n",
                    &ns,
                    "addr",
                    "add",
                    &format!("{}/24", net.ip(host)),
                    "dev",
                    "eth0",
                ]),
                cmd(&["ip", "-n", &ns, "link", "set", "eth0", "up"]),
            ]);
        }
        for step in steps {
            let out = Command::new(&step[0]).args(&step[1..]).output();
            let failed = match &out {
                Ok(o) if o.status.success() => continue,
                Ok(o) => String::from_utf8_lossy(&o.stderr).into_owned(),
                Err(e) => e.to_string(),
            };
            let why = format!("{}: {failed}", step.join(" "));
            drop(net);
            assert!(
                std::env::var_os("HANDOFF_REQUIRE_NETNS").is_none(),
                "network namespace setup failed: {why}"
            );
            eprintln!(
                "skipped: no network namespace ({why}); HANDOFF_REQUIRE_NETNS makes this fail"
            );
            return None;
        }
        Some(net)
    }

    fn ns(&self, k: &str) -> String {
        format!("{}-{k}", self.tag)
    }

    fn ip(&self, host: u32) -> String {
        format!("10.233.{}.{host}", self.net)
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for k in ["e", "p", "d", "hub"] {
            let _ = Command::new("ip")
                .args(["netns", "del", &self.ns(k)])
                .output();
        }
        let _ = Command::new("ip")
            .args(["link", "del", &format!("{}h", self.tag)])
            .output();
    }
}

fn cmd(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// A process, killed on drop, with every line of its standard error.
struct Proc {
    child: Child,
    log: Arc<Mutex<Vec<String>>>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    /// Start `program args` (in namespace `ns` if given), keeping its log.
    fn start(ns: Option<&str>, program: &str, args: &[&str]) -> Proc {
        let mut c = match ns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, program]);
                c
            }
            None => Command::new(program),
        };
        let mut child = c
            .args(args)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .env("HANDOFF_TRANSFER_SECRET", "netns discovery test secret")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {program}: {e}"));
        let log = Arc::new(Mutex::new(Vec::new()));
        let lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let l = log.clone();
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                l.lock().unwrap().push(line);
            }
        });
        Proc { child, log }
    }

    /// Wait until a log line contains `what`; that line.
    fn wait_log(&mut self, what: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            if let Some(l) = self.log.lock().unwrap().iter().find(|l| l.contains(what)) {
                return l.clone();
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "exited ({status}) before logging {what:?}:\n{}",
                    self.log.lock().unwrap().join("\n")
                );
            }
            assert!(
                Instant::now() < deadline,
                "no {what:?} within {within:?}:\n{}",
                self.log.lock().unwrap().join("\n")
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn listening(p: &mut Proc) -> String {
    let line = p.wait_log("listening on http://", Duration::from_secs(120));
    let i = line.find("listening on http://").unwrap();
    format!("http://{}", line[i + "listening on http://".len()..].trim())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_and_decode_on_two_hosts_find_each_other_in_etcd_on_a_third() {
    if !common::etcd_on_path() {
        return;
    }
    let Some(net) = Net::new() else { return };
    let dir = std::env::temp_dir().join(format!("handoff-netns-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("tiny.gguf");
    handoff_model::tiny::write_tiny_gguf(&model, 5).expect("tiny GGUF");
    let model = model.to_str().unwrap();
    let exe = env!("CARGO_BIN_EXE_handoff");

    // etcd on the third host.
    let client_url = format!("http://{}:2379", net.ip(2));
    let _etcd = Proc::start(
        Some(&net.ns("e")),
        "etcd",
        &[
            "--name",
            "t",
            "--data-dir",
            dir.join("etcd").to_str().unwrap(),
            "--listen-client-urls",
            &client_url,
            "--advertise-client-urls",
            &client_url,
            "--listen-peer-urls",
            "http://127.0.0.1:2380",
            "--initial-advertise-peer-urls",
            "http://127.0.0.1:2380",
            "--initial-cluster",
            "t=http://127.0.0.1:2380",
        ],
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while !reqwest::Client::new()
        .post(format!("{client_url}/v3/kv/range"))
        .json(&json!({"key": "AA=="}))
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
    {
        assert!(
            Instant::now() < deadline,
            "etcd never answered across the bridge"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let discovery = format!("etcd://{}:2379/netns", net.ip(2));

    // Prefill and decode, each on its own host, told only where etcd is.
    let worker = |role: &str, host: u32, extra: &[&str]| {
        let ip = net.ip(host);
        let mut args = vec![
            role,
            "--model",
            model,
            "--kv-pages",
            "256",
            "--host",
            &ip,
            "--port",
            "30001",
            "--discovery",
            &discovery,
        ];
        args.extend(extra);
        Proc::start(
            Some(&net.ns(if role == "prefill" { "p" } else { "d" })),
            exe,
            &args,
        )
    };
    let mut prefill = worker("prefill", 3, &["--disaggregation-bootstrap-port", "31001"]);
    let mut decode = worker("decode", 4, &[]);
    listening(&mut prefill);
    listening(&mut decode);

    // The router here, with no worker on its command line.
    let mut router = Proc::start(
        None,
        exe,
        &["router", "--port", "0", "--discovery", &discovery],
    );
    let r = listening(&mut router);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let w = workers(&r).await;
        let healthy = |role: &str| {
            w.iter()
                .any(|x| x["role"] == role && x["health"] == "healthy")
        };
        if healthy("prefill") && healthy("decode") {
            let urls: Vec<&str> = w.iter().filter_map(|x| x["url"].as_str()).collect();
            assert!(
                urls.contains(&format!("http://{}:30001", net.ip(3)).as_str()),
                "{w:#?}"
            );
            assert!(
                urls.contains(&format!("http://{}:30001", net.ip(4)).as_str()),
                "{w:#?}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "workers not found: {w:#?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Colocated serving of the same model, for the reference answers.
    let mut colocated = Proc::start(
        None,
        exe,
        &[
            "serve",
            "--colocated",
            "--model",
            model,
            "--port",
            "0",
            "--kv-pages",
            "256",
        ],
    );
    let c = listening(&mut colocated);
    for p in 0..3u32 {
        let (s, want) = generate(&c, p).await;
        assert_eq!(s, 200, "{want}");
        let (s, got) = generate(&r, p).await;
        assert_eq!(s, 200, "{got}");
        assert_eq!(got["output_ids"], want["output_ids"], "prompt {p}");
        assert!(!got["output_ids"].as_array().unwrap().is_empty());
    }
    // The decode worker chose tcp on its own: its prefill is on another
    // host.
    let line = decode.wait_log("connected to a prefill", Duration::from_secs(5));
    assert!(line.contains("transport=\"tcp\""), "{line}");
    assert!(line.contains(&format!("{}:31001", net.ip(3))), "{line}");
    drop((router, colocated, prefill, decode));
    drop(net);
    let _ = std::fs::remove_dir_all(&dir);
}
