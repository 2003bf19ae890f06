#!/usr/bin/env python3
"""Scale-out benchmarks of issue 15, as ratios and counts measured in one run.

  router   the router's added latency: the same /generate sent through the
           router and straight to a prefill and a decode worker (the client
           doing the router's job: one body with the bootstrap fields to
           both), alternating, N pairs; median and p99 of each and of the
           difference.
  kill     a decode replica SIGKILLed under a closed-loop load: failed
           requests (split: in flight on it vs started after it was gone,
           target 0), and the time from the kill until the router no longer
           chooses it (unhealthy or gone from /workers). Twice: `handoff
           serve --prefill-replicas 2 --decode-replicas 2` (static list,
           supervisor restarts it) and hand-started workers found through
           etcd (lease TTL 3 s).
  replicas 1P1D vs 2P2D (`handoff serve`) at the same offered load, by
           `handoff bench --baseline-url`.

Usage: scripts/bench-scaleout.py [--model GGUF] [router|kill|replicas ...]
Needs a release build (cargo build --release) and, for `kill`, etcd.
"""
import argparse
import http.client
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXE = os.path.join(ROOT, "target", "release", "handoff")
SECRET = "bench-scaleout secret"
PROMPT_TOKENS = 48


class Proc:
    """A process whose standard error goes to a file we can search."""

    def __init__(self, args, name):
        self.name = name
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"hoff-{name}-", delete=False)
        env = dict(os.environ, RUST_LOG="info", NO_COLOR="1", HANDOFF_TRANSFER_SECRET=SECRET)
        self.p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=self.log, env=env,
                                  stdin=subprocess.DEVNULL)

    def lines(self):
        with open(self.log.name) as f:
            return f.read().splitlines()

    def wait_for(self, text, within=300):
        deadline = time.time() + within
        while time.time() < deadline:
            for line in self.lines():
                if text in line and not line.startswith("["):
                    return line
            if self.p.poll() is not None:
                sys.exit(f"{self.name} exited:\n" + "\n".join(self.lines()[-20:]))
            time.sleep(0.1)
        sys.exit(f"{self.name}: no {text!r} within {within} s")

    def url(self):
        line = self.wait_for("listening on http://")
        return "http://" + line.split("listening on http://")[1].strip()

    def stop(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        os.unlink(self.log.name)


def post(url, path, body, timeout=120):
    host, port = url.removeprefix("http://").split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=timeout)
    t0 = time.perf_counter()
    try:
        c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
        return r.status, data, time.perf_counter() - t0
    except OSError as e:
        return 0, str(e).encode(), time.perf_counter() - t0
    finally:
        c.close()


def get_json(url, path):
    host, port = url.removeprefix("http://").split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        c.request("GET", path)
        return json.loads(c.getresponse().read())
    finally:
        c.close()


def body(i, new_tokens):
    rng = random.Random(i)
    return {"input_ids": [rng.randrange(100, 20000) for _ in range(PROMPT_TOKENS)],
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0}}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def free_port():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


# ---- router overhead ---------------------------------------------------


def bench_router(model, pairs):
    global PROMPT_TOKENS
    PROMPT_TOKENS = 8  # little model time, so the router's part shows
    bp = free_port()
    prefill = Proc([EXE, "prefill", "--model", model, "--port", "0", "--kv-pages", "1024",
                    "--disaggregation-bootstrap-port", str(bp)], "prefill")
    # Decode trusts this prefill by name (--prefill-allow), so the client
    # can send the bootstrap fields without the router's signature.
    decode = Proc([EXE, "decode", "--model", model, "--port", "0", "--kv-pages", "1024",
                   "--prefill-allow", f"127.0.0.1:{bp}"], "decode")
    p_url, d_url = prefill.url(), decode.url()
    router = Proc([EXE, "router", "--port", "0", "--prefill", p_url, str(bp), "--decode", d_url],
                  "router")
    r_url = router.url()
    time.sleep(1.5)  # the router's first probes

    def direct(i):
        b = dict(body(i, 1), bootstrap_host="127.0.0.1", bootstrap_port=bp,
                 bootstrap_room=random.getrandbits(62))
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("p", post(p_url, "/generate", b)))
        t0 = time.perf_counter()
        t.start()
        s, data, _ = post(d_url, "/generate", b)
        took = time.perf_counter() - t0
        t.join()
        assert s == 200 and out["p"][0] == 200, (s, data, out["p"][:2])
        return took, json.loads(data)["output_ids"]

    def routed(i):
        s, data, took = post(r_url, "/generate", body(i, 1))
        assert s == 200, (s, data)
        return took, json.loads(data)["output_ids"]

    for i in range(10):  # warm both paths
        direct(i), routed(i)
    d_ms, r_ms, diff = [], [], []
    for i in range(pairs):
        if i % 2:
            (b, out_b), (a, out_a) = routed(i), direct(i)
        else:
            (a, out_a), (b, out_b) = direct(i), routed(i)
        assert out_a == out_b, (out_a, out_b)
        d_ms.append(a * 1e3)
        r_ms.append(b * 1e3)
        diff.append((b - a) * 1e3)
    for p in (router, prefill, decode):
        p.stop()
    print(f"router overhead, {pairs} pairs of /generate ({PROMPT_TOKENS}-token prompt, 1 new token), "
          "same outputs both ways:")
    print(f"  direct  p50 {statistics.median(d_ms):7.2f} ms  p99 {pct(d_ms, .99):7.2f} ms")
    print(f"  router  p50 {statistics.median(r_ms):7.2f} ms  p99 {pct(r_ms, .99):7.2f} ms")
    print(f"  added   p50 {statistics.median(r_ms) - statistics.median(d_ms):7.2f} ms  "
          f"p99 {pct(r_ms, .99) - pct(d_ms, .99):7.2f} ms   "
          f"(per-pair difference: p50 {statistics.median(diff):.2f} ms, "
          f"p99 {pct(diff, .99):.2f} ms)")
    PROMPT_TOKENS = 48


# ---- SIGKILL of a decode replica ----------------------------------------


def load(url, stop, out, k):
    i = k * 100000
    while not stop.is_set():
        t0 = time.time()
        s, data, _ = post(url, "/generate", body(i % 16, 16))
        out.append((t0, time.time(), s, data))
        i += 1


def kill_under_load(name, url, victim_pid, victim_url, workers_gone):
    """Load 4 clients for 3 s, SIGKILL the victim, load 5 s more."""
    stop, out = threading.Event(), []
    ts = [threading.Thread(target=load, args=(url, stop, out, k)) for k in range(4)]
    for t in ts:
        t.start()
    time.sleep(3)
    killed = time.time()
    os.kill(victim_pid, signal.SIGKILL)
    unhealthy = removed = None
    while time.time() - killed < 8:
        w = {x["url"]: x for x in get_json(url, "/workers") if "url" in x}
        now = time.time() - killed
        x = w.get(victim_url)
        if x is None and removed is None:
            removed = now
        if (x is None or x["health"] != "healthy") and unhealthy is None:
            unhealthy = now
        if unhealthy is not None and (removed is not None or not workers_gone):
            break
        time.sleep(0.01)
    time.sleep(max(0, 5 - (time.time() - killed)))
    stop.set()
    for t in ts:
        t.join()
    gone_by = killed + 0.3
    failed_inflight = [r for r in out if r[2] != 200 and r[0] < gone_by]
    failed_after = [r for r in out if r[2] != 200 and r[0] >= gone_by]
    after = [r for r in out if r[0] >= gone_by]
    print(f"{name}: {len(out)} requests, {len(after)} started after the kill; failed: "
          f"{len(failed_inflight)} in flight on the killed replica, "
          f"{len(failed_after)} started after it was gone (target 0)")
    print(f"  not chosen any more (unhealthy) {unhealthy:.2f} s after the kill"
          + (f"; gone from /workers after {removed:.2f} s (lease TTL 3 s)" if workers_gone else ""))
    for r in failed_inflight[:4] + failed_after[:4]:
        print(f"    started {r[0] - killed:+.2f} s, ended {r[1] - killed:+.2f} s: {r[2]} "
              f"{r[3][:160]!r}")


def bench_kill(model):
    serve = Proc([EXE, "serve", "--model", model, "--port", "0", "--kv-pages", "512",
                  "--prefill-replicas", "2", "--decode-replicas", "2"], "serve")
    url = serve.url()
    time.sleep(2)
    line = next(x for x in serve.lines() if "worker process started" in x and "decode" in x)
    pid = int(line.split("pid=")[1].split()[0])
    port = line.split("port=")[1].split()[0]
    kill_under_load("handoff serve 2P2D", url, pid, f"http://127.0.0.1:{port}", False)
    serve.stop()

    if shutil.which("etcd") is None:
        print("etcd: not on PATH, skipped (apt-get install etcd-server)")
        return
    data = tempfile.mkdtemp(prefix="hoff-etcd-")
    cp, pp = free_port(), free_port()
    etcd = Proc(["etcd", "--name", "b", "--data-dir", data,
                 "--listen-client-urls", f"http://127.0.0.1:{cp}",
                 "--advertise-client-urls", f"http://127.0.0.1:{cp}",
                 "--listen-peer-urls", f"http://127.0.0.1:{pp}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{pp}",
                 "--initial-cluster", f"b=http://127.0.0.1:{pp}"], "etcd")
    time.sleep(2)
    ep = f"etcd://127.0.0.1:{cp}/bench"
    common = ["--model", model, "--port", "0", "--kv-pages", "512", "--discovery", ep]
    ws = [Proc([EXE, "prefill", *common, "--disaggregation-bootstrap-port", "0"], "prefill")]
    ws += [Proc([EXE, "decode", *common], f"decode{i}") for i in range(2)]
    urls = [w.url() for w in ws]
    router = Proc([EXE, "router", "--port", "0", "--discovery", ep], "router")
    r_url = router.url()
    time.sleep(2)
    kill_under_load("etcd discovery 1P2D", r_url, ws[1].p.pid, urls[1], True)
    for p in [router, *ws, etcd]:
        p.stop()
    shutil.rmtree(data, ignore_errors=True)


# ---- 1P1D vs 2P2D -----------------------------------------------------------


def bench_replicas(model, rate, requests):
    one = Proc([EXE, "serve", "--model", model, "--port", "0", "--kv-pages", "1024"], "1p1d")
    two = Proc([EXE, "serve", "--model", model, "--port", "0", "--kv-pages", "1024",
                "--prefill-replicas", "2", "--decode-replicas", "2"], "2p2d")
    u1, u2 = one.url(), two.url()
    time.sleep(2)
    cmd = [EXE, "bench", "--url", u2, "--label", "2P2D", "--baseline-url", u1,
           "--baseline-label", "1P1D", "--rate", str(rate), "--requests", str(requests),
           "--prompt-len", "128", "--output-len", "32", "--seed", "7"]
    print("$", " ".join(cmd[1:]))
    subprocess.run(cmd, check=True)
    one.stop()
    two.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "models",
                                                    "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--pairs", type=int, default=200)
    ap.add_argument("--rate", type=float, default=3.0)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("what", nargs="*", default=["router", "kill", "replicas"])
    a = ap.parse_args()
    if not os.path.exists(EXE):
        sys.exit("build first: cargo build --release")
    for w in a.what:
        {"router": lambda: bench_router(a.model, a.pairs),
         "kill": lambda: bench_kill(a.model),
         "replicas": lambda: bench_replicas(a.model, a.rate, a.requests)}[w]()


if __name__ == "__main__":
    main()
