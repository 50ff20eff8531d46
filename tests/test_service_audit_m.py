"""Audit M's findings on a real `kvtier serve`, each pinned where a user meets it.

- A reset's and an admin clear's drops are counted (`tiers.<t>.cleared`, per tier of a block's
  fastest copy), in the global and the tenant's `/v1/status`, in `/metrics` and on the page, so
  that `stored - evictions - cleared == index.blocks` still holds after them.
- `/docs` and `/redoc` (FastAPI's pages, which load their scripts from a CDN into the server's
  origin) are not served; `/openapi.json` is.
- `/v1/config` is the config as given, and the README says so (a value computed at start is
  null there; `/v1/status` has the value in force).
- The admin key on a tenant's route is told that it acts as no tenant, not "unknown API key".
"""

from __future__ import annotations

import base64
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
from lane_peer import lane_of, opened, read_frame, send
from page_reader import figures
from service_server import ADMIN_KEY, BT, Server, kv_of, running, tokens_of, write_config

import kvtier
from kvtier.client import Client

pytestmark = pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite

KEY_A = "tenant-a-key-0123456789"
KEY_B = "tenant-b-key-9876543210"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
README = Path(kvtier.__file__).resolve().parents[1] / "README.md"  # the code's own README


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tenants = {"a": {"api_keys": [KEY_A]}, "b": {"api_keys": [KEY_B]}}
    with running(write_config(tmp_path_factory.mktemp("keyed"), tenants=tenants)) as live:
        yield live


@pytest.fixture(scope="module")
def keyless(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tenants: dict[str, Any] = {"default": {}, "t1": {}}
    with running(write_config(tmp_path_factory.mktemp("keyless"), tenants=tenants)) as live:
        yield live


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def store_blocks(server: Server, key: str, base: int, sequences: int) -> None:
    """`sequences` prompts of 16 tokens (4 blocks each) stored as the tenant of `key`."""
    with Client(server.url, api_key=key, shared_memory=False) as client:
        for i in range(sequences):
            assert client.store(tokens_of(base + 100 * i, 16), kv_of(16, seed=i)).stored_tokens
            assert client.lookup(tokens_of(base + 100 * i, 16)).num_tokens == 16


def cleared(status: dict[str, Any]) -> dict[str, int]:
    return {tier: figures["cleared"] for tier, figures in status["tiers"].items()}


def metric_cleared(server: Server) -> dict[str, int]:
    text = server.get("/metrics", headers=ADMIN).text
    found = re.findall(r'^kvtier_tier_cleared_total\{tier="(\w+)"\} (\S+)$', text, re.M)
    return {tier: int(float(value)) for tier, value in found}


def lane_call(sock: socket.socket, path: str, auth: str | None, tenant: str | None,
              fields: dict[str, Any]) -> tuple[int, dict[str, Any]]:  # fmt: skip
    body = msgpack.packb(fields, use_bin_type=True)
    send(sock, msgpack.packb([path, auth, tenant, body], use_bin_type=True))
    status, reply = read_frame(sock)
    return status, msgpack.unpackb(reply, raw=False)


# ---- 1: a reset's and a clear's drops are counted ------------------------------------------


def test_a_reset_and_an_admin_clear_are_counted_as_cleared(keyed: Server) -> None:
    store_blocks(keyed, KEY_A, 1000, 3)  # 12 blocks of a, on gpu (and host: write_through)
    with Client(keyed.url, api_key=KEY_A, shared_memory=False) as client:
        assert client.reset()["dropped_blocks"] == 12
    everyone = keyed.get("/v1/status", headers=ADMIN).json()
    assert cleared(everyone) == {"gpu": 12, "host": 0}  # each block once, at its fastest copy
    assert cleared(keyed.get("/v1/status", headers=bearer(KEY_A)).json()) == {"gpu": 12, "host": 0}
    assert cleared(keyed.get("/v1/status", headers=bearer(KEY_B)).json()) == {"gpu": 0, "host": 0}
    assert metric_cleared(keyed) == {"gpu": 12, "host": 0}
    store_blocks(keyed, KEY_B, 5000, 2)  # 8 blocks of b, then an admin clear of everything
    assert keyed.admin("/v1/admin/clear").json()["dropped_blocks"] == 8
    everyone = keyed.get("/v1/status", headers=ADMIN).json()
    assert cleared(everyone) == {"gpu": 20, "host": 0} == metric_cleared(keyed)
    assert cleared(keyed.get("/v1/status", headers=bearer(KEY_B)).json())["gpu"] == 8
    assert cleared(keyed.get("/v1/status", headers=bearer(KEY_A)).json())["gpu"] == 12
    # every block stored is still here, evicted or cleared
    stored = everyone["ops"]["stored_tokens"] // BT
    gone = sum(f["evictions"] + f["cleared"] for f in everyone["tiers"].values())
    assert stored - gone == everyone["index"]["blocks"] == 0
    basic = base64.b64encode(f"operator:{ADMIN_KEY}".encode()).decode()
    page = figures(keyed.get("/", headers={"authorization": f"Basic {basic}"}).text)
    assert page["tiers.gpu.cleared"] == 20


# ---- 2: no /docs, /redoc -------------------------------------------------------------------


def test_no_docs_page_is_served_and_the_schema_is(keyless: Server) -> None:
    for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        response = keyless.get(path)
        assert response.status_code == 404, path
        assert "cdn.jsdelivr.net" not in response.text
    schema = keyless.get("/openapi.json")
    assert schema.status_code == 200 and "/v1/lookup" in schema.json()["paths"]
    assert "GET /openapi.json" in README.read_text() and "`GET /docs`" not in README.read_text()


# ---- 4: /v1/config is the config as given ---------------------------------------------------


def test_config_is_the_config_as_given_and_the_readme_says_so(keyless: Server) -> None:
    config = keyless.get("/v1/config").json()
    assert config["service"]["max_inflight_bytes"] is None  # computed at start: not here
    assert keyless.get("/v1/status").json()["inflight"]["limit_bytes"] == 4 << 30
    row = next(line for line in README.read_text().splitlines() if "| `GET /v1/config`" in line)
    assert "as given" in row and "/v1/status" in row and "effective" not in row


# ---- 5: the admin key on a tenant's route ---------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/pools", "/v1/leases/1"])
def test_the_admin_key_on_a_tenant_get_is_told_it_acts_as_no_tenant(
    keyed: Server, path: str
) -> None:
    response = keyed.get(path, headers=ADMIN)
    assert response.status_code == 403 and response.json()["error"] == "forbidden"
    detail = response.json()["detail"]
    assert "admin key acts as no tenant" in detail and path in detail, detail
    unknown = keyed.get(path, headers=bearer("not-a-key-0123456789")).json()["detail"]
    assert unknown == "unknown API key"


def test_the_admin_key_on_the_data_plane_and_the_lane_is_told_so_too(keyed: Server) -> None:
    lookup = keyed.post("/v1/lookup", json={"tokens": [1, 2, 3, 4]}, headers=ADMIN)
    assert lookup.status_code == 403 and "acts as no tenant" in lookup.json()["detail"]
    sock = opened(lane_of(keyed, f"Bearer {KEY_A}"))
    try:
        status, reply = lane_call(sock, "/v1/release", f"Bearer {ADMIN_KEY}", None, {"lease_id": 1})
        assert status == 403 and "acts as no tenant" in reply["detail"], reply
        assert "/v1/release" in reply["detail"] and ADMIN_KEY not in reply["detail"]
    finally:
        sock.close()
