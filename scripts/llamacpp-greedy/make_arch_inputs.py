#!/usr/bin/env python3
"""Prompts for scripts/gen-arch-refs.sh: seeded random token ids, one JSON
line per prompt ({"name", "prompt_seed", "prompt_ids"}), for the seeded test
models of crates/handoff-testmodels (they share one tiny vocabulary).

Usage: make_arch_inputs.py VOCAB_SIZE > prompts.jsonl
Ids are drawn uniformly from [3, VOCAB_SIZE) (no control tokens), with
Python's random.Random(seed): the same ids on every run."""
import json
import random
import sys

LENGTHS = (16, 100, 600, 1500)
FIRST_ID = 3  # ids 0..2 are <|endoftext|>, <|im_start|>, <|im_end|>


def main():
    vocab = int(sys.argv[1])
    for n in LENGTHS:
        seed = 1000 + n
        r = random.Random(seed)
        ids = [r.randrange(FIRST_ID, vocab) for _ in range(n)]
        print(json.dumps({"name": f"random-{n}", "prompt_seed": seed, "prompt_ids": ids}))


if __name__ == "__main__":
    main()
