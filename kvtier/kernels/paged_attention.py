"""Paged attention in Triton over the gpu pool's block-major layout: decode and extend.

Shapes and semantics are those of `reference.py` (read it first). The kernels take the pool
buffer, a layer and a block table; they read K and V in place, page by page, never copying
a sequence into a contiguous buffer. Nothing here checks residency or arguments: that is the
wrapper's job (`attention.py`), which engines should call.

    decode   grid (batch, kv_heads)            one program per kv head: its GQA group of query
                                               rows (padded to 16) against the sequence's tokens
    extend   grid (batch, q_heads, m_tiles)    BLOCK_M new tokens of one query head: the cached
                                               prefix (all visible), then the new tokens (causal)

Both walk their keys `TOKENS` at a time (several blocks per step: each token's slot is
gathered from the block table, so a step spans blocks), with an online softmax in fp32
(running max `m`, running sum `l`, accumulator `acc`), and `tl.dot` for the two products. fp32
pools use IEEE products (no TF32), so fp32 results match the reference to ~1e-7. Under the
interpreter every product is fp32 (its 16-bit `tl.dot` is broken), so the CPU tests check the
kernels' indexing, masking and softmax, and the GPU benchmark checks the 16-bit products.

Triton is imported lazily by `available()`: without it the module still imports (kvtier does
not require Triton), and the kernels' callers fall back to the reference. On a CPU the kernels
run under Triton's interpreter, which must be switched on (`TRITON_INTERPRET=1`) before this
module is first imported: `INTERPRETED` records it.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from kvtier.kernels.reference import paged_decode_reference, paged_extend_reference

__all__ = [
    "INTERPRETED",
    "available",
    "paged_decode",
    "paged_decode_reference",
    "paged_extend",
    "paged_extend_reference",
]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Whether Triton runs kernels on the CPU here (read once, at import, as Triton does)."""

TOKENS = {"cuda": 64, "cpu": 32}
"""Keys per step of the inner loop, a multiple of 16 for `tl.dot`: on a GPU, larger tiles keep
more bytes in flight per program; in the interpreter, smaller ones are quicker."""

BLOCK_M = 16
"""New tokens per extend program."""

try:
    import triton
    import triton.language as tl
except ImportError:  # kvtier runs without Triton; `available()` says so
    triton = None


def available() -> bool:
    """Whether the Triton kernels can run on tensors of `device` type cuda, or, under the
    interpreter, cpu."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _online_step(q, k, v, visible, m, denom, acc, scale, PRECISION: tl.constexpr):
        """Fold one chunk of keys into the running softmax of the rows of `q`."""
        if PRECISION == "ieee":  # fp32 products (fp32 pools, and the interpreter: see the doc)
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, denom, acc

    @triton.jit
    def _load_cached(
        KV,
        TABLE,
        row,
        start,
        n,
        h,
        d,
        dmask,
        stride_slot,
        stride_kv,
        stride_t,
        stride_h,
        BT: tl.constexpr,
        TOKENS_: tl.constexpr,
    ):
        """K and V of cached tokens start .. start+TOKENS_ (masked at n), gathered by slot."""
        tok = start + tl.arange(0, TOKENS_)
        valid = tok < n
        slot = tl.load(TABLE + row + tok // BT, mask=valid, other=0).to(tl.int64)
        offs = slot * stride_slot + (tok % BT) * stride_t + h * stride_h
        mask = valid[:, None] & dmask[None, :]
        k = tl.load(KV + offs[:, None] + d[None, :], mask=mask, other=0.0)
        v = tl.load(KV + stride_kv + offs[:, None] + d[None, :], mask=mask, other=0.0)
        return k, v, valid

    @triton.jit
    def _decode_kernel(
        Q,
        KV,
        TABLE,
        LENS,
        OUT,
        scale,
        stride_qb,
        stride_qh,
        stride_slot,
        stride_kv,
        stride_t,
        stride_h,
        stride_tb,
        stride_ob,
        stride_oh,
        GROUP: tl.constexpr,
        BLOCK_G: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BT: tl.constexpr,
        TOKENS_: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        n = tl.load(LENS + b)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        gmask, dmask = g < GROUP, d < D
        heads = h * GROUP + g
        qmask = gmask[:, None] & dmask[None, :]
        q = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0
        )
        if PRECISION == "ieee":
            q = q.to(tl.float32)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        row = b.to(tl.int64) * stride_tb
        for start in range(0, n, TOKENS_):
            k, v, valid = _load_cached(
                KV,
                TABLE,
                row,
                start,
                n,
                h,
                d,
                dmask,
                stride_slot,
                stride_kv,
                stride_t,
                stride_h,
                BT,
                TOKENS_,
            )
            m, denom, acc = _online_step(q, k, v, valid[None, :], m, denom, acc, scale, PRECISION)
        out = acc / denom[:, None]
        tl.store(
            OUT + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
            out.to(OUT.dtype.element_ty),
            mask=qmask,
        )

    @triton.jit
    def _extend_kernel(
        Q,
        KNEW,
        VNEW,
        KV,
        TABLE,
        PREFIX,
        STARTS,
        NEW,
        OUT,
        scale,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_slot,
        stride_kv,
        stride_t,
        stride_h,
        stride_tb,
        stride_ot,
        stride_oh,
        GROUP: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BT: tl.constexpr,
        BLOCK_M_: tl.constexpr,
        TOKENS_: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0)
        qh = tl.program_id(1)
        tile = tl.program_id(2)
        n_new = tl.load(NEW + b)
        if tile * BLOCK_M_ >= n_new:
            return
        n_old = tl.load(PREFIX + b)
        first = tl.load(STARTS + b).to(tl.int64)  # row of this sequence's token 0
        h = qh // GROUP
        i = tile * BLOCK_M_ + tl.arange(0, BLOCK_M_)  # new-token index of each query row
        real = i < n_new
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        qmask = real[:, None] & dmask[None, :]
        q = tl.load(
            Q + (first + i)[:, None] * stride_qt + qh * stride_qh + d[None, :],
            mask=qmask,
            other=0.0,
        )
        if PRECISION == "ieee":
            q = q.to(tl.float32)
        m = tl.full([BLOCK_M_], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_M_], tl.float32)
        acc = tl.zeros([BLOCK_M_, BLOCK_D], tl.float32)
        row = b.to(tl.int64) * stride_tb
        for start in range(0, n_old, TOKENS_):  # the cached prefix: every row sees all of it
            k, v, valid = _load_cached(
                KV,
                TABLE,
                row,
                start,
                n_old,
                h,
                d,
                dmask,
                stride_slot,
                stride_kv,
                stride_t,
                stride_h,
                BT,
                TOKENS_,
            )
            m, denom, acc = _online_step(q, k, v, valid[None, :], m, denom, acc, scale, PRECISION)
        last = tl.minimum(n_new, (tile + 1) * BLOCK_M_)
        for start in range(0, last, TOKENS_):  # the new tokens: row i sees j <= i
            j = start + tl.arange(0, TOKENS_)
            valid = j < n_new
            kmask = valid[:, None] & dmask[None, :]
            k_offs = (first + j)[:, None] * stride_kt + h * stride_kh + d[None, :]
            v_offs = (first + j)[:, None] * stride_vt + h * stride_vh + d[None, :]
            k = tl.load(KNEW + k_offs, mask=kmask, other=0.0)
            v = tl.load(VNEW + v_offs, mask=kmask, other=0.0)
            # rows past the sequence see every valid key: finite garbage, never stored
            visible = valid[None, :] & ((j[None, :] <= i[:, None]) | ~real[:, None])
            m, denom, acc = _online_step(q, k, v, visible, m, denom, acc, scale, PRECISION)
        out = acc / denom[:, None]
        tl.store(
            OUT + (first + i)[:, None] * stride_ot + qh * stride_oh + d[None, :],
            out.to(OUT.dtype.element_ty),
            mask=qmask,
        )


def _precision(dtype: torch.dtype) -> str:
    """fp32 products for fp32 pools, and always under the interpreter, whose bf16/fp16 `tl.dot`
    is wrong (it misreads the operands); on a GPU, 16-bit pools use 16-bit tensor-core products
    with fp32 accumulation."""
    return "ieee" if dtype == torch.float32 or INTERPRETED else "tf32"


def _pow2(n: int, at_least: int = 16) -> int:
    return max(at_least, 1 << max(0, math.ceil(math.log2(n))))


def _pool_view(buffer: torch.Tensor, layer: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """One layer of the pool, `[slots, 2, block_tokens, kv_heads, head_dim]`, and its strides."""
    view = buffer.select(1, layer)
    return view, tuple(view.stride()[:4])


def paged_decode(
    q: torch.Tensor,
    buffer: torch.Tensor,
    layer: int,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention (see the module doc); every seq_lens[b] must be >= 1. Unchecked: q and
    `out` need a contiguous last dimension (their other strides are passed), the table
    contiguous rows and seq_lens a contiguous int32 tensor."""
    assert triton is not None, "Triton is not installed"
    batch, q_heads, head_dim = q.shape
    kv_heads, block_tokens = buffer.shape[4], buffer.shape[3]
    group = q_heads // kv_heads
    out = torch.empty_like(q) if out is None else out
    kv, (s_slot, s_kv, s_t, s_h) = _pool_view(buffer, layer)
    kernel: Any = _decode_kernel
    kernel[(batch, kv_heads)](
        q, kv, block_table, seq_lens, out,
        1.0 / math.sqrt(head_dim) if scale is None else scale,
        q.stride(0), q.stride(1), s_slot, s_kv, s_t, s_h, block_table.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=_pow2(group), D=head_dim, BLOCK_D=_pow2(head_dim),
        BT=block_tokens, TOKENS_=max(TOKENS[q.device.type], _pow2(block_tokens)),
        PRECISION=_precision(q.dtype),
    )  # fmt: skip
    return out


def paged_extend(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    buffer: torch.Tensor,
    layer: int,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    new_lens: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Extend attention (see the module doc); every new_lens[b] must be >= 1. Unchecked: q,
    k_new, v_new and `out` need a contiguous last dimension (each is read by its own other
    strides), the table contiguous rows and the lengths contiguous int32 tensors."""
    assert triton is not None, "Triton is not installed"
    q_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads, block_tokens = buffer.shape[4], buffer.shape[3]
    starts = torch.zeros_like(new_lens)
    starts[1:] = torch.cumsum(new_lens, 0)[:-1]
    out = torch.empty_like(q) if out is None else out
    kv, (s_slot, s_kv, s_t, s_h) = _pool_view(buffer, layer)
    tiles = -(-int(new_lens.max()) // BLOCK_M) if len(new_lens) else 0
    kernel: Any = _extend_kernel
    kernel[(len(new_lens), q_heads, tiles)](
        q, k_new, v_new, kv, block_table, prefix_lens, starts, new_lens, out,
        1.0 / math.sqrt(head_dim) if scale is None else scale,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1),
        v_new.stride(0), v_new.stride(1), s_slot, s_kv, s_t, s_h, block_table.stride(0),
        out.stride(0), out.stride(1),
        GROUP=q_heads // kv_heads, D=head_dim, BLOCK_D=_pow2(head_dim), BT=block_tokens,
        BLOCK_M_=BLOCK_M, TOKENS_=max(TOKENS[q.device.type], _pow2(block_tokens)),
        PRECISION=_precision(q.dtype),
    )  # fmt: skip
    return out
