#!/usr/bin/env python3
"""Structured output's cost per token, in one run against one server:
alternating requests, each 200 tokens at temperature 0.8, free text
(ignore_eos) vs a JSON schema that needs more than 200 tokens (so both
run to max_tokens). Prints the median ms per token of each and their
ratio.

Usage: scripts/bench-structured.py [BASE_URL] [PAIRS]
(default http://127.0.0.1:30000, 6 pairs; start `handoff serve` first)
"""

import json
import statistics
import sys
import time
import urllib.request

BASE = (sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:30000").rstrip("/")
PAIRS = int(sys.argv[2]) if len(sys.argv) > 2 else 6
SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    "minItems": 40,
}


def per_token(extra, seed):
    body = {
        "messages": [{"role": "user", "content": "List people as JSON"}],
        "max_tokens": 200,
        "temperature": 0.8,
        "seed": seed,
    }
    body.update(extra)
    req = urllib.request.Request(
        BASE + "/v1/chat/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as r:
        out = json.load(r)
    n = out["usage"]["completion_tokens"]
    assert n == 200, out
    return (time.perf_counter() - t) / n


free, constrained = [], []
for i in range(PAIRS):
    free.append(per_token({"ignore_eos": True}, i))
    constrained.append(
        per_token({"response_format": {"type": "json_schema", "json_schema": {"name": "people", "schema": SCHEMA}}}, i)
    )
f, c = statistics.median(free), statistics.median(constrained)
print(f"free text {f * 1e3:.2f} ms/token, JSON schema {c * 1e3:.2f} ms/token, ratio {c / f:.3f} ({PAIRS} pairs)")
