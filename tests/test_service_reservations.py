"""Reservations against a real `kvtier serve`: a body-only tenant (another Unix user, mapping no
shared memory) cannot publish or read slots it never wrote; a late writer through the mapped
pool harms no one; reservation and lease ids count and reveal nothing (DESIGN invariant 8,
issue 11 points 1, 2 and 4).

Each test gets a server of its own with tenants `a` and `b` (keys below): gpu 4 blocks and host
8, fp16, 4096 bytes a block (`service_server.py`), pools in /dev/shm (mode 0600).
"""

from __future__ import annotations

import itertools
import json
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from conftest import same
from service_server import (
    ADMIN_KEY,
    BT,
    DIM,
    HEADS,
    LAYERS,
    Server,
    kv_of,
    running,
    tokens_of,
    write_config,
)

from kvtier.blocks import fresh_id, to_blocks
from kvtier.client import Client
from kvtier.errors import LeaseError
from kvtier.results import StoreResult

KEY_A = "tenant-a-key-0123456789"
KEY_B = "tenant-b-key-9876543210"
OTHER_USER = "kvtier-b"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}

# B's whole program: httpx and msgpack only, so that another Unix user can run it with the
# system's python. It tries to open the pools' shared memory, reserves, commits without
# writing, loads what it committed and aborts; it prints what it saw as one JSON line.
HOSTILE = r"""
import json, os, sys
import httpx, msgpack
url, key, first, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
headers = {"authorization": "Bearer " + key, "content-type": "application/msgpack"}
tokens = b"".join(t.to_bytes(4, "little") for t in range(first, first + count))

def decode(response):
    if response.headers["content-type"].startswith("application/msgpack"):
        return msgpack.unpackb(response.content)
    return response.json()

def post(path, body):
    response = httpx.post(url + path, content=msgpack.packb(body), headers=headers, timeout=30)
    return response.status_code, decode(response)

seen = {"mapped": []}
for pool in decode(httpx.get(url + "/v1/pools", headers=headers, timeout=30))["pools"]:
    try:
        with open(os.path.join("/dev/shm", pool["shared_memory"] or ""), "r+b"):
            seen["mapped"].append(pool["tier"])
    except OSError:
        pass
status, reservation = post("/v1/reserve", {"tokens": tokens})
seen["reserve"] = [status, reservation.get("num_tokens")]
rid = {"reservation_id": reservation.get("reservation_id", 0)}
status, body = post("/v1/commit", rid)
seen["commit"] = [status, body.get("error")]
status, body = post("/v1/load", {"tokens": tokens})
seen["load"] = [status, body.get("num_tokens"), body.get("kv", b"").hex()]
seen["abort"] = post("/v1/abort", rid)[0]
print(json.dumps(seen))
"""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    config = write_config(
        tmp_path,
        gpu_blocks=4,
        host_blocks=8,
        tenants={"a": {"api_keys": [KEY_A]}, "b": {"api_keys": [KEY_B]}},
    )
    with running(config) as live:
        yield live


def post(server: Server, path: str, body: dict[str, Any], key: str) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    return server.post(path, content=json.dumps(body).encode(), headers=headers)


AS_ANOTHER_USER = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("runuser") is None or shutil.which("useradd") is None,
    reason="running a client as another Unix user needs root, runuser and useradd",
)


def other_user_python() -> list[str]:
    """A command prefix that runs a python of this version as `OTHER_USER` (created here if
    missing) with this environment's site-packages (root, runuser and useradd: the caller is
    marked `AS_ANOTHER_USER`); skips with the reason if useradd refuses."""
    try:
        pwd.getpwnam(OTHER_USER)
    except KeyError:
        made = subprocess.run(
            ["useradd", "--system", "--no-create-home", OTHER_USER], capture_output=True
        )
        if made.returncode != 0:
            why = made.stderr.decode(errors="replace")
            pytest.skip(reason=f"useradd {OTHER_USER} failed: {why}")
    site = sysconfig.get_paths()["purelib"]
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for python in (os.path.realpath(sys.executable), f"/usr/bin/python{version}"):
        prefix = ["runuser", "-u", OTHER_USER, "--", "env", f"PYTHONPATH={site}", python]
        probe = subprocess.run([*prefix, "-c", "import httpx, msgpack"], capture_output=True)
        if probe.returncode == 0:
            return prefix
    pytest.skip(reason=f"no python {version} that {OTHER_USER} may run can import httpx ({site})")


def blocks_of(num_tokens: int, kv_hex: str) -> torch.Tensor:
    """A load's KV payload (fp16 bytes, hex) as blocks `[n, layers, 2, BT, heads, dim]`."""
    if not num_tokens:
        return torch.empty((0, LAYERS, 2, BT, HEADS, DIM), dtype=torch.float16)
    kv = torch.frombuffer(bytearray(bytes.fromhex(kv_hex)), dtype=torch.float16)
    return to_blocks(kv.view(LAYERS, 2, num_tokens, HEADS, DIM), BT)


@pytest.mark.parametrize("user", ["same", pytest.param("other", marks=AS_ANOTHER_USER)])
def test_a_body_only_tenant_cannot_commit_unwritten_slots_nor_read_what_they_held(
    server: Server, user: str
) -> None:
    prefix = other_user_python() if user == "other" else [sys.executable]
    secret = kv_of(16, seed=7)
    with Client(server.url, api_key=KEY_A, shared_memory=False) as a:  # 4 blocks: over a's
        assert a.store(tokens_of(0, 16), secret) == StoreResult(16, 16, 0)  # reserve quota
    # B reserves 2 blocks: LRU demotes a's last 2 to host and hands B their gpu slots
    run = subprocess.run(
        [*prefix, "-c", HOSTILE, server.url, KEY_B, "5000", "8"],
        capture_output=True,
        timeout=60,
        cwd="/",
    )
    assert run.returncode == 0, run.stderr.decode(errors="replace")
    seen = json.loads(run.stdout)
    theirs = blocks_of(*seen["load"][1:])
    leaked = [i for i, mine in enumerate(to_blocks(secret, BT)) if any(same(mine, theirs_i)
              for theirs_i in theirs)]  # fmt: skip
    assert leaked == []  # before the fix: a's last two blocks, bit-exact
    assert seen["reserve"] == [200, 8]
    assert seen["commit"] == [409, "not_written"]
    assert seen["load"][:2] == [200, 0]
    assert seen["abort"] == 200  # still live after the refusal: its holder ends it
    if user == "other":
        assert seen["mapped"] == []  # the body path: it could not open the pools
    with Client(server.url, api_key=KEY_A) as a:
        kept = a.load(tokens_of(0, 16))
        assert kept.num_tokens == 16 and same(kept.kv, secret)  # demoted to host, intact
    assert server.admin("/v1/admin/check").json() == {"ok": True, "detail": ""}


def test_a_late_writer_through_the_mapped_pool_writes_into_quarantine(server: Server) -> None:
    kvs = [kv_of(8, seed=20 + i) for i in range(2)]
    with Client(server.url, api_key=KEY_A) as a, Client(server.url, api_key=KEY_B) as b:
        pool = b.pool_buffer("gpu")
        assert pool is not None
        late = b.reserve(tokens_of(9000, 8), ttl_s=0.2)
        assert (late.tier, len(late.slots)) == ("gpu", 2)
        time.sleep(0.3)
        with pytest.raises(LeaseError):
            b.commit(late)  # expired: commit fails
        for i, kv in enumerate(kvs):
            assert a.store(tokens_of(100 * i, 8), kv) == StoreResult(8, 8, 0)
        pool[list(late.slots)] = to_blocks(kv_of(8, seed=99), BT)  # the late writer writes now
        for i, kv in enumerate(kvs):
            loaded = a.load(tokens_of(100 * i, 8))
            assert loaded.num_tokens == 8 and same(loaded.kv, kv)
    gpu = server.get("/v1/status", headers=ADMIN).json()["tiers"]["gpu"]
    assert gpu["slots"] - gpu["free_slots"] == gpu["blocks"] + 2  # quarantined, still counted
    assert server.admin("/v1/admin/check").json() == {"ok": True, "detail": ""}


def test_ids_are_random_and_another_tenants_id_is_a_404_like_any_other(server: Server) -> None:
    with Client(server.url, api_key=KEY_A) as a:
        a.store(tokens_of(0, 4), kv_of(4, seed=1))
        reservation_ids, lease_ids = [], []
        for _ in range(12):
            reservation = a.reserve(tokens_of(0, 8))
            reservation_ids.append(reservation.reservation_id)
            a.abort(reservation)
            lease = a.prefetch(tokens_of(0, 4))
            lease_ids.append(lease.lease_id)
            a.release(lease)
        for ids in (reservation_ids, lease_ids):
            steps = {later - earlier for earlier, later in itertools.pairwise(ids)}
            assert len(steps) == len(ids) - 1 and max(ids) >= 2**61 and min(ids) > 0
        reservation, lease = a.reserve(tokens_of(0, 8)), a.prefetch(tokens_of(0, 4))
        never = fresh_id({reservation.reservation_id, lease.lease_id})

        def refusal(path: str, field: str, own: int) -> tuple[int, str]:
            response = post(server, path, {field: own}, KEY_B)
            return response.status_code, response.text.replace(str(own), "<id>")

        for path, field, own in [
            ("/v1/commit", "reservation_id", reservation.reservation_id),
            ("/v1/abort", "reservation_id", reservation.reservation_id),
            ("/v1/release", "lease_id", lease.lease_id),
        ]:
            assert refusal(path, field, own) == refusal(path, field, never)
            assert refusal(path, field, own)[0] == 404
        peek = {"authorization": f"Bearer {KEY_B}"}
        mine = server.get(f"/v1/leases/{lease.lease_id}", headers=peek)
        other = server.get(f"/v1/leases/{never}", headers=peek)
        assert (mine.status_code, mine.text.replace(str(lease.lease_id), "<id>")) == (
            other.status_code,
            other.text.replace(str(never), "<id>"),
        )
        a.abort(reservation)  # untouched by B's tries: still A's, still live
        a.release(lease)
    assert server.admin("/v1/admin/check").json() == {"ok": True, "detail": ""}
