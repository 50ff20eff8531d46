"""`kvtier.routing` reads vLLM 0.33's own KV events: its `ZmqEventPublisher` sends each event as
a tagged map (`{"type": "BlockStored", "block_hashes": ..., ...}`, msgspec `tag=True`) in the
positional batch `[ts, events, dp_rank]`, and the router's index counted every one of them bad
(it read positional arrays only): routing from real vLLM pods scored nothing. Over loopback
ZMQ, from a real vLLM publisher to a real `Subscriber` and `PrefixIndex`.

    KVTIER_ENGINE_TESTS=1 PYTHONPATH=.engines/vllm \\
        python -m pytest tests/engines/test_vllm_events_router.py
"""

from __future__ import annotations

import socket
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is installed apart: bash tests/engines/install.sh vllm")

from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from kvtier.routing import PrefixIndex, Subscriber


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def until(check: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not check():  # type: ignore[operator]
        time.sleep(0.02)


def stored(hashes: list[int], parent: int | None, first: int, medium: str) -> BlockStored:
    tokens = list(range(first, first + 4 * len(hashes)))
    return BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=4,
        lora_id=None, medium=medium, lora_name=None, group_idx=0, session_id="s",
    )  # fmt: skip


def test_vllm_publisher_feeds_the_router() -> None:
    port, replay = free_port(), free_port()
    pub = ZmqEventPublisher(
        0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay}",  # "*": vLLM binds
        topic="kv@vllm-pod@m",
    )  # fmt: skip
    index = PrefixIndex(4)
    sub = Subscriber(index)
    try:
        sub.add(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}", pod="vllm-pod")
        time.sleep(0.8)  # the SUB's subscription reaches the PUB
        events = [AllBlocksCleared(), stored([11, 12], None, 0, "GPU"), stored([13], 12, 8, "GPU")]
        pub.publish(KVEventBatch(ts=time.time(), events=events))
        pub.publish(KVEventBatch(ts=time.time(), events=[BlockRemoved([13], medium="GPU")]))
        until(lambda: index.stats()["events"] >= 4)
        assert index.stats()["bad"] == 0, index.stats()
        assert index.score(list(range(12))) == {"vllm-pod": 8.0}
        index.check()
    finally:
        sub.close()
        pub.shutdown()
