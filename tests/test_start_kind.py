"""`start` must be an int: a NumPy integer (an engine's computed prefix length) is refused before
anything is read or stored, by a message that says the kind is what is wrong. Before, it said
"start: got np.int64(4), expected a multiple of block_tokens (4)": 4 is one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TINY_BLOCK_TOKENS, TINY_MODEL

from kvtier.config import parse_config
from kvtier.errors import InvalidArgumentError
from kvtier.store import KVStore

BT = TINY_BLOCK_TOKENS


def test_a_numpy_start_is_refused_naming_its_kind_and_nothing_is_stored() -> None:
    store = KVStore(parse_config({"model": {**TINY_MODEL, "dtype": "float32"}, "block_tokens": BT}))
    layout = store.layout
    tokens = list(range(2 * BT))
    kv = torch.zeros(layout.num_layers, 2, BT, layout.num_kv_heads, layout.head_dim,
                     dtype=layout.dtype)  # fmt: skip
    want = r"start: got .*4.* \(int64, not int\), expected an int, a multiple of block_tokens"
    with pytest.raises(InvalidArgumentError, match=want):
        store.store(tokens, kv, start=np.int64(BT))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"\(bool, not int\)"):
        store.load(tokens, start=True)
    assert store.lookup(tokens).num_tokens == 0
    store.check()
    assert store.store(tokens, torch.cat([kv, kv], 2), start=0).stored_tokens == 2 * BT
    store.close()
