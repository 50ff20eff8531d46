"""The slot lists of a block copy (`block_copy.py`), checked before anything is copied: one
destination per source, every slot an integer in its buffer, no destination named twice.

A slot is a Python int (one pass over a list of them), or a NumPy or torch integer
(`operator.index`); a float would truncate to another slot, a bool is no slot. Every refusal is
an `InvalidArgumentError` naming the slot and the range expected. A slice copy checks the runs
of its slots instead (`check_runs`, O(runs)): the same refusals, so that every strategy takes
and refuses the same slots (a planner that meets a refusal passes it on, and one strategy's
`TypeError` on a float slot would have retired that strategy for good).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import operator
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from kvtier.errors import InvalidArgumentError, shown


def check_counts(src_slots: Sequence[int], dst_slots: Sequence[int]) -> None:
    """`InvalidArgumentError` unless there is one destination slot per source slot."""
    if len(src_slots) != len(dst_slots):
        raise InvalidArgumentError(
            f"block copy: {len(src_slots)} source slots, {len(dst_slots)} destination slots; "
            "expected one destination slot per block"
        )


def integer(value: object) -> int | None:
    """`value` as an int if it is an integer of any kind (Python, NumPy, a 0-d torch tensor:
    `operator.index`), None for anything else, a float, a bool or a tensor of one element
    and more dimensions (which `operator.index` takes: `[torch.tensor([3])]` was slot 3)
    included."""
    if isinstance(value, (bool, np.bool_)) or getattr(value, "dtype", 0) == torch.bool:
        return None
    if isinstance(value, torch.Tensor) and value.dim() != 0:
        return None
    with contextlib.suppress(TypeError, ValueError, RuntimeError):
        return operator.index(value)  # type: ignore[arg-type]
    return None


def check_slots(src_slots: Sequence[int], dst_slots: Sequence[int], src: int, dst: int) -> None:
    """`InvalidArgumentError` for unequal counts, the first slot not an integer (a float would
    truncate to another slot) in `[0, src)` (sources) or `[0, dst)` (destinations), or a
    destination slot named twice (two writes to one slot in one launch race). A 1-D NumPy
    array or tensor of an integer dtype is checked whole (its elements one by one took 4 to 15
    us each: 1.5 s for 100k slots)."""
    check_counts(src_slots, dst_slots)
    dst_array = _integer_array(dst_slots)
    sides = (("source", src_slots, _integer_array(src_slots), src),
             ("destination", dst_slots, dst_array, dst))  # fmt: skip
    for name, slots, array, limit in sides:
        if array is not None:  # checked whole
            bad = np.flatnonzero((array < 0) | (array >= limit))
            if bad.size:
                raise InvalidArgumentError(
                    f"block copy: {name} slot {int(array[bad[0]])} is out of range; "
                    f"expected slots in [0, {limit})"
                )
            continue
        for slot in (odd := [s for s in slots if type(s) is not int or not 0 <= s < limit]):
            number = integer(slot)
            if number is None or not 0 <= number < limit:
                what = "is out of range" if number is not None else "is not an integer"
                raise InvalidArgumentError(
                    f"block copy: {name} slot {shown(slot)} {what}; expected slots in [0, {limit})"
                )
    if dst_array is not None:
        if np.unique(dst_array).size == dst_array.size:
            return
        named: Sequence[int] = dst_array.tolist()
    else:  # `odd`: the destinations' (the last side): tensors hash by id, so as ints
        named = [operator.index(s) for s in dst_slots] if odd else dst_slots
    if len(set(named)) != len(named):
        slot = collections.Counter(named).most_common(1)[0][0]
        raise InvalidArgumentError(
            f"block copy: destination slot {slot} is named twice; expected distinct slots"
        )


def _integer_array(slots: object) -> np.ndarray | None:
    """`slots` as a NumPy array when it is a 1-D array or tensor of an integer dtype (a
    tensor's on the CPU), else None: a list, or anything to check slot by slot."""
    if isinstance(slots, torch.Tensor):
        if slots.dim() != 1 or slots.dtype.is_floating_point or slots.dtype.is_complex:
            return None
        if slots.dtype == torch.bool:
            return None
        return slots.detach().cpu().numpy()
    if isinstance(slots, np.ndarray) and slots.ndim == 1 and slots.dtype.kind in "iu":
        return slots
    return None


Run = tuple[int, int, int]
"""(src_start, dst_start, length): `length` slots consecutive on both sides."""


def check_runs(runs: Sequence[Run], src_slots: int, dst_slots: int) -> None:
    """`InvalidArgumentError` naming the first run whose ends are not integers (`integer`: a
    bool was slot 1, a float a `TypeError` inside the copy) or leave `[0, src_slots)` or `[0,
    dst_slots)`, or a destination slot that two runs name. A slice does not fail there:
    `buffer[-2:-1]` is another slot, `buffer[s:s+n]` past the end is a shorter view (nothing
    copied into it, or one block broadcast over the rest), a slot named twice is written twice
    (the last copy wins, where `gather` and the kernel refuse): so a slice copy checks its runs
    first. O(runs): a run's slots lie between its ends (O(runs log runs) for the repeats)."""
    for s, d, n in runs:
        if type(s) is not int or type(d) is not int:  # NumPy or torch integers: as ints
            s, d = slot_number(s, "source"), slot_number(d, "destination")
        if s < 0 or d < 0 or s + n > src_slots or d + n > dst_slots:
            source = s < 0 or s + n > src_slots
            name, first, limit = (
                ("source", s, src_slots) if source else ("destination", d, dst_slots)
            )
            raise InvalidArgumentError(
                f"block copy: {name} slots {first}..{first + n - 1} are out of range; expected "
                f"slots in [0, {limit})"
            )
    if len(runs) > 1 and not _apart(runs):
        ends = sorted(runs, key=operator.itemgetter(1))  # by destination: the first repeat
        slot = next(after for (_, d, n), (_, after, _) in itertools.pairwise(ends) if d + n > after)
        raise InvalidArgumentError(
            f"block copy: destination slot {slot} is named twice; expected distinct slots"
        )


def _apart(runs: Sequence[Run]) -> bool:
    """Whether no destination slot is in two of `runs`: a set of their starts where every run
    is one block (scattered slots: 25 us for 1000 runs, a sort 220), else sorted by start."""
    if len({d for _, d, _ in runs}) < len(runs):
        return False
    if all(n == 1 for _, _, n in runs):
        return True
    ends = sorted(runs, key=operator.itemgetter(1))
    return all(d + n <= after for (_, d, n), (_, after, _) in itertools.pairwise(ends))


def slot_number(slot: object, name: str) -> int:
    """`slot` (a run's first, or any one) as an int, or `InvalidArgumentError` naming it."""
    number = integer(slot)
    if number is None:
        raise InvalidArgumentError(
            f"block copy: {name} slot {shown(slot)} is not an integer; expected a slot number"
        )
    return number


def holds_bool(slots: Iterable[object]) -> bool:
    """Whether a list (an array's dtype says) holds a bool: ~16 us for 1000 slots."""
    if isinstance(slots, (np.ndarray, torch.Tensor)):
        return False
    return any(issubclass(kind, (bool, np.bool_)) for kind in set(map(type, slots)))


def int_arrays(src: Sequence[int], dst: Sequence[int]) -> tuple[np.ndarray, np.ndarray] | None:
    """Both slot lists as int64 arrays of one shape, or None for anything else: a list of
    floats or bools, which `dtype=np.int64` truncated to other slots (`[0.5, 1.5]` was `[0,
    1]`; a `True` among ints was slot 1), is left to the loop, whose runs keep them for
    `check_runs` to refuse."""
    with contextlib.suppress(TypeError, ValueError, OverflowError, RuntimeError):
        froms, tos = np.asarray(src), np.asarray(dst)
        if _fits_int64(froms) and _fits_int64(tos) and froms.shape == tos.shape:
            if holds_bool(src) or holds_bool(dst):
                return None
            return froms.astype(np.int64), tos.astype(np.int64)
    return None


def _fits_int64(array: np.ndarray) -> bool:
    """1-D, of an integer dtype whose every value int64 holds (a uint64 may not: the loop)."""
    kind, width = array.dtype.kind, array.dtype.itemsize
    return array.ndim == 1 and (kind == "i" or (kind == "u" and width < 8))
