"""`POST /v1/reset` (`KVStore.reset`, `Client.reset`): a tenant's cached KV forgotten when what
computed it changed (an engine's weights), through a real `kvtier serve`: only the caller's
tenant, blocks held by a lease left (and counted) until it ends, disk copies retired so that a
restart brings nothing back; and the engines' helper (`integrations/resets.py`), which asks
again while blocks are held and reports a sidecar it cannot trust to be clear."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fake_server import FakeServer, fake_servers
from service_server import ADMIN_KEY, free_port, kv_of, running, write_config

from kvtier.cli import main
from kvtier.client import Client
from kvtier.errors import ReplyError
from kvtier.integrations.resets import reset_tenants

KEY_A, KEY_B = "tenant-a-key-0123456789", "tenant-b-key-9876543210"
PROMPT = list(range(100, 132))  # 8 blocks of 4


@pytest.fixture
def fake() -> Iterator[Callable[..., FakeServer]]:
    with fake_servers() as make:
        yield make


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_reset_forgets_the_callers_tenant_only_and_waits_out_a_lease(tmp_path: Path) -> None:
    tenants = {"a": {"api_keys": [KEY_A]}, "b": {"api_keys": [KEY_B]}}
    config = write_config(tmp_path, tenants=tenants, disk="1MiB")
    port = free_port()
    with running(config, port=port) as server:
        a = Client(server.url, api_key=KEY_A, shared_memory=False)
        b = Client(server.url, api_key=KEY_B, shared_memory=False)
        a.store(PROMPT, kv_of(32, seed=1))
        b.store(PROMPT, kv_of(32, seed=2))
        server.admin("/v1/admin/persist")  # disk copies too
        lease = a.prefetch(PROMPT[:16])  # a load in flight holds 4 blocks
        first = a.reset()  # the held blocks stay, the 4 after them go
        assert first == {"dropped_blocks": 4, "left_blocks": 4, "remote": False}, first
        assert a.lookup(PROMPT).num_tokens == 16  # still served: the engine asks again
        a.release(lease)
        second = a.reset()
        assert second == {"dropped_blocks": 4, "left_blocks": 0, "remote": False}
        assert a.lookup(PROMPT).num_tokens == 0
        assert b.lookup(PROMPT).num_tokens == 32  # another tenant's KV is not the caller's
        assert reset_tenants([a]) is None  # nothing held: clear at once
        b.store(PROMPT[:8], kv_of(8, seed=3))
        assert main(["reset", "--url", server.url, "--key", KEY_B]) == 0  # an SRE's command
        assert b.lookup(PROMPT).num_tokens == 0
        b.store(PROMPT, kv_of(32, seed=2))  # b's blocks again, for the restart below
        server.admin("/v1/admin/persist")
        a.close()
        b.close()
    with running(config, port=port) as again:  # recovered from the disk tier
        with Client(again.url, api_key=KEY_A, shared_memory=False) as a:
            assert a.lookup(PROMPT).num_tokens == 0  # retired durably: nothing comes back
        with Client(again.url, api_key=KEY_B, shared_memory=False) as b:
            assert b.lookup(PROMPT).num_tokens == 32
        with Client(again.url, api_key=ADMIN_KEY, shared_memory=False) as admin:
            assert admin.status()["index"]["blocks"] == 8  # b's, recovered; none of a's


def test_reset_tenants_reports_blocks_held_too_long_and_a_remote_tier(
    fake: Callable[..., FakeServer],
) -> None:
    held = fake(reset=(200, {"dropped_blocks": 0, "left_blocks": 3, "remote": False}))
    with Client(held.url, shared_memory=False) as client:
        why = reset_tenants([client], wait_s=0.2)
    assert why is not None and "3 blocks still held" in why
    assert held.paths.count("/v1/reset") >= 2  # asked again while they were held
    remote = fake(reset=(200, {"dropped_blocks": 5, "left_blocks": 0, "remote": True}))
    with Client(remote.url, shared_memory=False) as client:
        why = reset_tenants([client])
    assert why is not None and "remote tier" in why
    down = fake(reset=(503, {"error": "closed", "detail": "the store is closed"}))
    with Client(down.url, shared_memory=False) as client:
        why = reset_tenants([client])
    assert why is not None and "the store is closed" in why


@pytest.mark.parametrize(
    ("reply", "field"),
    [
        ({"dropped_blocks": -1, "left_blocks": 0, "remote": False}, "reset.dropped_blocks"),
        ({"dropped_blocks": 1, "left_blocks": "0", "remote": False}, "reset.left_blocks"),
        ({"dropped_blocks": 1, "left_blocks": 0}, "reset.remote"),
        ({"dropped_blocks": 1, "left_blocks": 0, "remote": 1}, "reset.remote"),
    ],
)
def test_a_malformed_reset_reply_is_a_reply_error_naming_the_field(
    fake: Callable[..., FakeServer], reply: dict[str, object], field: str
) -> None:
    server = fake(reset=(200, reply))
    with Client(server.url, shared_memory=False) as client, pytest.raises(ReplyError) as refused:
        client.reset()
    assert field in str(refused.value)


def test_the_reset_command_says_why_it_could_not_reset(fake: Callable[..., FakeServer]) -> None:
    remote = fake(reset=(200, {"dropped_blocks": 5, "left_blocks": 0, "remote": True}))
    assert main(["reset", "--url", remote.url]) == 1
