"""Quantized blocks: the lossy codecs a lower tier may keep its copies in (`fp8`, `int8`,
`int4`), their byte layout, and the plain-torch encoder and decoder (the reference the Triton
decoder, `kernels/dequant.py`, is bit-exact with).

A block is `[L, 2, T, H, D]` (layers, K|V, tokens, kv heads, head dim). Let `R = H * D`, one
token's row of K (or V) in one layer, and `N = L * 2 * T * R` the block's values. Its payload,
whatever the engine's dtype:

    fp8     codes  N bytes, e4m3 (vLLM's fp8 KV: finite, max 448), in the block's order
            scales [L, 2, H] fp32: per layer, K|V and head, amax / 448 over the block's tokens,
            at least 2**-117 (`FP8_SCALE_MIN`; 1 for a head of zeros)
    int8    codes  N bytes, in the block's order
    int4    codes  N / 2 bytes: value 2i in the low nibble of byte i, 2i + 1 in the high one
            scales [groups] fp16, then zeros [groups] int8: K's groups (all layers), then V's

int8 and int4 are group-wise asymmetric: a group of values shares a scale `s` and an integer
zero point `z`, and a value is `(q - z) * s`, q in [0, 2**bits - 1]: 3 bytes a group. Where the
groups run (`QuantSpec.keys`):

    V                               per token: Gv consecutive values of the row, [L, T*R/Gv]
    K with keys="token"             per token: Gk consecutive values of the row, [L, T*R/Gk]
    K with keys="channel" (KIVI)    per channel: one value of the row over the block's T
                                    tokens, [L, R]

Group sizes: `group` sets both (it must divide R); by default int8 takes 128 for both and int4
32 for K and 64 for V, or the largest divisor of R below each (SmolLM2: R = 192, so 96 / 96 and
32 / 64). K needs the smaller groups: RoPE'd keys carry channels of large, slowly varying
values, which set a per-token group's scale. KIVI quantizes keys per channel for that reason,
but at T = 16 tokens a block a channel's group is 16 values, so its 3 bytes cost 1.5 bits a
value: int4 keys/channel is the more accurate and the larger (`benchmarks/bench_quant.py`
measures both). A zero point is `round(-min / s)`; a group so far from 0 that it falls outside
int8 gets a wider scale, `z` at or near -128 or 127 (none does in SmolLM2's KV: the groups
straddle 0). Either way `z` is taken from the scale as stored (fp16, rounded up), so every
value of a group decodes within `s / 2` of itself before rounding to the engine's dtype.

The fp8 scale's floor keeps tiny KV (fp32 denormals: amax / 448 would round to 0, and 0 / 0
is a NaN code) encodable, and every nonzero decoded value a normal fp32 (the smallest code,
2**-9, times 2**-117), so that a GPU flushing denormals decodes the same bits; values below
about 2**-127 decode to 0. An fp8 value comes back within |x| / 16 + scale * 2**-10 (3 mantissa
bits; half the subnormal step) before rounding to the engine's dtype.

Decoding computes in fp32, `float(q - z) * s` (the difference is exact, one rounding) or
`float(code) * s` for fp8, clamps to the engine dtype's largest value within fp16's range
(`QuantCodec.finite`: 65504; bf16 65280; fp8 dtypes their largest), then rounds once to the
engine's dtype; a decoder that does the same steps gets the same bits.

Contract:
- `encode(x)` of `[n, *block_shape]` (any float dtype; values must be finite and within
  fp16's range, else `InvalidArgumentError`: the tier keeps such a block raw) returns
  `[n, payload_nbytes]` uint8; `decode(payload)` returns `[n, *block_shape]` in the layout's
  dtype, or writes `out`. Decoding is deterministic: the same payload gives the same bits on
  any path.
- `decode` of any bytes of the right size raises `CorruptQuantPayload` (an fp8 code that is
  NaN, a scale that is negative or not finite, an fp8 scale above 65504 / 448: no encoder of
  KV within fp16's range writes one) or returns values that are finite in the layout's dtype:
  |value| <= 65504 whatever the engine's dtype (`QuantCodec.finite`: the dtype's largest
  value within fp16's range): `decode` clamps before rounding. A group at fp16's edge decodes
  up to half a step past 65504 (its scale rounds up to fp16), so without the clamp finite KV
  near 65504 would come back as infinity in fp16, and in bf16 or fp32 as a value no codec
  keeps (a disk tier re-encoding a host copy's decode would refuse it); with it the value is
  65504 (bf16: 65280), within the same half step.
  A block that passed its checksum but was written by a broken encoder never reaches the
  engine as NaN or infinity either. So a block one quantized tier keeps, the next keeps.
- Every block `keepable` takes encodes to a payload `validate` accepts: `encode` checks its
  own output and never returns one that `decode` would refuse (a refusal there is an encoder
  bug, `AssertionError`, never a payload a tier acknowledges).
- Encoding is lossless in nothing: what it keeps is measured against the model, not asserted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from kvtier.blocks import KVLayout
from kvtier.errors import ConfigError, InvalidArgumentError, KVTierError

FP8_MAX = 448.0  # e4m3fn's largest finite value
FP8_SCALE_MIN = 2.0**-117  # the smallest code, 2**-9, times it is fp32's smallest normal
KINDS = {"fp8": 8, "int8": 8, "int4": 4}
"""Codec name -> bits a value."""
KEY_GROUPS = ("token", "channel")
_ID = re.compile(r"i([48])k(c|[1-9a-f][0-9a-f]?)v([1-9a-f][0-9a-f]?)")


class CorruptQuantPayload(KVTierError):
    """A quantized payload whose scales or codes cannot be a block's (NaN, negative scale)."""


DEFAULT_GROUPS = {"int8": (128, 128), "int4": (32, 64)}
"""Values a group, (K per token, V), before fitting to a layout's rows."""
MAX_GROUP = 255  # two hex digits in a codec id
FP16_MAX = 65504.0
FP8_SCALE_MAX = FP16_MAX / FP8_MAX * (1 + 2**-20)  # amax / 448, amax within fp16 (fp32 rounding)


@dataclass(frozen=True)
class QuantSpec:
    """How a tier quantizes: `kind` (a key of `KINDS`), `group` (int codecs: values a group
    along a token's row, K's and V's; None: `DEFAULT_GROUPS` fitted to the layout), `keys`
    ("token" or "channel": where K's groups run) and `key_group` (K's alone, over `group`: what
    a codec id records)."""

    kind: str
    group: int | None = None
    keys: str = "token"
    key_group: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError("codec", self.kind, f"one of {sorted(KINDS)}")
        for field, value in (("codec_group", self.group), ("codec_group", self.key_group)):
            if value is not None and (type(value) is not int or not 1 <= value <= MAX_GROUP):
                raise ConfigError(field, value, f"an integer in [1, {MAX_GROUP}]")
        if self.keys not in KEY_GROUPS:
            raise ConfigError("codec_keys", self.keys, f"one of {list(KEY_GROUPS)}")

    @property
    def bits(self) -> int:
        return KINDS[self.kind]

    @classmethod
    def from_id(cls, codec_id: str) -> QuantSpec | None:
        """The spec a copy's codec id names (`QuantCodec.id`), or None if it names none."""
        if codec_id == "fp8":
            return cls("fp8")
        found = _ID.fullmatch(codec_id)
        if found is None:
            return None
        bits, keys, values = found.groups()
        if keys == "c":
            return cls(f"int{bits}", int(values, 16), "channel")
        return cls(f"int{bits}", int(values, 16), "token", int(keys, 16))


class QuantCodec:
    """Encodes and decodes whole blocks of `layout` as `spec` says (module doc)."""

    def __init__(self, spec: QuantSpec, layout: KVLayout) -> None:
        L, _, T, H, D = layout.block_shape
        row = H * D
        self.spec, self.layout = spec, layout
        self.row = row
        self.group = self.key_group = 0  # values a V group, a K group (per token)
        self.numel = L * 2 * T * row
        self.code_nbytes = self.numel * spec.bits // 8
        if spec.kind == "fp8":
            self.k_groups = self.v_groups = 0
            self.meta_nbytes = L * 2 * H * 4
        else:
            k_default, v_default = DEFAULT_GROUPS[spec.kind]
            self.group = _group(spec.group, v_default, row)
            self.v_groups = T * row // self.group
            if spec.keys == "channel":
                self.k_groups = row
            else:
                self.key_group = _group(spec.key_group or spec.group, k_default, row)
                self.k_groups = T * row // self.key_group
            self.meta_nbytes = L * (self.k_groups + self.v_groups) * 3
        self.payload_nbytes = self.code_nbytes + self.meta_nbytes
        self.finite = _finite(layout.dtype)
        """The largest magnitude `decode` returns: the layout dtype's largest value within
        fp16's range, the most any codec keeps (`keepable`: 65504 for fp16 and fp32, 65280 for
        bf16, the dtype's largest for fp8); `decode` clamps to it before rounding, so that a
        block decoded from one quantized tier is one the next keeps."""

    @property
    def name(self) -> str:
        return self.spec.kind

    @property
    def id(self) -> str:
        """What a copy records as its codec (at most 8 characters): `fp8`, or `i<bits>k<K
        group>v<V group>` in hex, `c` for K per channel (`i4k20v40`, `i4kcv40`): all decoding
        needs besides the layout."""
        if self.spec.kind == "fp8":
            return "fp8"
        keys = "c" if self.spec.keys == "channel" else f"{self.key_group:x}"
        return f"i{self.spec.bits}k{keys}v{self.group:x}"

    def ratio(self) -> float:
        """How many times smaller a payload is than the block in bf16."""
        return self.numel * 2 / self.payload_nbytes

    # ---- encoding --------------------------------------------------------------------------

    def keepable(self, blocks: torch.Tensor) -> torch.Tensor:
        """Per block of `[n, *block_shape]`, whether `encode` takes it: every value finite and
        within fp16's range (a bool tensor on the blocks' device)."""
        return blocks.float().abs().flatten(1).amax(dim=1) <= FP16_MAX

    def encode(self, blocks: torch.Tensor) -> torch.Tensor:
        """`[n, *block_shape]` -> `[n, payload_nbytes]` uint8 (on the blocks' device)."""
        shape = tuple(self.layout.block_shape)
        if blocks.dim() != 6 or tuple(blocks.shape[1:]) != shape:
            raise InvalidArgumentError(
                f"blocks: got shape {tuple(blocks.shape)}, expected [n, *{list(shape)}]"
            )
        if not blocks.dtype.is_floating_point:
            raise InvalidArgumentError(f"blocks: got dtype {blocks.dtype}, expected a float dtype")
        x = blocks.float()
        if x.numel() and not bool(x.abs().amax() <= FP16_MAX):  # NaN compares false too
            raise InvalidArgumentError(
                f"blocks: a value is not finite or beyond +-{FP16_MAX:g}; expected KV a "
                f"{self.name} copy can keep"
            )
        n = x.shape[0]
        if n == 0:  # (its reshapes to [0, -1] are ambiguous)
            return torch.empty((0, self.payload_nbytes), dtype=torch.uint8, device=x.device)
        if self.spec.kind == "fp8":
            codes, meta = self._encode_fp8(x)
        else:
            codes, meta = self._encode_int(x)
        payload = torch.cat([codes.reshape(n, -1), meta.reshape(n, -1)], dim=1)
        try:
            self.validate(payload)
        except CorruptQuantPayload as e:  # never hand a tier a payload it could not read back
            raise AssertionError(f"{self.id} encoder wrote a payload it refuses: {e}") from e
        return payload

    def _encode_fp8(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        amax = x.abs().amax(dim=(3, 5))  # [n, L, 2, H]
        # amax / 448 of fp32 denormals rounds to 0: the floor keeps 0 / 0 out (module doc)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).clamp(FP8_SCALE_MIN)
        scaled = (x / scale[:, :, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
        codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
        return codes, scale.contiguous().view(torch.uint8)

    def _encode_int(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, L, _, T = x.shape[:4]
        levels = (1 << self.spec.bits) - 1
        rows = x.reshape(n, L, 2, T, self.row)
        v_groups = rows[:, :, 1].reshape(n, L, self.v_groups, self.group)
        if self.spec.keys == "channel":
            k_groups = rows[:, :, 0].transpose(2, 3)  # [n, L, R, T]: a channel's tokens
        else:
            k_groups = rows[:, :, 0].reshape(n, L, self.k_groups, self.key_group)
        k_scale, k_zero, k_codes = _quantize(k_groups, levels)
        v_scale, v_zero, v_codes = _quantize(v_groups, levels)
        if self.spec.keys == "channel":
            k_codes = k_codes.transpose(2, 3)  # back to [n, L, T, R]
        codes = torch.stack(
            [k_codes.reshape(n, L, T * self.row), v_codes.reshape(n, L, T * self.row)], dim=2
        ).reshape(n, -1)
        if self.spec.bits == 4:
            codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
        scales = torch.cat([k_scale.reshape(n, -1), v_scale.reshape(n, -1)], dim=1)
        zeros = torch.cat([k_zero.reshape(n, -1), v_zero.reshape(n, -1)], dim=1)
        meta = torch.cat([scales.view(torch.uint8), zeros.view(torch.uint8)], dim=1)
        return codes, meta

    # ---- decoding --------------------------------------------------------------------------

    def decode(self, payload: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`[n, payload_nbytes]` uint8 -> `[n, *block_shape]` in the layout's dtype (into `out`
        when given); `CorruptQuantPayload` for scales or codes no encoder writes."""
        n = self.validate(payload)
        codes, meta = payload[:, : self.code_nbytes], payload[:, self.code_nbytes :]
        L, _, T, H, D = self.layout.block_shape
        if self.spec.kind == "fp8":
            scale = (
                meta.clone(memory_format=torch.contiguous_format)
                .view(torch.float32)
                .reshape(n, L, 2, H)
            )
            values = codes.contiguous().view(torch.float8_e4m3fn).float()
            x = values.reshape(n, L, 2, T, H, D) * scale[:, :, :, None, :, None]
        else:
            x = self._decode_int(codes, meta, n)
        x.clamp_(-self.finite, self.finite)  # a group at fp16's edge decodes half a step past it
        result = x.to(self.layout.dtype).reshape(n, *self.layout.block_shape)
        if out is None:
            return result
        out.copy_(result)
        return out

    def validate(self, payload: torch.Tensor) -> int:
        """The number of blocks in `payload`, or `CorruptQuantPayload` when its size, scales or
        fp8 codes are none an encoder writes (module doc)."""
        if payload.dtype != torch.uint8 or payload.dim() != 2:
            raise InvalidArgumentError(
                f"payload: got {payload.dtype} of {payload.dim()} dims, expected [n, bytes] uint8"
            )
        if payload.shape[1] != self.payload_nbytes:
            raise CorruptQuantPayload(
                f"{self.name} payload of {payload.shape[1]} bytes, expected {self.payload_nbytes}"
            )
        meta = payload[:, self.code_nbytes :]
        if self.spec.kind == "fp8":
            scales = meta.clone(memory_format=torch.contiguous_format).view(torch.float32)
            if bool(((payload[:, : self.code_nbytes] & 0x7F) == 0x7F).any()):
                raise CorruptQuantPayload("fp8 payload: a code is NaN (no encoder writes one)")
            if bool((scales > FP8_SCALE_MAX).any()):  # 448 times it would overflow
                raise CorruptQuantPayload(f"fp8 payload: a scale above {FP8_SCALE_MAX:g}")
        else:
            groups = self.layout.num_layers * (self.k_groups + self.v_groups)
            scales = (
                meta[:, : 2 * groups]
                .clone(memory_format=torch.contiguous_format)
                .view(torch.float16)
            )
        if not bool((torch.isfinite(scales) & (scales >= 0)).all()):
            raise CorruptQuantPayload(f"{self.name} payload: a scale is not finite and >= 0")
        return int(payload.shape[0])

    def _decode_int(self, codes: torch.Tensor, meta: torch.Tensor, n: int) -> torch.Tensor:
        L, _, T = self.layout.block_shape[:3]
        groups = L * (self.k_groups + self.v_groups)
        scales = (
            meta[:, : groups * 2]
            .clone(memory_format=torch.contiguous_format)
            .view(torch.float16)
            .float()
        )
        zeros = meta[:, groups * 2 :].contiguous().view(torch.int8).float()
        if self.spec.bits == 4:
            q = torch.stack([codes & 0xF, codes >> 4], dim=2).reshape(n, self.numel)
        else:
            q = codes
        q = q.float().reshape(n, L, 2, T, self.row)
        kg = L * self.k_groups
        k_s, v_s = scales[:, :kg], scales[:, kg:]
        k_z, v_z = zeros[:, :kg], zeros[:, kg:]
        # sizes spelled out, no -1: a payload of no blocks decodes to none (-1 is ambiguous)
        v_q = q[:, :, 1].reshape(n, L, self.v_groups, self.group)
        v_shape = (n, L, self.v_groups, 1)
        v = (v_q - v_z.reshape(v_shape)) * v_s.reshape(v_shape)
        if self.spec.keys == "channel":
            k = (q[:, :, 0] - k_z.reshape(n, L, 1, self.row)) * k_s.reshape(n, L, 1, self.row)
        else:
            k_q = q[:, :, 0].reshape(n, L, self.k_groups, self.key_group)
            k_shape = (n, L, self.k_groups, 1)
            k = (k_q - k_z.reshape(k_shape)) * k_s.reshape(k_shape)
        return torch.stack([k.reshape(n, L, T, self.row), v.reshape(n, L, T, self.row)], dim=2)


def _finite(dtype: torch.dtype) -> float:
    """`dtype`'s largest value within fp16's range (`QuantCodec.finite`)."""
    top = float(torch.finfo(dtype).max)
    if top <= FP16_MAX:
        return top
    edge = torch.tensor(FP16_MAX, dtype=dtype)
    if float(edge) > FP16_MAX:  # rounded up (bf16: 65536): the value below it
        edge = torch.nextafter(edge, torch.zeros_like(edge))
    return float(edge)


def _group(asked: int | None, default: int, row: int) -> int:
    """A group size for rows of `row` values: `asked`, which must divide it, or the largest
    divisor of `row` up to `default`."""
    if asked is not None:
        if row % asked:
            raise ConfigError("codec_group", asked, f"a divisor of num_kv_heads * head_dim = {row}")
        return asked
    return max(g for g in range(1, default + 1) if row % g == 0)


def _quantize(groups: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scale (fp16), zero point (int8) and codes (uint8) of each group along the last dim,
    codes taken against the stored scale (module doc). A group whose zero point would fall
    outside int8 takes the scale that covers it from z = -128 (all values > 0) or 127 (all
    < 0): `max / (levels + 128)` or `-min / 127`, rounded up to fp16. Every z is
    `round(-min / s)` of the scale as stored, clamped to int8, so each value's code is within
    half a step of it."""
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((hi - lo) / levels).clamp(2.0**-24, FP16_MAX)
    zero = torch.round(-lo / _fp16_up(scale))
    above, below = zero < -128, zero > 127  # all positive, far from 0; all negative
    scale = torch.where(above, hi / (levels + 128), scale)
    scale = torch.where(below, -lo / 127, scale)
    s = _fp16_up(scale.clamp(2.0**-24, FP16_MAX))
    # z from the scale as stored, for far groups too: rounded up to fp16 (by up to a third where
    # it is subnormal), a far group's scale no longer put its smallest values at z = -128, and
    # they were clipped to code 0, up to 22 steps off; from `s`, each is within half a step
    zero = torch.round(-lo / s).clamp(-128, 127)
    codes = (torch.round(groups / s[..., None]) + zero[..., None]).clamp(0, levels)
    return s.half(), zero.to(torch.int8), codes.to(torch.uint8)


def _fp16_up(x: torch.Tensor) -> torch.Tensor:
    """`x` rounded up to an fp16 value (as fp32): a scale never shrinks the range it covers."""
    half = x.half()
    up = torch.nextafter(half, torch.full_like(half, float("inf")))
    return torch.where(half.float() < x, up, half).float()
