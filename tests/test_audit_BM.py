"""Audit BM: the remote tier's fill against a store of the same prompt during its round trip.

A fill reads a chunk from the cluster, then stores it through the write path. When another call
(the engine's store of the same prefix, or a second load of the same prompt: two requests
sharing a system prompt) put those blocks in the index during the round trip, the write path
stored nothing new, and the fill took that for a refusal: it stopped, counted `fill_refused`
with room to spare, and the load served its first chunk only (16 of 40 tokens here; on a real
cluster the second of two concurrent loads of a 40-token prompt served 16, 19 times in 20)."""

from __future__ import annotations

import socket
import threading
from typing import Any

import torch
from test_remote_audit import FakeNode, bulk

from kvtier import KVStore, parse_config

BT = 4


class HonestNode:
    """A one-node "cluster" (`FakeNode`) that keeps values as Redis does; a GETRANGE waits for
    `release` while `hold` is set, after setting `asked`."""

    def __init__(self) -> None:
        self.values: dict[bytes, bytes] = {}
        self.lock = threading.Lock()
        self.hold, self.asked, self.release = (
            threading.Event(),
            threading.Event(),
            threading.Event(),
        )
        self.node = FakeNode(self.answer)

    def answer(self, args: list[bytes], conn: socket.socket) -> bytes:
        name, key = args[0].upper(), args[1]
        with self.lock:
            value = self.values.get(key)
            if name == b"SET":
                if value is None:
                    self.values[key] = args[2]
                return b"+OK\r\n" if value is None else b"$-1\r\n"
            if name == b"DEL":
                return b":%d\r\n" % int(self.values.pop(key, None) is not None)
            if name == b"EXISTS":
                return b":%d\r\n" % int(value is not None)
        assert name == b"GETRANGE", name
        if self.hold.is_set():
            self.asked.set()
            self.release.wait(5.0)
        data = value or b""
        return bulk(data[int(args[2]) : int(args[3]) + 1])


def config(port: int) -> dict[str, Any]:
    return {
        "model": {
            "name": "m",
            "num_layers": 2,
            "num_kv_heads": 2,
            "head_dim": 8,
            "dtype": "float16",
        },
        "block_tokens": BT,
        "tiers": {
            "gpu": {"capacity": 64 * 2048, "device": "cpu"},
            "host": {"capacity": 64 * 2048, "pinned": False},
            "remote": {
                "nodes": [f"127.0.0.1:{port}"],
                "secret": "cluster-secret-0123456789",
                "group_blocks": 4,
                "timeout_s": 10.0,
            },
        },
        "tenants": {"default": {}},
        "mover": {"background": False},
    }


def kv_for(tokens: list[int]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(len(tokens))
    return torch.randn(2, 2, len(tokens), 2, 8, generator=generator).to(torch.float16)


def test_blocks_stored_during_a_fills_round_trip_are_taken_and_the_fill_goes_on() -> None:
    cluster = HonestNode()
    cfg = parse_config(config(cluster.node.port))
    tokens = list(range(100, 140))  # 10 blocks: chunks of 4, then 6
    kv = kv_for(tokens)
    with KVStore(cfg, secret=b"node A") as a, KVStore(cfg, secret=b"node B") as b:
        a.store(tokens, kv)
        assert a.drain()
        assert a.status()["remote"]["writer_written_blocks"] == 10
        cluster.hold.set()
        loaded: list[Any] = []
        loader = threading.Thread(target=lambda: loaded.append(b.load(tokens)))
        loader.start()
        assert cluster.asked.wait(10.0)  # B's fill waits on its first chunk's read
        cluster.hold.clear()
        assert b.store(tokens[:16], kv[:, :, :16]).stored_tokens == 16  # computed meanwhile
        cluster.release.set()
        loader.join(15.0)
        assert not loader.is_alive()
        got = loaded[0]
        assert got.num_tokens == 40  # before: 16, the fill stopped at the blocks stored
        assert torch.equal(got.kv.view(torch.int16), kv.view(torch.int16))
        status = b.status()["remote"]
        assert status["fill_refused"] == 0  # before: 1, with the host tier nearly empty
        assert (status["fills"], status["filled_blocks"]) == (1, 6)  # its own, not B's store's
        b.check()
        a.check()
