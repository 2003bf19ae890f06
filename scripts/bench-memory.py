#!/usr/bin/env python3
"""Start-up time and memory of one server at a time on the same GGUF, one run:
handoff serve (PD pair), handoff serve --colocated and llama.cpp's
llama-server, the same KV capacity (4096 tokens: --kv-pages 256 of 16 tokens
per handoff worker, -c 4096 for llama-server), 2 threads each.

For each: seconds from spawn to the first answered completion, then, after
that one request, PSS / RSS / anonymous memory summed over the server's
process tree (/proc/PID/smaps_rollup; PSS counts a page shared by N
processes 1/N in each, so a PD pair sharing one weight copy is not counted
twice). Ratios to llama-server are printed at the end.

Usage: scripts/bench-memory.py MODEL.gguf [--cases pd,colocated,llama,llama-norepack,pd-nocache]
  A case named twice runs twice (the second labelled NAME+); the weight
  cache is a fresh directory for the run, so the first handoff case writes it
  and later ones map it. --cold: a fresh cache before every case.
Needs a release build of handoff and scripts/build-llamacpp.sh.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HANDOFF = os.path.join(ROOT, "target/release/handoff")


def llama_server():
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts/build-llamacpp.sh")],
                         capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        if "llama-server" in line:
            return line.split()[0]
    sys.exit("llama-server missing: run scripts/build-llamacpp.sh")


def tree(pid):
    """pid and all its descendants."""
    kids = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            kids.setdefault(ppid, []).append(int(p))
        except (OSError, IndexError, ValueError):
            pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def memory(pid):
    tot = {"Pss": 0, "Rss": 0, "Anonymous": 0}
    for p in tree(pid):
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    k, _, v = line.partition(":")
                    if k in tot:
                        tot[k] += int(v.split()[0]) * 1024
        except OSError:
            pass
    return tot


def complete(port, timeout=600.0):
    body = json.dumps({"prompt": "Hello there, how are", "max_tokens": 8,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status == 200
    except Exception:
        return False


def run_case(name, cmd, port, env):
    t0 = time.monotonic()
    log = open(f"/tmp/bench-memory-{name}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    try:
        while not complete(port):
            if proc.poll() is not None:
                sys.exit(f"{name} exited: see /tmp/bench-memory-{name}.log")
            if time.monotonic() - t0 > 900:
                sys.exit(f"{name} did not answer in 900 s")
            time.sleep(0.25)
        up = time.monotonic() - t0
        time.sleep(1.0)
        mem = memory(proc.pid)
        return up, mem
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--cases", default="llama,pd,colocated")
    ap.add_argument("--cold", action="store_true")
    a = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="handoff-bench-weights-")
    env = dict(os.environ, RUST_LOG="info", NO_COLOR="1")
    hand = [HANDOFF, "serve", "--model", a.model, "--port", "31400", "--kv-pages", "256",
            "--threads", "2"]
    cases = {
        "pd": (hand + ["--weight-cache", cache], 31400),
        "pd-nocache": (hand + ["--weight-cache", "off"], 31400),
        "colocated": (hand + ["--colocated", "--weight-cache", cache], 31400),
        "llama": ([None, "-m", a.model, "-c", "4096", "-t", "2", "-tb", "2", "-np", "1",
                   "--port", "31401", "--host", "127.0.0.1"], 31401),
        "llama-norepack": ([None, "-m", a.model, "-c", "4096", "-t", "2", "-tb", "2", "-np",
                            "1", "--no-repack", "--port", "31401", "--host", "127.0.0.1"],
                           31401),
    }
    results = {}
    for case in a.cases.split(","):
        name = case
        while name in results:
            name += "+"
        cmd, port = cases[case]
        if cmd[0] is None:
            cmd = [llama_server()] + cmd[1:]
        if a.cold:
            shutil.rmtree(cache, ignore_errors=True)
            os.makedirs(cache, exist_ok=True)
        up, mem = run_case(name, cmd, port, env)
        results[name] = (up, mem)
        mib = lambda b: f"{b / 2**20:8.0f}"
        print(f"{name:16} up {up:6.1f} s   PSS {mib(mem['Pss'])} MiB   RSS {mib(mem['Rss'])} MiB"
              f"   anon {mib(mem['Anonymous'])} MiB", flush=True)
    base = results.get("llama")
    if base:
        for name, (up, mem) in results.items():
            if name == "llama":
                continue
            print(f"{name:16} / llama-server: start-up {up / base[0]:.2f}x, "
                  f"PSS {mem['Pss'] / base[1]['Pss']:.2f}x, RSS {mem['Rss'] / base[1]['Rss']:.2f}x")
    shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
