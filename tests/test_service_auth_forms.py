"""How a request names its key and its tenant, against a real `kvtier serve`:
- the `Authorization` scheme in any case (RFC 9110 11.1): `bearer KEY` and `BEARER KEY` act as
  KEY's tenant, an unknown key so written is 403 (not 401 "missing"), the status page takes
  `basic` credentials too (before: 401 "missing 'Authorization: Bearer <key>'");
- without keys, an empty `X-Kvtier-Tenant` is a tenant name the config does not list (403
  `unknown_tenant`), not the absent header's `default` (before: served as `default`)."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import pytest
from service_server import ADMIN_KEY, Server, running, write_config

KEY = "auth-forms-tenant-key-0123456789"
LOOKUP = {"tokens": [1, 2, 3, 4]}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = write_config(tmp_path_factory.mktemp("keyed"), tenants={"alice": {"api_keys": [KEY]}})
    with running(config) as live:
        yield live


@pytest.mark.parametrize(
    ("scheme", "basic"),
    [("Bearer", "Basic"), ("bearer", "basic"), ("BEARER", "BASIC"), ("bEaReR", "bAsIc")],
)
def test_the_scheme_in_any_case(keyed: Server, scheme: str, basic: str) -> None:
    reply = keyed.post("/v1/lookup", json=LOOKUP, headers={"authorization": f"{scheme} {KEY}"})
    assert reply.status_code == 200 and reply.json()["num_tokens"] == 0, reply.text
    reply = keyed.post("/v1/lookup", json=LOOKUP, headers={"authorization": f"{scheme} nokey"})
    assert reply.status_code == 403 and reply.json()["error"] == "forbidden", reply.text
    credentials = base64.b64encode(f"x:{KEY}".encode()).decode()
    page = keyed.get("/", headers={"authorization": f"{basic} {credentials}"})
    assert page.status_code == 200, page.text[:200]


def test_other_schemes_are_no_key(keyed: Server) -> None:
    for value in (f"Token {KEY}", KEY, f"Bearer\t{KEY}", "bearer", f"Bearer{KEY}"):
        reply = keyed.post("/v1/lookup", json=LOOKUP, headers={"authorization": value})
        assert reply.status_code == 401 and reply.json()["error"] == "unauthorized", value
    reply = keyed.post("/v1/admin/check", headers={"authorization": f"bearer {ADMIN_KEY}"})
    assert reply.status_code == 200, reply.text


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_an_empty_tenant_name_is_no_default(tmp_path_factory: pytest.TempPathFactory) -> None:
    config = write_config(tmp_path_factory.mktemp("keyless"), tenants={"default": {}})
    with running(config) as server:
        reply = server.post("/v1/lookup", json=LOOKUP, headers={"x-kvtier-tenant": ""})
        assert reply.status_code == 403 and reply.json()["error"] == "unknown_tenant", reply.text
        reply = server.post("/v1/lookup", json=LOOKUP)
        assert reply.status_code == 200, reply.text  # no header: `default`
