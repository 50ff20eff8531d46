"""A tenant's floor holds against two takers of its margin at once: the background mover's
demotion flight and another tenant's call making room (`transfer/background.py`).

A watermark pass plans a flight of the blocks a namespace has above its floor, counting them as
leaving (`Background._spare`); until the flight lands they are still resident, so a call of
another tenant making room in between may take the same margin (`index/eviction.py` bounds it
by what is resident). Before, the landing then freed the flight's source copies too and left the
namespace under its floor (a tenant kept 1 of its 4 gpu floor blocks in an audit's run); now a
landing keeps the source copies its namespace needs for its floor.
"""

from __future__ import annotations

from typing import Any

from conftest import TINY_BLOCK_TOKENS, TINY_MODEL, kv_for, tiny_block_bytes

from kvtier.config import parse_config
from kvtier.store import KVStore

BT = TINY_BLOCK_TOKENS
BLOCK = tiny_block_bytes()


def tokens(first: int, num_blocks: int) -> list[int]:
    return [first + j for j in range(num_blocks * BT)]


def test_a_flight_landing_after_another_tenant_took_the_margin_keeps_the_floor() -> None:
    floor = {"floor": {"gpu": f"{4 * BLOCK}B"}}
    config: dict[str, Any] = {
        "model": {**TINY_MODEL, "dtype": "float32"},
        "block_tokens": BT,
        "tiers": {
            "gpu": {"capacity": 16 * BLOCK, "device": "cpu", "high_watermark": 0.75,
                    "low_watermark": 0.5},
            "host": {"capacity": 64 * BLOCK, "pinned": False},
        },
        "policy": {"write": "write_back"},
        "mover": {"background": True},
        "tenants": {"v": floor, "x": floor},
    }  # fmt: skip
    store = KVStore(parse_config(config))
    try:
        for p in range(2):  # v: two prompts of 4 blocks, 4 above its floor; under the watermark
            store.store(tokens(1000 * p, 4), kv_for(store, 4 * BT), tenant="v")
        assert store.drain(10)
        with store.operations.lock:  # the mover's thread can neither plan nor land meanwhile
            store.store(tokens(5000, 5), kv_for(store, 5 * BT), tenant="x")  # 13 of 16: past 12
            store.mover.work.keep_watermarks()  # a flight of v's older prompt: its margin
            assert store.mover.flights
            store.store(tokens(7000, 4), kv_for(store, 4 * BT), tenant="x")  # room for 1 more
        assert store.drain(10)
        gpu = store.status("v")["tiers"]["gpu"]
        assert gpu["blocks"] >= gpu["floor_blocks"] == 4, gpu
        for p in range(2):  # and v loses nothing: what left gpu is on host
            assert store.lookup(tokens(1000 * p, 4), tenant="v").num_tokens == 4 * BT
        store.check()
    finally:
        store.close()
