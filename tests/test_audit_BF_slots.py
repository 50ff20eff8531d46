"""Audit BF: the slot lists of a slice copy and of the copy planner, refused as `gather` and the
kernel refuse them; the device stage, used only for host views of few pieces.

Each test failed before its fix: `copy_blocks_slices` copied slot 1 for a bool slot, truncated
64 float slots to other slots (NumPy's `dtype=int64`) and copied them, wrote a destination named
twice twice (the last copy won, where `gather` refuses), and raised a `TypeError` or a
`RuntimeError` for a float, a string or a NumPy slot past int64; `BlockCopier.copy` failed a
tensor of slots `[0]` ("a copy of no blocks") and unequal counts with a `ValueError`, and took
the `TypeError` of a float slot for a strategy torch cannot run: `slices` was retired for that
kind of copy for good, every later copy went through `gather`; a load from a CUDA pool into
a host `out[..., ::2]` was staged as one memcpy per element.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvtier.blocks import blocks_of
from kvtier.errors import InvalidArgumentError
from kvtier.kernels import staged
from kvtier.kernels.block_copy import copy_blocks_gather, copy_blocks_kernel, copy_blocks_slices
from kvtier.transfer.planner import BlockCopier


def buffers(slots: int = 80) -> tuple[torch.Tensor, torch.Tensor]:
    """A source of distinct blocks and an empty destination, `slots` blocks of 2x3 each."""
    return torch.arange(slots * 6, dtype=torch.float32).view(slots, 2, 3), torch.zeros(slots, 2, 3)


HOSTILE: list[tuple[Any, Any, str]] = [
    ([True], [0], "source slot True is not an integer"),
    ([0], [False], "destination slot False is not an integer"),
    ([i + 0.5 for i in range(64)], list(range(64)), "source slot 0.5 is not an integer"),
    ([0.5, 3], [1, 2], "source slot 0.5 is not an integer"),
    ([*range(63), True], list(range(64)), "source slot True is not an integer"),
    (list(range(64)), [*range(1, 64), np.bool_(False)], "destination slot np.False_ is not"),
    (["1"], [0], "source slot '1' is not an integer"),
    ([0, None], [0, 1], "source slot None is not an integer"),
    (torch.tensor([[1]]), [0], r"source slot tensor\(\[1\]\) is not an integer"),
    (np.array([2**63 - 1]), [0], "source slots 9223372036854775807.* out of range"),
    ([0, 1], [2, 2], "destination slot 2 is named twice"),
    ([0, 1, 2, 3], [5, 6, 7, 6], "destination slot 6 is named twice"),
    (list(range(70)), [*range(69), 3], "destination slot 3 is named twice"),
]


@pytest.mark.parametrize(("src_slots", "dst_slots", "message"), HOSTILE)
def test_every_strategy_refuses_the_same_slots_typed_and_copies_nothing(
    src_slots: Any, dst_slots: Any, message: str
) -> None:
    for copy in (copy_blocks_slices, BlockCopier().copy):
        src, dst = buffers()
        with pytest.raises(InvalidArgumentError, match=message):
            copy(src, dst, src_slots, dst_slots)
        assert not dst.any(), f"{copy} wrote before refusing"
    src, dst = buffers()
    with pytest.raises(InvalidArgumentError):  # (gather refused them all already)
        copy_blocks_gather(src, dst, src_slots, dst_slots)


def test_a_refused_float_slot_does_not_retire_the_slice_strategy() -> None:
    copier = BlockCopier()
    src, dst = buffers()
    with pytest.raises(InvalidArgumentError, match="not an integer"):
        copier.copy(src, dst, [0.5, 3], [1, 2])  # type: ignore[list-item]
    used = set()
    for _ in range(8):  # the same kind of copy (2 runs, 2 blocks): measured, then chosen
        used.add(copier.copy(src, dst, [0, 3], [1, 2]))
        assert torch.equal(dst[1], src[0]) and torch.equal(dst[2], src[3])
    assert "slices" in used  # was: gather only, slices refused for this key for good


def test_the_copier_takes_slot_arrays_and_refuses_unequal_counts_typed() -> None:
    copier = BlockCopier()
    src, dst = buffers()
    copier.copy(src, dst, torch.tensor([0]), torch.tensor([5]))  # type: ignore[arg-type]
    assert torch.equal(dst[5], src[0])  # was: AssertionError "a copy of no blocks"
    copier.copy(src, dst, np.array([7, 9]), np.array([1, 2]))  # type: ignore[arg-type]
    assert torch.equal(dst[1], src[7]) and torch.equal(dst[2], src[9])
    before = dst.clone()
    with pytest.raises(InvalidArgumentError, match="one destination slot per block"):
        copier.copy(src, dst, [0, 1], [3])  # was: ValueError from zip()
    with pytest.raises(InvalidArgumentError, match="one destination slot per block"):
        copier.copy(src, dst, list(range(70)), list(range(69)))  # was: AssertionError
    assert torch.equal(dst, before)


def test_long_integer_slot_lists_of_any_kind_still_copy_exactly() -> None:
    """The NumPy pass over long lists takes integer arrays (int32, uint8, tensors) as before."""
    src, _ = buffers(200)
    order = torch.randperm(200, generator=torch.Generator().manual_seed(1))[:100]
    kinds: list[Any] = [list, np.array, torch.tensor, lambda s: np.array(s, dtype=np.uint8)]
    for kind in kinds:
        for copy in (copy_blocks_slices, BlockCopier().copy):
            dst = torch.zeros(200, 2, 3)
            copy(src, dst, kind(order.tolist()), kind(list(range(100, 200))))
            assert torch.equal(dst[100:], src[order]) and not dst[:100].any()


# ---- the device stage: only for host views of few pieces ------------------------------------


def test_the_stage_is_for_host_views_of_few_pieces_not_one_memcpy_an_element() -> None:
    """`staged` moves each contiguous piece of a host view with one memcpy: a layer-major view
    (or any permutation of a dense tensor) is `L * 2` pieces a run; `out[..., ::2]` was one an
    element (4M memcpys for 8 MiB of KV), now left to `copy_`."""
    L, T, H, D, n = 3, 4, 2, 5, 6
    few = {
        "layer-major": torch.empty(L, 2, n * T, H, D),
        "permuted": torch.empty(D, H, n * T, 2, L).permute(4, 3, 2, 1, 0),
        "tokens sliced": torch.empty(L, 2, n * T + 3, H, D)[:, :, 3:],
    }
    many = {
        "every other element": torch.empty(L, 2, n * T, H, 2 * D)[..., ::2],
        "half of each row": torch.empty(L, 2, n * T, H, 2 * D)[..., :D],
    }
    for name, out in {**few, **many}.items():
        assert staged.few_pieces(blocks_of(out, T, 0, n)) == (name in few), name
    assert staged.few_pieces(torch.empty(2 * n, L, 2, T, H, D)[::2])  # every other page
    assert not staged.few_pieces(torch.empty(n, L, 2, T, H, 2 * D)[..., ::2])


def test_the_kernel_refuses_a_slot_read_and_written_in_shared_memory_before_its_launch() -> None:
    """The kernel's blocks run in any order: within one buffer, `[0, 1] -> [1, 2]` read slot 1
    while another block wrote it (gather reads all first, slices refuse the overlap). Checked
    before the media, so on the CPU too; slots apart within one buffer are not refused."""
    pool = torch.arange(24.0).view(6, 4)
    for dst, src_slots, dst_slots in ((pool, [0, 1], [1, 2]), (pool[1:], [0], [3])):
        with pytest.raises(InvalidArgumentError, match="share memory and a slot is read"):
            copy_blocks_kernel(pool, dst, src_slots, dst_slots)
    with pytest.raises(InvalidArgumentError, match="expected a CUDA buffer"):  # apart: on
        copy_blocks_kernel(pool, pool, [0, 1], [2, 3])
    assert torch.equal(pool, torch.arange(24.0).view(6, 4))
