"""A second client process for `test_service.py`: shared memory across real processes.

    python service_peer.py URL LOAD_BASE LOAD_SEED STORE_BASE STORE_SEED NUM_TOKENS

Maps the server's pools, loads the sequence of NUM_TOKENS tokens at LOAD_BASE (which the test
stored with `kv_of(NUM_TOKENS, LOAD_SEED)`) and compares it bit for bit, then stores the
sequence at STORE_BASE with `kv_of(NUM_TOKENS, STORE_SEED)` for the test to load. Prints one
JSON line: `{"mapped", "loaded_tokens", "loaded_same", "stored"}`.
"""

from __future__ import annotations

import json
import sys

import torch
from service_server import kv_of, tokens_of

from kvtier.client import Client


def main(argv: list[str]) -> None:
    url = argv[0]
    load_base, load_seed, store_base, store_seed, num_tokens = map(int, argv[1:6])
    with Client(url) as client:
        loaded = client.load(tokens_of(load_base, num_tokens))
        expected = kv_of(num_tokens, load_seed)
        stored = client.store(tokens_of(store_base, num_tokens), kv_of(num_tokens, store_seed))
        report = {
            "mapped": client.pool_buffer("gpu") is not None,
            "loaded_tokens": loaded.num_tokens,
            "loaded_same": loaded.kv.shape == expected.shape
            and torch.equal(loaded.kv.view(torch.int16), expected.view(torch.int16)),
            "stored": list(stored),
        }
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
