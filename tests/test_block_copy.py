"""Block copies: every strategy moves exactly the blocks asked for, bit for bit; the planner
measures the candidates of each kind of copy in turn and keeps the fastest; the CUDA kernel's
source compiles, and on a GPU with CuPy it copies like the others.

Pools of a tiny layout (2 layers, 2 kv heads, head_dim 4, 2 tokens: 128-byte fp16 blocks) hold
random bits; every destination slot starts as POISON, so a slot left untouched still reads
POISON and a slot copied reads its source's bits in every byte.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.blocks import KVLayout
from kvtier.errors import InvalidArgumentError
from kvtier.kernels import block_copy
from kvtier.kernels.block_copy import (
    BLOCK_COPY_CUDA,
    KERNEL_UNITS,
    STRATEGIES,
    CopyStrategy,
    applies_anywhere,
    contiguous_runs,
    copy_blocks_kernel,
    kernel_applies,
    kernel_available,
)
from kvtier.tiers import SlotPool
from kvtier.transfer import CopyKey, CopyPlanner, InlineExecutor, Transfer
from kvtier.transfer.planner import BlockCopier, bucket

CPU = torch.device("cpu")
LAYOUT = KVLayout("t", 2, 2, 4, "float16", 2)  # 128-byte blocks
POISON = 0x5A5A  # int16 bit pattern in every byte of an untouched destination slot
SLOTS = 16

PATTERNS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "scattered": ((9, 0, 14, 3, 7), (2, 11, 5, 15, 0)),
    "contiguous": ((4, 5, 6, 7), (10, 11, 12, 13)),
    "runs and singles": ((0, 1, 2, 8, 12, 13), (5, 6, 7, 0, 14, 15)),
}


def random_pool(name: str = "src", device: torch.device = CPU, pinned: bool = False) -> SlotPool:
    pool = SlotPool(name, LAYOUT, SLOTS, device, pin_memory=pinned)
    gen = torch.Generator().manual_seed(len(name))
    bits = torch.randint(-(2**15), 2**15, pool.buffer.shape, dtype=torch.int16, generator=gen)
    pool.buffer.view(torch.int16).copy_(bits)
    return pool


def poisoned_pool(name: str = "dst", device: torch.device = CPU, pinned: bool = False) -> SlotPool:
    pool = SlotPool(name, LAYOUT, SLOTS, device, pin_memory=pinned)
    pool.buffer.view(torch.int16).fill_(POISON)
    return pool


def assert_copied(
    src: torch.Tensor, dst: torch.Tensor, src_slots: Sequence[int], dst_slots: Sequence[int]
) -> None:
    """Each dst slot holds its source's bits; every other dst slot is still all POISON."""
    src_bits, dst_bits = src.cpu().view(torch.int16), dst.cpu().view(torch.int16)
    for s, d in zip(src_slots, dst_slots, strict=True):
        assert torch.equal(dst_bits[d], src_bits[s]), f"slot {d} is not a copy of slot {s}"
    for d in set(range(len(dst))) - set(dst_slots):
        assert bool((dst_bits[d] == POISON).all()), f"slot {d} was written"


# -- the torch strategies -----------------------------------------------------------------------


def test_runs_pair_slots_that_advance_together() -> None:
    src, dst = PATTERNS["runs and singles"]
    assert contiguous_runs(src, dst) == [(0, 5, 3), (8, 0, 1), (12, 14, 2)]
    assert contiguous_runs((3, 4), (7, 9)) == [(3, 7, 1), (4, 9, 1)]  # only one side advances
    assert contiguous_runs((), ()) == []


@pytest.mark.parametrize("n", [1, 2, 63, 64, 300])
def test_slots_that_all_advance_together_are_one_run_whatever_their_sequence(n: int) -> None:
    for src in (list(range(7, 7 + n)), tuple(range(7, 7 + n)), range(7, 7 + n)):
        assert contiguous_runs(src, range(n)) == [(7, 0, n)]
        assert contiguous_runs(src, list(range(3, 3 + n))) == [(7, 3, n)]
    if n > 2:  # the same ends, one pair swapped inside: no longer one run
        swapped = list(range(7, 7 + n))
        swapped[1], swapped[2] = swapped[2], swapped[1]
        runs = contiguous_runs(swapped, range(n))
        assert runs[:3] == [(7, 0, 1), (9, 1, 1), (8, 2, 1)] and sum(r[2] for r in runs) == n
    with pytest.raises((AssertionError, ValueError)):  # one destination per block, still
        contiguous_runs(range(7, 7 + n), range(n + 1))


@settings(max_examples=100, deadline=None)
@given(
    pairs=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 3)), min_size=block_copy.LONG, max_size=200
    )
)
def test_long_slot_lists_find_the_runs_a_loop_finds(pairs: list[tuple[int, int]]) -> None:
    # slots that mostly advance together (a step of 1 on both sides, from random jumps)
    src, dst, s, d = [], [], 0, 0
    for jump_s, jump_d in pairs:
        s, d = s + (1 if jump_s else 5), d + (1 if jump_d else 9)
        src.append(s)
        dst.append(d)
    pieces = [contiguous_runs(src[i : i + 8], dst[i : i + 8]) for i in range(0, len(src), 8)]
    joined: list[tuple[int, int, int]] = []
    for run in (r for piece in pieces for r in piece):  # the loop's runs of 8-slot pieces,
        if joined:  # rejoined where both sides go on
            s0, d0, n0 = joined[-1]
            if (s0 + n0, d0 + n0) == run[:2]:
                joined[-1] = (s0, d0, n0 + run[2])
                continue
        joined.append(run)
    assert contiguous_runs(src, dst) == joined


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s.name != "kernel"], ids=str)
def test_each_torch_strategy_copies_exactly_the_slots_asked(
    strategy: CopyStrategy, pattern: str
) -> None:
    src, dst = random_pool(), poisoned_pool()
    before = src.buffer.clone()
    src_slots, dst_slots = PATTERNS[pattern]
    strategy.copy(src.buffer, dst.buffer, src_slots, dst_slots)
    assert_copied(src.buffer, dst.buffer, src_slots, dst_slots)
    assert torch.equal(src.buffer.view(torch.int16), before.view(torch.int16))


def test_strategies_agree_on_a_random_permutation_of_every_slot() -> None:
    src = random_pool()
    perm = tuple(torch.randperm(SLOTS, generator=torch.Generator().manual_seed(3)).tolist())
    results = []
    for strategy in STRATEGIES[:2]:
        dst = poisoned_pool()
        strategy.copy(src.buffer, dst.buffer, tuple(range(SLOTS)), perm)
        assert_copied(src.buffer, dst.buffer, tuple(range(SLOTS)), perm)
        results.append(dst.buffer.view(torch.int16))
    assert torch.equal(results[0], results[1])


# -- the kernel, without CUDA -------------------------------------------------------------------


@pytest.mark.skipif(
    kernel_available(), reason="CUDA and CuPy are here: the GPU tests below cover the kernel"
)
def test_without_cuda_the_kernel_applies_nowhere_and_refuses_host_buffers() -> None:
    assert not kernel_applies("pinned", "cuda:0") and not kernel_applies("cuda:0", "cuda:0")
    assert [s.name for s in STRATEGIES if s.applies("cpu", "cpu")] == ["slices", "gather"]
    src, dst = random_pool(), poisoned_pool()
    with pytest.raises(InvalidArgumentError, match=r"from cpu to cpu; expected a CUDA buffer"):
        copy_blocks_kernel(src.buffer, dst.buffer, (0,), (0,))
    assert_copied(src.buffer, dst.buffer, (), ())


@pytest.mark.parametrize(
    ("src_slots", "dst_slots", "message"),
    [
        ((0, 16), (1, 2), r"source slot 16 is out of range; expected slots in \[0, 16\)"),
        ((0,), (-1,), r"destination slot -1 is out of range"),
        ((0, 1), (1,), r"2 source slots, 1 destination slots"),
    ],
)
def test_the_kernel_checks_its_slots_before_anything_else(
    src_slots: tuple[int, ...], dst_slots: tuple[int, ...], message: str
) -> None:
    src, dst = random_pool(), poisoned_pool()
    with pytest.raises(InvalidArgumentError, match=message):
        copy_blocks_kernel(src.buffer, dst.buffer, src_slots, dst_slots)


def test_the_kernel_refuses_blocks_of_another_shape_or_dtype() -> None:
    src = random_pool()
    other = torch.zeros((SLOTS, *LAYOUT.block_shape), dtype=torch.float32)
    with pytest.raises(InvalidArgumentError, match=r"of torch.float16 in src, .* torch.float32"):
        copy_blocks_kernel(src.buffer, other, (0,), (0,))
    with pytest.raises(InvalidArgumentError, match=r"expected a contiguous pool buffer"):
        copy_blocks_kernel(src.buffer, src.buffer.transpose(0, 1), (0,), (0,))


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found is None and Path("/usr/local/cuda/bin/nvcc").exists():
        found = "/usr/local/cuda/bin/nvcc"
    return found


@pytest.mark.skipif(
    _nvcc() is None,
    reason="nvcc is not on PATH nor at /usr/local/cuda/bin/nvcc: cannot compile CUDA C",
)
def test_the_cuda_source_compiles_for_hopper(tmp_path: Path) -> None:
    nvcc = _nvcc()
    assert nvcc is not None
    source, ptx = tmp_path / "block_copy.cu", tmp_path / "block_copy.ptx"
    source.write_text(BLOCK_COPY_CUDA)
    done = subprocess.run(
        [nvcc, "--ptx", "-arch=sm_90", "-o", str(ptx), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    text = ptx.read_text()
    for unit in KERNEL_UNITS:
        assert f".entry kvtier_copy_blocks_{unit}(" in text
    assert "ld.global.v4" in text  # the 16-byte kernel moves int4 vectors


# -- the planner --------------------------------------------------------------------------------


class FakeClock:
    """A clock that moves only when a fake strategy says its copy took time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def timed(name: str, clock: FakeClock, seconds_per_block: Callable[[int], float]) -> CopyStrategy:
    """A strategy that really copies (as `slices`) and costs `seconds_per_block(block_bytes)`."""

    def copy(
        src: torch.Tensor, dst: torch.Tensor, src_slots: Sequence[int], dst_slots: Sequence[int]
    ) -> None:
        block_copy.copy_blocks_slices(src, dst, src_slots, dst_slots)
        clock.now += len(src_slots) * seconds_per_block(src[0].numel() * src.element_size())

    return CopyStrategy(name, copy, applies_anywhere)


def test_the_planner_alternates_then_keeps_the_fastest_per_key() -> None:
    clock = FakeClock()
    strategies = [  # "a" wins on small blocks, "b" on large ones, "c" never
        timed("a", clock, lambda nbytes: 1.0 if nbytes < 1024 else 5.0),
        timed("b", clock, lambda nbytes: 2.0 if nbytes < 1024 else 3.0),
        timed("c", clock, lambda nbytes: 9.0),
    ]
    copier = BlockCopier(CopyPlanner(strategies, samples=2), clock)
    src, dst = random_pool(), poisoned_pool()
    big_layout = KVLayout("t", 2, 2, 64, "float16", 2)  # 2 KiB blocks
    big_src = SlotPool("big", big_layout, 4, CPU)
    big_dst = SlotPool("big2", big_layout, 4, CPU)

    used = [copier.copy(src.buffer, dst.buffer, (1, 5), (2, 9)) for _ in range(8)]
    assert used == ["a", "b", "c", "a", "b", "c", "a", "a"]  # 2 samples each, then the fastest
    assert_copied(src.buffer, dst.buffer, (1, 5), (2, 9))
    small = CopyKey("cpu", "cpu", LAYOUT.block_bytes, runs=2, blocks=2)
    assert copier.planner.choices == {small: "a"}

    used = [copier.copy(big_src.buffer, big_dst.buffer, (0, 1, 3), (3, 2, 0)) for _ in range(7)]
    assert used == ["a", "b", "c", "a", "b", "c", "b"]
    big = CopyKey("cpu", "cpu", big_layout.block_bytes, runs=4, blocks=4)  # 3 rounds up to 4
    assert copier.planner.choices == {small: "a", big: "b"}
    assert str(big) == "cpu->cpu 2048B runs<=4 blocks<=4"


def test_copies_of_another_scatter_are_another_key() -> None:
    clock = FakeClock()
    strategies = [timed("a", clock, lambda _: 1.0), timed("b", clock, lambda _: 2.0)]
    copier = BlockCopier(CopyPlanner(strategies, samples=1), clock)
    src, dst = random_pool(), poisoned_pool()
    assert [copier.copy(src.buffer, dst.buffer, (0, 1, 2, 3), (4, 5, 6, 7)) for _ in range(3)] == [
        "a",
        "b",
        "a",
    ]
    assert copier.copy(src.buffer, dst.buffer, (0, 2, 4, 6), (9, 7, 5, 3)) == "a"  # measured anew
    assert copier.copy(src.buffer, dst.buffer, (0, 2, 4, 6), (9, 7, 5, 3)) == "b"
    assert sorted((k.runs, k.blocks) for k in copier.planner.choices) == [(1, 4), (4, 4)]
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 9, 16, 17)] == [1, 2, 4, 4, 8, 16, 16, 32]


def test_a_key_with_one_candidate_is_decided_without_measuring() -> None:
    only_cuda = CopyStrategy("cuda only", block_copy.copy_blocks_slices, lambda s, d: s != "cpu")
    planner = CopyPlanner([STRATEGIES[0], only_cuda])
    key = CopyKey("cpu", "cpu", 128, 1, 1)
    pick = planner.pick(key)
    assert (pick.strategy.name, pick.measure) == ("slices", False)
    assert planner.choices == {key: "slices"}


def test_one_run_is_copied_as_one_slice_without_measuring_the_others() -> None:
    # a commit of fresh, consecutive slots: trying gather on it cost a second pass
    planner = CopyPlanner(STRATEGIES)
    one_run, two_runs = CopyKey("cpu", "cpu", 128, 1, 64), CopyKey("cpu", "cpu", 128, 2, 64)
    assert (planner.pick(one_run).strategy.name, planner.pick(one_run).measure) == (
        "slices",
        False,
    )
    assert planner.pick(two_runs).measure  # more runs: the candidates are measured


def test_samples_may_come_late_and_out_of_order() -> None:
    """As on CUDA streams: several copies are picked before the first sample is recorded."""
    a = CopyStrategy("a", block_copy.copy_blocks_slices, applies_anywhere)
    b = CopyStrategy("b", block_copy.copy_blocks_gather, applies_anywhere)
    planner = CopyPlanner([a, b], samples=1)
    key = CopyKey("cuda:0", "pinned", 1 << 21, 8, 8)
    picks = [planner.pick(key) for _ in range(3)]
    assert [(p.strategy.name, p.measure) for p in picks] == [("a", True), ("b", True), ("a", True)]
    planner.record(key, "b", seconds=0.4, blocks=8)
    assert planner.choices == {}  # "a" has no sample yet
    planner.record(key, "a", seconds=0.8, blocks=8)
    planner.record(key, "a", seconds=0.1, blocks=8)  # after the choice: ignored
    assert planner.choices == {key: "b"}
    assert planner.pick(key).measure is False


def test_the_inline_executor_moves_whole_blocks_through_its_planner() -> None:
    src, dst = random_pool("gpu"), poisoned_pool("host")
    executor = InlineExecutor()
    slots = [((i, (i + 5) % SLOTS), (15 - i, i)) for i in range(8)]  # 2 scattered blocks each
    for src_slots, dst_slots in slots:
        assert executor.run(Transfer(src, src_slots, dst, dst_slots)) == [True, True]
    copied_src = tuple(s for pair, _ in slots for s in pair)
    copied_dst = tuple(d for _, pair in slots for d in pair)
    assert_copied(src.buffer, dst.buffer, copied_src, copied_dst)
    key = CopyKey("cpu", "cpu", LAYOUT.block_bytes, runs=2, blocks=2)
    assert executor.copier.planner.choices[key] in {"slices", "gather"}  # 3 samples each: chosen


def test_a_layer_range_moves_as_slices_without_the_planner() -> None:
    src, dst = random_pool("gpu"), poisoned_pool("host")
    executor = InlineExecutor()
    executor.run(Transfer(src, (3, 9), dst, (0, 1), layers=(1, 2)))
    assert executor.copier.planner.choices == {}
    bits_src, bits_dst = src.buffer.view(torch.int16), dst.buffer.view(torch.int16)
    assert torch.equal(bits_dst[[0, 1], 1], bits_src[[3, 9], 1])
    assert bool((bits_dst[[0, 1], 0] == POISON).all())  # layer 0 untouched


# -- on a GPU with CuPy -------------------------------------------------------------------------

needs_kernel = pytest.mark.skipif(
    not kernel_available(),
    reason="needs CUDA and CuPy (torch.cuda.is_available() and `import cupy`)",
)


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
def test_the_kernel_copies_exactly_the_slots_asked_on_a_gpu(direction: str, pattern: str) -> None:
    cuda = torch.device("cuda", torch.cuda.current_device())
    src_device, dst_device = {"h2d": (CPU, cuda), "d2h": (cuda, CPU), "d2d": (cuda, cuda)}[
        direction
    ]
    src = random_pool("src", src_device, pinned=src_device == CPU)
    dst = poisoned_pool("dst", dst_device, pinned=dst_device == CPU)
    src_slots, dst_slots = PATTERNS[pattern]
    copy_blocks_kernel(src.buffer, dst.buffer, src_slots, dst_slots)
    torch.cuda.synchronize()
    assert_copied(src.buffer, dst.buffer, src_slots, dst_slots)


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("offset", [0, 2, 1])  # 16-byte, 2-byte and 1-byte units
def test_the_kernel_falls_back_to_narrower_units_when_misaligned(offset: int) -> None:
    cuda = torch.device("cuda", torch.cuda.current_device())
    block = 48
    raw_src = torch.randint(0, 256, (SLOTS * block + offset,), dtype=torch.uint8, device=cuda)
    raw_dst = torch.full((SLOTS * block + offset,), 7, dtype=torch.uint8, device=cuda)
    src = raw_src[offset:].view(SLOTS, block)
    dst = raw_dst[offset:].view(SLOTS, block)
    copy_blocks_kernel(src, dst, (3, 0, 15), (1, 2, 3))
    torch.cuda.synchronize()
    assert torch.equal(dst[[1, 2, 3]], src[[3, 0, 15]])
    assert bool((dst[[0, *range(4, SLOTS)]] == 7).all())


@pytest.mark.gpu
@needs_kernel
def test_the_cuda_executor_measures_slices_against_the_kernel() -> None:
    from kvtier.transfer import CudaExecutor

    cuda = torch.device("cuda", torch.cuda.current_device())
    host, gpu = random_pool("host", CPU, pinned=True), poisoned_pool("gpu", cuda)
    executor = CudaExecutor(cuda)
    src_slots, dst_slots = PATTERNS["scattered"]
    for _ in range(8):
        handle = executor.submit(Transfer(host, src_slots, gpu, dst_slots))
        assert handle.wait(10) and handle.result() == [True] * len(src_slots)
    executor.close()
    assert_copied(host.buffer, gpu.buffer, src_slots, dst_slots)
    key = CopyKey("pinned", str(cuda), LAYOUT.block_bytes, runs=8, blocks=8)
    assert executor.planner.choices[key] in {"slices", "kernel"}


def test_a_decided_copy_hands_its_strategy_the_runs_it_found() -> None:
    """`BlockCopier` finds a copy's runs for its key; a strategy that takes runs gets those
    rather than finding them again (a pass over the slots: 37 us for 63 blocks here)."""
    given: list[list[tuple[int, int, int]]] = []

    def by_runs(src: torch.Tensor, dst: torch.Tensor, runs: Sequence[tuple[int, int, int]]) -> None:
        given.append(list(runs))
        block_copy.copy_runs(src, dst, runs)

    def never(*args: object) -> None:
        raise AssertionError("the runs were known: copy_runs should have been called")

    strategy = CopyStrategy("runs", never, applies_anywhere, by_runs)
    copier = BlockCopier(CopyPlanner([strategy]))
    src, dst = random_pool(), poisoned_pool()
    src_slots, dst_slots = (0, 1, 2, 6, 7, 3), (9, 10, 11, 4, 5, 0)
    assert copier.copy(src.buffer, dst.buffer, src_slots, dst_slots) == "runs"
    assert given == [[(0, 9, 3), (6, 4, 2), (3, 0, 1)]]
    assert_copied(src.buffer, dst.buffer, src_slots, dst_slots)
