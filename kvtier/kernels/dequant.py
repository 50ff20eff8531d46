"""Decoding quantized blocks (`kvtier.quant`) in Triton, straight into slots of a pool.

    payload [n, payload_nbytes] uint8        pool [slots, *block_shape] (the engine's dtype)
    row i   ──── decode block i ────►        slot slots[i]                      for i < n

One program decodes one token's row of K or V in one layer (`R = H * D` values): grid
`(n * L * 2 * T,)`. It reads the row's codes (one byte a value, or a nibble for int4), the
scale and zero point of each value's group (int8/int4: K's groups per token or per channel, V's
per token; fp8: one scale per head), and writes `(q - z) * s` (or `code * s`) clamped to
+-`QuantCodec.finite` (the pool dtype's largest value within fp16's range) and rounded to the
pool's dtype (to nearest, ties to even; bf16 by hand, see `_rounded`). Scales (and zero
points) are read a byte at a time and put together, so a payload need not be aligned; fp8
codes are decoded to fp32 with integer arithmetic (e4m3fn: 1 sign, 4 exponent bits biased by
7, 3 mantissa bits; exponent 0 is subnormal, `code * 2**-9`).

Bit-exact with `QuantCodec.decode`: both compute in fp32, one product after an exact
difference, clamp to the same bound, and round once to the pool's dtype (the launch also turns
fused multiply-add off, `enable_fp_fusion=False`, so that no compile can fuse what the
reference rounds twice).
`dequantize` checks the payload first (`QuantCodec.validate`: no NaN code, no bad scale) and
the slots (in range, distinct: two programs writing one slot would race), then
launches on a CUDA pool; on a CPU pool it decodes with torch, unless asked for the kernel (under
`TRITON_INTERPRET=1`: the tests).
"""

from __future__ import annotations

from typing import Any

import torch

from kvtier.errors import InvalidArgumentError, shown
from kvtier.kernels.paged_attention import INTERPRETED, available
from kvtier.quant import QuantCodec

try:
    import triton
    import triton.language as tl
except ImportError:  # `available()` says so
    triton = None


def dequantize(
    codec: QuantCodec,
    payload: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    kernel: bool | None = None,
) -> None:
    """Decode block i of `payload` into `pool[slots[i]]` (module doc): with the kernel for a
    CUDA pool, or where `kernel` asks (the interpreter, in tests), else torch."""
    n = codec.validate(payload)
    if pool.dim() != 6 or tuple(pool.shape[1:]) != tuple(codec.layout.block_shape):
        raise InvalidArgumentError(
            f"pool: got shape {tuple(pool.shape)}, expected [slots, *{codec.layout.block_shape}]"
        )
    if pool.dtype != codec.layout.dtype or not pool.is_contiguous():
        raise InvalidArgumentError(
            f"pool: got a {pool.dtype} pool, expected a contiguous {codec.layout.dtype} one"
        )
    if slots.dim() != 1 or slots.numel() != n or slots.dtype != torch.int64:
        raise InvalidArgumentError(f"slots: expected {n} int64 slot numbers, got {shown(slots)}")
    if n and not (int(slots.min()) >= 0 and int(slots.max()) < pool.shape[0]):
        raise InvalidArgumentError(f"slots: expected slots in [0, {pool.shape[0]})")
    if n and int(torch.unique(slots).numel()) != n:  # two programs writing one slot race
        raise InvalidArgumentError(f"slots: got {slots.tolist()!r:.80}, expected distinct slots")
    if n == 0:
        return
    if not (runs_kernel(pool) if kernel is None else kernel and available()):
        pool[slots] = codec.decode(payload).to(pool.device)
        return
    _launch(codec, payload.contiguous(), pool, slots.to(pool.device))


def runs_kernel(pool: torch.Tensor) -> bool:
    """Whether `dequantize` runs the Triton kernel for a pool on this device unasked: on CUDA
    (on a CPU it would be Triton's interpreter, far slower than torch)."""
    return available() and pool.is_cuda


def _launch(
    codec: QuantCodec, payload: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor
) -> None:
    L, _, T, H, D = codec.layout.block_shape
    n = payload.shape[0]
    common: dict[str, Any] = {
        "L": L,
        "T": T,
        "R": codec.row,
        "D": D,
        "BLOCK_R": triton.next_power_of_2(codec.row),
        "FINITE": codec.finite,
    }
    if not INTERPRETED:
        common["enable_fp_fusion"] = False
    grid = (n * L * 2 * T,)
    if codec.spec.kind == "fp8":
        sizes = (codec.payload_nbytes, codec.code_nbytes)
        _fp8_rows[grid](payload, pool, slots, *sizes, H=H, **common)
    else:
        _int_rows[grid](
            payload,
            pool,
            slots,
            codec.payload_nbytes,
            codec.code_nbytes,
            L * (codec.k_groups + codec.v_groups),
            codec.k_groups,
            codec.v_groups,
            G=codec.group,
            GK=codec.key_group or 1,
            BITS=codec.spec.bits,
            KEYS_CHANNEL=codec.spec.keys == "channel",
            **common,
        )


if triton is not None:

    @triton.jit
    def _u16(ptr, offs, mask):
        lo = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32)
        hi = tl.load(ptr + offs + 1, mask=mask, other=0).to(tl.int32)
        return (lo | (hi << 8)).to(tl.int16)

    @triton.jit
    def _f32(ptr, offs, mask):
        word = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32)
        for k in tl.static_range(1, 4):
            word = word | (tl.load(ptr + offs + k, mask=mask, other=0).to(tl.int32) << (8 * k))
        return word.to(tl.float32, bitcast=True)

    @triton.jit
    def _rounded(value, dtype: tl.constexpr):
        """`value` (fp32, within `dtype`'s range) to `dtype`, to nearest, ties to even. bf16
        and fp8 by hand: the interpreter truncates bf16, and its fp8 rounding does not carry
        into the exponent (1.99 became 1.0, not 2.0) nor round subnormals; here fp8 gets an
        fp32 it holds exactly, which every conversion keeps."""
        if dtype == tl.bfloat16:
            bits = value.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        if dtype == tl.float8e4nv or dtype == tl.float8e5:
            value = _fp8_exact(value, 3 if dtype == tl.float8e4nv else 2)
        return value.to(dtype)

    @triton.jit
    def _fp8_exact(value, MANTISSA: tl.constexpr):
        """`value` rounded (to nearest, ties to even) to an fp8 value with `MANTISSA` bits
        (e4m3: 3, e5m2: 2), as an fp32: normal ones by the bits (the carry moves into the
        exponent), subnormal ones (below 2**-6, 2**-14) to a multiple of their step (2**-9,
        2**-16) by one fp32 addition of 2**14 (2**7), whose step that is, sign put back."""
        DROP: tl.constexpr = 23 - MANTISSA
        NORMAL: tl.constexpr = 2.0 ** (-6 if MANTISSA == 3 else -14)
        STEP_UP: tl.constexpr = 2.0 ** (14 if MANTISSA == 3 else 7)
        bits = value.to(tl.uint32, bitcast=True)
        bits = (bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)) >> DROP << DROP
        small = (tl.abs(value) + STEP_UP) - STEP_UP
        sign = value.to(tl.uint32, bitcast=True) & 0x80000000
        small = (small.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        return tl.where(tl.abs(value) < NORMAL, small, bits.to(tl.float32, bitcast=True))

    @triton.jit
    def _row(payload, P, L: tl.constexpr, T: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr):
        """This program's row: its block `b`, its (layer, kv, token) `row` in the block's
        order, its lanes `c` (and `mask`), the block's payload `base`, each value's index `e`."""
        pid = tl.program_id(0)
        b = pid // (L * 2 * T)
        row = pid % (L * 2 * T)
        c = tl.arange(0, BLOCK_R)
        e = row.to(tl.int64) * R + c
        return b, row, c, c < R, payload + b.to(tl.int64) * P, e

    @triton.jit
    def _put(pool, slots, b, e, value, mask, BLOCK: tl.constexpr, FINITE: tl.constexpr):
        """Values `e` of the slot block `b` decodes into, clamped to +-FINITE
        (`QuantCodec.finite`) and rounded to the pool's dtype."""
        value = tl.minimum(tl.maximum(value, -FINITE), FINITE)
        out = pool + tl.load(slots + b) * BLOCK + e
        tl.store(out, _rounded(value, pool.dtype.element_ty), mask=mask)

    @triton.jit
    def _int_rows(
        payload,
        pool,
        slots,
        P,
        CODE_NBYTES,
        GROUPS,
        KG,
        VG,
        L: tl.constexpr,
        T: tl.constexpr,
        R: tl.constexpr,
        D: tl.constexpr,
        BLOCK_R: tl.constexpr,
        FINITE: tl.constexpr,
        G: tl.constexpr,
        GK: tl.constexpr,
        BITS: tl.constexpr,
        KEYS_CHANNEL: tl.constexpr,
    ):
        b, row, c, mask, base, e = _row(payload, P, L, T, R, BLOCK_R)
        layer = row // (2 * T)
        kv = (row // T) % 2
        t = row % T
        if BITS == 8:
            q = tl.load(base + e, mask=mask, other=0).to(tl.int32)
        else:
            byte = tl.load(base + e // 2, mask=mask, other=0).to(tl.int32)
            q = (byte >> ((e % 2) * 4).to(tl.int32)) & 15
        if KEYS_CHANNEL:  # noqa: SIM108 (a constexpr branch, compiled away)
            k_group = c
        else:
            k_group = (t * R + c) // GK  # per token
        g = tl.where(kv == 0, layer * KG + k_group, L * KG + layer * VG + (t * R + c) // G)
        meta = base + CODE_NBYTES
        s = _u16(meta, 2 * g, mask).to(tl.float16, bitcast=True).to(tl.float32)
        z = tl.load(meta + 2 * GROUPS + g, mask=mask, other=0).to(tl.int32)
        z = tl.where(z > 127, z - 256, z)  # int8
        _put(pool, slots, b, e, (q - z).to(tl.float32) * s, mask, L * 2 * T * R, FINITE)

    @triton.jit
    def _fp8_rows(
        payload,
        pool,
        slots,
        P,
        CODE_NBYTES,
        L: tl.constexpr,
        T: tl.constexpr,
        R: tl.constexpr,
        D: tl.constexpr,
        BLOCK_R: tl.constexpr,
        FINITE: tl.constexpr,
        H: tl.constexpr,
    ):
        b, row, c, mask, base, e = _row(payload, P, L, T, R, BLOCK_R)
        lk = row // T  # layer * 2 + kv
        code = tl.load(base + e, mask=mask, other=0).to(tl.int32)
        sign = (code >> 7) & 1
        exp = (code >> 3) & 15
        man = code & 7
        normal = ((sign << 31) | ((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
        # 2**-9 * man, exact; its sign set as a bit: a GPU compiles `-x` as `0 - x`, which turns
        # the code 0x80 (-0.0) into +0.0 where torch keeps -0.0
        tiny = (man.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True) | (sign << 31)
        value = tl.where(exp == 0, tiny.to(tl.float32, bitcast=True), normal)
        scale = _f32(base + CODE_NBYTES, 4 * (lk * H + c // D), mask)
        _put(pool, slots, b, e, value * scale, mask, L * 2 * T * R, FINITE)
