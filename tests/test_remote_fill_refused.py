"""A block the cluster holds that this node's tiers refuse is a miss, not the call's error
(`transfer/remote.py`, "In"): node A (plain tiers) stores fp16 KV holding an infinity, which a
remote tier keeps plain; node B, whose host tier is int8 (it refuses KV it cannot quantize),
loads and prefetches the same prompt. Before, its fill's store raised `InvalidKVError` out of
the load; now the load serves B's own prefix, `fill_refused` counts it, and nothing is stored.

Skipped without `redis-server`, unless KVTIER_REQUIRE_REDIS=1 (CI sets it)."""

from __future__ import annotations

import torch
from test_remote_audit3 import config, kv_for, node, twin


def test_kv_the_local_tiers_refuse_is_a_miss_counted_not_an_error(redis_nodes: list[str]) -> None:
    ca = config(redis_nodes)
    cb = twin(ca)
    cb["tiers"] = {**cb["tiers"], "host": {**cb["tiers"]["host"], "codec": "int8"}}
    a, b = node(ca), node(cb)
    try:
        tokens = list(range(1000, 1032))  # 8 blocks
        kv = kv_for(tokens)
        kv[0, 0, 20, 0, 0] = float("inf")  # block 5: no int8 copy can hold it
        assert a.store(tokens, kv).stored_tokens == 32
        assert a.drain()
        own = tokens[:8]
        assert b.store(own, kv[:, :, :8].clone()).stored_tokens == 8  # B's own prefix, 2 blocks
        assert b.drain()  # its writer connected (a call while it connects is a miss at once)
        b.check()
        loaded = b.load(tokens)  # the cluster holds 6 more blocks; B's host cannot keep block 5
        assert loaded.num_tokens == 8
        assert torch.equal(loaded.kv, kv[:, :, :8])
        lease = b.prefetch(tokens)
        assert lease.num_tokens == 8
        b.release(lease)
        figures = b.status()["remote"]
        assert figures["fill_refused"] == 2 and figures["filled_blocks"] == 0
        assert b.lookup(tokens).num_tokens == 8 + 6 * 4  # the cluster's still count as remote
        b.check()
    finally:
        a.close()
        b.close()
