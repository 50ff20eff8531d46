"""KV tensors at the public API: validated, and cut into blocks or joined back.

The engine hands KV over as `[num_layers, 2, num_tokens, num_kv_heads, head_dim]` (K at 0,
V at 1); tiers hold blocks as `[n, num_layers, 2, block_tokens, num_kv_heads, head_dim]`.

    kv [L, 2, n*bt, H, D]  --to_blocks (a view)-->  [n, L, 2, bt, H, D]
    [n, L, 2, bt, H, D]    --from_blocks (a copy)-> kv [L, 2, n*bt, H, D], contiguous
"""

from __future__ import annotations

import torch

from kvtier.errors import InvalidArgumentError, InvalidKVError
from kvtier.layout import KVLayout


def check_kv(layout: KVLayout, kv: object, num_tokens: int) -> None:
    """`InvalidKVError` unless `kv` is a tensor of the layout's dtype and shape for
    `num_tokens` tokens."""
    want = (layout.num_layers, 2, num_tokens, layout.num_kv_heads, layout.head_dim)
    if not isinstance(kv, torch.Tensor):
        raise InvalidKVError(f"kv: got {type(kv).__name__}, expected a torch.Tensor")
    if kv.dtype != layout.dtype:
        raise InvalidKVError(f"kv: got dtype {kv.dtype}, expected {layout.dtype}")
    if tuple(kv.shape) != want:
        raise InvalidKVError(
            f"kv: got shape {tuple(kv.shape)}, expected {want} "
            "= [num_layers, 2, len(tokens), num_kv_heads, head_dim]"
        )


def check_device(device: torch.device | str | None) -> torch.device | None:
    """The device that a `device=` argument names, or `InvalidArgumentError`."""
    if device is None:
        return None
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        target = None
    if target is None or target.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"device: got {device!r}, expected 'cpu', 'cuda' or 'cuda:N'")
    if target.type == "cuda" and (target.index or 0) >= torch.cuda.device_count():
        raise InvalidArgumentError(
            f"device: got {device!r}, but this machine has {torch.cuda.device_count()} CUDA devices"
        )
    return target


def to_blocks(kv: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """`[L, 2, n*bt, H, D]` -> a `[n, L, 2, bt, H, D]` view (no copy)."""
    layers, two, tokens, heads, dim = kv.shape
    n = tokens // block_tokens
    return kv.reshape(layers, two, n, block_tokens, heads, dim).permute(2, 0, 1, 3, 4, 5)


def from_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """`[n, L, 2, bt, H, D]` -> a contiguous `[L, 2, n*bt, H, D]`."""
    n, layers, two, bt, heads, dim = blocks.shape
    return blocks.permute(1, 2, 0, 3, 4, 5).reshape(layers, two, n * bt, heads, dim)
