#!/usr/bin/env python3
"""The fixed cost of a short request against one server: /generate with
8 prompt tokens and 1 new token, then with 9 new tokens (the difference is
8 decode steps), N of each, median latency in ms.

Usage: scripts/bench-short-request.py [BASE_URL] [N]
(default http://127.0.0.1:30000, 30; start the server first, e.g.
`handoff serve --colocated --prefill-format f32` then `q8_0-rows`)
"""

import json
import statistics
import sys
import time
import urllib.request

BASE = (sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:30000").rstrip("/")
N = int(sys.argv[2]) if len(sys.argv) > 2 else 30


def once(new_tokens):
    body = {
        "input_ids": [1, 2, 3, 4, 5, 6, 7, 8],
        "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True},
    }
    req = urllib.request.Request(BASE + "/generate", json.dumps(body).encode(), {"content-type": "application/json"})
    t = time.perf_counter()
    urllib.request.urlopen(req, timeout=120).read()
    return time.perf_counter() - t


one = statistics.median(once(1) for _ in range(N))
nine = statistics.median(once(9) for _ in range(N))
print(f"8 prompt tokens + 1 new: p50 {one * 1e3:.1f} ms; + 9 new: p50 {nine * 1e3:.1f} ms; 8 decode steps {(nine - one) * 1e3:.1f} ms")
