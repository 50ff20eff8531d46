"""Quantized blocks (`kvtier.quant`): sizes, what a round trip keeps, hostile payloads, codec
ids, and the Triton decoder (under Triton's interpreter here) bit for bit against the torch
reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.blocks import KVLayout
from kvtier.errors import ConfigError, InvalidArgumentError
from kvtier.kernels.dequant import dequantize, runs_kernel
from kvtier.quant import CorruptQuantPayload, QuantCodec, QuantSpec
from kvtier.tiers.disk.codec import CorruptPayload, codec_for, tier_codec

SMOLLM2 = KVLayout("smollm2", 30, 3, 64, "bfloat16", 16)  # R = 192
SMALL = KVLayout("small", 2, 2, 64, "bfloat16", 4)  # R = 128
SPECS = [
    QuantSpec("fp8"),
    QuantSpec("int8"),
    QuantSpec("int4"),
    QuantSpec("int8", keys="channel"),
    QuantSpec("int4", 32, "channel"),
]


def kv(layout: KVLayout, n: int, seed: int = 0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """n blocks of KV-like values: normal, with a per-channel offset in K (as RoPE'd keys
    have) and one large channel."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *layout.block_shape, generator=gen)
    x[:, :, 0] += torch.randn(layout.num_kv_heads, layout.head_dim, generator=gen) * 3
    x[:, :, 0, :, 0, 5] *= 20
    return x.to(dtype or layout.dtype)


def test_sizes_and_ratios_on_smollm2_blocks() -> None:
    sizes = {
        spec: QuantCodec(spec, SMOLLM2).payload_nbytes for spec in SPECS[:3]
    }  # raw bf16: 368,640 bytes
    n = 30 * 2 * 16 * 192
    assert sizes[QuantSpec("fp8")] == n + 30 * 2 * 3 * 4
    # int8: groups of 96 (the largest divisor of 192 up to 128), 3 bytes each, K's and V's
    assert sizes[QuantSpec("int8")] == n + 30 * 2 * (16 * 192 // 96) * 3
    # int4: K in groups of 32, V of 64
    assert sizes[QuantSpec("int4")] == n // 2 + 30 * (16 * 192 // 32 + 16 * 192 // 64) * 3
    ratios = [QuantCodec(spec, SMOLLM2).ratio() for spec in SPECS[:3]]
    assert ratios[0] > 1.99 and ratios[1] >= 1.9 and ratios[2] >= 3.5
    kivi = QuantCodec(QuantSpec("int4", keys="channel"), SMOLLM2)
    assert kivi.k_groups == 192 and kivi.payload_nbytes > sizes[QuantSpec("int4")]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-{s.keys}")
def test_a_round_trip_stays_within_half_a_step_of_each_group(spec: QuantSpec) -> None:
    codec = QuantCodec(spec, SMALL)
    x = kv(SMALL, 3)
    payload = codec.encode(x)
    assert payload.dtype == torch.uint8 and payload.shape == (3, codec.payload_nbytes)
    y = codec.decode(payload)
    assert y.dtype == SMALL.dtype and y.shape == x.shape
    err = (y.float() - x.float()).abs()
    if spec.kind == "fp8":  # e4m3: 3 mantissa bits, relative error <= 2**-4 of the value
        scale = x.float().abs().amax(dim=(3, 5), keepdim=True) / 448
        assert bool((err <= x.float().abs() / 16 + scale * 2**-9 + 0.02).all())
    else:  # a group's step is (max - min) / levels; bf16 rounding adds <= 2**-8 relative
        levels = (1 << spec.bits) - 1
        span = x.float().amax() - x.float().amin()
        assert float(err.max()) <= float(span) / levels * 0.51 + float(x.abs().max()) / 128
    assert torch.equal(codec.decode(payload), y)  # deterministic


def test_per_channel_keys_are_closer_on_offset_channels() -> None:
    x = kv(SMALL, 4, seed=1)
    errors = {}
    for keys in ("token", "channel"):
        codec = QuantCodec(QuantSpec("int4", keys=keys), SMALL)
        errors[keys] = float((codec.decode(codec.encode(x)) - x).float()[:, :, 0].abs().mean())
    assert errors["channel"] < errors["token"]


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_groups_far_from_zero_widen_their_scale_and_stay_close(kind: str) -> None:
    codec = QuantCodec(QuantSpec(kind), SMALL)
    x = torch.linspace(0, 1, codec.numel).reshape(1, *SMALL.block_shape)
    for far in (x * 0.5 + 1000.0, -(x * 0.5 + 1000.0), x * 0.5 + 3.0):
        y = codec.decode(codec.encode(far.to(SMALL.dtype))).float()
        # 1000.x: z pinned at -128 (or 127), the scale widened to 1000.5 / (levels + 128)
        step = float(far.abs().amax()) / ((1 << codec.spec.bits) - 1 + 127)
        assert float((y - far).abs().max()) <= max(step, 4.0)  # bf16's own step at 1000 is 4


def test_kv_a_codec_cannot_keep_is_refused() -> None:
    codec = QuantCodec(QuantSpec("int8"), SMALL)
    x = kv(SMALL, 1)
    for bad in (float("nan"), float("inf"), 1e6):
        y = x.float().clone()
        y[0, 1, 0, 2, 1, 3] = bad
        with pytest.raises(InvalidArgumentError, match="not finite or beyond"):
            codec.encode(y)
    with pytest.raises(InvalidArgumentError, match="expected"):
        codec.encode(x[0])
    with pytest.raises(InvalidArgumentError, match="float"):
        codec.encode(torch.zeros(1, *SMALL.block_shape, dtype=torch.int32))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-{s.keys}")
def test_payloads_no_encoder_writes_are_refused(spec: QuantSpec) -> None:
    codec = QuantCodec(spec, SMALL)
    good = codec.encode(kv(SMALL, 1))
    with pytest.raises(CorruptQuantPayload, match="bytes"):
        codec.decode(good[:, :-1])
    meta = codec.code_nbytes
    width = 4 if spec.kind == "fp8" else 2
    for bad in (float("nan"), float("-inf"), -1.0):
        payload = good.clone()
        payload[0, meta : meta + width] = torch.tensor(
            [bad], dtype=torch.float32 if width == 4 else torch.float16
        ).view(torch.uint8)
        with pytest.raises(CorruptQuantPayload, match="scale"):
            codec.decode(payload)
    if spec.kind == "fp8":
        payload = good.clone()
        payload[0, 7] = 0x7F  # e4m3fn NaN
        with pytest.raises(CorruptQuantPayload, match="NaN"):
            codec.decode(payload)
        payload = good.clone()  # a scale 448 codes of which overflow fp32 (2.4e36 * 144)
        payload[0, meta : meta + 4] = torch.tensor([2.4e36]).view(torch.uint8)
        with pytest.raises(CorruptQuantPayload, match="scale above"):
            codec.decode(payload)
    else:  # any zero point is one an encoder may write: the value stays finite
        payload = good.clone()
        payload[0, -1] = 0x80  # z = -128
        assert bool(torch.isfinite(codec.decode(payload).float()).all())
    with pytest.raises(InvalidArgumentError, match="uint8"):
        codec.decode(good.view(torch.int16))


TINY = KVLayout("tiny", 1, 2, 8, "bfloat16", 4)  # R = 16, 128 values a block


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(SPECS), st.data())
def test_any_bytes_of_a_payloads_size_decode_finite_or_are_refused(
    spec: QuantSpec, data: st.DataObject
) -> None:
    codec = QuantCodec(QuantSpec(spec.kind, keys=spec.keys), TINY)
    raw = data.draw(st.binary(min_size=codec.payload_nbytes, max_size=codec.payload_nbytes))
    payload = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(1, -1)
    try:
        out = codec.decode(payload)
    except CorruptQuantPayload:
        return
    assert out.shape == (1, *TINY.block_shape) and bool(torch.isfinite(out.float()).all())
    pool = torch.zeros(2, *TINY.block_shape, dtype=TINY.dtype)
    dequantize(codec, payload, pool, torch.tensor([1]), kernel=True)
    assert torch.equal(pool[1].view(torch.int16), out[0].view(torch.int16))


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(SPECS),
    st.floats(-3e4, 3e4, allow_nan=False, width=16),
    st.floats(0, 2e3, allow_nan=False, width=16),
    st.integers(0, 2**31),
)
def test_encode_then_decode_stays_within_a_step_of_any_kv(
    spec: QuantSpec, center: float, spread: float, seed: int
) -> None:
    codec = QuantCodec(QuantSpec(spec.kind, keys=spec.keys), TINY)
    gen = torch.Generator().manual_seed(seed)
    x = (center + spread * torch.rand(1, *TINY.block_shape, generator=gen)).to(TINY.dtype)
    y = codec.decode(codec.encode(x)).float()
    top = float(x.float().abs().max())
    if spec.kind == "fp8":  # 3 mantissa bits of the scaled value, bf16 rounding on top
        bound = top / 16 + top / 128 + 1e-3
    else:  # half a step of the widest group, or a widened one far from 0; bf16 rounding
        levels = (1 << spec.bits) - 1
        bound = max(spread / levels, top / (levels + 127)) + top / 128 + 1e-3
    assert float((y - x.float()).abs().max()) <= bound


def test_codec_ids_name_everything_decoding_needs() -> None:
    assert [QuantCodec(s, SMOLLM2).id for s in SPECS] == [
        "fp8",
        "i8k60v60",  # K and V in groups of 96 (hex 60)
        "i4k20v40",  # K 32, V 64
        "i8kcv60",
        "i4kcv20",
    ]
    assert QuantCodec(QuantSpec("int4", 48), SMOLLM2).id == "i4k30v30"  # `group`: both
    for spec in SPECS:
        codec = QuantCodec(spec, SMOLLM2)
        again = QuantSpec.from_id(codec.id)
        assert again is not None and QuantCodec(again, SMOLLM2).id == codec.id
    for hostile in ("i4", "i3k20v40", "i4k0v40", "i4k20v40x", "i8k100v40", "fp16", "", "i4k020v40",
                    "i4kCv40", "i4k20v0", "i4g64t"):  # fmt: skip
        assert QuantSpec.from_id(hostile) is None
        with pytest.raises(CorruptPayload, match="unknown codec"):
            codec_for(hostile, SMOLLM2)
    with pytest.raises(CorruptPayload, match="does not fit"):
        codec_for("i4k20v64", SMOLLM2)  # V groups of 100 do not divide 192
    with pytest.raises(CorruptPayload, match="unknown codec"):
        codec_for("i4k20v40", None)  # a tier whose superblock names no quantized layout


def test_config_values_are_checked_against_the_layout() -> None:
    assert tier_codec("int4", SMOLLM2).name == "i4k20v40"
    assert tier_codec("int8", SMALL).name == "i8k80v80"
    assert tier_codec("lz4", SMOLLM2).lossy is False
    with pytest.raises(ConfigError, match=r"codec_group.*divisor of num_kv_heads"):
        tier_codec("int4", SMOLLM2, group=128)
    for bad in (0, 256, True):
        with pytest.raises(ConfigError, match="codec_group"):
            QuantSpec("int4", bad)
    with pytest.raises(ConfigError, match="codec_keys"):
        QuantSpec("int4", keys="head")
    with pytest.raises(ConfigError, match="'codec'"):
        QuantSpec("int2")


# ---- the Triton decoder ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-{s.keys}")
def test_the_kernel_decodes_bit_for_bit_as_the_reference(spec: QuantSpec, dtype: str) -> None:
    layout = KVLayout("small", 2, 2, 64, dtype, 4)
    codec = QuantCodec(spec, layout)
    payload = codec.encode(kv(layout, 3, seed=2))
    pool = torch.full((6, *layout.block_shape), float("nan"), dtype=layout.dtype)
    assert not runs_kernel(pool)  # a CPU pool: torch, unless asked
    dequantize(codec, payload, pool, torch.tensor([5, 0, 3]), kernel=True)  # interpreted
    expected = codec.decode(payload)
    assert torch.equal(pool[[5, 0, 3]].view(torch.uint8), expected.view(torch.uint8))
    assert bool(pool[[1, 2, 4]].isnan().all())  # other slots untouched


def every_fp8_code(codec: QuantCodec, device: str) -> torch.Tensor:
    """A payload of 2 blocks whose codes run through every fp8 code but NaN (0x80 is -0.0)."""
    payload = codec.encode(kv(codec.layout, 2)).to(device)
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    payload[:, : codec.code_nbytes] = codes.repeat(codec.code_nbytes // len(codes) + 1)[
        : codec.code_nbytes
    ].to(device)
    return payload


def test_the_kernel_decodes_every_fp8_code_and_odd_row_widths() -> None:
    layout = KVLayout("odd", 1, 3, 40, "bfloat16", 4)  # R = 120: masked lanes, unaligned
    codec = QuantCodec(QuantSpec("fp8"), layout)
    payload = every_fp8_code(codec, "cpu")
    pool = torch.zeros(2, *layout.block_shape, dtype=layout.dtype)
    dequantize(codec, payload, pool, torch.tensor([1, 0]), kernel=True)
    assert torch.equal(pool[[1, 0]].view(torch.uint8), codec.decode(payload).view(torch.uint8))
    int4 = QuantCodec(QuantSpec("int4", 40, "channel"), layout)
    payload = int4.encode(kv(layout, 2, seed=3))
    dequantize(int4, payload, pool, torch.tensor([0, 1]), kernel=True)
    assert torch.equal(pool.view(torch.uint8), int4.decode(payload).view(torch.uint8))


def test_the_kernel_wrapper_checks_before_it_launches() -> None:
    codec = QuantCodec(QuantSpec("int8"), SMALL)
    payload = codec.encode(kv(SMALL, 2))
    pool = torch.zeros(4, *SMALL.block_shape, dtype=SMALL.dtype)
    with pytest.raises(InvalidArgumentError, match="slots"):
        dequantize(codec, payload, pool, torch.tensor([0, 4]))
    with pytest.raises(InvalidArgumentError, match="slots"):
        dequantize(codec, payload, pool, torch.tensor([0]))
    with pytest.raises(InvalidArgumentError, match="pool"):
        dequantize(codec, payload, pool.float(), torch.tensor([0, 1]))
    bad = payload.clone()
    bad[1, codec.code_nbytes : codec.code_nbytes + 2] = torch.tensor(
        [float("nan")], dtype=torch.float16
    ).view(torch.uint8)
    with pytest.raises(CorruptQuantPayload):
        dequantize(codec, bad, pool, torch.tensor([0, 1]))
    assert not pool.any()  # nothing written


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-{s.keys}")
def test_on_a_gpu_the_kernel_decodes_as_torch_does_there(spec: QuantSpec) -> None:
    layout = KVLayout("llama-ish", 4, 8, 128, "bfloat16", 16)
    codec = QuantCodec(spec, layout)
    payload = codec.encode(kv(layout, 5).cuda())
    pool = torch.full((9, *layout.block_shape), float("nan"), dtype=layout.dtype, device="cuda")
    slots = torch.tensor([8, 0, 3, 5, 1], device="cuda")
    assert runs_kernel(pool)
    dequantize(codec, payload, pool, slots)
    expected = codec.decode(payload)  # torch, on the same GPU
    assert torch.equal(pool[slots].view(torch.int16), expected.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_kernel_decodes_every_fp8_code_as_torch_does_there() -> None:
    # the H200 found it: the code 0x80 (-0.0) came out +0.0, the sign lost in `-x`
    codec = QuantCodec(QuantSpec("fp8"), KVLayout("odd", 1, 3, 40, "bfloat16", 4))
    payload = every_fp8_code(codec, "cuda")
    pool = torch.zeros(2, *codec.layout.block_shape, dtype=codec.layout.dtype, device="cuda")
    dequantize(codec, payload, pool, torch.tensor([1, 0], device="cuda"))
    expected = codec.decode(payload)  # torch, on the same GPU
    assert torch.equal(pool[[1, 0]].view(torch.int16), expected.view(torch.int16))
    negative_zero = payload[:, : codec.code_nbytes] == 0x80
    assert bool(negative_zero.any())
    assert bool((pool[[1, 0]].reshape(2, -1).view(torch.int16)[negative_zero] == -(2**15)).all())


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_one_block_of_an_odd_head_dim_encodes_checks_and_decodes(kind: str) -> None:
    """A one-row payload's scales sit at an odd offset of its storage (codes of an odd
    head_dim): they were viewed in place as fp16/fp32, a RuntimeError; a copy reads them."""
    layout = KVLayout("odd", 1, 1, 5, "float16", 1)
    codec = QuantCodec(QuantSpec(kind), layout)
    block = torch.randn(1, *layout.block_shape, generator=torch.Generator().manual_seed(0)).half()
    payload = codec.encode(block)
    assert codec.validate(payload) == 1
    assert torch.equal(codec.decode(payload), codec.decode(torch.cat([payload, payload]))[:1])
    assert (codec.decode(payload).float() - block.float()).abs().max() < 0.5
