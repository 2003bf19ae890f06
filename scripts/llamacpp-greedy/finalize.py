#!/usr/bin/env python3
"""Wraps the raw llamacpp-greedy output with provenance metadata and writes it
in a diff-friendly layout (arrays of scalars on one line). Used by
scripts/gen-llamacpp-refs.sh."""
import argparse
import json


def depth(v):
    if isinstance(v, dict):
        return 99
    if isinstance(v, list):
        return 1 + max((depth(x) for x in v), default=0)
    return 0


def dump(v, indent=0):
    pad = "  " * indent
    if isinstance(v, dict):
        if not v:
            return "{}"
        items = [f'{pad}  {json.dumps(k)}: {dump(x, indent + 1)}' for k, x in v.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(v, list):
        if depth(v) <= 2:  # lists of scalars / of short scalar lists: one line
            return json.dumps(v, ensure_ascii=False, separators=(", ", ": "))
        items = [pad + "  " + dump(x, indent + 1) for x in v]
        return "[\n" + ",\n".join(items) + "\n" + pad + "]"
    return json.dumps(v, ensure_ascii=False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sha256", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--llama-cpp-commit", required=True)
    ap.add_argument("--llama-cpp-python", required=True)
    ap.add_argument("--greedy", nargs=3, action="append", default=[],
                    metavar=("RAW_IN", "OUT", "CMD"), help="raw generate output, file to write, its command")
    ap.add_argument("--tokenize", nargs=3, metavar=("RAW_IN", "OUT", "CMD"))
    ap.add_argument("--regenerate", default="scripts/gen-llamacpp-refs.sh",
                    help="the script that regenerates the files (recorded as provenance)")
    a = ap.parse_args()

    provenance = {
        "llama_cpp": {
            "repo": "ggml-org/llama.cpp",
            "commit": a.llama_cpp_commit,
            "source": f"PyPI sdist llama-cpp-python=={a.llama_cpp_python} (vendor/llama.cpp)",
            "llama_cpp_python_version": a.llama_cpp_python,
        },
        "model": {"file": a.model, "sha256": a.sha256},
        "regenerate": a.regenerate,
    }

    for greedy_in, greedy_out, gen_cmd in a.greedy:
        write_greedy(provenance, greedy_in, greedy_out, gen_cmd)

    if a.tokenize is None:
        return
    tok_in, tok_out, tok_cmd = a.tokenize
    t = json.load(open(tok_in, encoding="utf-8"))
    out = dict(provenance)
    out["command"] = tok_cmd
    for k in list(t.keys()):
        if k != "cases":
            out[k] = t[k]
    out["cases"] = t["cases"]
    with open(tok_out, "w", encoding="utf-8") as f:
        f.write(dump(out) + "\n")
    print(tok_out)


def write_greedy(provenance, greedy_in, greedy_out, gen_cmd):
    g = json.load(open(greedy_in, encoding="utf-8"))
    for c in g["cases"]:
        c["logit_margins"] = [round(m, 4) for m in c["logit_margins"]]
        c["min_logit_margin"] = round(c["min_logit_margin"], 4)
        c["top_logits"] = [[[i, round(l, 4)] for i, l in step] for step in c["top_logits"]]
    out = dict(provenance)
    out["command"] = gen_cmd
    out["n_threads"] = g.pop("n_threads")
    for k in list(g.keys()):
        if k != "cases":
            out[k] = g[k]
    out["cases"] = g["cases"]
    with open(greedy_out, "w", encoding="utf-8") as f:
        f.write(dump(out) + "\n")
    print(greedy_out)

if __name__ == "__main__":
    main()
