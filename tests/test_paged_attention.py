"""Paged attention: the Triton kernels (under Triton's interpreter on this CPU) against the torch
reference, on fresh random inputs each run (the seed is in every failure message), and the
checked wrapper's residency guard against a real store's leases."""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Iterator

import pytest
import torch
from conftest import build_store, kv_for

from kvtier.errors import InvalidArgumentError, ResidencyError
from kvtier.kernels import paged_attention as kernels
from kvtier.kernels.attention import PagedAttention
from kvtier.kernels.reference import cached_kv
from kvtier.store import KVStore

pytestmark = pytest.mark.skipif(not kernels.available(), reason="Triton is not installed")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}
KV_HEADS, HEAD_DIM, BLOCK_TOKENS, LAYERS, SLOTS = 2, 32, 4, 2, 48


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def fresh_seed() -> int:
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    return seed


def pool(dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(SLOTS, LAYERS, 2, BLOCK_TOKENS, KV_HEADS, HEAD_DIM).to(dtype)


def tables(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Scattered, distinct slots per sequence; the table is wider than any sequence needs."""
    width = max(-(-n // BLOCK_TOKENS) for n in lengths) + 2
    rows = [torch.randperm(SLOTS)[:width] for _ in lengths]
    return torch.stack(rows).to(torch.int32), torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_kernel_matches_the_reference(dtype: torch.dtype, group: int) -> None:
    seed = fresh_seed()
    buffer = pool(dtype)
    # 1 token, exact multiples of block_tokens, ragged, and more than one 32-token step
    table, lens = tables([1, BLOCK_TOKENS, 2 * BLOCK_TOKENS, 7, 45])
    q = torch.randn(len(lens), KV_HEADS * group, HEAD_DIM).to(dtype)
    out = torch.full_like(q, math.nan)  # poisoned: every element must be written
    got = kernels.paged_decode(q, buffer, 1, table, lens, out=out)
    want = kernels.paged_decode_reference(q, buffer, 1, table, lens)
    assert got is out and not torch.isnan(got).any(), f"seed {seed}: an output was not written"
    assert rel_error(got, want) <= TOLERANCE[dtype], f"seed {seed}: {rel_error(got, want)}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_extend_kernel_matches_the_reference(dtype: torch.dtype, group: int) -> None:
    seed = fresh_seed()
    buffer = pool(dtype)
    prefix = [0, BLOCK_TOKENS, 9, 3]
    new = [1, 3, 2 * BLOCK_TOKENS, 21]  # 21 > one 16-row tile
    table, prefix_lens = tables([max(n, 1) for n in prefix])
    new_lens = torch.tensor(new, dtype=torch.int32)
    prefix_lens = torch.tensor(prefix, dtype=torch.int32)
    total = sum(new)
    q = torch.randn(total, KV_HEADS * group, HEAD_DIM).to(dtype)
    k_new = torch.randn(total, KV_HEADS, HEAD_DIM).to(dtype)
    v_new = torch.randn(total, KV_HEADS, HEAD_DIM).to(dtype)
    out = torch.full_like(q, math.nan)
    args = (q, k_new, v_new, buffer, 0, table, prefix_lens, new_lens)
    got = kernels.paged_extend(*args, out=out)
    want = kernels.paged_extend_reference(*args)
    assert not torch.isnan(got).any(), f"seed {seed}: an output was not written"
    assert rel_error(got, want) <= TOLERANCE[dtype], f"seed {seed}: {rel_error(got, want)}"


def test_the_reference_agrees_with_sdpa_on_one_contiguous_sequence() -> None:
    """The reference itself, against torch's own attention on the same keys (a second opinion)."""
    seed = fresh_seed()
    buffer = pool(torch.float32)
    table, lens = tables([13])
    q = torch.randn(1, KV_HEADS * 4, HEAD_DIM)
    k, v = cached_kv(buffer, 1, table[0], 13)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q[0][:, None, :],  # [q_heads, 1, dim]
        k.repeat_interleave(4, 1).transpose(0, 1),  # [q_heads, 13, dim]
        v.repeat_interleave(4, 1).transpose(0, 1),
    )[:, 0]
    ref = kernels.paged_decode_reference(q, buffer, 1, table, lens)
    assert rel_error(ref[0], sdpa) <= 1e-6, f"seed {seed}"


# ---- the checked wrapper, over a real store's gpu pool -----------------------------------------


@pytest.fixture
def store() -> Iterator[KVStore]:
    store = build_store(gpu_blocks=8, host_blocks=16)
    yield store
    store.close()


def query(store: KVStore, batch: int, group: int = 2) -> torch.Tensor:
    layout = store.layout
    return torch.randn(batch, layout.num_kv_heads * group, layout.head_dim)


def test_decode_through_leases_reads_exactly_the_stored_kv(store: KVStore) -> None:
    seed = fresh_seed()
    attn = PagedAttention(store)
    assert attn.backend == ("triton" if kernels.INTERPRETED else "reference")
    a, b = list(range(12)), list(range(100, 108))
    kv_a, kv_b = kv_for(store, 12, seed=1), kv_for(store, 8, seed=2)
    store.store(a, kv_a)
    store.store(b, kv_b)
    leases = [store.prefetch(a), store.prefetch(b)]
    q = query(store, 2)
    out = attn.decode(q, 1, leases)
    for row, kv in enumerate((kv_a, kv_b)):  # attention over the KV as it was given
        k, v = kv[1, 0].float(), kv[1, 1].float()  # layer 1: [tokens, kv_heads, dim]
        want = torch.nn.functional.scaled_dot_product_attention(
            q[row].view(2, 2, -1).float(), k.transpose(0, 1), v.transpose(0, 1)
        ).reshape(4, -1)
        assert rel_error(out[row], want) <= 1e-5, f"seed {seed}: sequence {row}"
    shorter = attn.decode(q, 1, leases, seq_lens=[5, 8])  # a prefix of a lease is fine too
    assert rel_error(shorter[1], out[1]) <= 1e-6
    for lease in leases:
        store.release(lease)


def test_a_table_with_an_unleased_slot_is_refused(store: KVStore) -> None:
    attn = PagedAttention(store)
    tokens = list(range(8))
    store.store(tokens, kv_for(store, 8))
    lease = store.prefetch(tokens[:4])  # only the first block is leased
    other = next(slot for slot in range(8) if slot not in lease.block_table)
    table = torch.tensor([[lease.block_table[0], other]])
    with pytest.raises(ResidencyError, match="block 1: gpu slot"):
        attn.decode_table(query(store, 1), 0, table, torch.tensor([8]))
    out = attn.decode_table(query(store, 1), 0, table, torch.tensor([4]))  # block 0 only: fine
    assert out.shape == (1, 4, store.layout.head_dim)
    store.release(lease)


def test_released_freed_and_demoted_slots_are_refused(store: KVStore) -> None:
    attn = PagedAttention(store)
    tokens = list(range(8))
    store.store(tokens, kv_for(store, 8))
    lease = store.prefetch(tokens)
    table = torch.tensor([list(lease.block_table)])
    attn.decode_table(query(store, 1), 0, table, torch.tensor([8]))  # leased: fine
    store.release(lease)
    with pytest.raises(ResidencyError, match="not covered"):
        attn.decode_table(query(store, 1), 0, table, torch.tensor([8]))  # released
    with pytest.raises(ResidencyError, match="released"):
        attn.decode(query(store, 1), 0, [lease])
    assert store.evict("gpu", 8) == 2  # demoted (write_through: host keeps the copies)
    with pytest.raises(ResidencyError):
        attn.decode_table(query(store, 1), 0, table, torch.tensor([8]))
    store.store(list(range(50, 58)), kv_for(store, 8, seed=3))  # the freed slots are reused
    with pytest.raises(ResidencyError):
        attn.decode_table(query(store, 1), 0, table, torch.tensor([8]))


def test_a_pending_lease_is_refused_until_it_is_ready() -> None:
    from kvtier.transfer.stepped import SteppedExecutor

    config = build_store(gpu_blocks=8, host_blocks=16)
    cfg = config.config
    config.close()
    executor = SteppedExecutor()  # the prefetch's copies run when stepped
    store = KVStore(cfg, executor=executor)
    try:
        tokens = list(range(16))
        store.store(tokens, kv_for(store, 16))
        store.evict("gpu", 4)
        lease = store.prefetch(tokens, wait=False)
        attn = PagedAttention(store)
        with pytest.raises(ResidencyError, match="pending"):
            attn.decode(query(store, 1), 0, [lease])
        executor.run_all()
        assert lease.wait(10)
        assert attn.decode(query(store, 1), 0, [lease]).shape[0] == 1
        store.release(lease)
    finally:
        store.close()


def test_extend_through_a_lease_matches_the_reference(store: KVStore) -> None:
    seed = fresh_seed()
    attn = PagedAttention(store)
    prefix = list(range(8))
    store.store(prefix, kv_for(store, 8))
    lease = store.prefetch(prefix)
    layout = store.layout
    q = torch.randn(5, layout.num_kv_heads * 2, layout.head_dim)
    k_new = torch.randn(5, layout.num_kv_heads, layout.head_dim)
    v_new = torch.randn(5, layout.num_kv_heads, layout.head_dim)
    got = attn.extend(q, k_new, v_new, 1, [lease], [5])
    table = torch.tensor([list(lease.block_table)], dtype=torch.int32)
    want = kernels.paged_extend_reference(
        q, k_new, v_new, store.gpu_pool.buffer, 1, table, torch.tensor([8]), torch.tensor([5])
    )
    assert rel_error(got, want) <= 1e-5, f"seed {seed}"
    store.release(lease)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"q": torch.zeros(1, 3, 4)}, "q_heads a multiple of 2"),
        ({"q": torch.zeros(1, 4, 4, dtype=torch.float64)}, "expected torch.float32"),
        ({"layer": 2}, "layer: got 2"),
        ({"seq_lens": torch.tensor([0])}, "every length >= 1"),
        ({"seq_lens": torch.tensor([40])}, "at most"),
        ({"block_table": torch.zeros(1, 2)}, "int32 or int64"),
    ],
)
def test_bad_arguments_name_the_value(
    store: KVStore, change: dict[str, object], message: str
) -> None:
    attn = PagedAttention(store)
    args: dict[str, object] = {
        "q": torch.zeros(1, 4, store.layout.head_dim),
        "layer": 0,
        "block_table": torch.zeros(1, 2, dtype=torch.int32),
        "seq_lens": torch.tensor([8]),
    }
    args.update(change)
    with pytest.raises(InvalidArgumentError, match=message):
        attn.decode_table(**args)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_decode_and_extend_on_cuda_match_the_reference(dtype: torch.dtype) -> None:
    seed = fresh_seed()
    buffer = pool(dtype).cuda()
    table, lens = tables([1, BLOCK_TOKENS, 45, 17])
    table, lens = table.cuda(), lens.cuda()
    q = torch.randn(4, KV_HEADS * 4, HEAD_DIM, device="cuda").to(dtype)
    got = kernels.paged_decode(q, buffer, 0, table, lens)
    want = kernels.paged_decode_reference(q, buffer, 0, table, lens)
    assert rel_error(got, want) <= TOLERANCE[dtype], f"seed {seed}"
    new_lens = torch.tensor([3, 1, 20, 5], dtype=torch.int32, device="cuda")
    total = int(new_lens.sum())
    qe = torch.randn(total, KV_HEADS * 4, HEAD_DIM, device="cuda").to(dtype)
    kn = torch.randn(total, KV_HEADS, HEAD_DIM, device="cuda").to(dtype)
    vn = torch.randn(total, KV_HEADS, HEAD_DIM, device="cuda").to(dtype)
    args = (qe, kn, vn, buffer, 1, table, lens, new_lens)
    got = kernels.paged_extend(*args)
    assert rel_error(got, kernels.paged_extend_reference(*args)) <= TOLERANCE[dtype], f"seed {seed}"


def test_residency_is_read_without_the_store_lock_and_ends_at_expiry() -> None:
    """The kernel's check reads the residency view (`transfer/leasing.py`): it answers while
    another thread holds the store's lock, and a lease past its expiry on the store's clock no
    longer covers its slots, before any store call has expired it."""
    now = [0.0]
    store = build_store(gpu_blocks=8, host_blocks=16, clock=lambda: now[0], lease_ttl_s=10.0)
    try:
        attn = PagedAttention(store)
        tokens = list(range(8))
        store.store(tokens, kv_for(store, 8))
        lease = store.prefetch(tokens)
        table = torch.tensor([list(lease.block_table)])
        assert store.residency.slots() == frozenset(lease.block_table) == store.leased_slots()
        held, done = threading.Event(), threading.Event()

        def hold_the_lock() -> None:
            with store.parts.state.lock:
                held.set()
                done.wait(30)

        holder = threading.Thread(target=hold_the_lock)
        holder.start()
        try:
            assert held.wait(10)
            out = attn.decode_table(query(store, 1), 0, table, torch.tensor([8]))
            assert out.shape == (1, 4, store.layout.head_dim)
            now[0] = 10.0  # expired on the store's clock; nobody has called the store since
            with pytest.raises(ResidencyError, match="not covered"):
                attn.decode_table(query(store, 1), 0, table, torch.tensor([8]))
        finally:
            done.set()
            holder.join()
        assert store.leases() == [] and store.residency.slots() == frozenset()
        store.check()
    finally:
        store.close()
