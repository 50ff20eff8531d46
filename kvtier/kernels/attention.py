"""The checked way to attend over a store's gpu pages: arguments and residency, then launch.

    attn = PagedAttention(store)
    lease = store.prefetch(tokens)                      # READY: its pages stay put while it lives
    out = attn.decode(q, layer, [lease])                # q [batch, q_heads, head_dim]
    out = attn.decode_table(q, layer, table, seq_lens)  # an engine's own block table
    out = attn.extend(q, k_new, v_new, layer, [lease], new_lens)
    store.release(lease)                                # after the kernel has finished

Contract:
- Leases: a list (or tuple) of leases made by this store (a lease of another is a
  `LeaseError` naming it: its slots are slot numbers of another pool), each READY.
- Residency: every slot a launch will read (the first ceil(len / block_tokens) entries of each
  row) must be covered by a READY lease that is live now; else `ResidencyError` names the
  sequence, the position and the slot, and nothing is launched. A slot that was never leased,
  was released, expired, was freed or demoted, fails. Checked just before the launch in the
  store's residency view (`transfer/leasing.py`: a lookup per slot, without the store's
  lock); the caller keeps its leases until the kernel is done (on CUDA the launch returns
  before it is).
- Arguments: shapes, dtypes (q, k and v in the pool's dtype), devices, strides (q, k_new and
  v_new each with a contiguous last dimension; any other strides, each tensor read by its
  own), head counts (query heads a positive multiple of kv heads), the softmax scale (None or a
  finite number > 0), lengths (integers >= 1, within the block
  table, at most 2**31 - 1), the slots a launch reads of an engine's table (in the pool,
  before the table becomes int32, which would wrap 2**32 + s onto slot s) are checked first,
  each failure an `InvalidArgumentError` naming the value and what was expected.
- Dispatch: the Triton kernels (`paged_attention.py`) on CUDA tensors, and on CPU tensors under
  Triton's interpreter; the torch reference otherwise (a CPU without `TRITON_INTERPRET=1`, or no
  Triton), so every path runs everywhere. `backend` says which.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtier.errors import InvalidArgumentError, LeaseError, ResidencyError, shown
from kvtier.kernels import paged_attention as kernels
from kvtier.results import Lease

if TYPE_CHECKING:
    from kvtier.store import KVStore

INT32_MAX = 2**31 - 1
"""The kernels take lengths and slots as int32: a larger value is refused, never wrapped."""

FLOAT_MAX = 3.4e38
"""About fp32's largest: a larger softmax scale (an int past a float's range too) is refused."""


class PagedAttention:
    def __init__(self, store: KVStore) -> None:
        self.residency = store.residency  # read without the store's lock
        self.buffer = store.gpu_pool.buffer
        self.layout = store.layout
        self.canceller = store.cancel  # a lease made by `store` cancels through it

    @property
    def backend(self) -> str:
        """'triton' or 'reference': what a launch on this pool's device runs."""
        on_cuda = self.buffer.device.type == "cuda"
        if kernels.available() and (on_cuda or kernels.INTERPRETED):
            return "triton"
        return "reference"

    # ---- decode ---------------------------------------------------------------------------

    def decode(
        self,
        q: torch.Tensor,
        layer: int,
        leases: Sequence[Lease],
        seq_lens: Sequence[int] | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """One query token per lease, over its leased prefix (or the first `seq_lens[b]`
        tokens of it)."""
        table, lens = self._from_leases(leases, seq_lens)
        return self.decode_table(q, layer, table, lens, scale)

    def decode_table(
        self,
        q: torch.Tensor,
        layer: int,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Decode over an engine's own block table `[batch, max_blocks]` (int32 or int64 slot
        ids) and `seq_lens` `[batch]`; q `[batch, q_heads, head_dim]`."""
        self._check_q(q, "q", 3)
        self._check_layer(layer)
        scale = _check_scale(scale)
        table, lens = self._check_table(block_table, seq_lens, q.shape[0])
        self._check_resident(table, lens)
        table, lens = table.to(self.buffer.device), lens.to(self.buffer.device)
        if self.backend == "triton":
            return kernels.paged_decode(q, self.buffer, layer, table, lens, scale)
        return kernels.paged_decode_reference(q, self.buffer, layer, table, lens, scale)

    # ---- extend ---------------------------------------------------------------------------

    def extend(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        layer: int,
        leases: Sequence[Lease],
        new_lens: Sequence[int],
        scale: float | None = None,
    ) -> torch.Tensor:
        """New tokens after each lease's prefix: `new_lens[b]` of them per lease, packed in
        order in q `[total, q_heads, head_dim]` and k/v `[total, kv_heads, head_dim]`; each
        attends to the whole leased prefix and causally to the new tokens."""
        table, prefix = self._from_leases(leases, None, allow_empty=True)
        self._check_q(q, "q", 3)
        self._check_layer(layer)
        scale = _check_scale(scale)
        new = _lengths(new_lens, "new_lens", len(leases))
        total = int(new.sum())
        kv_shape = (total, self.layout.num_kv_heads, self.layout.head_dim)
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            if not isinstance(t, torch.Tensor):
                raise InvalidArgumentError(
                    f"{name}: got {shown(t)}, expected a {q.dtype} tensor {kv_shape}"
                )
            if tuple(t.shape) != kv_shape or t.dtype != q.dtype or t.device != q.device:
                raise InvalidArgumentError(
                    f"{name}: got {tuple(t.shape)} {t.dtype} on {t.device}, expected "
                    f"{kv_shape} {q.dtype} on {q.device}"
                )
            if t.stride(-1) != 1:
                raise InvalidArgumentError(f"{name}: its last dimension must be contiguous")
        if q.shape[0] != total:
            raise InvalidArgumentError(
                f"q: got {q.shape[0]} tokens, expected sum(new_lens) = {total}"
            )
        self._check_resident(table, prefix)
        device = self.buffer.device
        args = (table.to(device), prefix.to(device), new.to(device))
        if self.backend == "triton":
            return kernels.paged_extend(q, k_new, v_new, self.buffer, layer, *args, scale)
        return kernels.paged_extend_reference(q, k_new, v_new, self.buffer, layer, *args, scale)

    # ---- checks ---------------------------------------------------------------------------

    def _from_leases(
        self, leases: Sequence[Lease], seq_lens: Sequence[int] | None, allow_empty: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(leases, Sequence):  # a lone Lease, a generator
            raise InvalidArgumentError(
                f"leases: got {shown(leases)}, expected a list of leases, one per sequence"
            )
        if not leases:
            raise InvalidArgumentError("leases: got none, expected one lease per sequence")
        for b, lease in enumerate(leases):
            if not isinstance(lease, Lease):
                raise InvalidArgumentError(f"leases[{b}]: got {shown(lease)}, expected a Lease")
            if not lease.made_by(self.canceller):
                raise LeaseError(
                    f"leases[{b}]: lease {lease.lease_id} was made by another store, expected "
                    "one of the store this PagedAttention reads (its slots name other pages)"
                )
            if not lease.ready():
                raise ResidencyError(
                    f"leases[{b}]: lease {lease.lease_id} is {lease.state.value}, expected "
                    "ready (wait for it before reading its pages)"
                )
        if seq_lens is None:
            lens = torch.tensor([lease.num_tokens for lease in leases], dtype=torch.int32)
        else:  # a caller's: a count, a type or a size past int32 refused, never cast
            lens = _lengths(seq_lens, "seq_lens", len(leases), least=0)
        for b, lease in enumerate(leases):
            if int(lens[b]) > lease.num_tokens or (int(lens[b]) < 1 and not allow_empty):
                raise InvalidArgumentError(
                    f"seq_lens[{b}]: got {int(lens[b])}, expected 1..{lease.num_tokens} "
                    f"(the tokens lease {lease.lease_id} covers)"
                )
        width = max(1, max(len(lease.block_table) for lease in leases))
        table = torch.zeros((len(leases), width), dtype=torch.int32)
        for b, lease in enumerate(leases):
            table[b, : len(lease.block_table)] = torch.tensor(lease.block_table, dtype=torch.int32)
        return table, lens

    def _check_q(self, q: torch.Tensor, name: str, dims: int) -> None:
        kv_heads, dim = self.layout.num_kv_heads, self.layout.head_dim
        if not (
            isinstance(q, torch.Tensor)
            and q.dim() == dims
            and q.shape[-1] == dim
            and q.shape[1] > 0  # no query head: nothing to launch a program for
            and q.shape[1] % kv_heads == 0
        ):
            raise InvalidArgumentError(
                f"{name}: got {_describe(q)}, expected [n, q_heads, {dim}] with q_heads a "
                f"multiple of {kv_heads} kv heads"
            )
        if q.dtype != self.buffer.dtype or q.device != self.buffer.device:
            raise InvalidArgumentError(
                f"{name}: got {q.dtype} on {q.device}, expected {self.buffer.dtype} on "
                f"{self.buffer.device} (the gpu pool's)"
            )
        if q.stride(-1) != 1:
            raise InvalidArgumentError(f"{name}: its last dimension must be contiguous")

    def _check_layer(self, layer: int) -> None:
        if type(layer) is not int or not 0 <= layer < self.layout.num_layers:
            raise InvalidArgumentError(
                f"layer: got {shown(layer)}, expected an int in [0, {self.layout.num_layers})"
            )

    def _check_table(
        self, block_table: torch.Tensor, seq_lens: torch.Tensor, batch: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if (
            not isinstance(block_table, torch.Tensor)
            or block_table.dim() != 2
            or block_table.shape[0] != batch
            or block_table.dtype not in (torch.int32, torch.int64)
        ):
            raise InvalidArgumentError(
                f"block_table: got {_describe(block_table)}, expected an int32 or int64 tensor "
                f"[{batch}, max_blocks]"
            )
        lens = _lengths(seq_lens, "seq_lens", batch)
        bt, num_slots = self.layout.block_tokens, self.buffer.shape[0]
        table = block_table.to("cpu")
        for b in range(batch):
            if int(lens[b]) > block_table.shape[1] * bt:
                raise InvalidArgumentError(
                    f"seq_lens[{b}]: got {int(lens[b])}, expected at most "
                    f"{block_table.shape[1] * bt} ({block_table.shape[1]} blocks in the table)"
                )
        # the entries a launch reads, checked before int32 (2**32 + s is not slot s); the
        # padding past a sequence's blocks is never read
        read = torch.arange(table.shape[1])[None, :] < (lens[:, None].long() + bt - 1) // bt
        outside = read & ((table < 0) | (table >= num_slots))
        if bool(outside.any()):
            b, position = (int(i) for i in outside.nonzero()[0])
            raise InvalidArgumentError(
                f"block_table[{b}, {position}]: got slot {int(table[b, position])}, expected a "
                f"gpu slot in [0, {num_slots})"
            )
        return table.to(torch.int32).contiguous(), lens

    def _check_resident(self, table: torch.Tensor, lens: torch.Tensor) -> None:
        bt = self.layout.block_tokens
        for b in range(table.shape[0]):
            used = -(-int(lens[b]) // bt)
            slots = table[b, :used].tolist()
            slot = self.residency.uncovered(slots)
            if slot is not None:
                position = slots.index(slot)
                raise ResidencyError(
                    f"sequence {b}, block {position}: gpu slot {slot} is not covered by a "
                    "live ready lease (never leased, released, expired, freed or demoted); "
                    "prefetch the prefix and wait for its lease"
                )


def _lengths(
    values: Sequence[int] | torch.Tensor, name: str, batch: int, least: int = 1
) -> torch.Tensor:
    """`batch` lengths in [least, INT32_MAX] as a contiguous int32 tensor, or
    `InvalidArgumentError` naming `name` (strings, bools, floats, an integer past int64)."""
    try:
        lens = torch.as_tensor(values).to("cpu")
    except (TypeError, ValueError, RuntimeError, OverflowError):  # "3", [[1], 2], 2**70
        lens = None
    if (
        lens is None
        or lens.dim() != 1
        or lens.shape[0] != batch
        or lens.dtype.is_floating_point
        or lens.dtype.is_complex
        or lens.dtype == torch.bool
    ):
        raise InvalidArgumentError(
            f"{name}: got {_describe(values)}, expected {batch} integer lengths"
        )
    if batch and (int(lens.min()) < least or int(lens.max()) > INT32_MAX):
        raise InvalidArgumentError(
            f"{name}: got {lens.tolist()!r:.80}, expected every length >= {least} and <= "
            f"{INT32_MAX}"
        )
    # checked first: 2**31 would wrap to a negative length; contiguous, as the kernels read it
    return lens.to(torch.int32).contiguous()


def _check_scale(scale: object) -> float | None:
    """None (1/sqrt(head_dim)) or a finite number > 0 (a NumPy or 0-d tensor one too), as the
    float the kernels take as an fp32 factor of every score (a string failed inside the
    launch, a NaN made every output NaN)."""
    if scale is None:
        return None
    value = math.nan
    scalar = getattr(scale, "ndim", 0) == 0  # (float() takes a tensor or an array [0.5])
    if scalar and not isinstance(scale, (str, bytes, bool, np.bool_)):  # (float("2") is 2.0)
        with contextlib.suppress(TypeError, ValueError, OverflowError, RuntimeError):
            value = float(scale)  # type: ignore[arg-type]
    if not 0 < value <= FLOAT_MAX:  # (an fp32 factor: past it, every score inf; nan fails)
        raise InvalidArgumentError(
            f"scale: got {shown(scale)}, expected None or a finite number > 0"
        )
    return value


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return shown(value)
