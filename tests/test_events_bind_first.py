"""The KV events' addresses are bound before any tier is made (an in-process `KVStore` on real
slab files and real ZMQ sockets).

Pins:
- a restart at a lowered `tiers.disk.capacity` whose `events.endpoint` (or `replay_endpoint`)
  is taken is refused with a `ConfigError` naming the field, and cuts nothing: the slab keeps
  its size and the old config finds every persisted copy (before, the disk tier had been opened
  and cut first, and the refusal came after the copies past the new capacity were gone);
- a store whose assembly fails after its events were bound gives the addresses back: the next
  store binds them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import zmq
from service_server import tokens_of
from test_disk_cut_count import KEPT, STORED, config, persisted

from kvtier.errors import ConfigError
from kvtier.store import KVStore


@pytest.fixture
def taken() -> Any:
    """A loopback TCP address held by a socket of the test's own, and its `tcp://` form."""
    context = zmq.Context()
    socket = context.socket(zmq.PUB)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    yield f"tcp://127.0.0.1:{port}"
    socket.close(linger=0)
    context.term()


@pytest.mark.parametrize("field", ["endpoint", "replay_endpoint"])
def test_a_taken_events_address_refuses_before_the_disk_is_cut(
    tmp_path: Path, taken: str, field: str
) -> None:
    slot = persisted(tmp_path)
    slab = tmp_path / "disk" / "slab-00000.kvt"
    size = slab.stat().st_size
    events = {"endpoint": "tcp://127.0.0.1:0", field: taken}
    with pytest.raises(ConfigError) as refused:
        KVStore(config(tmp_path, KEPT * slot, events))
    assert f"events.{field}" in str(refused.value) and taken in str(refused.value)
    assert slab.stat().st_size == size  # nothing cut
    store = KVStore(config(tmp_path, "1MiB"))
    try:
        store.check()
        assert store.recovery["recovered"] == STORED
        assert store.recovery["cut"] == 0
        hit = store.lookup(tokens_of(0, STORED * 4))
        assert hit.num_tokens == STORED * 4
    finally:
        store.close()


def test_a_failed_assembly_gives_its_events_addresses_back(tmp_path: Path) -> None:
    probe = zmq.Context()
    socket = probe.socket(zmq.PUB)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    socket.close(linger=0)
    probe.term()
    address = f"tcp://127.0.0.1:{port}"
    (tmp_path / "disk").write_text("a file where the disk tier's directory goes")
    with pytest.raises(ConfigError):
        KVStore(config(tmp_path, "1MiB", {"endpoint": address}))
    (tmp_path / "disk").unlink()
    store = KVStore(config(tmp_path, "1MiB", {"endpoint": address}))
    try:
        store.check()
        assert store.status()["events"]["topic"]
    finally:
        store.close()
