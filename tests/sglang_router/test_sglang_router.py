"""SGLang's PD router (sglang-router 0.3.2) fronting handoff prefill and
decode workers, unchanged: chat, completions and generate, whole and
streamed, equal the colocated output (greedy); a prompt longer than the
context comes back as a 400 with the workers' message and leaves no pages
reserved, also when the refusal comes from the prefill after decode reserved
them. Started by run.sh, which sets the URLs."""

import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

ROUTER = os.environ["ROUTER_URL"]
COLOCATED = os.environ["COLOCATED_URL"]
DECODE = os.environ["DECODE_URL"]
PREFILL = os.environ["PREFILL_URL"]
# A router in front of a 256-token-context prefill whose requests arrive
# 0.5 s late, and the same decode.
ROUTER_SMALL = os.environ["ROUTER_SMALL_URL"]


def post(base, path, body):
    req = urllib.request.Request(
        base + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def events(text):
    out = []
    for ev in text.split("\n\n"):
        data = [l[5:].lstrip() for l in ev.splitlines() if l.startswith("data:")]
        if data:
            out.append("\n".join(data))
    return out


def output(path, stream, text):
    def pick(v):
        if path == "/generate":
            return v["text"]
        if path == "/v1/completions":
            return v["choices"][0]["text"]
        if stream:
            return v["choices"][0]["delta"].get("content") or ""
        return v["choices"][0]["message"]["content"]

    if not stream:
        return pick(json.loads(text))
    evs = events(text)
    assert evs[-1] == "[DONE]", text
    values = [json.loads(e) for e in evs[:-1]]
    for v in values:
        assert "error" not in v, v
    if path == "/generate":
        return pick(values[-1])
    return "".join(pick(v) for v in values if v.get("choices"))


def request(path, stream, i=0):
    prompt = ["The capital of France is", "Write a haiku about rivers.",
              "List three prime numbers:", "Once upon a time"][i % 4]
    if path == "/generate":
        return {"text": prompt, "stream": stream,
                "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    if path == "/v1/completions":
        return {"model": "m", "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": stream}
    return {"model": "m", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 12, "temperature": 0, "stream": stream}


def load(base):
    status, text = post_get(base, "/get_load")
    assert status == 200, text
    return json.loads(text)[0]


def post_get(base, path):
    with urllib.request.urlopen(base + path, timeout=10) as r:
        return r.status, r.read().decode()


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_router_output_equals_colocated(path, stream):
    body = request(path, stream)
    cs, colocated = post(COLOCATED, path, body)
    assert cs == 200, colocated
    rs, routed = post(ROUTER, path, body)
    assert rs == 200, routed
    want = output(path, stream, colocated)
    assert want, colocated
    assert output(path, stream, routed) == want


def test_concurrent_requests_equal_colocated():
    bodies = [request("/v1/completions", False, i) for i in range(4)]
    want = [output("/v1/completions", False, post(COLOCATED, "/v1/completions", b)[1]) for b in bodies]
    with ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda b: post(ROUTER, "/v1/completions", b), bodies))
    for (status, text), w in zip(got, want):
        assert status == 200, text
        assert output("/v1/completions", False, text) == w


def test_prompt_over_the_context_is_a_400_and_frees_pages():
    body = {"model": "m", "prompt": "hello " * 9000, "max_tokens": 4}
    t = time.monotonic()
    status, text = post(ROUTER, "/v1/completions", body)
    took = time.monotonic() - t
    assert status == 400, text
    assert "exceeds the context length of 8192 tokens" in text, text
    assert took < 5, f"took {took:.1f}s: a timeout, not the protocol"
    for _ in range(100):
        d, p = load(DECODE), load(PREFILL)
        if d["num_reqs"] == 0 and d["num_tokens"] == 0 and p["num_reqs"] == 0:
            break
        time.sleep(0.05)
    assert d["num_tokens"] == 0 and d["num_reqs"] == 0, d
    assert p["num_reqs"] == 0, p


def test_a_prefill_refusal_after_decode_reserved_frees_decodes_pages():
    # Fits decode's context (8192) and not the small prefill's (256): decode
    # reserves the prompt's pages, then the prefill (reached late) refuses.
    body = {"model": "m", "messages": [{"role": "user", "content": "word " * 400}],
            "max_tokens": 4}
    with ThreadPoolExecutor(1) as ex:
        answer = ex.submit(post, ROUTER_SMALL, "/v1/chat/completions", body)
        reserved = 0
        while not answer.done() and reserved == 0:
            reserved = load(DECODE)["num_tokens"]
            time.sleep(0.01)
        status, text = answer.result()
    assert status == 400, text
    assert "exceeds the context length of 256 tokens" in text, text
    assert reserved > 0, "decode never reserved: the refusal did not come after the reservation"
    for _ in range(100):
        d = load(DECODE)
        if d["num_reqs"] == 0 and d["num_tokens"] == 0:
            break
        time.sleep(0.05)
    assert d["num_tokens"] == 0 and d["num_reqs"] == 0, d

