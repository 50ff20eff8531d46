"""Audit BL of the sidecar's data plane, server side (`kvtier/service/plane.py`, `grants.py`):

- A load against a server whose `service.max_body_bytes` is less than one block (the config
  allows it: 1 KiB at least, whatever the model) loaded `tokens[:start]`: from 0 a 400
  `invalid_tokens` ("an empty sequence") for a good request, from a later block a 200 reply
  `truncated` at its own start, which the client refuses as a broken server's. It is a typed
  413 `body_too_large` naming the block's bytes and the bound now.
- A prefetch tries again after a FAILED lease under the same request token (`plane.py`): a
  give-back that came between two attempts withdrew the first lease's id, left no tombstone,
  and the next attempt's lease was granted, held to its ttl though its client had given it back.
  A withdrawal always leaves the tombstone now.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgpack  # type: ignore[import-untyped]
import pytest
from service_server import BLOCK_BYTES, BT, Server, running, write_config

from kvtier.service.grants import Grants

TINY_BODY = 2048  # less than one block of the tests' layout
MSGPACK = {"content-type": "application/msgpack"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    assert TINY_BODY < BLOCK_BYTES
    config = write_config(
        tmp_path_factory.mktemp("audit_bl"), service={"max_body_bytes": TINY_BODY}
    )
    with running(config) as live:
        yield live


@pytest.mark.parametrize("start", [0, BT, 4 * BT])
def test_a_load_no_reply_can_carry_is_a_typed_413(server: Server, start: int) -> None:
    body = {"tokens": list(range(1000, 1064)), **({"start": start} if start else {})}
    reply = server.post("/v1/load", content=msgpack.packb(body), headers=MSGPACK)
    assert reply.status_code == 413, reply.content[:200]
    refusal = msgpack.unpackb(reply.content)
    assert refusal["error"] == "body_too_large"
    assert f"{BLOCK_BYTES} bytes" in refusal["detail"] and str(TINY_BODY) in refusal["detail"]
    # a load from the end asks for nothing: still answered, empty
    end = {"tokens": list(range(1000, 1064)), "start": 64}
    empty = server.post("/v1/load", content=msgpack.packb(end), headers=MSGPACK)
    assert empty.status_code == 200 and msgpack.unpackb(empty.content)["num_tokens"] <= 64
    server.admin("/v1/admin/check")  # asserts 200: the store's checks hold


def test_a_grant_after_its_tokens_give_back_grants_nothing() -> None:
    """The retry's sequence on the real table: attempt 1 granted, given back, attempt 2."""
    grants, tenants, token = Grants(), ("a", "b"), "00000000000000b1"
    assert grants.grant("lease", "a", token, 11, tenants)
    assert grants.withdraw("lease", "a", token, tenants) == 11
    grants.check()
    assert not grants.grant("lease", "a", token, 12, tenants)  # ended at once by its caller
    grants.check()
    assert grants.withdraw("lease", "a", token, tenants) is None  # nothing left to give back
    # another tenant's same token is its own, untouched
    assert grants.grant("lease", "b", token, 13, tenants)
    assert grants.withdraw("lease", "b", token, tenants) == 13
    grants.check()
