#!/usr/bin/env python3
"""Wraps raw `llamacpp-greedy generate` output for one handoff-testmodels
preset into crates/handoff-model/tests/data/arch/<preset>.json: provenance
(llama.cpp commit, GGUF sha256, exact command), then per case prompt_ids,
output_ids, logit margins and top-5 logits per step, floats rounded to 4
decimals, arrays of scalars on one line. Used by scripts/gen-arch-refs.sh.

Optionally (--ablation RAW NAME): a second raw output for a variant of the
same file (llama3 without rope_freqs.weight); records per case whether its
greedy tokens differ and from which step."""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finalize import dump  # noqa: E402

DROP = ("prompt", "output_text", "output_text_valid_utf8", "output_text_hex", "output_pieces")


def first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--raw", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", required=True)
    ap.add_argument("--sha256", required=True)
    ap.add_argument("--bytes", type=int, required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--write-command", required=True)
    ap.add_argument("--llama-cpp-commit", required=True)
    ap.add_argument("--llama-cpp-python", required=True)
    ap.add_argument("--inputs", required=True, help="the prompts .jsonl (for prompt_seed)")
    ap.add_argument("--ablation", nargs=3, metavar=("RAW", "NAME", "COMMAND"))
    a = ap.parse_args()

    seeds = {}
    with open(a.inputs, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                seeds[d["name"]] = d.get("prompt_seed")

    g = json.load(open(a.raw, encoding="utf-8"))
    out = {
        "llama_cpp": {
            "repo": "ggml-org/llama.cpp",
            "commit": a.llama_cpp_commit,
            "source": f"PyPI sdist llama-cpp-python=={a.llama_cpp_python} (vendor/llama.cpp)",
            "llama_cpp_python_version": a.llama_cpp_python,
        },
        "model": {
            "preset": a.preset,
            "writer": "crates/handoff-testmodels (handoff_testmodels::write_preset)",
            "write_command": a.write_command,
            "bytes": a.bytes,
            "sha256": a.sha256,
        },
        "regenerate": "scripts/gen-arch-refs.sh",
        "command": a.command,
    }
    cases = g.pop("cases")
    for k, v in g.items():
        out[k] = v
    for c in cases:
        for k in DROP:
            c.pop(k, None)
        c["prompt_seed"] = seeds.get(c["name"])
        c["logit_margins"] = [round(m, 4) for m in c["logit_margins"]]
        c["min_logit_margin"] = round(c["min_logit_margin"], 4)
        c["top_logits"] = [[[i, round(l, 4)] for i, l in step] for step in c["top_logits"]]
        # prompt_seed right after name
        order = ["name", "prompt_seed"]
        c2 = {k: c[k] for k in order}
        c2.update({k: v for k, v in c.items() if k not in order})
        c.clear()
        c.update(c2)
    if a.ablation:
        raw, name, cmd = a.ablation
        b = json.load(open(raw, encoding="utf-8"))
        per = []
        for c, d in zip(cases, b["cases"]):
            assert c["name"] == d["name"]
            step = first_diff(c["output_ids"], d["output_ids"])
            per.append({"name": c["name"], "output_differs": step is not None, "first_differing_step": step,
                        "output_ids": d["output_ids"]})
        out["ablation"] = {
            "variant": name,
            "command": cmd,
            "cases_with_different_output": sum(p["output_differs"] for p in per),
            "cases": per,
        }
    out["cases"] = cases
    with open(a.out, "w", encoding="utf-8") as f:
        f.write(dump(out) + "\n")
    print(a.out)


if __name__ == "__main__":
    main()
