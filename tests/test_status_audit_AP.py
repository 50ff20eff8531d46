"""Audit AP of what operators are told (`/v1/status`, the status page, `/metrics`).

- The page shows every figure of `GET /v1/status` with the API's value, for the admin and for a
  tenant's key: before this audit it left out the write policy (`policy.write`), the requests'
  bytes in flight (`inflight`, which `kvtier status` prints), and for a tenant its name as a
  figure and its `locked_blocks` (what its leases and reservation pins lock), so a script
  reading the page as it reads the API missed them and an operator saw no write policy.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from service_server import ADMIN_KEY, Server, kv_of, running, tokens_of, write_config

from kvtier.client import Client

KEYS = {"a": "tenant-a-key-0123456789abcdef", "b": "tenant-b-key-0123456789abcdef"}
NOT_ON_PAGE = ("mover.copy_choices.",)  # names of strategies, for the API (`render.py`)


def _leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for name, inner in value.items():
            yield from _leaves(inner, f"{path}.{name}" if path else name)
    else:
        yield path, value


def _page_figures(text: str) -> dict[str, str]:
    pairs = re.findall(r'data-field="([^"]*)" data-value="([^"]*)"', text)
    return {html.unescape(field): html.unescape(value) for field, value in pairs}


def _shown(server: Server, key: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The status and the page's figures, read back to back on a quiet server."""
    headers = {"authorization": f"Bearer {key}"}
    status = server.get("/v1/status", headers=headers)
    page = server.get("/?part=main", headers=headers)
    assert status.status_code == 200 and page.status_code == 200, (status.text, page.text)
    return status.json(), _page_figures(page.text)


def test_every_status_figure_is_on_the_page_with_its_value(tmp_path: Path) -> None:
    config = write_config(
        tmp_path, tenants={name: {"api_keys": [key]} for name, key in KEYS.items()}
    )
    with running(config) as server:
        client = Client(server.url, api_key=KEYS["a"], shared_memory=False)
        try:
            for i in range(3):
                client.store(tokens_of(1000 * i, 16), kv_of(16, i))
                client.lookup(tokens_of(1000 * i, 16))
            lease = client.prefetch(tokens_of(0, 8))  # locks 2 blocks of tenant a
            for key in (ADMIN_KEY, KEYS["a"]):
                status, page = _shown(server, key)
                leaves = {
                    path: value
                    for path, value in _leaves(status)
                    if value is not None and not path.startswith(NOT_ON_PAGE)
                }
                missing = sorted(path for path in leaves if path not in page)
                assert not missing, f"figures of /v1/status not on the page: {missing}"
                for path, value in leaves.items():
                    on_page = page[path] if isinstance(value, str) else json.loads(page[path])
                    assert on_page == value, (path, on_page, value)
            assert page["tenant"] == "a" and json.loads(page["locked_blocks"]) == 2
            client.release(lease)
        finally:
            client.close()
