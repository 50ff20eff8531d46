"""The remote writer queues what its backlog has room for, a store's leading blocks, rather than
dropping the whole store (`tiers/remote/writer.py`): a store larger than
`tiers.remote.max_pending_bytes` is shared up to the bound (before: not at all, even with the
writer idle: with the default 256 MiB, any store of more new KV than that, some 800 tokens of a
70B model, never reached the cluster), and a bound below one block still shares one block at a
time. Over a real Redis Cluster, two stores ("node A", "node B") in one process.

Skipped without `redis-server`, unless KVTIER_REQUIRE_REDIS=1 (CI sets it)."""

from __future__ import annotations

import torch
from test_remote_audit3 import config, kv_for, node, twin

BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 2  # layers, K/V, block_tokens, heads, head_dim, fp16


def test_a_store_past_the_backlog_bound_shares_its_head(redis_nodes: list[str]) -> None:
    ca = config(redis_nodes, max_pending_bytes=4 * BLOCK_BYTES)
    tokens = list(range(7000, 7040))  # 10 blocks
    kv = kv_for(tokens, seed=7)
    with node(ca) as a, node(twin(ca)) as b:
        assert a.store(tokens, kv).stored_tokens == 40
        assert a.drain()
        figures = a.status()["remote"]
        assert figures["writer_queued_blocks"] == 4 and figures["writer_dropped_blocks"] == 6
        assert figures["writer_written_blocks"] == 4
        got = b.load(tokens)  # the head, exact
        assert got.num_tokens == 16 and torch.equal(got.kv, kv[:, :, :16])
        a.check()
        b.check()


def test_a_bound_below_one_block_still_shares_one_block_at_a_time(redis_nodes: list[str]) -> None:
    ca = config(redis_nodes, max_pending_bytes=BLOCK_BYTES // 2)
    tokens = list(range(8000, 8016))  # 4 blocks
    kv = kv_for(tokens, seed=8)
    with node(ca) as a, node(twin(ca)) as b:
        a.store(tokens[:4], kv[:, :, :4])
        assert a.drain()
        a.store(tokens, kv)  # the writer idle again: one more block
        assert a.drain()
        assert a.status()["remote"]["writer_written_blocks"] == 2
        got = b.load(tokens)
        assert got.num_tokens == 8 and torch.equal(got.kv, kv[:, :, :8])
