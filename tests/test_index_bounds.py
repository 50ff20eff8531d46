"""Slot, page and block indices that reach copy code: every one out of range (past the end,
negative, not an integer, 2**32 past a real slot) or named twice for a write is a typed error
naming it, and nothing is copied. Slicing and torch's CPU indexing do not fail on their own: a
negative index is another slot from the end, a slice past the end a shorter view (a block
broadcast over the rest, or nothing written), a bool tensor a mask, a float truncated; on a GPU
an index past the end reads or writes whatever memory lies there.

The doors: the block-copy strategies and the mover's executors (our own slots, checked before
a launch or a slice), the quantized decode kernel, the paged-attention wrapper (an engine's
block table and lengths, the Triton kernels under TRITON_INTERPRET=1), and the vLLM and SGLang
paged copies (`integrations/paged.py`: an engine's block ids and host slots). A sidecar's
lease and reservation slots are checked by `service/replies.py` (`tests/test_client_trust.py`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import build_store, kv_for

from kvtier.blocks import KVLayout
from kvtier.errors import InvalidArgumentError, InvalidKVError, InvariantError
from kvtier.integrations.paged import gather, host_gather, host_scatter, scatter
from kvtier.kernels import paged_attention
from kvtier.kernels.attention import PagedAttention
from kvtier.kernels.block_copy import copy_blocks_gather, copy_blocks_kernel, copy_blocks_slices
from kvtier.kernels.dequant import dequantize
from kvtier.quant import QuantCodec, QuantSpec
from kvtier.store import KVStore
from kvtier.tiers import SlotPool
from kvtier.tiers.disk import BlockMeta, DiskTier
from kvtier.tiers.quantized import QuantPool
from kvtier.transfer import InlineExecutor, ThreadExecutor, Transfer

CPU = torch.device("cpu")
LAYOUT = KVLayout("t", 2, 2, 8, "float32", 4)  # 1 KiB blocks
SENTINEL = -7.0


def buffers(slots: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """A source pool buffer whose block i is all i, and a destination full of SENTINEL."""
    src = torch.arange(slots, dtype=torch.float32).view(slots, 1, 1).expand(slots, 2, 3).clone()
    return src, torch.full((slots, 2, 3), SENTINEL)


def pools(slots: int = 8) -> tuple[SlotPool, SlotPool]:
    """A `gpu` pool whose block i is all i, and a `host` pool full of SENTINEL; all allocated."""
    gpu, host = SlotPool("gpu", LAYOUT, slots, CPU), SlotPool("host", LAYOUT, slots, CPU)
    gpu.allocate(slots)
    host.allocate(slots)
    for i in range(slots):
        gpu.buffer[i].fill_(float(i))
    host.buffer.fill_(SENTINEL)
    return gpu, host


def untouched(buffer: torch.Tensor) -> bool:
    return bool((buffer == SENTINEL).all())


# ---- block copies: our own slots, checked before a slice or a launch -----------------------


@pytest.mark.parametrize(
    ("src_slots", "dst_slots", "message"),
    [
        ((1,), (-2,), r"destination slots -2..-2 are out of range; expected slots in \[0, 4\)"),
        ((3, 4, 5), (0, 1, 2), r"source slots 3..5 are out of range"),  # was: 3 broadcast x3
        ((3,), (5,), r"destination slots 5..5 are out of range"),  # was: nothing written
        ((-3, -2), (0, 1), r"source slots -3..-2 are out of range"),  # was: slots 1 and 2
    ],
)
def test_a_slice_copy_refuses_slots_a_slice_would_clamp_or_wrap(
    src_slots: tuple[int, ...], dst_slots: tuple[int, ...], message: str
) -> None:
    src, dst = buffers()
    with pytest.raises(InvalidArgumentError, match=message):
        copy_blocks_slices(src, dst, src_slots, dst_slots)
    assert untouched(dst)


def test_gather_and_kernel_refuse_a_destination_named_twice() -> None:
    src, dst = buffers()
    for copy in (copy_blocks_gather, copy_blocks_kernel):  # the kernel: before CUDA is asked
        with pytest.raises(InvalidArgumentError, match="destination slot 2 is named twice"):
            copy(src, dst, (0, 1), (2, 2))
        assert untouched(dst)
    with pytest.raises(InvalidArgumentError, match="source slot -1 is out of range"):
        copy_blocks_gather(src, dst, (-1,), (0,))
    assert untouched(dst)


@pytest.mark.parametrize("executor", [InlineExecutor, ThreadExecutor])
def test_the_mover_refuses_a_transfer_past_its_pool(executor: type) -> None:
    gpu, host = pools()
    mover = executor()
    try:
        whole = mover.submit(Transfer(gpu, (6, 7, 8), host, (0, 1, 2)))  # 8 of 8
        layers = mover.submit(Transfer(gpu, (0,), host, (-1,), layers=(0, 1)))
        for handle in (whole, layers):
            assert handle.wait(10)
            with pytest.raises(InvalidArgumentError, match="out of range"):
                handle.result()
        assert untouched(host.buffer)
        good = mover.submit(Transfer(gpu, (6, 7), host, (0, 1)))
        assert good.wait(10) and good.result() == [True, True]
        assert bool((host.buffer[1] == 7.0).all())
    finally:
        mover.close()


def test_a_disk_copy_refuses_a_negative_pool_slot(tmp_path: Path) -> None:
    layout = KVLayout("tiny", 2, 2, 64, "float16", 4)  # 4 KiB blocks, as the disk tests use
    host = SlotPool("host", layout, 4, CPU)
    host.allocate(4)
    host.buffer.copy_(torch.randn(host.buffer.shape).to(layout.dtype))
    disk = DiskTier(layout, tmp_path / "disk", 1 << 20)
    mover = InlineExecutor()
    try:
        slots = tuple(disk.allocate(2))
        metas = tuple(
            BlockMeta(bytes([i]) * 16, b"\0" * 16, b"\1" * 16, "t", b"\0" * 16) for i in range(2)
        )
        for transfer, bad in (
            (Transfer(host, (0, -1), disk, slots, metas), "source slot -1"),  # was: slot 3
            (Transfer(host, (0, 1), disk, (slots[0], disk.num_slots), metas), "destination"),
        ):
            with pytest.raises(InvalidArgumentError, match=bad):
                mover.run(transfer)
        assert disk.scan().copies == []  # nothing written
        assert mover.run(Transfer(host, (0, 1), disk, slots, metas)) == [True, True]
        with pytest.raises(InvalidArgumentError, match="destination slot 2 is named twice"):
            mover.run(Transfer(disk, slots, host, (2, 2), metas))
    finally:
        disk.close()


def test_a_quantized_copy_refuses_a_wrapping_slot_and_a_repeated_one() -> None:
    layout = KVLayout("q", 2, 2, 64, "bfloat16", 4)
    codec = QuantCodec(QuantSpec("int8"), layout)
    quant = QuantPool(codec, 4)
    quant.write(quant.allocate(2), torch.randn(2, *layout.block_shape).to(layout.dtype))
    gpu = SlotPool("gpu", layout, 4, CPU)
    gpu.allocate(4)
    gpu.buffer.fill_(SENTINEL)
    mover = InlineExecutor()
    with pytest.raises(InvalidArgumentError, match="destination slot -1"):  # was: slot 3
        mover.run(Transfer(quant, (0,), gpu, (-1,), layers=(0, 1)))
    with pytest.raises(InvalidArgumentError, match="destination slot 1 is named twice"):
        mover.run(Transfer(quant, (0, 1), gpu, (1, 1)))
    assert untouched(gpu.buffer)
    payloads = quant.payloads([0, 1])
    for kernel in (False, True):  # torch, and the Triton kernel (interpreted on a CPU)
        with pytest.raises(InvalidArgumentError, match="expected distinct slots"):
            dequantize(codec, payloads, gpu.buffer, torch.tensor([3, 3]), kernel=kernel)
    assert untouched(gpu.buffer)


# ---- paged attention: an engine's block table and lengths ----------------------------------


@pytest.fixture
def store() -> Iterator[KVStore]:
    store = build_store(gpu_blocks=8, host_blocks=16)
    yield store
    store.close()


def test_a_table_slot_past_int32_is_refused_not_wrapped_onto_a_leased_slot(
    store: KVStore,
) -> None:
    attn = PagedAttention(store)
    assert attn.backend == ("triton" if paged_attention.INTERPRETED else "reference")
    tokens = list(range(8))
    store.store(tokens, kv_for(store, 8))
    lease = store.prefetch(tokens)
    first, second = lease.block_table
    q = torch.randn(1, 4, store.layout.head_dim)
    wrapped = torch.tensor([[(1 << 32) + first, second]], dtype=torch.int64)
    with pytest.raises(InvalidArgumentError, match=rf"block_table\[0, 0\]: got slot {1 << 32}"):
        attn.decode_table(q, 0, wrapped, torch.tensor([8]))
    negative = torch.tensor([[first, -1]], dtype=torch.int64)
    with pytest.raises(InvalidArgumentError, match=r"block_table\[0, 1\]: got slot -1"):
        attn.decode_table(q, 0, negative, torch.tensor([8]))
    padded = torch.tensor([[first, second, -1, 1 << 40]], dtype=torch.int64)  # padding: unread
    out = attn.decode_table(q, 0, padded, torch.tensor([8]))
    plain = attn.decode_table(q, 0, torch.tensor([[first, second]]), torch.tensor([8]))
    assert torch.equal(out, plain)
    store.release(lease)


def test_a_length_past_int32_is_refused_not_wrapped_negative(store: KVStore) -> None:
    attn = PagedAttention(store)
    tokens = list(range(8))
    store.store(tokens, kv_for(store, 8))
    lease = store.prefetch(tokens)
    table = torch.tensor([list(lease.block_table)])
    q = torch.randn(1, 4, store.layout.head_dim)
    with pytest.raises(InvalidArgumentError, match="seq_lens: got"):  # was: NaN, nothing read
        attn.decode_table(q, 0, table, torch.tensor([1 << 31]))
    assert bool(torch.isfinite(attn.decode_table(q, 0, table, torch.tensor([8]))).all())
    store.release(lease)


# ---- vLLM's paged layers: the engine's block ids --------------------------------------------


def paged_layers() -> list[torch.Tensor]:
    """Two layers of 4 blocks `[blocks, heads 1, block_size 2, 2 * dim 2]`, full of SENTINEL."""
    return [torch.full((4, 1, 2, 2), SENTINEL) for _ in range(2)]


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([1.7], "block id 1.7"),  # was: truncated to block 1
        ([True], "block id True"),
        ([-1], r"block id -1 .*expected each in \[0, 4\)"),
        ([2, 2], "expected distinct ids"),  # two writes of one block in one index_copy_
    ],
)
def test_vllm_scatter_refuses_ids_that_are_not_distinct_ints_in_range(
    ids: list[object], message: str
) -> None:
    layers = paged_layers()
    kv = torch.ones(2, 2, 2 * len(ids), 1, 1)
    with pytest.raises(InvalidKVError, match=message):
        scatter(layers, ids, kv)  # type: ignore[arg-type]
    assert all(untouched(layer) for layer in layers)


def test_vllm_ids_may_be_numpy_or_tensor_ints() -> None:
    layers = paged_layers()
    kv = torch.arange(8, dtype=torch.float32).view(2, 2, 2, 1, 1)
    scatter(layers, [np.int64(3)], kv)  # type: ignore[list-item]
    assert torch.equal(gather(layers, [torch.tensor(3)]), kv)  # type: ignore[list-item]
    assert all(untouched(layer[:3]) for layer in layers)


# ---- SGLang's host pool: the engine's host slots ----------------------------------------------

PAGE = 4
SHAPES = {  # 2 layers, 12 slots (3 pages of 4), 1 head, dim 1
    "layer_first": (2, 2, 12, 1, 1),
    "page_first": (2, 12, 2, 1, 1),
    "page_first_direct": (2, 3, 2, PAGE, 1, 1),
    "page_head": (2, 3, 1, PAGE, 2, 1),
}


@pytest.mark.parametrize("layout", list(SHAPES))
@pytest.mark.parametrize(
    ("slots", "message"),
    [
        (torch.arange(-4, 0), r"host slot -4: expected slots in \[0, 12\)"),  # was: page 2
        (torch.arange(12, 16), r"host slot 12: expected slots in \[0, 12\)"),
        (torch.tensor([0, 1, 2, 3, 4, 5, 6, 7], dtype=torch.int32) - 8, "host slot -8"),
        (torch.ones(4, dtype=torch.bool), "1-D integer tensor"),  # was: a mask
        (torch.arange(4.0), "1-D integer tensor"),
        (torch.arange(4).view(2, 2), "1-D integer tensor"),
    ],
)
def test_sglang_host_copies_refuse_slots_outside_the_pool(
    layout: str, slots: torch.Tensor, message: str
) -> None:
    buffer = torch.full(SHAPES[layout], SENTINEL)
    kv = torch.ones(2, 2, len(slots), 1, 1)
    with pytest.raises(InvalidKVError, match=message):
        host_scatter(buffer, layout, slots, PAGE, kv)
    with pytest.raises(InvalidKVError, match=message):
        host_gather(buffer, layout, slots, PAGE)
    assert untouched(buffer)


@pytest.mark.parametrize("layout", ["page_first_direct", "page_head"])
def test_sglang_host_pages_must_be_whole_pages_of_their_own_slots(layout: str) -> None:
    buffer = torch.full(SHAPES[layout], SENTINEL)
    mixed = torch.tensor([0, 9, 10, 11])  # page 0's first slot, then page 2's: was page 0
    with pytest.raises(InvalidKVError, match="whole pages of 4 consecutive slots"):
        host_scatter(buffer, layout, mixed, PAGE, torch.ones(2, 2, 4, 1, 1))
    assert untouched(buffer)


@pytest.mark.parametrize("layout", list(SHAPES))
def test_sglang_host_scatter_refuses_repeats_and_a_kv_of_other_length(layout: str) -> None:
    buffer = torch.full(SHAPES[layout], SENTINEL)
    twice = torch.tensor([4, 5, 6, 7, 4, 5, 6, 7])
    with pytest.raises(InvalidKVError, match="expected distinct slots"):
        host_scatter(buffer, layout, twice, PAGE, torch.ones(2, 2, 8, 1, 1))
    with pytest.raises(InvalidKVError, match=r"host KV: got \(2, 2, 8, 1, 1\)"):
        host_scatter(buffer, layout, torch.arange(4, 8), PAGE, torch.ones(2, 2, 8, 1, 1))
    assert untouched(buffer)
    kv = torch.arange(8, dtype=torch.float32).view(2, 2, 2, 1, 1).repeat(1, 1, 2, 1, 1)
    host_scatter(buffer, layout, torch.arange(8, 12), PAGE, kv)  # page 2: fine
    assert torch.equal(host_gather(buffer, layout, torch.arange(8, 12), PAGE), kv)
    assert untouched(host_gather(buffer, layout, torch.arange(0, 8), PAGE))


# ---- the store's check(): every slot the index names is allocated in its tier --------------


def test_check_finds_an_index_slot_its_pool_never_allocated(store: KVStore) -> None:
    store.store(list(range(8)), kv_for(store, 8))  # 2 blocks in gpu slots 0 and 1
    store.check()
    index, gpu = store.parts.state.index, store.parts.state.pools[0]
    root = next(index.roots())
    assert root.children is not None
    node = next(iter(root.children.values()))
    assert list(node.slots[0]) == [0, 1] and not gpu.is_allocated(7)
    node.slots[0][1] = 7  # counts and distinctness still agree; a read would copy slot 7
    with pytest.raises(InvariantError, match=r"block 1 of .* is in slot 7, which the tier has"):
        store.check()
    node.slots[0][1] = 1
    store.check()
