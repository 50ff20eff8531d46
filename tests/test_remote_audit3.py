"""The remote tier after the third audit, two stores ("node A", "node B", one process) over a real
Redis Cluster: a cluster secret counts whole (fleets whose secrets differ only past byte 64 stay
apart, and with `authenticate` neither deletes the other's values); blocks stored below a prefix
that lives only on disk are sent like any others; a lossy codec whose payload would be larger
than the plain block is refused at start (every tier), not accepted and then failing every
write; fp16 KV at the edge of fp16's range written quantized is served finite; and what sharing
means for embedded stores without a cluster secret (README "Remote tier").

Skipped without `redis-server`, unless KVTIER_REQUIRE_REDIS=1 (CI sets it)."""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier import KVStore, parse_config
from kvtier.blocks import tenant_salt
from kvtier.errors import ConfigError

BT = 4
SECRET = "cluster-secret-0123456789"
OWN = b"this node's own secret, not shared"
_prefixes = itertools.count()


def config(nodes: list[str], dtype: str = "float16", **remote: Any) -> dict[str, Any]:
    """The tiny fp16 layout over `nodes`, a key prefix of the test's own, the shared secret
    unless `secret` is given (None: none)."""
    settings = {"secret": SECRET, "group_blocks": 4, **remote}
    if settings["secret"] is None:
        del settings["secret"]
    return {
        "model": {"name": "m", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": dtype},
        "block_tokens": BT,
        "tiers": {
            "gpu": {"capacity": 64 * 2048, "device": "cpu"},
            "host": {"capacity": 64 * 2048, "pinned": False},
            "remote": {"nodes": nodes, "key_prefix": f"audit3-{next(_prefixes)}", **settings},
        },
        "tenants": {"default": {}},
        "mover": {"background": False},
    }


def node(cfg: dict[str, Any], own: bytes | None = OWN) -> KVStore:
    if own is None:
        return KVStore(parse_config(cfg))
    return KVStore(parse_config(cfg), secret=own)


def kv_for(tokens: list[int], seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, len(tokens), 2, 8, generator=gen).to(torch.float16)


def twin(cfg: dict[str, Any], **remote: Any) -> dict[str, Any]:
    """`cfg` with the same cluster and key prefix, `remote` settings changed."""
    return {**cfg, "tiers": {**cfg["tiers"], "remote": {**cfg["tiers"]["remote"], **remote}}}


# ---- a secret counts whole ---------------------------------------------------------------------


def test_a_secret_keys_salts_by_every_byte_and_short_ones_as_before() -> None:
    for size in (16, 40, 64):  # <= 64 bytes: the key itself, ids of existing caches unchanged
        secret = bytes(range(size))
        plain = hashlib.blake2b(b"alice", key=secret, digest_size=16).digest()
        assert tenant_salt("alice", secret) == plain
    base = b"x" * 64
    salts = {tenant_salt("alice", base + tail) for tail in (b"", b"-fleet-A", b"-fleet-B")}
    assert len(salts) == 3
    long = b"y" * 200
    assert tenant_salt("alice", long) == tenant_salt("alice", long)  # deterministic


@pytest.mark.parametrize("authenticate", [False, True])
def test_fleets_whose_secrets_differ_past_byte_64_stay_apart(
    redis_nodes: list[str], authenticate: bool
) -> None:
    base = "x" * 64
    ca = config(redis_nodes, secret=base + "-fleet-A", authenticate=authenticate)
    cb = twin(ca, secret=base + "-fleet-B")
    tokens = list(range(100, 140))
    kv = kv_for(tokens)
    with node(ca) as a, node(cb) as b, node(ca, own=b"another node of fleet A's own") as a2:
        a.store(tokens, kv)
        assert a.drain()
        assert b.lookup(tokens).remote_tokens == 0
        assert b.load(tokens).num_tokens == 0  # fleet B neither sees nor serves A's blocks
        assert b.status()["remote"]["verify_failures"] == 0  # nor reads, nor deletes them
        got = a2.load(tokens)  # fleet A's other node still finds every block
        assert got.num_tokens == 40 and torch.equal(got.kv, kv)


# ---- blocks below a disk-only prefix ---------------------------------------------------------


@pytest.mark.parametrize("background", [False, True])
def test_blocks_stored_below_a_disk_only_prefix_reach_the_cluster(
    redis_nodes: list[str], tmp_path: Path, background: bool
) -> None:
    ca = config(redis_nodes)
    ca["tiers"]["disk"] = {"capacity": "4MiB", "path": str(tmp_path / "disk")}
    ca["mover"] = {"background": background}
    cb = twin(ca)
    del cb["tiers"]["disk"]
    cb["mover"] = {"background": False}
    tokens = list(range(500, 548))
    kv = kv_for(tokens, seed=1)
    with node(ca) as a, node(cb) as b:
        a.store(tokens[:16], kv[:, :, :16])
        assert a.drain()
        a.persist()
        a.evict("gpu", 100)
        a.evict("host", 100)
        assert a.drain()
        head = a.lookup(tokens[:16])
        assert head.disk_tokens == 16 and head.gpu_tokens == head.host_tokens == 0
        stored = a.store(tokens, kv)  # the 8 new blocks go to disk, below the disk-only head
        assert stored.stored_tokens + stored.pending_tokens == 32 and stored.dropped_tokens == 0
        assert a.drain()
        assert a.status()["remote"]["writer_failed_blocks"] == 0
        assert b.lookup(tokens).remote_tokens == 48
        got = b.load(tokens)
        assert got.num_tokens == 48 and torch.equal(got.kv, kv)


# ---- a lossy codec larger than the plain block ----------------------------------------------


@pytest.mark.parametrize(
    ("tier", "dtype", "codec", "group"),
    [
        ("remote", "float8_e4m3fn", "fp8", None),
        ("remote", "float8_e4m3fn", "int8", None),
        ("remote", "float16", "int8", 1),
        ("remote", "float16", "int8", 2),
        ("remote", "float16", "int4", 1),
        ("host", "float16", "int8", 1),
        ("host", "float8_e4m3fn", "fp8", None),
        ("disk", "float16", "int4", 1),
    ],
)
def test_a_codec_whose_payload_passes_the_plain_block_is_refused_at_start(
    redis_nodes: list[str], tmp_path: Path, tier: str, dtype: str, codec: str, group: int | None
) -> None:
    cfg = config(redis_nodes, dtype=dtype)
    if tier == "disk":
        cfg["tiers"]["disk"] = {"capacity": "4MiB", "path": str(tmp_path / "disk")}
    cfg["tiers"][tier]["codec"] = codec
    if group is not None:
        cfg["tiers"][tier]["codec_group"] = group
    with pytest.raises(ConfigError) as refused:
        node(cfg).close()
    error = refused.value
    assert error.field == f"tiers.{tier}.codec" and error.value == codec
    assert "no larger than the plain block" in error.expected and dtype in error.expected
    if group is not None:
        assert f"codec_group {group}" in error.expected


@pytest.mark.parametrize(("codec", "group"), [("int8", 4), ("int4", 2), ("int4", None)])
def test_a_codec_no_larger_than_the_block_writes_and_is_served(
    redis_nodes: list[str], codec: str, group: int | None
) -> None:
    ca = config(redis_nodes, codec=codec)
    if group is not None:
        ca["tiers"]["remote"]["codec_group"] = group
    tokens = list(range(700, 716))
    with node(ca) as a, node(twin(ca, codec="none")) as b:
        a.store(tokens, kv_for(tokens, seed=2))
        assert a.drain()
        status = a.status()["remote"]
        assert status["writer_failed_blocks"] == 0 and status["writer_written_blocks"] == 4
        assert b.load(tokens).num_tokens == 16


# ---- fp16's edge through a quantized remote copy -----------------------------------------------


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_fp16_kv_at_the_edge_of_its_range_is_served_finite(
    redis_nodes: list[str], codec: str
) -> None:
    ca = config(redis_nodes, codec=codec)
    tokens = list(range(900, 908))
    kv = torch.full((2, 2, 8, 2, 8), 65504.0, dtype=torch.float16)
    kv[1] = -65504.0
    with node(ca) as a, node(twin(ca, codec="none")) as b:
        a.store(tokens, kv)
        assert a.drain()
        got = b.load(tokens)
        assert got.num_tokens == 8 and bool(torch.isfinite(got.kv).all())
        assert float((got.kv.float() - kv.float()).abs().max()) <= 65504 / 15 + 32


# ---- embedded stores without a cluster secret (README) ------------------------------------------


def test_embedded_stores_without_any_secret_share_and_their_own_secrets_keep_them_apart(
    redis_nodes: list[str],
) -> None:
    cfg = config(redis_nodes, secret=None)
    tokens = list(range(300, 316))
    with node(cfg, own=None) as a, node(cfg, own=None) as b, node(cfg) as c:
        a.store(tokens, kv_for(tokens, seed=3))
        assert a.drain()
        assert b.load(tokens).num_tokens == 16  # both keyed by the empty secret (README)
        assert c.load(tokens).num_tokens == 0  # its own secret: reads only what it wrote
