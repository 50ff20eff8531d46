"""Copies between an engine's paged KV cache and kvtier's KV layout (issue 15): vLLM's paged
layers (`gather`, `scatter`) and SGLang's host pool (`host_gather`, `host_scatter`, below; an
MLA pool through `mla_host_view`).

vLLM (0.33) hands a connector one tensor per attention layer, logically

    layer  [num_blocks, num_kv_heads, block_size, head_size + head_size_v]

whatever its physical order (`LBNHC`, `LBHNC`, ...): block b is `layer[b]`, and a
FlashAttention-style backend reads K as the first `head_size` values of the last dimension and
V as the rest. kvtier's stores take and give `[num_layers, 2, tokens, num_kv_heads, head_dim]`
(`blocks.py`). `gather` reads whole engine blocks into that shape, `scatter` writes it back:

    gather:  layer[ids] [n, H, N, 2D] -> [n, N, H, 2D] -> [n*N, H, 2D] -> K [..., :D], V [..., D:]
    scatter: the inverse, into `layer[ids]` (index_put: one copy per layer)

Contract:
- `gather(layers, ids)` returns a new contiguous tensor on the layers' device, `scatter`
  writes exactly the blocks `ids` of every layer and nothing else.
- `scatter(layers, ids, gather(layers, ids))` writes back the same bytes, and for any `kv` of
  the right shape `gather(layers, ids)` after `scatter(layers, ids, kv)` equals `kv`: the
  mapping is a bijection on the blocks' bytes, so KV round trips bit-exact between two engines
  with the same backend, whatever that backend means by the last dimension.
- A shape that does not fit (layers of different shapes, an odd last dimension, `kv` of
  another shape or dtype) is an `InvalidKVError` naming what was expected, and so is a block id
  or host slot that is not an integer in range, or (for a write) named twice, or a host page
  that is not whole: checked before a byte moves. The engine's indices are not trusted: a
  negative index would pick another block from the end, a bool tensor would be a mask, a float
  would be truncated, and on a GPU an index past the end reads or writes whatever memory lies
  there; two writes to one block in one `index_copy_` race.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch

from kvtier.errors import InvalidKVError, shown


def geometry(layers: Sequence[torch.Tensor]) -> tuple[int, int, int, int, torch.dtype]:
    """(num_blocks, num_kv_heads, block_size, head_dim, dtype) shared by every layer."""
    if len(layers) == 0:  # (`not` of a stacked tensor of layers raised RuntimeError)
        raise InvalidKVError("paged KV: no layers")
    first = layers[0]
    for layer in layers:
        if not isinstance(layer, torch.Tensor):  # (an AttributeError from `.dim()` before)
            raise InvalidKVError(f"paged KV: a layer {shown(layer)}, expected a tensor")
        if layer.dim() != 4:
            raise InvalidKVError(
                f"paged KV: a layer of {layer.dim()} dimensions {tuple(layer.shape)}, expected 4: "
                "[num_blocks, heads, block_size, 2 * head_dim]"
            )
        if layer.shape != first.shape or layer.dtype != first.dtype:
            raise InvalidKVError(
                f"paged KV: a layer of {tuple(layer.shape)} {layer.dtype}, expected every layer "
                f"like the first, of its shape and dtype: {tuple(first.shape)} {first.dtype}"
            )
    blocks, heads, size, both = first.shape
    if both % 2:
        raise InvalidKVError(f"paged KV: last dimension {both}, expected K and V of equal size")
    return blocks, heads, size, both // 2, first.dtype


def gather(layers: Sequence[torch.Tensor], ids: Sequence[int]) -> torch.Tensor:
    """Blocks `ids` of every layer as `[len(layers), 2, len(ids) * block_size, heads, dim]`."""
    blocks, heads, size, dim, dtype = geometry(layers)
    index = _index(ids, blocks, layers[0].device)
    shape = (len(layers), 2, len(ids) * size, heads, dim)
    out = torch.empty(shape, dtype=dtype, device=layers[0].device)
    for at, layer in enumerate(layers):
        tokens = layer.index_select(0, index).transpose(1, 2).reshape(-1, heads, 2 * dim)
        out[at, 0] = tokens[..., :dim]
        out[at, 1] = tokens[..., dim:]
    return out


def scatter(layers: Sequence[torch.Tensor], ids: Sequence[int], kv: torch.Tensor) -> None:
    """Write `kv` (`[len(layers), 2, len(ids) * block_size, heads, dim]`) into blocks `ids`."""
    blocks, heads, size, dim, dtype = geometry(layers)
    want = (len(layers), 2, len(ids) * size, heads, dim)
    if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != want or kv.dtype != dtype:
        raise InvalidKVError(f"paged KV: got {_described(kv)}, expected {want} {dtype}")
    index = _index(ids, blocks, layers[0].device, writes=True)
    kv = kv.to(layers[0].device)
    for at, layer in enumerate(layers):
        tokens = torch.cat((kv[at, 0], kv[at, 1]), dim=-1)  # [n*N, H, 2D]
        layer.index_copy_(0, index, tokens.view(len(ids), size, heads, 2 * dim).transpose(1, 2))


def _index(
    ids: Sequence[int], blocks: int, device: torch.device, writes: bool = False
) -> torch.Tensor:
    """`ids` as an index tensor, each an integer (not a bool) in `[0, blocks)`, and distinct
    when they are `writes`; else `InvalidKVError` naming the first that is not."""
    given: object = ids  # an engine's: trusted for nothing, a 2-D tensor or None included
    if (isinstance(given, torch.Tensor) and given.dim() != 1) or not hasattr(given, "__iter__"):
        raise InvalidKVError(f"paged KV: block ids {shown(ids)}, expected a sequence of ints")
    checked: list[int] = []
    for i in ids:
        try:
            value = operator.index(i)  # ints, NumPy ints, 0-d integer tensors; no floats
        except TypeError:
            value = None
        if isinstance(i, bool) or value is None or not 0 <= value < blocks:
            raise InvalidKVError(
                f"paged KV: block id {shown(i)} (of {list(ids)!r:.80}), expected each in "
                f"[0, {blocks}), an int"
            )
        checked.append(value)
    if writes and len(set(checked)) != len(checked):
        raise InvalidKVError(f"paged KV: block ids {shown(checked)}, expected distinct ids")
    return torch.tensor(checked, dtype=torch.long, device=device)


# ---- SGLang's host pool (`MHATokenToKVPoolHost.kv_buffer`) -----------------------------------
#
# kv_buffer by layout (K at [0], V at [1]; a page is `page_size` consecutive, aligned slots):
#   layer_first        [2, layers, slots, heads, dim]
#   page_first         [2, slots, layers, heads, dim]
#   page_first_direct  [2, pages, layers, page_size, heads, dim]
#   page_head          [2, pages, heads, page_size, layers, dim]

HOST_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")

# SGLang's MLA host pool (`MLATokenToKVPoolHost.kv_buffer`): one latent of C values per token and
# layer (kv_lora_rank + qk_rope_head_dim), no separate V. kvtier holds it as one head of K and V
# halves (C/2 each): `mla_host_view` is the buffer seen as the MHA layout of the same memory
# (a strided view: what is written through it lands in the buffer), so the copies and checks
# above serve it unchanged:
#   layer_first        [layers, slots, 1, C]              -> layer_first
#   page_first         [slots, layers, 1, C]              -> page_first
#   page_first_direct  [pages, layers, page_size, 1, C]   -> page_first_direct
#   page_unified       [pages, layers, page_size, C]      -> page_first_direct (the same bytes)
MLA_HOST_LAYOUTS = {"layer_first": 4, "page_first": 4, "page_first_direct": 5, "page_unified": 4}
"""Per MLA host layout: the kv_buffer's dims."""


def mla_host_view(kv_buffer: torch.Tensor, layout: str) -> tuple[torch.Tensor, str]:
    """SGLang's MLA host `kv_buffer` as an MHA host buffer of one head of C/2 (K the latent's
    first half, V its second), and that buffer's layout; `InvalidKVError` for a layout or a
    shape it cannot be (a latent of odd size)."""
    if layout not in MLA_HOST_LAYOUTS:
        known = list(MLA_HOST_LAYOUTS)
        raise InvalidKVError(f"MLA host layout {layout!r}, expected one of {known}")
    dims = MLA_HOST_LAYOUTS[layout]
    if (
        not isinstance(kv_buffer, torch.Tensor)
        or kv_buffer.dim() != dims
        or kv_buffer.shape[-1] % 2
    ):
        raise InvalidKVError(
            f"MLA host kv_buffer: got {_described(kv_buffer)}, expected {dims} dims of "
            f"layout {layout!r} ending in a latent of even size"
        )
    halves = kv_buffer.view(*kv_buffer.shape[:-1], 2, kv_buffer.shape[-1] // 2)
    if layout == "page_unified":  # no head axis: add the one head
        halves = halves.unsqueeze(-3)
    mha = "page_first_direct" if layout == "page_unified" else layout
    return halves.movedim(-2, 0), mha


Geometry = Callable[[tuple[int, ...], int], tuple[int, int, int, int]]
_HOST_GEOMETRY: dict[str, tuple[int, Geometry]] = {
    "layer_first": (5, lambda s, ps: (s[2], s[1], s[3], s[4])),
    "page_first": (5, lambda s, ps: (s[1], s[2], s[3], s[4])),
    "page_first_direct": (6, lambda s, ps: (s[1] * ps, s[2], s[4], s[5])),
    "page_head": (6, lambda s, ps: (s[1] * ps, s[4], s[2], s[5])),
}
"""Per host layout: the kv_buffer's dims, and from its shape and the page size its (slots,
layers, heads, dim)."""


def host_gather(
    kv_buffer: torch.Tensor, layout: str, slots: torch.Tensor, page_size: int
) -> torch.Tensor:
    """The KV of host slots `slots` (whole pages, in order) as kvtier's `[layers, 2, tokens,
    heads, dim]`, a new contiguous tensor."""
    _host_slots(kv_buffer, layout, slots, page_size)
    return torch.stack([_host_view(kv_buffer[kv], layout, slots, page_size) for kv in (0, 1)], 1)


def host_scatter(
    kv_buffer: torch.Tensor, layout: str, slots: torch.Tensor, page_size: int, kv: torch.Tensor
) -> None:
    """Write kvtier's `kv` (`[layers, 2, len(slots), heads, dim]`) into host slots `slots`."""
    layers, heads, dim = _host_slots(kv_buffer, layout, slots, page_size, writes=True)
    want = (layers, 2, len(slots), heads, dim)
    if tuple(kv.shape) != want or kv.dtype != kv_buffer.dtype:
        raise InvalidKVError(
            f"host KV: got {tuple(kv.shape)} {kv.dtype}, expected {want} {kv_buffer.dtype}"
        )
    for at in (0, 1):
        half, part = kv_buffer[at], kv[:, at]  # part: [layers, tokens, heads, dim]
        if layout == "layer_first":
            half[:, slots] = part
        elif layout == "page_first":
            half[slots] = part.transpose(0, 1)
        else:
            pages, count = _pages(slots, page_size)
            paged_part = part.reshape(part.shape[0], count, page_size, *part.shape[2:])
            if layout == "page_first_direct":  # [pages, layers, page_size, heads, dim]
                half[pages] = paged_part.transpose(0, 1)
            else:  # page_head: [pages, heads, page_size, layers, dim]
                half[pages] = paged_part.permute(1, 3, 2, 0, 4)


def _host_view(
    half: torch.Tensor, layout: str, slots: torch.Tensor, page_size: int
) -> torch.Tensor:
    """One of K or V of `slots` as `[layers, tokens, heads, dim]`."""
    if layout == "layer_first":
        return half[:, slots]
    if layout == "page_first":
        return half[slots].transpose(0, 1)
    pages, count = _pages(slots, page_size)
    if layout == "page_first_direct":
        picked = half[pages].transpose(0, 1)  # [layers, pages, page_size, heads, dim]
    elif layout == "page_head":
        picked = half[pages].permute(3, 0, 2, 1, 4)  # [layers, pages, page_size, heads, dim]
    else:
        raise InvalidKVError(f"host layout {layout!r}, expected one of {HOST_LAYOUTS}")
    return picked.reshape(picked.shape[0], count * page_size, *picked.shape[3:])


def _host_slots(
    kv_buffer: torch.Tensor, layout: str, slots: torch.Tensor, page_size: int, writes: bool = False
) -> tuple[int, int, int]:
    """Check SGLang's `slots` against its host pool before any is indexed (module doc): a 1-D
    integer tensor of slots in range, whole aligned pages in a paged layout, and distinct when
    they are `writes`; else `InvalidKVError` naming the first bad one. Returns the pool's
    (layers, heads, dim)."""
    if layout not in _HOST_GEOMETRY:
        raise InvalidKVError(f"host layout {layout!r}, expected one of {HOST_LAYOUTS}")
    size = None if isinstance(page_size, bool) else _integer(page_size)
    if size is None or size < 1:  # 0 divided by zero, -4 sliced backwards, 4.0 raised
        raise InvalidKVError(f"host page size {shown(page_size)}, expected an int >= 1")
    if not isinstance(kv_buffer, torch.Tensor) or kv_buffer.dim() < 1 or kv_buffer.shape[0] != 2:
        raise InvalidKVError(  # K at [0] and V at [1]: a [3, ...] buffer was read as its first 2
            f"host kv_buffer: got {_described(kv_buffer)}, expected a tensor [2, ...] (K, V)"
        )
    if not _integer_vector(slots):
        raise InvalidKVError(
            f"host slots: got {_described(slots)}, expected a 1-D integer tensor (int64 or "
            "int32) of slot ids"
        )
    dims, geometry = _HOST_GEOMETRY[layout]
    if dims == 6:
        _pages(slots, page_size)
    if kv_buffer.dim() != dims or (dims == 6 and kv_buffer.shape[3] != page_size):
        raise InvalidKVError(
            f"host kv_buffer: got shape {tuple(kv_buffer.shape)}, expected {dims} dims of "
            f"layout {layout!r} with pages of {page_size}"
        )
    capacity, layers, heads, dim = geometry(tuple(kv_buffer.shape), page_size)
    if len(slots):
        outside = (slots < 0) | (slots >= capacity)
        if bool(outside.any()):
            bad = int(slots[outside][0])
            raise InvalidKVError(f"host slot {bad}: expected slots in [0, {capacity})")
    if writes and int(torch.unique(slots).numel()) != len(slots):
        raise InvalidKVError(f"host slots {slots.tolist()!r:.80}: expected distinct slots")
    return layers, heads, dim


def _integer(value: object) -> int | None:
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def _integer_vector(slots: object) -> bool:
    """A 1-D tensor of int64 or int32 ids: a narrower dtype would wrap the bounds check (520
    compared as uint8 is 8), and torch indexes with a uint8 (or bool) tensor as a mask."""
    return (
        isinstance(slots, torch.Tensor)
        and slots.dim() == 1
        and slots.dtype in (torch.int64, torch.int32)
    )


def _described(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def _pages(slots: torch.Tensor, page_size: int) -> tuple[torch.Tensor, int]:
    """The page numbers of whole, aligned pages of slots: each page's slots its first one and
    the `page_size - 1` after it, in order (a page is copied whole, so a slot named in place
    of one of them would leave it unwritten and write the page's own)."""
    if len(slots) % page_size or bool((slots[::page_size] % page_size).any()):
        raise InvalidKVError(f"host slots: {len(slots)} slots, expected whole aligned pages")
    firsts = slots[::page_size]
    rows = slots.reshape(-1, page_size) - firsts[:, None]
    if not bool((rows == torch.arange(page_size, device=slots.device)).all()):
        raise InvalidKVError(
            f"host slots {slots.tolist()!r:.80}: expected whole pages of {page_size} "
            "consecutive slots"
        )
    return firsts // page_size, len(slots) // page_size
