"""Plain-torch paged attention: what the Triton kernels must compute, in fp32, sequence by
sequence. Slow and obviously right; the kernels' tests and the GPU benchmark compare against it.

Shapes (the pool layout of `tiers/pool.py`, one layer at a time):

    buffer       [slots, layers, 2, block_tokens, kv_heads, head_dim]   K at [.., 0, ..], V at 1
    block_table  [batch, max_blocks]   slot of each block of a sequence; entries past its blocks
                                       are ignored
    decode  q    [batch, q_heads, head_dim]      one new token per sequence; attends to the
                                                 seq_lens[b] cached tokens
    extend  q    [total_new, q_heads, head_dim]  the new tokens of every sequence, packed in
            k/v  [total_new, kv_heads, head_dim] order (new_lens[b] each); token j of sequence b
                                                 attends to its prefix_lens[b] cached tokens and
                                                 to new tokens 0..j (causal)

GQA/MQA: query head h reads kv head h // (q_heads // kv_heads). The softmax scale defaults to
1/sqrt(head_dim). Outputs come in q's dtype.
"""

from __future__ import annotations

import math

import torch


def cached_kv(
    buffer: torch.Tensor, layer: int, table_row: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first `num_tokens` tokens behind one block-table row, each
    `[num_tokens, kv_heads, head_dim]` in fp32."""
    block_tokens, kv_heads, head_dim = buffer.shape[3], buffer.shape[4], buffer.shape[5]
    blocks = -(-num_tokens // block_tokens)
    pages = buffer[table_row[:blocks].long(), layer].float()  # [blocks, 2, bt, kv_heads, dim]
    flat = pages.permute(1, 0, 2, 3, 4).reshape(2, blocks * block_tokens, kv_heads, head_dim)
    return flat[0, :num_tokens], flat[1, :num_tokens]


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """q [m, q_heads, d], k/v [n, kv_heads, d], mask [m, n] (True: visible) -> [m, q_heads, d]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", q, k) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    return torch.einsum("hmn,nhd->mhd", scores.softmax(dim=-1), v)


def paged_decode_reference(
    q: torch.Tensor,
    buffer: torch.Tensor,
    layer: int,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        k, v = cached_kv(buffer, layer, block_table[b], int(seq_lens[b]))
        out[b] = _attend(q[b : b + 1].float(), k, v, None, scale)[0].to(q.dtype)
    return out


def paged_extend_reference(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    buffer: torch.Tensor,
    layer: int,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    new_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.empty_like(q)
    start = 0
    for b in range(len(new_lens)):
        n_new, n_old = int(new_lens[b]), int(prefix_lens[b])
        rows = slice(start, start + n_new)
        k_old, v_old = cached_kv(buffer, layer, block_table[b], n_old)
        k = torch.cat([k_old, k_new[rows].float()])
        v = torch.cat([v_old, v_new[rows].float()])
        visible = torch.ones(n_new, n_old + n_new, dtype=torch.bool)
        visible[:, n_old:] = torch.tril(torch.ones(n_new, n_new, dtype=torch.bool))
        out[rows] = _attend(q[rows].float(), k, v, visible.to(q.device), scale).to(q.dtype)
        start += n_new
    return out
