"""Audit 3 of the write paths: what a quantized host tier left out is never published, and a
reset voids the tenant's live reservations.

- A block a quantized host's codec cannot keep (a value not finite, or past fp16's range: a
  bf16 model's 70000) gets no host copy. The `selective` policy's hot copy and a write_through
  commit used to publish the freshly taken host slot anyway, so that once the gpu copy left,
  `load` decoded whatever that slot held before: here another tenant's cleared KV.
- `reset(tenant)` used to leave the tenant's live reservations alive (and their pins holding
  the prefix): a commit afterwards published KV computed before the reset.

Layout: a small fp16 (or bf16) model, 4-token blocks, cpu "gpu" pool, inline mover, an int8
host tier; tenant "a" leaves distinctive KV in host slots, clears it, and tenant "b" writes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvtier import KVStore, parse_config
from kvtier.errors import LeaseError
from kvtier.tiers.base import GPU

L, H, D, BT = 2, 2, 32, 4


def _block_bytes(dtype: str) -> int:
    return L * 2 * BT * H * D * 2  # fp16 and bf16: 2 bytes a value


def _config(
    write: str, gpu: int, host: int, dtype: str = "float16", codec: str = "int8"
) -> dict[str, Any]:
    bb = _block_bytes(dtype)
    host_tier: dict[str, object] = {"capacity": host * bb, "pinned": False}
    if codec:
        host_tier["codec"] = codec
    return {
        "model": {"name": "m", "num_layers": L, "num_kv_heads": H, "head_dim": D, "dtype": dtype},
        "block_tokens": BT,
        "tiers": {"gpu": {"capacity": gpu * bb, "device": "cpu"}, "host": host_tier},
        "policy": {"write": write, "selective_hits": 2},
        "mover": {"background": False},
        "tenants": {
            t: {"quota": {"gpu": 1.0, "host": 1.0}, "floor": {"gpu": 1, "host": 1}}
            for t in ("a", "b")
        },
    }


@pytest.fixture
def stores() -> Iterator[list[KVStore]]:
    opened: list[KVStore] = []
    yield opened
    for store in opened:
        store.close()


def _open(stores: list[KVStore], raw: dict[str, Any]) -> KVStore:
    store = KVStore(parse_config(raw), secret=b"s" * 32)
    stores.append(store)
    return store


def _secret(tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """Tenant a's KV: constant values, easy to recognise when served to someone else."""
    kv = torch.full((L, 2, tokens, H, D), 1.5, dtype=dtype)
    kv[..., ::2] = -0.75
    return kv


def _served_close(served: torch.Tensor, written: torch.Tensor, tol: float) -> bool:
    finite = torch.isfinite(written)
    err = (served.float() - written.float())[finite].abs().max().item()
    return err < tol


@pytest.mark.parametrize(
    ("dtype", "bad"), [("float16", float("inf")), ("bfloat16", 70000.0)], ids=["inf", "bf16-big"]
)
def test_selective_hot_copy_of_an_unkeepable_block_is_not_published(
    stores: list[KVStore], dtype: str, bad: float
) -> None:
    store = _open(stores, _config("selective", gpu=4, host=8, dtype=dtype))
    torch_dtype = getattr(torch, dtype)
    secret = _secret(BT, torch_dtype)
    old = list(range(4))
    store.store(old, secret, tenant="a")
    store.load(old, tenant="a")
    store.load(old, tenant="a")  # hot: its host copy now
    store.evict("gpu", 4)
    assert store.lookup(old, tenant="a").host_tokens == BT
    assert store.clear("a") == 1  # a's bytes stay in the freed host slot
    free_host = store.status()["tiers"]["host"]["free_slots"]

    toks = list(range(100, 104))
    mine = torch.randn(L, 2, BT, H, D).to(torch_dtype)
    mine[0, 0, 2, 0, 0] = bad
    assert store.store(toks, mine, tenant="b").stored_tokens == BT
    for _ in range(3):
        assert store.load(toks, tenant="b").num_tokens == BT  # hot: a host copy is tried
    store.check()
    assert store.lookup(toks, tenant="b").host_tokens == 0  # the codec left it out
    assert store.status()["tiers"]["host"]["free_slots"] == free_host  # its slot freed
    store.evict("gpu", 4)
    got = store.load(toks, tenant="b")
    if got.num_tokens:  # served at all: what b wrote, never a's cleared KV
        assert _served_close(got.kv.cpu(), mine, 0.1)
    store.check()


def _write_reserved(store: KVStore, slots: tuple[int, ...], kv: torch.Tensor) -> None:
    for i, slot in enumerate(slots):
        store.gpu_pool.buffer[slot].copy_(kv[:, :, BT * i : BT * (i + 1)])


def test_write_through_commit_publishes_only_the_host_copies_that_landed(
    stores: list[KVStore],
) -> None:
    store = _open(stores, _config("write_through", gpu=4, host=8))
    secret = _secret(16, torch.float16)
    for i in range(2):  # a's KV fills the host slots, then a clears it
        store.store(list(range(1000 * i, 1000 * i + 16)), secret, tenant="a")
    assert store.clear("a") == 8

    toks = list(range(100, 116))
    r = store.reserve(toks, tenant="b")
    assert r.tier == "gpu" and len(r.slots) == 4
    written = torch.randn(L, 2, 16, H, D).half()
    written[0, 0, 2, 0, 0] = float("inf")  # block 0: int8 cannot keep it
    _write_reserved(store, r.slots, written)
    result = store.commit(r)
    assert result.stored_tokens == 16 and result.dropped_tokens == 0
    assert store.status()["tiers"]["host"]["blocks"] == 3  # blocks 1-3: block 0 has none
    store.check()

    kv = store.load(toks, tenant="b").kv.cpu()
    assert torch.equal(kv[:, :, :BT], written[:, :, :BT])  # its own gpu copy, inf and all
    assert _served_close(kv[:, :, BT:], written[:, :, BT:], 0.1)  # int8 rounding, not a's
    store.evict("gpu", 4)  # block 0 can never be copied down: dropped with all below it
    assert store.lookup(toks, tenant="b").num_tokens == 0  # (audit L: it held its slot)
    assert [store.status()["tiers"][t]["blocks"] for t in ("gpu", "host")] == [0, 0]
    store.check()


def test_a_commit_whose_only_copy_left_is_host_drops_from_the_first_block_left_out(
    stores: list[KVStore],
) -> None:
    store = _open(stores, _config("write_through", gpu=12, host=16))
    toks = list(range(200, 232))  # 8 blocks
    r = store.reserve(toks, tenant="b")
    assert r.tier == "gpu" and len(r.slots) == 8
    # meanwhile someone stores the first 4 blocks, and they leave the gpu (host-only)
    head = torch.randn(L, 2, 16, H, D).half()
    assert store.store(toks[:16], head, tenant="b").stored_tokens == 16
    assert store.evict("gpu", 4) == 4
    assert store.lookup(toks[:16], tenant="b").host_tokens == 16

    written = torch.randn(L, 2, 32, H, D).half()
    written[:, :, :16] = head
    written[1, 1, 4 * 5 + 1, 0, 3] = float("nan")  # block 5: int8 cannot keep it
    _write_reserved(store, r.slots, written)
    result = store.commit(r)  # the gpu copies go (closure): only the host copies remain
    assert (result.cached_tokens, result.stored_tokens, result.dropped_tokens) == (20, 4, 12)
    store.check()
    hit = store.lookup(toks, tenant="b")
    assert hit.num_tokens == 20 and hit.host_tokens == 20
    kv = store.load(toks, tenant="b").kv.cpu()
    assert _served_close(kv, written[:, :, :20], 0.1)
    store.check()


def _reset_config() -> dict[str, Any]:
    raw = _config("write_back", gpu=16, host=16, codec="")
    raw["policy"]["reservation_quarantine_s"] = 3600.0
    return raw


def test_reset_voids_the_tenants_live_reservations(stores: list[KVStore]) -> None:
    store = _open(stores, _reset_config())
    toks = list(range(8))
    before = torch.randn(L, 2, 8, H, D).half()
    r = store.reserve(toks, tenant="a")
    other = store.reserve(list(range(50, 58)), tenant="b")
    _write_reserved(store, r.slots, before)
    _write_reserved(store, other.slots, before)

    assert store.reset("a") == {"dropped_blocks": 0, "left_blocks": 0, "remote": False}
    with pytest.raises(LeaseError):  # as for an expired reservation
        store.commit(r)
    assert store.lookup(toks, tenant="a").num_tokens == 0
    # its slots stay quarantined (a writer may still write them through shared memory)
    assert store.reservations.quarantined(GPU, "a") == 2
    assert store.reservations.live(GPU, "a") == 0
    store.check()
    # another tenant's reservation is untouched
    assert store.commit(other).stored_tokens == 8
    assert store.lookup(list(range(50, 58)), tenant="b").num_tokens == 8
    store.check()


def test_reset_drops_the_prefix_a_voided_reservation_pinned(stores: list[KVStore]) -> None:
    store = _open(stores, _reset_config())
    toks = list(range(16))
    store.store(toks[:8], torch.randn(L, 2, 8, H, D).half(), tenant="a")
    r = store.reserve(toks, tenant="a")  # pins the cached 2-block prefix
    assert r.cached_tokens == 8
    reply = store.reset("a")
    assert reply["dropped_blocks"] == 2 and reply["left_blocks"] == 0  # nothing truly held
    assert store.lookup(toks, tenant="a").num_tokens == 0
    with pytest.raises(LeaseError):
        store.commit(r)
    store.check()


def test_reset_leaves_blocks_a_lease_holds_and_counts_them(stores: list[KVStore]) -> None:
    store = _open(stores, _reset_config())
    toks = list(range(8))
    store.store(toks, torch.randn(L, 2, 8, H, D).half(), tenant="a")
    lease = store.prefetch(toks, tenant="a")
    r = store.reserve(list(range(16)), tenant="a")
    reply = store.reset("a")
    assert reply["dropped_blocks"] == 0 and reply["left_blocks"] == 2  # the lease's
    with pytest.raises(LeaseError):
        store.commit(r)
    store.release(lease)
    assert store.reset("a")["dropped_blocks"] == 2
    store.check()
