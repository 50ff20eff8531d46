"""The client trusts nothing its server says (issue 11.6).

A fake server (`fake_server.py`: a real HTTP server on a thread of the test) answers the
client's calls with the bodies a test plants: shared-memory names that point outside /dev/shm,
segments that are not what a kvtier server makes, layouts and slot lists out of range, garbage.
The client must refuse each with a typed error (`ReplyError`) naming the field, or leave the
pool unmapped and use the body path, and in every case write nothing outside the pool and
nothing into a file that is not the server's segment. A positive control (a true segment) shows
that the fake server's replies do reach the shared-memory path.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fake_server import FakeServer, Reply, fake_servers, host_reservation, ready_lease
from service_server import BLOCK_BYTES, BT, DIM, HEADS, LAYERS, kv_of, tokens_of

from kvtier.client import Client, ServiceError
from kvtier.errors import (
    CapacityError,
    NotWrittenError,
    QuotaError,
    ReplyError,
    StorageError,
)
from kvtier.results import LookupResult
from kvtier.service import wire
from kvtier.tiers.shm import SHM_DIR, create_shared

SLOTS = 8
POOL_BYTES = SLOTS * BLOCK_BYTES
TOKENS = tokens_of(0, 2 * BT)
KV = kv_of(2 * BT, 1)


@pytest.fixture
def fake() -> Iterator[Callable[..., FakeServer]]:
    with fake_servers() as make:
        yield make


@pytest.fixture
def segment() -> Iterator[str]:
    """A true segment of the host pool, made as a kvtier server makes one (unlinked after)."""
    name = f"kvtier-{os.getpid()}-{secrets.token_hex(4)}-host"
    create_shared(name, POOL_BYTES).close()
    yield name
    os.unlink(SHM_DIR / name)


def layout() -> dict[str, Any]:
    return {
        "dtype": "float16",
        "block_shape": [LAYERS, 2, BT, HEADS, DIM],
        "block_bytes": BLOCK_BYTES,
        "block_tokens": BT,
    }


def pools_reply(name: object, tier: str = "host", num_slots: object = SLOTS) -> Reply:
    pool = {"tier": tier, "device": "cpu", "num_slots": num_slots, "shared_memory": name}
    return 200, {"layout": layout(), "pools": [pool]}


def reservation(**fields: Any) -> Reply:
    return 200, host_reservation(BT, **fields)


STORED = (200, {"cached_tokens": 8, "stored_tokens": 8, "dropped_tokens": 0, "pending_tokens": 0})


def store_through(server: FakeServer) -> BaseException | None:
    """Store `KV` through a client of `server`; the exception it raised, if any."""
    try:
        with Client(server.url) as client:
            client.store(TOKENS, KV)
    except Exception as exc:
        return exc
    return None


def planted(tmp_path: Path) -> tuple[Path, bytes]:
    """A file of exactly a pool's size that a hostile name may point at, and its bytes."""
    target = tmp_path / "victim"
    content = os.urandom(POOL_BYTES)
    target.write_bytes(content)
    return target, content


# ---- the control: a true segment is mapped and written ---------------------------------------


def test_a_true_segment_is_mapped_and_store_writes_the_blocks_into_it(
    fake: Callable[..., FakeServer], segment: str
) -> None:
    server = fake(pools=pools_reply(segment), reserve=reservation(), commit=STORED)
    assert store_through(server) is None
    assert "/v1/commit" in server.paths and "/v1/store" not in server.paths
    written = (SHM_DIR / segment).read_bytes()[: 2 * BLOCK_BYTES]
    assert written != bytes(2 * BLOCK_BYTES)  # the KV went into slots 0 and 1


# ---- names: nothing outside /dev/shm is ever mapped ------------------------------------------


@pytest.mark.parametrize(
    "hostile",
    [
        "absolute",
        "dotdot",
        "dotdot-after-a-good-name",
        "empty",
        "long",
        "not-text",
        "other-tier",
    ],
)
def test_a_name_that_is_not_a_segment_of_ours_is_refused_and_the_target_untouched(
    fake: Callable[..., FakeServer], tmp_path: Path, hostile: str
) -> None:
    target, content = planted(tmp_path)
    good = f"kvtier-{os.getpid()}-0badc0de"
    name = {
        "absolute": str(target),
        "dotdot": f"../..{target}",
        "dotdot-after-a-good-name": f"{good}-host/../../..{target}",
        "empty": "",
        "long": "kvtier-1-0badc0de-" + "x" * 5000,
        "not-text": ["..", str(target)],
        "other-tier": f"{good}-gpu",
    }[hostile]
    server = fake(pools=pools_reply(name), reserve=reservation(), commit=STORED, store=STORED)
    refused = store_through(server)
    assert target.read_bytes() == content
    assert isinstance(refused, ReplyError) and "pools.pools[0].shared_memory" in str(refused)
    assert server.paths == ["/v1/pools"]  # nothing reserved, stored or committed


@pytest.mark.parametrize(
    "mismatch",
    [
        "symlink",
        "larger",
        "smaller",
        "mode",
        pytest.param(
            "owner",
            marks=pytest.mark.skipif(
                os.geteuid() != 0, reason="giving a file to another user needs root"
            ),
        ),
        "link",
    ],
)
def test_a_segment_that_is_not_the_file_its_server_made_stays_unmapped(
    fake: Callable[..., FakeServer], tmp_path: Path, mismatch: str
) -> None:
    """A well-formed name whose file is not exactly what `create_shared` makes is not mapped:
    the KV goes in the body, and the file (or what it points at) is untouched."""
    target, content = planted(tmp_path)
    name = f"kvtier-{os.getpid()}-{secrets.token_hex(4)}-host"
    path = SHM_DIR / name
    if mismatch == "symlink":
        path.symlink_to(target)
    elif mismatch == "link":
        create_shared(name, POOL_BYTES).close()
        os.link(path, SHM_DIR / f"{name}-link")
    else:
        size = {"larger": POOL_BYTES + BLOCK_BYTES, "smaller": POOL_BYTES - 1}.get(
            mismatch, POOL_BYTES
        )
        create_shared(name, size).close()
    if mismatch == "mode":
        path.chmod(0o644)
    if mismatch == "owner":
        os.chown(path, 54321, 54321)
    before = path.read_bytes()
    try:
        server = fake(pools=pools_reply(name), reserve=reservation(), commit=STORED, store=STORED)
        with Client(server.url) as client:
            client.store(TOKENS, KV)
            assert path.read_bytes() == before
            assert target.read_bytes() == content
            assert client.pool_buffer("host") is None
        assert "/v1/store" in server.paths and "/v1/reserve" not in server.paths
    finally:
        path.unlink()
        if mismatch == "link":
            (SHM_DIR / f"{name}-link").unlink()


# ---- layouts and pool lists ---------------------------------------------------------------


def _with_layout(**fields: Any) -> Reply:
    return 200, {"layout": {**layout(), **fields}, "pools": []}


@pytest.mark.parametrize(
    ("reply", "field"),
    [
        ((200, {"pools": []}), "pools.layout"),
        (_with_layout(dtype="int64"), "pools.layout.dtype"),
        (_with_layout(dtype=["float16"]), "pools.layout.dtype"),
        (_with_layout(block_shape=[LAYERS, 2, BT, HEADS]), "pools.layout.block_shape"),
        (_with_layout(block_shape=[LAYERS, 2, BT, HEADS, -DIM]), "pools.layout.block_shape"),
        (_with_layout(block_shape=[LAYERS, 2, BT, HEADS, 1 << 40]), "pools.layout.block_shape"),
        (_with_layout(block_shape=[True, 2, BT, HEADS, DIM]), "pools.layout.block_shape"),
        (_with_layout(block_shape=[LAYERS, 3, BT, HEADS, DIM]), "pools.layout.block_shape"),
        (_with_layout(block_bytes=BLOCK_BYTES * 2), "pools.layout.block_bytes"),
        (_with_layout(block_tokens=BT + 1), "pools.layout.block_tokens"),
        (_with_layout(tp_rank=2, tp_size=2), "pools.layout.tp_rank"),
        (_with_layout(tp_rank=-1), "pools.layout.tp_rank"),
        (_with_layout(tp_size=0), "pools.layout.tp_rank"),
        (_with_layout(tp_size=True), "pools.layout.tp_rank"),
        ((200, {"layout": layout(), "pools": {"tier": "host"}}), "pools.pools"),
        ((200, {"layout": layout(), "pools": ["host"]}), "pools.pools[0]"),
        (pools_reply(None, tier="disk"), "pools.pools[0].tier"),
        (pools_reply(None, num_slots=0), "pools.pools[0].num_slots"),
        (pools_reply(None, num_slots=-1), "pools.pools[0].num_slots"),
        (pools_reply(None, num_slots=2.5), "pools.pools[0].num_slots"),
        (pools_reply(None, num_slots=True), "pools.pools[0].num_slots"),
        (pools_reply(None, num_slots=1 << 62), "pools.pools[0].num_slots"),
        ((200, [1, 2]), "/v1/pools"),
        ((200, b"\x00 not json"), "/v1/pools"),
        ((200, {**pools_reply(None)[1], "max_body_bytes": "1GiB"}), "pools.max_body_bytes"),
        ((200, {**pools_reply(None)[1], "max_body_bytes": 0}), "pools.max_body_bytes"),
        ((200, {**pools_reply(None)[1], "max_body_bytes": 1 << 60}), "pools.max_body_bytes"),
    ],
)
def test_a_malformed_pools_reply_is_a_reply_error_naming_the_field(
    fake: Callable[..., FakeServer], reply: Reply, field: str
) -> None:
    server = fake(pools=reply)
    with pytest.raises(ReplyError) as refused:
        Client(server.url)
    assert field in str(refused.value)


def test_two_pools_of_one_tier_are_refused(fake: Callable[..., FakeServer]) -> None:
    pool = {"tier": "host", "num_slots": SLOTS, "shared_memory": None}
    server = fake(pools=(200, {"layout": layout(), "pools": [pool, pool]}))
    with pytest.raises(ReplyError, match=r"pools.pools\[1\].tier"):
        Client(server.url)


# ---- slots: never a write or read outside the pool --------------------------------------------


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"slots": [0, SLOTS]}, "reservation.slots"),
        ({"slots": [0, -1]}, "reservation.slots"),
        ({"slots": [1, 1]}, "reservation.slots"),
        ({"slots": [0, "1"]}, "reservation.slots"),
        ({"slots": [0, True]}, "reservation.slots"),
        ({"slots": "01"}, "reservation.slots"),
        ({"slots": [0]}, "reservation.num_tokens"),
        ({"num_tokens": BT + 1}, "reservation.num_tokens"),
        ({"cached_tokens": 1}, "reservation.cached_tokens"),
        ({"cached_tokens": BT}, "reservation: tokens [4, 12) of a 8-token sequence"),
        ({"tier": "../host"}, "reservation.tier"),
        ({"reservation_id": "7"}, "reservation.reservation_id"),
        ({"expires_at": "soon"}, "reservation.expires_at"),
        ({"tenant": None}, "reservation.tenant"),
    ],
)
def test_a_reservation_outside_the_pool_is_refused_before_anything_is_written(
    fake: Callable[..., FakeServer], segment: str, fields: dict[str, Any], field: str
) -> None:
    server = fake(pools=pools_reply(segment), reserve=reservation(**fields), commit=STORED)
    refused = store_through(server)
    assert isinstance(refused, ReplyError) and field in str(refused), refused
    assert (SHM_DIR / segment).read_bytes() == bytes(POOL_BYTES)
    assert "/v1/commit" not in server.paths


def lease(**fields: Any) -> Reply:
    return 200, ready_lease(BT, LAYERS, **fields)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"block_table": [0, SLOTS + 3]}, "lease.block_table"),
        ({"block_table": [-1, 0]}, "lease.block_table"),
        ({"block_table": [0, 0]}, "lease.block_table"),
        ({"block_table": None}, "lease.block_table"),
        ({"num_tokens": 3 * BT}, "lease.num_tokens"),
        ({"num_tokens": 3 * BT, "block_table": [0, 1, 2]}, "lease.num_tokens"),  # > asked
        ({"state": "owned"}, "lease.state"),
        ({"state": ["ready"]}, "lease.state"),
        ({"lease_id": -9}, "lease.lease_id"),
        ({"lease_id": 1 << 70}, "lease.lease_id"),
        ({"expires_at": float("nan")}, "lease.expires_at"),
        ({"reason": 3}, "lease.reason"),
    ],
)
def test_a_lease_outside_the_gpu_pool_is_refused_before_anything_is_read(
    fake: Callable[..., FakeServer], fields: dict[str, Any], field: str
) -> None:
    name = f"kvtier-{os.getpid()}-{secrets.token_hex(4)}-gpu"
    create_shared(name, POOL_BYTES).close()
    try:
        server = fake(
            pools=pools_reply(name, tier="gpu"), prefetch=lease(**fields), release=(200, {})
        )
        with Client(server.url) as client:
            assert client.pool_buffer("gpu") is not None
            with pytest.raises(ReplyError) as refused:
                client.load(TOKENS)
        assert field in str(refused.value)
    finally:
        os.unlink(SHM_DIR / name)


@pytest.mark.parametrize(
    ("num_tokens", "kv_tokens"),
    [(3 * BT, 3 * BT), (BT + 1, BT + 1)],  # more tokens than asked; not whole blocks
)
def test_a_load_reply_that_does_not_fit_the_prompt_never_lands_in_the_callers_out(
    fake: Callable[..., FakeServer], num_tokens: int, kv_tokens: int
) -> None:
    body = {"num_tokens": num_tokens, **wire.kv_to_wire(kv_of(kv_tokens, 5))}
    server = fake(pools=pools_reply(None, tier="gpu"), load=(200, body))
    out = torch.full((LAYERS, 2, 2 * BT, HEADS, DIM), 7.0, dtype=torch.float16)
    with Client(server.url, shared_memory=False) as client, pytest.raises(ReplyError) as refused:
        client.load(TOKENS, out=out)
    assert "load.num_tokens" in str(refused.value)
    assert bool((out == 7).all())  # not a byte of the reply landed


LOOKUP_8 = {"num_tokens": 8, "gpu_tokens": 8, "host_tokens": 0, "disk_tokens": 0}


def test_a_lookup_reply_without_remote_tokens_is_one_without_a_remote_tier(
    fake: Callable[..., FakeServer],
) -> None:
    server = fake(lookup=(200, LOOKUP_8))  # a server from before the remote tier
    with Client(server.url, shared_memory=False) as client:
        assert client.lookup(TOKENS) == LookupResult(8, 8, 0, 0, 0)
    server = fake(lookup=(200, {**LOOKUP_8, "num_tokens": 12, "remote_tokens": 4}))
    with Client(server.url, shared_memory=False) as client:
        assert client.lookup(tokens_of(0, 3 * BT)) == LookupResult(12, 8, 0, 0, 4)


@pytest.mark.parametrize(
    ("path", "reply", "field"),
    [
        ("lookup", (200, {"num_tokens": "8"}), "lookup.num_tokens"),
        (
            "lookup",
            (200, {"num_tokens": 8, "gpu_tokens": 8, "host_tokens": 8, "disk_tokens": 0}),
            "lookup",
        ),
        ("lookup", (200, b"]]"), "/v1/lookup"),
        (
            "lookup",
            (200, {**LOOKUP_8, "remote_tokens": 4}),  # the tiers add up to 12, not 8
            "lookup",
        ),
        ("lookup", (200, {**LOOKUP_8, "remote_tokens": -4}), "lookup.remote_tokens"),
        ("store", (200, {"cached_tokens": 8}), "store.stored_tokens"),
        ("load", (200, {"num_tokens": 4, "kv": "AAAA", "dtype": "float16", "shape": [1]}), "load"),
        ("load", (200, {"num_tokens": -4}), "load.num_tokens"),
    ],
)
def test_garbage_in_any_other_reply_is_a_reply_error(
    fake: Callable[..., FakeServer], path: str, reply: Reply, field: str
) -> None:
    server = fake(**{path: reply}, pools=pools_reply(None))  # a store asks the layout first
    with Client(server.url, shared_memory=False) as client, pytest.raises(ReplyError) as refused:
        getattr(client, path)(TOKENS, **({"kv": KV} if path == "store" else {}))
    assert field in str(refused.value)


# ---- error kinds ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "kind", "raised"),
    [
        (429, "quota", QuotaError),
        (409, "not_written", NotWrittenError),
        (503, "storage", StorageError),
        (507, "capacity", CapacityError),
    ],
)
def test_the_new_error_kinds_come_back_as_the_stores_error_types(
    fake: Callable[..., FakeServer], status: int, kind: str, raised: type[Exception]
) -> None:
    server = fake(lookup=(status, {"error": kind, "detail": f"the {kind} detail"}))
    with Client(server.url, shared_memory=False) as client, pytest.raises(raised) as caught:
        client.lookup(TOKENS)
    assert type(caught.value) is raised and str(caught.value) == f"the {kind} detail"


def test_a_closed_or_unready_server_is_still_a_service_error(
    fake: Callable[..., FakeServer],
) -> None:
    server = fake(lookup=(503, {"error": "closed", "detail": "the store is closed"}))
    with Client(server.url, shared_memory=False) as client, pytest.raises(ServiceError) as caught:
        client.lookup(TOKENS)
    assert (caught.value.status, caught.value.kind) == (503, "closed")
