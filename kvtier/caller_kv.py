"""The caller's KV tensors as the store's blocks: the two layouts that `store`, `load` and the
clients take, checked, and seen as block views without a copy.

    "layers"  [num_layers, 2, tokens, kv_heads, head_dim]                 (the default)
    "blocks"  [blocks, num_layers, 2, block_tokens, kv_heads, head_dim]   (pages: the pools'
              own layout, for an engine whose buffer is block-major)

    caller's tensor ──blocks_view (no copy)──► [n, *block_shape], strided for "layers"
                                                 │
    pool slots ◄──── one copy_ per run of slots ─┘ (`kernels.block_copy.copy_blocks_slices`)

Why: a load that gathers slots into a block-major temporary, transposes it to layer-major and
hands back a freshly allocated tensor passes over the bytes three times (issue 19: 1.40 GB/s
where one `clone` of the same bytes runs at 5.1). Copying each run of slots straight into the
caller's memory, whatever its layout, is one pass; a store reads the caller's tensor into its
slots the same way. Within one (layer, K|V) a block's tokens are contiguous in both layouts, so
a strided copy moves rows of `block_tokens * kv_heads * head_dim` elements and runs near the
speed of a flat copy.

Contract:
- `kv_layout(name)` is the name if it is one of `LAYOUTS`, else `InvalidArgumentError`.
- `check_kv_as(layout, kv, kind, num_tokens)`: the KV of `num_tokens` tokens in `kind`, else
  `InvalidKVError` naming what was expected: a dense tensor in CPU or CUDA memory
  (`check_memory`: a "meta", sparse or nested tensor, which no copy can read, is refused before
  a slot is taken); "layers" exactly as `blocks.check_kv`; "blocks" one page per block, a last
  partly filled page allowed (its tokens are not stored).
- `check_out(layout, out, kind, num_tokens, device, pools)`: a destination for the cached
  prefix of a prompt of `num_tokens` tokens: a tensor of the layout's dtype in `kind`'s shape
  with room for every full block of the prompt (more tokens or pages are left as they are), on
  `device` when one is named, in memory the store can copy into (`check_memory`) and write in place
  (`check_writable`: no grad, no inference tensor outside inference mode, no elements that
  share memory), and apart from the store's own pools (`check_apart`: a view of a pool's
  buffer is refused); else `InvalidKVError` / `InvalidArgumentError`, before anything is read
  or written. A store's `kv` is only read: an `expand()`ed one is fine.
- `blocks_view(kv, kind, block_tokens, count)` is a `[count, *block_shape]` view of the first
  `count` blocks of `kv`, detached from autograd (a store keeps values, never a graph): writes
  into it land in `kv`.
- `prefix_of(out, kind, count, block_tokens)` is the part of `out` that holds `count` blocks.
- `new_kv(layout, kind, count, device)` is an uninitialized tensor of `count` blocks in `kind`.
- `store_blocks(layout, key, kv, start, kind, pools)`: a store's KV checked (`check_start`,
  `check_kv_as`): the first block it holds and its full blocks as a view, copied first when
  `kv` shares memory with one of the store's `pools` (the store may write new blocks into the
  very slots it reads).
- `Destination.of(layout, kind, asked, out, device, default, pools)`: where one load writes,
  `out` checked first. `blocks(count)` is asked once, when the prefix's length is known: a view of
  `out`, or of a tensor made then on `device` (else `default`; no allocation before the count,
  none when `out` is given). `result(count)` is what the load returns, the part holding the
  first `count` blocks (fewer than asked when a disk copy failed verification on the way;
  then a view of the tensor made for the whole prefix).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Literal

import torch

from kvtier.blocks import TOKEN_NBYTES, KVLayout, blocks_of, check_kv, check_start
from kvtier.errors import InvalidArgumentError, InvalidKVError
from kvtier.tiers.pool import SlotPool

KVKind = Literal["layers", "blocks"]
LAYOUTS: tuple[KVKind, ...] = ("layers", "blocks")


def kv_layout(name: object) -> KVKind:
    """`name` as a KV layout, or `InvalidArgumentError` naming it."""
    if name == "layers":
        return "layers"
    if name == "blocks":
        return "blocks"
    raise InvalidArgumentError(f"layout: got {name!r}, expected one of {list(LAYOUTS)}")


def check_kv_as(layout: KVLayout, kv: object, kind: KVKind, num_tokens: int) -> None:
    """`InvalidKVError` unless `kv` is the KV of `num_tokens` tokens in `kind` (module doc)."""
    check_memory(kv, "kv")
    if kind == "layers":
        check_kv(layout, kv, num_tokens)
        return
    if not isinstance(kv, torch.Tensor):
        raise InvalidKVError(f"kv: got {type(kv).__name__}, expected a torch.Tensor")
    if kv.dtype != layout.dtype:
        raise InvalidKVError(f"kv: got dtype {kv.dtype}, expected {layout.dtype}")
    full, pages = num_tokens // layout.block_tokens, -(-num_tokens // layout.block_tokens)
    if kv.dim() != 6 or tuple(kv.shape[1:]) != layout.block_shape or not full <= len(kv) <= pages:
        want = f"[{full}{'' if full == pages else f' or {pages}'}, *{list(layout.block_shape)}]"
        raise InvalidKVError(
            f"kv: got shape {tuple(kv.shape)}, expected {want} = [pages of {num_tokens} tokens, "
            "num_layers, 2, block_tokens, num_kv_heads, head_dim] (layout 'blocks')"
        )


COPYABLE = ("cpu", "cuda")
"""The devices whose memory the store copies blocks from and into."""


def check_memory(tensor: object, name: str) -> None:
    """`InvalidKVError` for a tensor whose memory the store cannot copy (another device than
    `COPYABLE`, e.g. "meta", which has no data; a sparse or other non-strided layout; a nested
    tensor), named `name`; anything else is left to the type, dtype and shape checks."""
    if not isinstance(tensor, torch.Tensor):
        return
    if tensor.device.type not in COPYABLE or tensor.layout != torch.strided or tensor.is_nested:
        form = "a nested tensor" if tensor.is_nested else "a tensor"
        raise InvalidKVError(
            f"{name}: got {form} on device {str(tensor.device)!r} in layout {tensor.layout}, "
            "expected a strided (dense) tensor in 'cpu' or 'cuda' memory"
        )


def check_out(
    layout: KVLayout,
    out: object,
    kind: KVKind,
    num_tokens: int,
    device: torch.device | None,
    pools: Mapping[str, torch.Tensor] = MappingProxyType({}),
) -> torch.Tensor:
    """`out` checked as a destination for the cached prefix of `num_tokens` tokens, apart from
    the buffers of `pools` (a tier name -> its pool's buffer; module doc)."""
    if not isinstance(out, torch.Tensor):
        raise InvalidKVError(f"out: got {type(out).__name__}, expected a torch.Tensor")
    check_memory(out, "out")
    if out.dtype != layout.dtype:
        raise InvalidKVError(f"out: got dtype {out.dtype}, expected {layout.dtype}")
    if device is not None and out.device != device:
        raise InvalidArgumentError(
            f"device: got {device}, but out is on {out.device}; expected the same or no device"
        )
    full = num_tokens // layout.block_tokens
    if kind == "layers":
        layers, _, _, heads, dim = layout.block_shape
        ok = out.dim() == 5 and out.shape[2] >= full * layout.block_tokens
        ok = ok and tuple(out.shape[i] for i in (0, 1, 3, 4)) == (layers, 2, heads, dim)
        want = f"[{layers}, 2, >= {full * layout.block_tokens}, {heads}, {dim}]"
    else:
        ok = out.dim() == 6 and tuple(out.shape[1:]) == layout.block_shape and len(out) >= full
        want = f"[>= {full}, *{list(layout.block_shape)}]"
    if not ok:
        raise InvalidKVError(
            f"out: got shape {tuple(out.shape)}, expected {want} (layout {kind!r}: room for "
            f"the {full} full blocks of {num_tokens} tokens)"
        )
    check_writable(out, "out")
    check_apart(out, "out", pools)
    return out


def check_writable(tensor: torch.Tensor, name: str) -> None:
    """`InvalidKVError` naming `name` unless torch lets the store write every element of
    `tensor` in place, each into its own memory, here and now: refused are a tensor that
    requires grad, an inference tensor outside `torch.inference_mode()` (torch refuses the
    write), and one whose elements may share memory (an `expand()`ed or overlapping
    `as_strided` view: torch refuses some, and writes the others' shared bytes more than once).

    The overlap test is sufficient, not exact: the dims of size > 1, sorted by stride, each
    need a stride past the furthest element of the dims before it (`stride >= 1 + sum((size -
    1) * stride)`). Every dense or sliced layout passes; an exotic interleaved one that does
    not overlap may be refused too (clone it). Memory torch cannot tell is read-only (a tensor
    over a read-only numpy array or mmap) is not detected."""
    if tensor.requires_grad:
        raise InvalidKVError(f"{name}: requires grad; expected a plain buffer to copy into")
    if tensor.is_inference() and not torch.is_inference_mode_enabled():
        raise InvalidKVError(
            f"{name}: an inference tensor (made under torch.inference_mode()), which torch "
            "lets no one write outside inference mode; expected a normal tensor (clone() it "
            "outside inference mode, or call inside torch.inference_mode())"
        )
    if tensor.numel() == 0:
        return
    reach = 0  # the furthest element, in elements from the first, of the dims seen so far
    for size, stride in sorted(
        ((n, st) for n, st in zip(tensor.shape, tensor.stride(), strict=True) if n > 1),
        key=lambda dim: dim[1],
    ):
        if stride < 1 + reach:
            raise InvalidKVError(
                f"{name}: got shape {tuple(tensor.shape)} with strides {tensor.stride()}, "
                "whose elements may share memory (an expand()ed or overlapping as_strided "
                "view); expected a tensor with memory of its own for each element (clone() it)"
            )
        reach += (size - 1) * stride


def check_apart(tensor: torch.Tensor, name: str, pools: Mapping[str, torch.Tensor]) -> None:
    """`InvalidArgumentError` naming `name` when `tensor` may write into one of `pools`: the
    bytes from its first element to its last (strides are never negative) meet the buffer's
    on the same device. A view of a tier's own pool is such a tensor: a load into it would
    overwrite the cached blocks of other prompts behind the index's back."""
    tier = overlapped_pool(tensor, pools)
    if tier is not None:
        raise InvalidArgumentError(
            f"{name}: got a tensor whose memory overlaps the {tier!r} tier's pool of this "
            "store (slots that hold cached blocks); expected memory of the caller's own"
        )


def overlapped_pool(tensor: torch.Tensor, pools: Mapping[str, torch.Tensor]) -> str | None:
    """The name of the first of `pools` whose buffer may share memory with `tensor` (module
    doc, `check_apart`), or None."""
    if tensor.numel() == 0:
        return None
    reach = sum((n - 1) * st for n, st in zip(tensor.shape, tensor.stride(), strict=True))
    first = tensor.data_ptr()
    end = first + (reach + 1) * tensor.element_size()
    for tier, buffer in pools.items():
        start = buffer.data_ptr()
        if buffer.device == tensor.device and start < end and first < start + buffer.nbytes:
            return tier
    return None


def pool_buffers(pools: Iterable[SlotPool]) -> dict[str, torch.Tensor]:
    """A tier name -> its pool's buffer, for the memory pools of a store not closed yet."""
    return {pool.name: pool.buffer for pool in pools if not pool.closed}


def store_blocks(
    layout: KVLayout, key: bytes, kv: object, start: int, kind: KVKind, pools: Iterable[SlotPool]
) -> tuple[int, torch.Tensor]:
    """A store's KV for the tokens of `key` from `start` on, checked (`check_start`,
    `check_kv_as`): the first block it holds, and its full blocks as a view, or as a copy when
    `kv` shares memory with one of the store's `pools` (a view of `gpu_pool.buffer`, say, the
    pages of a lease): the store may free those slots to make room and write the new blocks
    into them, while the copy still reads them (blocks were served another block's bytes)."""
    num_tokens, bt = len(key) // TOKEN_NBYTES, layout.block_tokens
    first = check_start(start, num_tokens, bt)
    check_kv_as(layout, kv, kind, num_tokens - start)
    assert isinstance(kv, torch.Tensor)
    blocks = blocks_view(kv, kind, bt, num_tokens // bt - first)
    return first, blocks.clone() if overlapped_pool(kv, pool_buffers(pools)) else blocks


def blocks_view(kv: torch.Tensor, kind: KVKind, block_tokens: int, count: int) -> torch.Tensor:
    """The first `count` blocks of `kv` as a `[count, *block_shape]` view (no copy), detached
    from autograd: a store copies the values of a `kv` that requires grad, never its graph
    (copied into a pool's buffer, it made the buffer require grad and chained one more graph
    node to it with every later store: memory that grew without end, and loads that came
    back requiring grad)."""
    kv = kv.detach()
    if kind == "blocks":
        return kv[:count]
    return blocks_of(kv, block_tokens, 0, count)


def prefix_of(out: torch.Tensor, kind: KVKind, count: int, block_tokens: int) -> torch.Tensor:
    """The part of `out` that holds its first `count` blocks, in `out`'s own layout."""
    return out[:count] if kind == "blocks" else out[:, :, : count * block_tokens]


def new_kv(layout: KVLayout, kind: KVKind, count: int, device: torch.device) -> torch.Tensor:
    """An uninitialized tensor of `count` blocks in `kind`, on `device`."""
    if kind == "blocks":
        shape: tuple[int, ...] = (count, *layout.block_shape)
    else:
        layers, _, bt, heads, dim = layout.block_shape
        shape = (layers, 2, count * bt, heads, dim)
    return torch.empty(shape, dtype=layout.dtype, device=device)


class Destination:
    """Where one load writes its blocks (module doc)."""

    def __init__(
        self, layout: KVLayout, kind: KVKind, device: torch.device, out: torch.Tensor | None = None
    ) -> None:
        """`out` checked already (`check_out`); without it a tensor is made on `device`."""
        self.layout = layout
        self.kind = kind
        self.device = device
        self.tensor = out

    @staticmethod
    def of(
        layout: KVLayout,
        kind: KVKind,
        asked: int,
        out: object,
        device: torch.device | None,
        default: torch.device,
        pools: Mapping[str, torch.Tensor] = MappingProxyType({}),
    ) -> Destination:
        """A load's destination for a prompt of `asked` tokens: `out` checked against the
        layout, `device` and the store's `pools` (`check_out`), or a tensor made on `device`
        (else `default`) once the count is known."""
        if out is None:
            return Destination(layout, kind, device or default)
        checked = check_out(layout, out, kind, asked, device, pools)
        return Destination(layout, kind, default, checked)

    def blocks(self, count: int) -> torch.Tensor:
        """A `[count, *block_shape]` view to copy the prefix's blocks into."""
        if self.tensor is None:
            self.tensor = new_kv(self.layout, self.kind, count, self.device)
        return blocks_view(self.tensor, self.kind, self.layout.block_tokens, count)

    def result(self, count: int) -> torch.Tensor:
        """The part of the destination that holds the first `count` blocks (after `blocks`)."""
        assert self.tensor is not None, "a load's result is asked after its blocks"
        return prefix_of(self.tensor, self.kind, count, self.layout.block_tokens)
