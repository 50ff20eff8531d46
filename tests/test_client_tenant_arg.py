"""A call's `tenant` argument is checked by the client before anything is sent: a tenant that is
not a str, or not a header's text (a newline, past latin-1), is an `InvalidArgumentError` naming
`tenant`, from `Client` and `AsyncClient`, over the lane and over HTTP alike. Before, a non-str
or a newline went into the request as it was: `http.client` raised a bare ValueError or
TypeError, and a prefetch's give-back of its request token then failed again on the client's
release thread (an uncaught exception there); an int went over the lane as "5"."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
from service_server import kv_of, running, write_config

from kvtier.client import AsyncClient, Client
from kvtier.errors import InvalidArgumentError

BAD = [5, None, b"x", "b\n", "b\r\nx-kvtier-tenant: a", "\u0436"]


@pytest.mark.parametrize("shared_memory", [True, False])
def test_a_bad_tenant_argument_is_refused_before_it_is_sent(
    tmp_path: Path, shared_memory: bool
) -> None:
    crashed: list[Any] = []
    hook, threading.excepthook = threading.excepthook, crashed.append
    try:
        with running(write_config(tmp_path, service={"shared_memory": shared_memory})) as server:
            tokens = list(range(16))
            kv = kv_of(16, seed=1)
            with Client(server.url) as client:
                for tenant in BAD:
                    bad: Any = tenant
                    with pytest.raises(InvalidArgumentError, match="tenant"):
                        client.lookup(tokens, tenant=bad)
                    with pytest.raises(InvalidArgumentError, match="tenant"):
                        client.store(tokens, kv, tenant=bad)
                    with pytest.raises(InvalidArgumentError, match="tenant"):
                        client.prefetch(tokens, tenant=bad)
                    with pytest.raises(InvalidArgumentError, match="tenant"):
                        client.load(tokens, tenant=bad)
                assert client.store(tokens, kv).stored_tokens == 16  # the client still works
                assert client.lookup(tokens).num_tokens == 16

            async def main() -> None:
                async with AsyncClient(server.url) as aclient:
                    for tenant in BAD:
                        with pytest.raises(InvalidArgumentError, match="tenant"):
                            await aclient.lookup(tokens, tenant=tenant)  # type: ignore[arg-type]
                        with pytest.raises(InvalidArgumentError, match="tenant"):
                            await aclient.prefetch(tokens, tenant=tenant)  # type: ignore[arg-type]
                    assert (await aclient.lookup(tokens)).num_tokens == 16

            asyncio.run(main())
    finally:
        threading.excepthook = hook
    assert crashed == []  # no give-back failed on the release thread
