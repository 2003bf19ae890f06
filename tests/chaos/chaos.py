#!/usr/bin/env python3
"""handoff's chaos suite (issue 14 item 8). Run as root: scripts/chaos.sh.

Prefill, decode and router run as real `handoff` processes in three network
namespaces joined by veth pairs to a bridge in a fourth, so KV moves over
tcp and every link can be cut. Decode reaches the prefill's transfer
endpoint through a proxy (in the prefill's namespace) that can inject
malformed frames into live connections. While a bounded, seeded load runs
through the router, a seeded schedule of faults lands at random moments
(so requests are in every phase: bootstrap, waiting for pages, transfer,
decode): SIGKILL, SIGTERM and SIGSTOP of each process, link down, 100%
loss and 300 ms delay (tc netem) on each namespace's link, malformed frames
injected into live control connections (both directions) and data links
(decode's acks), garbage on fresh transfer connections, a peer replaying a
recorded protocol-1 handshake, and client disconnects in the load itself.

Every answer is classified: output equal to the fault-free greedy output,
a typed error (a JSON error with a message, as a status or an SSE error
event; or the router's port refusing while it is down), a stream cut by a
killed router, a client disconnect (by design), garbage (a 200 whose text
differs from the reference, or a malformed answer), or hung (no answer
within the deadline). After the load, faults heal and the suite waits for
the workers to settle, then reads the pages and rooms each still holds.
It exits non-zero on any garbage, hang or leak.

`--faults kill-workers --require-no-errors` (issue 32): only SIGKILLs of the
prefill and the decode, and the verdict also needs every request to
complete with the reference output: a worker's death must cost no client
anything (streams continue on the restarted decode, a dead prefill's
requests are prefilled on the decode, a request waits for a worker being
restarted).
"""
import argparse
import http.client
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

HUB = "hoff-chaos-hub"
NS = {"p": "hoff-chaos-p", "d": "hoff-chaos-d", "r": "hoff-chaos-r"}
IP = {"p": "10.231.0.1", "d": "10.231.0.2", "r": "10.231.0.3"}
HTTP_PORT = {"p": 30001, "d": 30002, "r": 30000}
TRANSFER_PORT = 31001
PROXY_PORT = 31002
NAMES = {"p": "prefill", "d": "decode", "r": "router"}
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

PROMPTS = [
    "The capital of France is",
    "Write one sentence about the sea.",
    "List three colours:",
    "Explain in a few words why the sky is blue.",
    "A haiku about autumn leaves:",
    "Translate 'good morning' into Spanish:",
    "The first five prime numbers are",
    "Once upon a time, in a small village by the mountains, there lived an old "
    "clockmaker who repaired every clock in the valley. One winter morning a "
    "stranger knocked on his door carrying a clock that had no hands. The "
    "clockmaker looked at it for a long time and said",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Q: What is the boiling point of water at sea level in Celsius?\nA:",
    "Summarise the plot of Romeo and Juliet in one line:",
    "Three tips for learning a new language: 1.",
]
KINDS = ["cmpl", "cmpl-stream", "chat", "chat-stream", "generate"]
MAX_TOKENS = 8


def run(*cmd, check=True):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return r


def in_ns(k, *cmd, check=True):
    return run("ip", "netns", "exec", NS[k], *cmd, check=check)


# ---- network -------------------------------------------------------------


def teardown_net():
    for ns in list(NS.values()) + [HUB]:
        run("ip", "netns", "del", ns, check=False)


def setup_net():
    teardown_net()
    run("ip", "netns", "add", HUB)
    run("ip", "-n", HUB, "link", "add", "br0", "type", "bridge")
    run("ip", "-n", HUB, "link", "set", "br0", "up")
    for k, ns in NS.items():
        run("ip", "netns", "add", ns)
        run("ip", "-n", ns, "link", "set", "lo", "up")
        run("ip", "-n", HUB, "link", "add", f"h-{k}", "type", "veth", "peer", "name", "eth0",
            "netns", ns)
        run("ip", "-n", HUB, "link", "set", f"h-{k}", "master", "br0", "up")
        run("ip", "-n", ns, "addr", "add", f"{IP[k]}/24", "dev", "eth0")
        run("ip", "-n", ns, "link", "set", "eth0", "up")


def link(k, up):
    run("ip", "-n", NS[k], "link", "set", "eth0", "up" if up else "down")


NETEM = None


def has_netem():
    """Whether this kernel has the netem qdisc (some VM kernels lack it)."""
    global NETEM
    if NETEM is None:
        r = in_ns("p", "tc", "qdisc", "add", "dev", "eth0", "root", "netem", "delay", "1ms",
                  check=False)
        NETEM = r.returncode == 0
        in_ns("p", "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
    return NETEM


def impair(k, what):
    """`loss` (100%) or `delay` on namespace `k`'s link, `None` to heal.
    With netem: loss 100% / delay 300 ms. Without it: loss is an iptables
    DROP of everything in and out, and delay a 1 Mbit/s token bucket (tbf),
    which delays by queueing (a KV transfer of a long prompt takes seconds)."""
    in_ns(k, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
    for chain in ("INPUT", "OUTPUT"):
        while in_ns(k, "iptables", "-D", chain, "-i" if chain == "INPUT" else "-o", "eth0",
                    "-j", "DROP", check=False).returncode == 0:
            pass
    if what is None:
        return
    if has_netem():
        args = ["loss", "100%"] if what == "loss" else ["delay", "300ms"]
        in_ns(k, "tc", "qdisc", "add", "dev", "eth0", "root", "netem", *args)
    elif what == "loss":
        in_ns(k, "iptables", "-A", "INPUT", "-i", "eth0", "-j", "DROP")
        in_ns(k, "iptables", "-A", "OUTPUT", "-o", "eth0", "-j", "DROP")
    else:
        in_ns(k, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "1mbit", "burst",
              "32kbit", "latency", "5s")


# ---- the proxy that injects malformed frames --------------------------------

FRAME_HEADER = 12
BAD_FRAME = b"HOFF" + bytes([1, 0x63, 0, 0]) + struct.pack("<I", 0)  # unknown kind 99


class Framer:
    """Finds frame boundaries in one direction of a connection: `skip`
    bytes first (a preface), then `frames` control frames, then (data links,
    decode to prefill) `setup` bytes and fixed `record` bytes each."""

    def __init__(self, skip, frames_only, setup=0, record=0):
        self.skip, self.frames_only, self.setup, self.record = skip, frames_only, setup, record
        self.buf = b""
        self.frames_seen = 0

    def feed(self, data, inject):
        """Forward `data`; if `inject` is set, put a malformed frame (or ack)
        at the first boundary after the handshake. Returns (bytes, injected)."""
        out, injected = b"", False
        self.buf += data
        while True:
            if self.skip:
                n = min(self.skip, len(self.buf))
                out, self.buf, self.skip = out + self.buf[:n], self.buf[n:], self.skip - n
                if self.skip:
                    return out, injected
                continue
            if self.frames_only or self.frames_seen < 2:
                if len(self.buf) < FRAME_HEADER:
                    return out, injected
                (length,) = struct.unpack("<I", self.buf[8:12])
                total = FRAME_HEADER + length
                if len(self.buf) < total:
                    return out, injected
                if inject and not injected and self.frames_seen >= 2:
                    out += BAD_FRAME
                    injected = True
                out, self.buf = out + self.buf[:total], self.buf[total:]
                self.frames_seen += 1
                if not self.frames_only and self.frames_seen == 2:
                    self.skip = self.setup
                continue
            # Decode's acks on a data link: fixed records.
            if len(self.buf) < self.record:
                return out, injected
            if inject and not injected:
                out += b"\xee" * self.record
                injected = True
            out, self.buf = out + self.buf[: self.record], self.buf[self.record:]


class Proxy:
    """TCP proxy in front of the prefill's transfer endpoint. SIGUSR1: inject
    a malformed frame into every live control connection (both directions);
    SIGUSR2: a malformed ack into every live data link."""

    def __init__(self, listen, target):
        self.listen, self.target = listen, target
        self.want = {"C": 0, "D": 0}
        self.lock = threading.Lock()
        signal.signal(signal.SIGUSR1, lambda *_: self.arm("C"))
        signal.signal(signal.SIGUSR2, lambda *_: self.arm("D"))

    def arm(self, kind):
        with self.lock:
            self.want[kind] += 1

    def take(self, kind, seen):
        with self.lock:
            return self.want[kind] > seen

    def serve(self):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(self.listen)
        s.listen(128)
        print("PROXY READY", flush=True)
        while True:
            c, _ = s.accept()
            threading.Thread(target=self.pair, args=(c,), daemon=True).start()

    def pair(self, c):
        try:
            u = socket.create_connection(self.target)
        except OSError:
            c.close()
            return
        first = c.recv(1, socket.MSG_PEEK)
        kind = "C" if first == b"C" else "D"
        if kind == "C":
            up, down = Framer(17, True), Framer(0, True)
        else:
            # Preface, Register + AuthProof, tcp setup (1 + 8 + 10), acks.
            up, down = Framer(17, False, setup=19, record=10), None
        with self.lock:
            base = self.want[kind]
        state = {"seen": base}
        for src, dst, fr in ((c, u, up), (u, c, down)):
            threading.Thread(target=self.pump, args=(src, dst, fr, kind, state),
                             daemon=True).start()

    def pump(self, src, dst, framer, kind, state):
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if framer is not None:
                    inject = self.take(kind, state["seen"])
                    data, done = framer.feed(data, inject)
                    if done:
                        state["seen"] += 1
                        print(f"PROXY injected into a {kind} connection", flush=True)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


# ---- processes -------------------------------------------------------------


class Proc:
    def __init__(self, k, argv, log_dir):
        self.k, self.argv = k, argv
        self.log = open(os.path.join(log_dir, f"{NAMES[k]}.log"), "ab")
        self.p = None
        self.restarts = 0

    def start(self):
        self.p = subprocess.Popen(["ip", "netns", "exec", NS[self.k]] + self.argv,
                                  stdout=self.log, stderr=subprocess.STDOUT,
                                  start_new_session=True)

    def signal(self, sig):
        if self.p and self.p.poll() is None:
            os.killpg(self.p.pid, sig)

    def stop_for_good(self):
        if self.p and self.p.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGKILL)
            self.p.wait()


def http_get(host, port, path, timeout=2.0):
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read().decode("utf-8", "replace")
    finally:
        c.close()


def wait_healthy(k, timeout):
    end = time.time() + timeout
    while time.time() < end:
        try:
            if http_get(IP[k], HTTP_PORT[k], "/health")[0] == 200:
                return True
        except OSError:
            pass
        time.sleep(0.1)
    return False


def metrics(k):
    try:
        http_get(IP[k], HTTP_PORT[k], "/flush_cache")
        _, text = http_get(IP[k], HTTP_PORT[k], "/metrics")
    except OSError as e:
        return {"error": str(e)}
    out = {}
    for line in text.splitlines():
        for name in ("handoff_kv_pages_used", "handoff_transfer_live_rooms",
                     "handoff_num_requests_running", "handoff_num_requests_waiting"):
            if line.startswith(name + " "):
                out[name[len("handoff_"):]] = float(line.split()[1])
    return out


# ---- the load --------------------------------------------------------------


def body(kind, prompt):
    if kind.startswith("cmpl"):
        return "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                   "temperature": 0, "stream": kind.endswith("stream")}
    if kind.startswith("chat"):
        return "/v1/chat/completions", {
            "model": "m", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "stream": kind.endswith("stream")}
    return "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": MAX_TOKENS,
                                                             "temperature": 0}}


def is_error(obj):
    e = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(e, dict):
        return isinstance(e.get("message"), str)
    return isinstance(e, str) and isinstance(obj.get("type", obj.get("code")), (str, int))


def error_kind(detail):
    """`status type/code` of a typed error's detail, for the breakdown."""
    status, _, rest = detail.partition(" ")
    if not status.isdigit():
        status, rest = "SSE", detail
    try:
        e = json.loads(rest)["error"]
        e = e if isinstance(e, dict) else {"code": e}
        return f"{status} {e.get('type') or e.get('code')}: {str(e.get('message'))[:70]}"
    except (ValueError, KeyError, TypeError):
        return f"{status} {rest[:70]}"


def one(kind, prompt, deadline, disconnect=False):
    """One request through the router: (outcome, text or detail)."""
    path, payload = body(kind, prompt)
    c = http.client.HTTPConnection(IP["r"], HTTP_PORT["r"], timeout=deadline)
    try:
        try:
            c.request("POST", path, json.dumps(payload), {"Content-Type": "application/json"})
            r = c.getresponse()
        except ConnectionRefusedError:
            return "refused", "router port closed"
        except socket.timeout:
            return "hung", "no status within the deadline"
        except (ConnectionError, http.client.HTTPException) as e:
            return "cut", f"before the status: {e!r}"
        if r.status != 200:
            raw = r.read()
            try:
                obj = json.loads(raw)
            except ValueError:
                return "garbage", f"status {r.status} with a non-JSON body {raw[:200]!r}"
            return ("error", f"{r.status} {json.dumps(obj)[:1000]}") if is_error(obj) else \
                ("garbage", f"status {r.status} without a JSON error: {raw[:200]!r}")
        if not payload.get("stream"):
            raw = r.read()
            obj = json.loads(raw)
            if kind == "generate":
                return "ok", obj["text"]
            ch = obj["choices"][0]
            return "ok", ch["text"] if kind.startswith("cmpl") else ch["message"]["content"]
        text, done = "", False
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            obj = json.loads(data)
            if "error" in obj:
                return ("error", json.dumps(obj)[:1000]) if is_error(obj) else \
                    ("garbage", f"malformed error event {data[:200]!r}")
            for ch in obj.get("choices", []):
                text += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
            if disconnect:
                return "client_abort", ""
        return ("ok", text) if done else ("cut", "stream ended without [DONE] or an error event")
    except socket.timeout:
        return "hung", "no byte within the deadline"
    except (ConnectionError, http.client.HTTPException, OSError) as e:
        return "cut", repr(e)
    except (ValueError, KeyError, IndexError, TypeError) as e:
        return "garbage", f"malformed answer: {e!r}"
    finally:
        c.close()


# ---- the run ---------------------------------------------------------------


class Run:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.lock = threading.Lock()
        self.results = []
        # When the router was killed or terminated (a stream cut then is not
        # the router's fault).
        self.router_kills = []
        self.heals = []
        self.faults = {}
        self.done = threading.Event()
        os.makedirs(args.log_dir, exist_ok=True)
        secret = os.path.join(args.log_dir, "transfer.secret")
        with open(secret, "w") as f:
            f.write("chaos-%016x" % random.Random(args.seed + 1).getrandbits(64))
        common = ["--model", args.model, "--log-level", "warn",
                  "--transfer-secret-file", secret, "--stream-stall-timeout-secs", "20"]
        b = args.bin
        self.procs = {
            "p": Proc("p", [b, "prefill", "--host", IP["p"], "--port", str(HTTP_PORT["p"]),
                            "--disaggregation-bootstrap-port", str(TRANSFER_PORT),
                            "--kv-pages", "512"] + common
                      + (["--transfer", "nixl"] if args.transfer == "nixl" else []),
                      args.log_dir),
            "d": Proc("d", [b, "decode", "--host", IP["d"], "--port", str(HTTP_PORT["d"]),
                            "--disaggregation-transfer-backend", args.transfer,
                            "--kv-pages", "512"]
                      + common, args.log_dir),
            "r": Proc("r", [b, "router", "--host", IP["r"], "--port", str(HTTP_PORT["r"]),
                            "--prefill", f"http://{IP['p']}:{HTTP_PORT['p']}", str(PROXY_PORT),
                            "--decode", f"http://{IP['d']}:{HTTP_PORT['d']}",
                            "--transfer-secret-file", secret, "--log-level", "warn",
                            "--stream-stall-timeout-secs", "20",
                            "--queue-timeout-secs", "30",
                            "--health-check-interval-secs", "1"], args.log_dir),
        }
        self.proxy = subprocess.Popen(
            ["ip", "netns", "exec", NS["p"], sys.executable, os.path.abspath(__file__),
             "proxy", IP["p"], str(PROXY_PORT), str(TRANSFER_PORT)],
            stdout=open(os.path.join(args.log_dir, "proxy.log"), "ab"),
            stderr=subprocess.STDOUT)

    def start_all(self):
        for k in "pdr":
            self.procs[k].start()
        for k in "pdr":
            if not wait_healthy(k, 120):
                raise RuntimeError(f"{NAMES[k]} never became healthy (logs in "
                                   f"{self.args.log_dir})")
        # The router's health check must have seen both workers.
        end = time.time() + 30
        while time.time() < end:
            if one("generate", PROMPTS[0], 30)[0] == "ok":
                return
            time.sleep(0.2)
        raise RuntimeError("no request got through before the faults began")

    def references(self):
        self.ref = {}
        for kind in ("cmpl", "chat", "generate"):
            for i, p in enumerate(PROMPTS):
                outcome, text = one(kind, p, 60)
                if outcome != "ok":
                    raise RuntimeError(f"fault-free reference {kind} {i}: {outcome} {text}")
                self.ref[(kind, i)] = text

    def worker(self, queue):
        while True:
            with self.lock:
                if not queue:
                    return
                kind, i, disconnect = queue.pop()
            t0 = time.time()
            outcome, text = one(kind, PROMPTS[i], self.args.deadline, disconnect)
            t1 = time.time()
            if outcome == "ok":
                want = self.ref[(kind.replace("-stream", ""), i)]
                if text != want:
                    outcome, text = "garbage", f"{text!r} != reference {want!r}"
            if outcome == "cut" and any(t0 - 0.5 <= t <= t1 for t in self.router_kills):
                outcome = "cut_by_router_kill"
            with self.lock:
                self.results.append((t0, t1, kind, i, outcome, text))
            if outcome in ("refused", "error", "cut", "cut_by_router_kill"):
                # As a client would, back off before the next try.
                time.sleep(1.0)

    def fault(self):
        a, rng = self.args, self.rng
        k = rng.choice("pdr")
        what = rng.choice(["kill", "term", "stop", "down", "loss", "delay", "inject-control",
                           "inject-data", "garbage-control", "garbage-data", "v1-peer"])
        if a.faults == "kill-workers":
            k, what = rng.choice("pd"), "kill"
        if what.startswith(("inject", "garbage", "v1")):
            k = "p"
        dur = rng.uniform(0.3, a.max_fault_secs)
        name = f"{what} {NAMES[k]}"
        self.faults[name] = self.faults.get(name, 0) + 1
        proc = self.procs[k]
        if what in ("kill", "term"):
            t = time.time()
            proc.signal(signal.SIGKILL if what == "kill" else signal.SIGTERM)
            if k == "r":
                self.router_kills.append(t)
            try:
                proc.p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.signal(signal.SIGKILL)
                proc.p.wait()
            time.sleep(rng.uniform(0.1, 1.0))
            proc.start()
            proc.restarts += 1
            wait_healthy(k, 60)
        elif what == "stop":
            proc.signal(signal.SIGSTOP)
            time.sleep(dur)
            proc.signal(signal.SIGCONT)
        elif what == "down":
            link(k, False)
            time.sleep(dur)
            link(k, True)
        elif what in ("loss", "delay"):
            impair(k, what)
            time.sleep(dur)
            impair(k, None)
        elif what.startswith("inject"):
            os.kill(self.proxy.pid, signal.SIGUSR1 if what.endswith("control") else signal.SIGUSR2)
            time.sleep(dur)
        elif what.startswith("garbage"):
            kind = b"C" if what.endswith("control") else b"D"
            in_ns("d", sys.executable, os.path.abspath(__file__), "garbage", IP["p"],
                  str(TRANSFER_PORT), kind.decode(), str(rng.getrandbits(32)), check=False)
        elif what == "v1-peer":
            in_ns("d", sys.executable, os.path.abspath(__file__), "v1peer", IP["p"],
                  str(TRANSFER_PORT), check=False)
        self.heals.append(time.time())

    def chaos(self):
        if self.args.no_faults:
            return
        while not self.done.is_set():
            time.sleep(self.rng.uniform(0.2, self.args.max_gap_secs))
            if not self.done.is_set():
                self.fault()

    def load(self):
        rng = random.Random(self.args.seed + 2)
        queue = []
        for _ in range(self.args.requests):
            queue.append((rng.choice(KINDS), rng.randrange(len(PROMPTS)),
                          rng.random() < self.args.disconnect_share))
        # A client that disconnects does so mid-stream.
        queue = [(k if not d or "stream" in k else "cmpl-stream", i, d) for k, i, d in queue]
        threads = [threading.Thread(target=self.worker, args=(queue,))
                   for _ in range(self.args.concurrency)]
        chaos = threading.Thread(target=self.chaos)
        self.t_start = time.time()
        for t in threads:
            t.start()
        chaos.start()
        for t in threads:
            t.join()
        self.done.set()
        chaos.join()
        self.t_end = time.time()

    def settle(self):
        for k in "pdr":
            impair(k, None)
            link(k, True)
        for k in "pdr":
            self.procs[k].signal(signal.SIGCONT)
        end = time.time() + self.args.settle_secs
        while True:
            left = {k: metrics(k) for k in "pd"}
            clean = all(v and "error" not in v and not any(v.values()) for v in left.values())
            if clean or time.time() > end:
                return left, clean
            time.sleep(0.5)

    def recovery(self):
        """Per healed fault: from the heal to the end of the first request
        started after it that answered correctly."""
        oks = sorted((t0, t1) for t0, t1, _, _, o, _ in self.results if o == "ok")
        out = []
        for h in self.heals:
            after = [t1 for t0, t1 in oks if t0 >= h]
            if after:
                out.append(min(after) - h)
        return sorted(out)

    def report(self, left, clean):
        by = {}
        for r in self.results:
            by[r[4]] = by.get(r[4], 0) + 1
        n = len(self.results)
        worst = max((t1 - t0 for t0, t1, *_ in self.results), default=0)
        rec = self.recovery()
        pct = (lambda q: rec[min(len(rec) - 1, int(q * len(rec)))]) if rec else (lambda q: 0)
        bad = by.get("garbage", 0) + by.get("hung", 0)
        print(f"\n== chaos: {n} requests in {self.t_end - self.t_start:.0f} s, seed "
              f"{self.args.seed}, concurrency {self.args.concurrency}")
        print(f"completed, output equal to the fault-free greedy output: {by.get('ok', 0)}")
        print(f"ended with a typed error (JSON error, status or SSE event): {by.get('error', 0)}")
        kinds = {}
        for *_, o, text in self.results:
            if o == "error":
                key = error_kind(text)
                kinds[key] = kinds.get(key, 0) + 1
        for key, v in sorted(kinds.items(), key=lambda kv: -kv[1]):
            print(f"    {v:5d}  {key}")
        print(f"refused while the router was down (connection refused): {by.get('refused', 0)}")
        print(f"stream cut by a killed or terminated router (nothing left to send an error): "
              f"{by.get('cut_by_router_kill', 0)}")
        print(f"cut without an error event, router alive: {by.get('cut', 0)}")
        print(f"client disconnects (part of the load): {by.get('client_abort', 0)}")
        print(f"garbage: {by.get('garbage', 0)}")
        print(f"hung past the {self.args.deadline:.0f} s deadline: {by.get('hung', 0)}")
        print(f"max time to a response: {worst:.2f} s")
        print("faults: " + ", ".join(f"{k} x{v}" for k, v in sorted(self.faults.items())))
        print("restarts: " + ", ".join(f"{NAMES[k]} {p.restarts}" for k, p in self.procs.items()))
        print(f"time to recover after a healed fault (first correct request started after it): "
              f"p50 {pct(0.5):.2f} s, p90 {pct(0.9):.2f} s, max {pct(1.0):.2f} s over {len(rec)}")
        for k, v in left.items():
            print(f"left on {NAMES[k]} after settling: {v}")
        for t0, t1, kind, i, o, text in self.results:
            if o in ("garbage", "hung", "cut"):
                print(f"  {o}: {kind} prompt {i} at +{t0 - self.t_start:.1f}s: {text}")
        ok = bad == 0 and clean and by.get("cut", 0) == 0
        # Client-visible failures: everything but the reference output and
        # the load's own disconnects.
        visible = n - by.get("ok", 0) - by.get("client_abort", 0)
        if self.args.require_no_errors:
            print(f"client-visible failures (required 0): {visible}")
            for t0, t1, kind, i, o, text in self.results:
                if o not in ("ok", "client_abort", "garbage", "hung", "cut"):
                    print(f"  {o}: {kind} prompt {i} at +{t0 - self.t_start:.1f}s: {text}")
            ok = ok and visible == 0
        print("VERDICT: " + ("PASS" if ok else "FAIL") +
              f" ({by.get('garbage', 0)} garbage, {by.get('hung', 0)} hung, "
              f"{by.get('cut', 0)} silent cuts, leaks {'none' if clean else 'FOUND'}"
              + (f", {visible} client-visible failures" if self.args.require_no_errors else "")
              + ")")
        return ok

    def close(self):
        for p in self.procs.values():
            p.stop_for_good()
        self.proxy.kill()
        self.proxy.wait()


def garbage(host, port, kind, seed):
    rng = random.Random(int(seed))
    try:
        s = socket.create_connection((host, int(port)), timeout=2)
        pre = kind.encode() + rng.randbytes(16)
        s.sendall(pre + rng.randbytes(rng.randrange(1, 4096)))
        s.sendall(b"HOFF" + bytes([2, 1, 0, 0]) + struct.pack("<I", 1 << 30))
        time.sleep(0.2)
        s.close()
    except OSError:
        pass


def v1peer(host, port):
    """Replay the recorded protocol-1 decode (its Register and the frames it
    sent next) on a fresh control connection: without the transfer secret
    it is refused, and the real decode keeps being served."""
    path = os.path.join(ROOT, "crates/handoff-proto/tests/transcripts/decode_v1.hex")
    data = bytes.fromhex(open(path).read().strip())
    try:
        s = socket.create_connection((host, int(port)), timeout=2)
        s.sendall(b"C" + random.randbytes(16) + data)
        s.settimeout(2)
        try:
            s.recv(4096)
        except OSError:
            pass
        s.close()
    except OSError:
        pass


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "proxy":
        Proxy((sys.argv[2], int(sys.argv[3])), (sys.argv[2], int(sys.argv[4]))).serve()
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "garbage":
        garbage(*sys.argv[2:6])
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "v1peer":
        v1peer(*sys.argv[2:4])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=os.path.join(ROOT, "target/debug/handoff"))
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--deadline", type=float, default=60.0)
    ap.add_argument("--max-fault-secs", type=float, default=2.5)
    ap.add_argument("--max-gap-secs", type=float, default=2.0)
    ap.add_argument("--disconnect-share", type=float, default=0.05)
    ap.add_argument("--settle-secs", type=float, default=30.0)
    ap.add_argument("--faults", choices=["all", "kill-workers"], default="all",
                    help="kill-workers: only SIGKILLs of the prefill and the decode")
    ap.add_argument("--require-no-errors", action="store_true",
                    help="fail on any request that does not end with the reference output "
                         "(the load's own disconnects aside)")
    ap.add_argument("--no-faults", action="store_true",
                    help="the same load with no fault: the control run")
    ap.add_argument("--log-dir", default="/tmp/handoff-chaos")
    ap.add_argument("--transfer", choices=["tcp", "nixl"], default="tcp",
                    help="KV transport (nixl: a handoff built with --features nixl, "
                         "scripts/fetch-nixl.sh's folder on LD_LIBRARY_PATH; KV then moves "
                         "over UCX directly, not through the proxy, whose faults reach only "
                         "the control connection and the data link's records)")
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("chaos: needs root (network namespaces, tc)", file=sys.stderr)
        return 2
    if not args.inside:
        setup_net()
        try:
            # The driver and its clients live in the router's namespace.
            r = subprocess.run(["ip", "netns", "exec", NS["r"], sys.executable,
                                os.path.abspath(__file__), "--inside"] + sys.argv[1:])
            return r.returncode
        finally:
            teardown_net()
    run_ = Run(args)
    try:
        run_.start_all()
        run_.references()
        run_.load()
        left, clean = run_.settle()
        return 0 if run_.report(left, clean) else 1
    finally:
        run_.close()


if __name__ == "__main__":
    sys.exit(main())
