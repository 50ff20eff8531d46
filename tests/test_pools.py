"""Slot pools: exact slot ids, all-or-nothing errors, bit-exact data, exact accounting."""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.blocks import KVLayout, blocks_of, to_blocks
from kvtier.errors import CapacityError, ClosedError, ConfigError, InvalidKVError, InvariantError
from kvtier.tiers import GpuPool, HostPool, SlotPool, available_host_bytes, free_device_bytes
from kvtier.tiers.memory import parse_mem_available
from kvtier.tiers.shm import segment_prefix

CPU = torch.device("cpu")
INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
CUDA = torch.cuda.is_available()


def tiny(dtype_name: str = "bfloat16") -> KVLayout:
    return KVLayout(
        "tiny", num_layers=2, num_kv_heads=2, head_dim=4, dtype_name=dtype_name, block_tokens=4
    )


def pool(num_slots: int = 4, dtype_name: str = "bfloat16") -> SlotPool:
    return SlotPool("gpu", tiny(dtype_name), num_slots, CPU)


def random_blocks(layout: KVLayout, n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((n, *layout.block_shape), generator=gen).to(layout.dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT_VIEW[t.dtype])


def test_fresh_pool_hands_out_in_order_and_reuses_last_freed_first() -> None:
    p = pool(4)
    assert p.allocate(3) == [0, 1, 2]
    p.free([1])
    assert p.allocate(1) == [1]
    p.free([0, 2])
    assert p.allocate(2) == [2, 0]
    assert (p.num_used, p.num_free) == (3, 1)
    assert p.used_bytes == 3 * p.layout.block_bytes
    p.check()


def test_allocate_beyond_free_raises_and_changes_nothing() -> None:
    p = pool(4)
    p.allocate(3)
    assert p.can_allocate(1) and not p.can_allocate(2)
    with pytest.raises(CapacityError, match=r"'gpu'.*allocate 2 slots.*only 1 of 4 free"):
        p.allocate(2)
    assert p.num_free == 1
    assert [p.is_allocated(s) for s in range(4)] == [True, True, True, False]
    p.check()
    assert p.allocate(1) == [3]


def test_allocate_zero_and_negative() -> None:
    p = pool(2)
    assert p.allocate(0) == []
    with pytest.raises(ValueError, match="-1"):
        p.allocate(-1)
    assert p.num_free == 2
    p.check()


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16", "float32"])
def test_write_read_round_trip_is_bit_exact(dtype_name: str) -> None:
    p = pool(4, dtype_name)
    slots = p.allocate(3)
    blocks = random_blocks(p.layout, 3)
    blocks.view(-1)[:2] = torch.tensor([float("nan"), float("-inf")])  # odd bit patterns too
    p.write([slots[2], slots[0]], blocks[:2])
    p.write([slots[1]], blocks[2:])
    got = p.read([slots[2], slots[0], slots[1]])
    assert got.shape == (3, *p.layout.block_shape)
    assert got.dtype == p.layout.dtype
    assert torch.equal(bits(got), bits(blocks))
    assert torch.equal(bits(p.block(slots[1])), bits(blocks[2]))


def test_block_is_a_view_of_the_slot() -> None:
    p = pool(2)
    (slot,) = p.allocate(1)
    p.block(slot).fill_(3.0)
    assert p.block(slot).data_ptr() == p.buffer[slot].data_ptr()
    assert torch.equal(p.read([slot])[0], torch.full(p.layout.block_shape, 3.0).bfloat16())


def test_bad_writes_raise_and_leave_contents_unchanged() -> None:
    p = pool(4)
    slots = p.allocate(2)
    before = random_blocks(p.layout, 2, seed=1)
    p.write(slots, before)
    wrong_dtype = random_blocks(p.layout, 2, seed=2).float()
    with pytest.raises(InvalidKVError, match=r"float32.*expected torch\.bfloat16"):
        p.write(slots, wrong_dtype)
    wrong_shape = random_blocks(p.layout, 3, seed=3)
    with pytest.raises(InvalidKVError, match=r"shape \[3, 2, 2, 4, 2, 4\].*\[2, 2, 2, 4, 2, 4\]"):
        p.write(slots, wrong_shape)
    with pytest.raises(InvariantError, match="slot 3, it is not allocated"):
        p.write([slots[0], 3], random_blocks(p.layout, 2, seed=4))
    assert torch.equal(bits(p.read(slots)), bits(before))


def test_read_of_free_slot_raises() -> None:
    p = pool(4)
    p.allocate(1)
    with pytest.raises(InvariantError, match="slot 1, it is not allocated"):
        p.read([0, 1])
    with pytest.raises(InvariantError, match="slot 2, it is not allocated"):
        p.block(2)


@pytest.mark.parametrize(
    ("to_free", "message"),
    [
        ([0, 2], "slot 2, it is not allocated"),  # never allocated
        ([1, 4], r"slot 4, outside \[0, 4\)"),
        ([1, -1], r"slot -1, outside \[0, 4\)"),
        ([0, 1, 0], "slot 0, it is repeated"),
    ],
)
def test_bad_free_raises_and_frees_nothing(to_free: list[int], message: str) -> None:
    p = pool(4)
    p.allocate(2)
    with pytest.raises(InvariantError, match=message):
        p.free(to_free)
    assert (p.num_used, p.num_free) == (2, 2)
    assert p.is_allocated(0) and p.is_allocated(1)
    p.check()


def test_free_of_a_run_is_checked_like_any_free() -> None:
    """A run of consecutive slots in any order is checked and freed in C (`SlotAllocator.free`):
    the same refusals as slot by slot, nothing freed by a refused call, the same free list."""
    p = pool(6)
    p.allocate(6)
    p.free([1])
    for run, message in (
        ([2, 1, 0], "slot 1, it is not allocated"),  # spans 3 ids, one of them free
        ([4, 3, 3], "slot 3, it is repeated"),  # 3 slots over 2 ids
        ([5, 4, 6], r"slot 6, outside \[0, 6\)"),
    ):
        with pytest.raises(InvariantError, match=message):
            p.free(run)
        assert p.num_used == 5 and all(p.is_allocated(s) for s in (0, 2, 3, 4, 5))
    p.free([5, 4, 3])  # a node's tail, last block first
    assert p.num_used == 2 and not any(p.is_allocated(s) for s in (3, 4, 5))
    p.check()
    assert p.allocate(4) == [3, 4, 5, 1]  # last freed first, as freeing one by one would give
    p.check()


def test_double_free_raises() -> None:
    p = pool(4)
    p.allocate(2)
    p.free([1])
    with pytest.raises(InvariantError, match="slot 1, it is not allocated"):
        p.free([0, 1])
    assert p.is_allocated(0)
    p.check()


def test_with_capacity_rounds_down_to_whole_blocks() -> None:
    layout = tiny()
    assert layout.block_bytes == 256
    p = SlotPool.with_capacity("host", layout, 3 * 256 + 128, CPU)
    assert (p.num_slots, p.capacity_bytes) == (3, 768)
    assert p.buffer.shape == layout.pool_shape(3) and p.buffer.is_contiguous()
    with pytest.raises(ConfigError, match=r"tiers\.host\.capacity.*255.*one block of 256 bytes"):
        SlotPool.with_capacity("host", layout, 255, CPU)


def test_check_detects_tampered_free_list() -> None:
    p = pool(4)
    p.allocate(2)
    p.free([0])
    p.check()
    p._slots._freed.append(0)
    with pytest.raises(InvariantError, match=r"slot 0 is 2 times in the free list of 4"):
        p.check()
    p._slots._freed[-1] = 1  # allocated slot also in the free list
    with pytest.raises(InvariantError, match=r"slot 1 is in the free list and marked allocated"):
        p.check()
    p._slots._freed[-1] = 3  # a fresh slot also in the freed stack
    with pytest.raises(
        InvariantError, match=r"holds slot 3, outside \[0, 2\).*from 2 on are fresh"
    ):
        p.check()
    p._slots._freed.pop()
    p._slots._allocated[3] = 1  # a fresh slot marked allocated
    with pytest.raises(InvariantError, match=r"slot 3 is fresh \(never handed out\) and marked"):
        p.check()
    p._slots._allocated[3] = 0
    p._slots._num_used = 2
    with pytest.raises(InvariantError, match=r"3 free \+ 1 allocated.*4 slots.*num_used 2"):
        p.check()


def test_closed_pool_refuses_everything() -> None:
    p = pool(2)
    p.allocate(1)
    p.close()
    p.close()
    assert p.closed
    for call in (lambda: p.allocate(1), lambda: p.free([0]), lambda: p.read([0]), p.check):
        with pytest.raises(ClosedError, match="'gpu' is closed"):
            call()
    with pytest.raises(ClosedError):
        _ = p.buffer


def test_gpu_pool_on_cpu_and_auto() -> None:
    p = GpuPool.create(tiny(), 2 * 256, device="cpu")
    assert (p.name, p.device, p.num_slots) == ("gpu", CPU, 2)
    auto = GpuPool.create(tiny(), 256)
    assert auto.device == (torch.device("cuda", 0) if CUDA else CPU)


@pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_gpu_pool_on_cuda_without_cuda_is_a_config_error(device: str) -> None:
    with pytest.raises(ConfigError, match=r"tiers\.gpu\.device.*without CUDA"):
        GpuPool.create(tiny(), 256, device=device)


@pytest.mark.parametrize("device", ["mps", "tpu:0", "banana"])
def test_gpu_pool_on_unknown_device_is_a_config_error(device: str) -> None:
    with pytest.raises(ConfigError, match=r"tiers\.gpu\.device"):
        GpuPool.create(tiny(), 256, device=device)


def vm_flags(address: int) -> list[str]:
    """The kernel's flags of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(
    not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
    reason="a kernel without transparent huge pages",
)
@pytest.mark.parametrize("shared", [False, True])
def test_cpu_pools_ask_for_huge_pages_and_pinned_ones_do_not(shared: bool) -> None:
    name = f"{segment_prefix('kvtier_test')}-host" if shared else None
    big = SlotPool("host", tiny(), 16384, CPU, shared_name=name)  # 4 MiB: two huge pages
    try:
        assert "hg" in vm_flags(big.buffer.data_ptr())  # VM_HUGEPAGE: MADV_HUGEPAGE was taken
        slots = big.allocate(16384)
        blocks = random_blocks(tiny(), 2)
        big.write(slots[-2:], blocks)  # the last huge page: the advice changed no byte we keep
        assert torch.equal(bits(big.read(slots[-2:])), bits(blocks))
        big.check()
    finally:
        big.close()
    plain = torch.empty(1 << 22, dtype=torch.uint8)  # torch's own memory: no advice from us
    assert "hg" not in vm_flags(plain.data_ptr())


def test_host_pool_pinning() -> None:
    p = HostPool.create(tiny(), 256, pinned=False)
    assert (p.name, p.device, p.buffer.is_pinned()) == ("host", CPU, False)
    assert HostPool.create(tiny(), 256).buffer.is_pinned() == CUDA
    with pytest.raises(ConfigError, match=r"tiers\.host\.pinned.*'yes'"):
        HostPool.create(tiny(), 256, pinned="yes")


@pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without CUDA")
def test_host_pool_pinned_without_cuda_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"tiers\.host\.pinned.*True.*without CUDA"):
        HostPool.create(tiny(), 256, pinned=True)


def test_memory_probes_return_positive_ints() -> None:
    host = available_host_bytes()
    assert type(host) is int and host > 0
    device = free_device_bytes("cuda:0" if CUDA else "cpu")
    assert type(device) is int and device > 0
    assert parse_mem_available("MemTotal: 100 kB\nMemAvailable:   7 kB\n") == 7 * 1024
    assert parse_mem_available("MemTotal: 100 kB\n") is None
    with pytest.raises(ConfigError, match="'meta'"):
        free_device_bytes("meta")


class FreeList:
    """The allocator's order, written the plain way: one free list used as a stack, filled in
    reverse so that a fresh pool hands out 0, 1, 2, ...; `SlotAllocator` must match it."""

    def __init__(self, num_slots: int) -> None:
        self.free = list(range(num_slots - 1, -1, -1))

    def allocate(self, n: int) -> list[int]:
        return [self.free.pop() for _ in range(n)]

    def release(self, slots: list[int]) -> None:
        self.free.extend(slots)

    def claim(self, slots: set[int]) -> None:
        self.free = [slot for slot in self.free if slot not in slots]


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_random_allocate_free_claim_matches_a_plain_free_list(data: st.DataObject) -> None:
    p = pool(8)
    reference: set[int] = set()
    order = FreeList(8)
    for _ in range(data.draw(st.integers(0, 30), label="steps")):
        action = data.draw(st.sampled_from(["allocate", "free", "claim"]), label="action")
        if action == "allocate":
            n = data.draw(st.integers(0, 10), label="n")
            if n > 8 - len(reference):
                with pytest.raises(CapacityError):
                    p.allocate(n)
            else:
                got = p.allocate(n)
                assert got == order.allocate(n)  # the same slots, in the same order
                assert len(set(got)) == n and not set(got) & reference
                reference |= set(got)
        elif action == "free" and reference:
            chosen = data.draw(st.permutations(sorted(reference)), label="free")
            chosen = chosen[: data.draw(st.integers(0, len(chosen)), label="how many")]
            p.free(chosen)
            order.release(chosen)
            reference -= set(chosen)
        elif action == "claim":
            free = sorted(set(range(8)) - reference)
            claimed = data.draw(st.sets(st.sampled_from(free)) if free else st.just(set()))
            p._slots.claim(claimed)  # what the disk tier's recovery calls
            order.claim(claimed)
            reference |= claimed
        assert {s for s in range(8) if p.is_allocated(s)} == reference
        assert (p.num_used, p.num_free, p.used_bytes) == (
            len(reference),
            8 - len(reference),
            len(reference) * p.layout.block_bytes,
        )
        p.check()


def test_claim_refuses_a_taken_or_outside_slot_and_changes_nothing() -> None:
    p = pool(4)
    p.allocate(1)
    for bad in ([2, 0], [2, 4]):
        with pytest.raises(InvariantError, match=f"cannot claim slot {bad[1]}"):
            p._slots.claim(bad)
        assert (p.num_used, p.num_free) == (1, 3) and not p.is_allocated(2)
    p._slots.claim([2])
    assert p.allocate(2) == [1, 3]  # 1 was passed over by the claim, then the fresh 3
    p.check()


@pytest.mark.parametrize(
    "order",
    [
        [0, 1, 2, 3, 4],  # one run up: one slice copy
        [4, 3, 2, 1, 0],  # down: the indexed copy
        [2, 3, 4, 0, 1],  # two runs
        [0, 1, 3, 2, 4],  # first and last would make a run, the middle does not
    ],
)
def test_write_is_bit_exact_whatever_the_order_of_slots(order: list[int]) -> None:
    p = pool(6)
    assert p.allocate(5) == [0, 1, 2, 3, 4]
    blocks = random_blocks(p.layout, 5, seed=7)
    p.write(order, blocks)
    for i, slot in enumerate(order):
        assert torch.equal(bits(p.block(slot)), bits(blocks[i]))
    p.write(tuple(order[1:4]), blocks[:3])  # a tuple, and a part of the slots
    assert torch.equal(bits(p.read(order[1:4])), bits(blocks[:3]))
    p.write([], blocks[:0])
    p.check()


def test_write_of_a_run_with_a_free_slot_raises_and_writes_nothing() -> None:
    p = pool(6)
    p.allocate(6)
    before = random_blocks(p.layout, 2, seed=8)
    p.write([1, 2], before)
    p.free([2])
    for run, message in (
        ([1, 2, 3], "slot 2, it is not allocated"),
        ([4, 5, 6], r"slot 6, outside \[0, 6\)"),
        ([-1, 0], r"slot -1, outside \[0, 6\)"),
    ):
        with pytest.raises(InvariantError, match=message):
            p.write(run, random_blocks(p.layout, len(run), seed=9))
    assert torch.equal(bits(p.read([1])), bits(before[:1]))
    p.check()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_pool_round_trips_and_host_pool_is_pinned() -> None:
    layout = tiny()
    gpu = GpuPool.create(layout, 4 * layout.block_bytes, device="cuda")
    assert gpu.device == torch.device("cuda", 0) and gpu.buffer.is_cuda
    host = HostPool.create(layout, 4 * layout.block_bytes, pinned=True)
    assert host.buffer.is_pinned()
    blocks = random_blocks(layout, 2)
    slots = gpu.allocate(2)
    gpu.write(slots, blocks)
    host_slots = host.allocate(2)
    host.write(host_slots, gpu.read(slots))
    assert torch.equal(bits(host.read(host_slots)), bits(blocks))
    assert free_device_bytes("cuda:0") > 0
    gpu.check()
    host.check()


@pytest.mark.parametrize("contiguous", [True, False])
def test_blocks_of_kv_are_the_blocks_a_reshape_would_cut(contiguous: bool) -> None:
    layout = tiny()
    gen = torch.Generator().manual_seed(3)
    # [L, 2, tokens, H, D]; the non-contiguous one is a transposed view, as engines hand over
    base = torch.randn((2, 2, 2, 5 * 4, 4), generator=gen).to(layout.dtype)
    kv = base.transpose(2, 3) if not contiguous else base.transpose(2, 3).contiguous()
    whole = kv.contiguous().reshape(2, 2, 5, 4, 2, 4).permute(2, 0, 1, 3, 4, 5)
    for first, count in ((0, 5), (1, 3), (4, 1), (2, 0)):
        got = blocks_of(kv, 4, first, count)
        assert got.shape == (count, *layout.block_shape)
        assert torch.equal(bits(got), bits(whole[first : first + count]))
    assert torch.equal(bits(to_blocks(kv, 4)), bits(whole))
    p = pool(6)
    slots = p.allocate(3)
    p.write(slots, blocks_of(kv, 4, 2, 3))  # one run: the slice copy from a strided view
    assert torch.equal(bits(p.read(slots)), bits(whole[2:5]))


def test_a_forked_child_writes_pool_slots_of_its_own() -> None:
    # a CPU pool is private memory, as torch's is: a forked child's writes stay in the child
    p = pool(2)
    p.buffer[1].fill_(3)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        p.buffer[1].fill_(7)
        os._exit(0 if float(p.buffer[1].flatten()[0]) == 7 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert bool((p.buffer[1] == 3).all())


def test_close_gives_a_pools_memory_back_while_the_pool_object_lives() -> None:
    p = pool(4)
    p.buffer.fill_(1)
    memory = weakref.ref(p._mapping)
    p.close()
    gc.collect()
    assert memory() is None and p.closed
