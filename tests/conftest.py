"""Shared test helpers."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.blocks import KVLayout
from kvtier.config import KVTierConfig, parse_config
from kvtier.results import Lease, LookupResult, StoreResult
from kvtier.store import KVStore
from kvtier.tiers.disk.format import BlockHeader, CorruptHeader, decode_header

# Triton reads this when a kernel is defined, so before any test imports
# kvtier.kernels.paged_attention (the imports above do not import Triton): without CUDA the
# kernels run on the CPU, in Triton's interpreter
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# tests/engines/ runs against vLLM / SGLang installed apart (tests/engines/install.sh), in
# pytest runs of their own (KVTIER_ENGINE_TESTS=1, PYTHONPATH=.engines/ENGINE): the default
# suite does not collect it
collect_ignore = [] if os.environ.get("KVTIER_ENGINE_TESTS") == "1" else ["engines"]

# ---- KVStore factory (tests/test_store*.py) ---------------------------------------------------
#
# A tiny layout: 2 layers, 2 kv heads, head_dim 4, 4 tokens per block. Capacities are given in
# whole blocks; watermarks default to 1.0/1.0 so that nothing moves unless a tier is full.

TINY_MODEL = {"name": "tiny", "num_layers": 2, "num_kv_heads": 2, "head_dim": 4}
TINY_BLOCK_TOKENS = 4


def tiny_block_bytes(dtype: str = "float32") -> int:
    """Bytes of one block of the tiny layout in `dtype`."""
    layout = KVLayout(
        "tiny", num_layers=2, num_kv_heads=2, head_dim=4, dtype_name=dtype, block_tokens=4
    )
    return layout.block_bytes


def build_store(
    *,
    gpu_blocks: int = 8,
    host_blocks: int = 16,
    write: str = "write_through",
    dtype: str = "float32",
    tenants: tuple[str, ...] = ("default",),
    clock: Callable[[], float] | None = None,
    selective_hits: int = 2,
    lease_ttl_s: float = 60.0,
    gpu_watermarks: tuple[float, float] = (1.0, 1.0),
    host_watermarks: tuple[float, float] = (1.0, 1.0),
    background: bool = True,
    layer_groups: int = 4,
) -> KVStore:
    """A `KVStore` over the tiny layout with `gpu_blocks` and `host_blocks` slots on the CPU;
    its mover runs on threads unless `background` is False."""
    block_bytes = tiny_block_bytes(dtype)
    config = parse_config(
        {
            "model": {**TINY_MODEL, "dtype": dtype},
            "block_tokens": TINY_BLOCK_TOKENS,
            "tiers": {
                "gpu": {
                    "capacity": gpu_blocks * block_bytes,
                    "high_watermark": gpu_watermarks[0],
                    "low_watermark": gpu_watermarks[1],
                    "device": "cpu",
                },
                "host": {
                    "capacity": host_blocks * block_bytes,
                    "high_watermark": host_watermarks[0],
                    "low_watermark": host_watermarks[1],
                    "pinned": False,
                },
            },
            "policy": {
                "write": write,
                "selective_hits": selective_hits,
                "lease_ttl_s": lease_ttl_s,
            },
            "mover": {"background": background, "layer_groups": layer_groups},
            "tenants": {tenant: {} for tenant in tenants},
        }
    )
    if clock is None:
        return KVStore(config)
    return KVStore(config, clock=clock)


@pytest.fixture
def make_store() -> Iterator[Callable[..., KVStore]]:
    """`make_store(gpu_blocks=..., host_blocks=..., write=..., dtype=..., tenants=..., clock=...)`
    builds a tiny store (see `build_store`); every store built is closed after the test."""
    stores: list[KVStore] = []

    def factory(**kwargs: Any) -> KVStore:
        store = build_store(**kwargs)
        stores.append(store)
        return store

    yield factory
    for store in stores:
        store.close()


def kv_for(store: KVStore, n_tokens: int, seed: int = 0) -> torch.Tensor:
    """Random KV `[num_layers, 2, n_tokens, num_kv_heads, head_dim]` in the store's dtype."""
    layout = store.layout
    gen = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, 2, n_tokens, layout.num_kv_heads, layout.head_dim)
    return torch.randn(shape, generator=gen).to(layout.dtype)


def leased_kv(store: KVStore, lease: Lease) -> torch.Tensor:
    """What the gpu slots of `lease` hold, as `[num_layers, 2, num_tokens, heads, head_dim]`."""
    blocks = store.gpu_pool.buffer[list(lease.block_table)]
    n, layers, two, bt, heads, dim = blocks.shape
    return blocks.permute(1, 2, 0, 3, 4, 5).reshape(layers, two, n * bt, heads, dim)


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t` viewed as same-width integers, so that equality is bit equality (NaN, -0.0 too)."""
    view = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
    return t.view(view[t.dtype])


# ---- end of the KVStore factory ---------------------------------------------------------------


# ---- disk-tier stores (tests/test_disk_*.py) ---------------------------------------------------
#
# A tiny fp16 layout whose block is exactly one sector: 2 layers, 2 kv heads, head_dim 64, 4 tokens
# a block -> 4096 bytes; a disk slot is a 4096-byte header region plus the payload, 8192 bytes.
# Capacities of gpu and host are in whole blocks with watermarks 1.0/1.0, so a tier demotes only
# when a new block needs its room; write_back and no disk admission unless a test asks.

DISK_MODEL = {
    "name": "tiny",
    "num_layers": 2,
    "num_kv_heads": 2,
    "head_dim": 64,
    "dtype": "float16",
}
DISK_BLOCK_TOKENS = 4
DISK_BLOCK_BYTES = 4096
DISK_SLOT_BYTES = 8192
DISK_HEADER_BYTES = 4096


def disk_config(
    path: str | os.PathLike[str],
    *,
    capacity: str | int = "1MiB",
    gpu_blocks: int = 4,
    host_blocks: int = 4,
    block_tokens: int = DISK_BLOCK_TOKENS,
    codec: str = "none",
    admission_hits: int = 0,
    write: str = "write_back",
    tenants: tuple[str, ...] = ("default",),
    background: bool = False,
    host_watermarks: tuple[float, float] = (1.0, 1.0),
    gpu_watermarks: tuple[float, float] = (1.0, 1.0),
) -> KVTierConfig:
    """A config of the tiny fp16 layout with a disk tier of `capacity` under `path`. The mover
    runs inline unless `background`: these tests pin down where each block is after each call."""
    block_bytes = DISK_BLOCK_BYTES * block_tokens // DISK_BLOCK_TOKENS
    return parse_config(
        {
            "model": DISK_MODEL,
            "block_tokens": block_tokens,
            "tiers": {
                "gpu": {
                    "capacity": gpu_blocks * block_bytes,
                    "high_watermark": gpu_watermarks[0],
                    "low_watermark": gpu_watermarks[1],
                    "device": "cpu",
                },
                "host": {
                    "capacity": host_blocks * block_bytes,
                    "high_watermark": host_watermarks[0],
                    "low_watermark": host_watermarks[1],
                    "pinned": False,
                },
                "disk": {"capacity": capacity, "path": os.fspath(path), "codec": codec},
            },
            "policy": {"write": write, "disk_admission_hits": admission_hits},
            "mover": {"background": background},
            "tenants": {tenant: {} for tenant in tenants},
        }
    )


@pytest.fixture
def open_store() -> Iterator[Callable[[KVTierConfig], KVStore]]:
    """`open_store(config)` starts a `KVStore` (recovering its disk tier); every store opened is
    closed after the test, so a test may restart a store by closing it and opening another."""
    stores: list[KVStore] = []

    def factory(config: KVTierConfig) -> KVStore:
        store = KVStore(config)
        stores.append(store)
        return store

    yield factory
    for store in stores:
        store.close()


def slab_headers(path: str | os.PathLike[str]) -> dict[tuple[int, ...], tuple[int, BlockHeader]]:
    """The valid headers of the first slab under `path`, by their block's tokens: `(slot,
    header)`. Empty and damaged slots are left out; with disjoint token ranges per sequence,
    each block's tokens are unique."""
    data = (Path(path) / "slab-00000.kvt").read_bytes()
    found: dict[tuple[int, ...], tuple[int, BlockHeader]] = {}
    for slot in range(len(data) // DISK_SLOT_BYTES):
        start = slot * DISK_SLOT_BYTES
        try:
            header = decode_header(data[start : start + DISK_HEADER_BYTES])
        except CorruptHeader:
            continue
        if header is not None:
            tokens = tuple(
                int.from_bytes(header.tokens[i : i + 4], "little")
                for i in range(0, len(header.tokens), 4)
            )
            found[tokens] = (slot, header)
    return found


# ---- end of the disk-tier stores ----------------------------------------------------------------


def hit(gpu: int = 0, host: int = 0, disk: int = 0) -> LookupResult:
    """The lookup result of a prefix cached as `gpu`, `host` and `disk` tokens."""
    return LookupResult(gpu + host + disk, gpu, host, disk)


def tier(store: KVStore, name: str) -> dict[str, Any]:
    """One tier's part of `store.status()`."""
    status: dict[str, Any] = store.status()["tiers"][name]
    return status


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes and bit-identical contents (NaN patterns included)."""
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


def fill(store: KVStore, seqs: list[list[int]], seed: int = 0) -> list[torch.Tensor]:
    """Store each sequence with its own KV (all of it new); check after each; return the KVs."""
    kvs = []
    for i, tokens in enumerate(seqs):
        kv = kv_for(store, len(tokens), seed=seed + i)
        assert store.store(tokens, kv) == StoreResult(len(tokens), len(tokens), 0)
        store.check()
        kvs.append(kv)
    return kvs


@contextlib.contextmanager
def mounted_tmpfs(mount_point: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of `size` (e.g. "512k") mounted on `mount_point` for the block, unmounted
    after it; skips the test, with the reason, where mounting is not permitted (not root)."""
    mount_point.mkdir(exist_ok=True)
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(reason=f"cannot run mount: {exc}")
    if done.returncode != 0:
        pytest.skip(reason=f"mounting a tmpfs is not permitted here: {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True, timeout=30)


@pytest.fixture(scope="session")
def smollm2() -> Any:
    """SmolLM2-135M loaded once for the session (the reference model's and engine's tests only
    read it): 15 s of the default suite each time it is loaded."""
    from kvtier.reference import load_smollm2

    return load_smollm2()


@pytest.fixture(scope="module")
def redis_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """The Redis Cluster CI started (`KVTIER_REDIS_NODES`), or one of the module's own (a
    3-primary `LocalCluster`; skipped without redis-server unless `KVTIER_REQUIRE_REDIS`)."""
    from redis_cluster import LocalCluster, require_redis

    if os.environ.get("KVTIER_REDIS_NODES"):
        yield os.environ["KVTIER_REDIS_NODES"].split(",")
        return
    require_redis()
    with LocalCluster(Path(tmp_path_factory.mktemp("redis")), primaries=3) as running:
        yield running.nodes


@pytest.fixture
def ctx() -> Iterator[Any]:
    """A ZMQ context for the test's own sockets (a peer, a hostile publisher), destroyed after."""
    import zmq

    context: Any = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def closing(ctx: Any) -> Iterator[Callable[[Any], Any]]:
    """`closing(thing)`: `thing`, closed when the test ends (passed or not), before `ctx`."""
    opened: list[Any] = []

    def keep(thing: Any) -> Any:
        opened.append(thing)
        return thing

    yield keep
    for thing in reversed(opened):
        thing.close()


def wait_until(predicate: Callable[[], object], timeout: float = 5.0) -> bool:
    """Poll `predicate` every 10 ms until it holds or `timeout` s pass; whether it holds."""
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(predicate())


def salted_kv(store: KVStore, tokens: list[int], salt: float) -> torch.Tensor:
    """KV whose every token's values name (salt, position, token): a wrong block shows."""
    layout = store.layout
    n = len(tokens)
    shape = (layout.num_layers, 2, n, layout.num_kv_heads, layout.head_dim)
    values = torch.tensor([salt + i * 10 + t for i, t in enumerate(tokens)], dtype=torch.float32)
    return values.view(1, 1, n, 1, 1).expand(shape).contiguous().to(layout.dtype)


def block_seq(first: int, num_blocks: int) -> list[int]:
    """Tokens of `num_blocks` tiny blocks, block b all `first + b`."""
    return [first + b for b in range(num_blocks) for _ in range(TINY_BLOCK_TOKENS)]
