#!/usr/bin/env python3
"""sha256 of a GGUF's tensor data, independent of its metadata: for each
tensor in name order, its name (UTF-8) then its bytes. Matches
`tensor_data_sha256` in crates/handoff-model/tests/arch_llamacpp.rs.
Needs gguf-py on PYTHONPATH (the pinned llama.cpp's)."""
import hashlib
import sys

from gguf import GGUFReader


def main():
    r = GGUFReader(sys.argv[1])
    h = hashlib.sha256()
    for t in sorted(r.tensors, key=lambda t: t.name):
        h.update(t.name.encode())
        h.update(t.data.tobytes())
    print(h.hexdigest())


if __name__ == "__main__":
    main()
