"""Check lm-eval's loglikelihoods against handoff's own API.

For every (context, continuation) lm-eval scored, recompute what its
`local-completions` model computes (tokens of context + continuation,
the continuation's tokens after the context's; their log-probabilities
summed; greedy if each is the most likely at its position) through
`/generate` with `input_ids`, `return_logprob`, `logprob_start_len` and
`top_logprobs_num`, and require the same sums, flags and accuracy.

Usage: check.py BASE_URL LM_EVAL_OUTPUT_DIR
"""

import glob
import json
import sys
import urllib.request


def post(base, path, body):
    req = urllib.request.Request(
        base + path, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def tokens(base, text):
    return post(base, "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]


def score(base, context, continuation):
    # lm-eval's split: a context's trailing spaces go to the continuation.
    n = len(context) - len(context.rstrip(" "))
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tokens(base, context + continuation)
    ctx = len(tokens(base, context))
    out = post(
        base,
        "/generate",
        {
            "input_ids": whole,
            "return_logprob": True,
            "logprob_start_len": ctx,
            "top_logprobs_num": 1,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        },
    )
    meta = out["meta_info"]
    lps = [entry[0] for entry in meta["input_token_logprobs"]]
    tops = [t[0][0] for t in meta["input_top_logprobs"]]
    assert len(lps) == len(whole) - ctx > 0, (context, continuation)
    greedy = all(lp == top for lp, top in zip(lps, tops))
    return sum(lps), greedy


def main():
    base, out_dir = sys.argv[1], sys.argv[2]
    (samples,) = glob.glob(f"{out_dir}/*/samples_handoff_mc_*.jsonl")
    docs = [json.loads(line) for line in open(samples)]
    assert len(docs) == 10, len(docs)
    correct = 0
    checked = 0
    for d in docs:
        ours = []
        for key, args in sorted(d["arguments"].items(), key=lambda kv: int(kv[0].split("_")[-1])):
            i = int(key.split("_")[-1])
            ll, greedy = score(base, args["arg_0"], args["arg_1"])
            theirs_ll = float(d["filtered_resps"][i][0])
            theirs_greedy = d["filtered_resps"][i][1] in (True, "True")
            assert abs(ll - theirs_ll) <= 1e-6 * max(1.0, abs(ll)), (d["doc_id"], i, ll, theirs_ll)
            assert greedy == theirs_greedy, (d["doc_id"], i, greedy, theirs_greedy)
            ours.append(ll)
            checked += 1
        acc = float(max(range(len(ours)), key=ours.__getitem__) == int(d["target"]))
        assert acc == d["acc"], (d["doc_id"], acc, d["acc"])
        correct += acc
    # Three choices each: chance is 1/3.
    assert correct / len(docs) > 0.5, f"accuracy {correct}/{len(docs)}"
    print(f"lm-eval's {checked} loglikelihoods equal handoff's /generate; accuracy {correct / len(docs):.2f}")


if __name__ == "__main__":
    main()
