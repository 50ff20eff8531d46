"""Quantized blocks of an fp16 model at the edge of fp16's range (`kvtier.quant`): a group's
scale rounds up to fp16, so its codes decode up to half a step past the group's largest value;
next to 65504 that is past fp16's largest finite value. Decoding clamps to the dtype's finite
range before rounding, so such KV comes back finite and within half a step, from the torch
decoder, the Triton one (interpreted here) and a real store's quantized host tier alike; and any
bytes of a payload's size decode to finite fp16 or are refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import disk_config
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.blocks import KVLayout
from kvtier.config import KVTierConfig, parse_config
from kvtier.kernels.dequant import dequantize
from kvtier.quant import QuantCodec, QuantSpec
from kvtier.store import KVStore

FP16 = KVLayout("edge", 2, 2, 8, "float16", 4)  # R = 16
SPECS = [
    QuantSpec("fp8"),
    QuantSpec("int8"),
    QuantSpec("int4"),
    QuantSpec("int8", keys="channel"),
    QuantSpec("int4", keys="channel"),
]
FP16_MAX = 65504.0


def edge(name: str) -> torch.Tensor:
    """One fp16 block of KV at fp16's edge, finite throughout."""
    x = torch.zeros(1, *FP16.block_shape)
    if name == "max":
        x.fill_(FP16_MAX)
    elif name == "-max":
        x.fill_(-FP16_MAX)
    elif name == "65000":
        x.fill_(65000.0)
    elif name == "int4_edge":  # int4's step past 65504 starts near 62080
        x.fill_(62100.0)
    else:  # one large value in each row next to -1000: a wide group
        x.fill_(-1000.0)
        x[..., 0] = 65400.0
    return x.to(torch.float16)


EDGES = ["max", "-max", "65000", "int4_edge", "mixed"]


def half_step(spec: QuantSpec, x: torch.Tensor) -> float:
    """A bound on one value's error: half the widest step a group of `x` can get (module doc of
    `kvtier.quant`: a group far from 0 widens to max / (levels + 128)), plus fp16's rounding."""
    top = float(x.float().abs().max())
    if spec.kind == "fp8":
        return top / 16 + 32.0
    levels = (1 << spec.bits) - 1
    spread = float(x.float().max() - x.float().min())
    return max(spread / levels, top / (levels + 127)) + 32.0


@pytest.mark.parametrize("name", EDGES)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-{s.keys}")
def test_kv_at_fp16s_edge_decodes_finite_and_within_half_a_step(spec: QuantSpec, name: str) -> None:
    codec = QuantCodec(spec, FP16)
    x = edge(name)
    payload = codec.encode(x)
    y = codec.decode(payload)
    assert y.dtype == torch.float16 and bool(torch.isfinite(y).all()), y.flatten()[:4]
    assert float((y.float() - x.float()).abs().max()) <= half_step(spec, x)
    pool = torch.full((3, *FP16.block_shape), float("nan"), dtype=torch.float16)
    dequantize(codec, payload, pool, torch.tensor([2]), kernel=True)  # interpreted
    assert torch.equal(pool[2].view(torch.int16), y[0].view(torch.int16))


TINY = KVLayout("tiny16", 1, 2, 8, "float16", 4)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(SPECS), st.data())
def test_any_payload_with_valid_scales_decodes_finite_in_fp16(
    spec: QuantSpec, data: st.DataObject
) -> None:
    """Codes and zero points any bytes, scales any an encoder may write: finite fp16 out."""
    codec = QuantCodec(QuantSpec(spec.kind, keys=spec.keys), TINY)
    codes = bytearray(data.draw(st.binary(min_size=codec.code_nbytes, max_size=codec.code_nbytes)))
    if spec.kind == "fp8":  # no NaN code; fp32 scales up to 65504 / 448
        codes = bytearray(c & 0xF7 if c & 0x7F == 0x7F else c for c in codes)
        count, dtype = TINY.num_layers * 2 * TINY.num_kv_heads, torch.float32
        scale = st.floats(0, 146.0, width=32)
    else:  # fp16 scales, any of them
        count, dtype = TINY.num_layers * (codec.k_groups + codec.v_groups), torch.float16
        scale = st.floats(0, FP16_MAX, width=16)
    scales = data.draw(st.lists(scale, min_size=count, max_size=count))
    meta = torch.tensor(scales, dtype=dtype).view(torch.uint8)
    if spec.kind != "fp8":
        zeros = data.draw(st.binary(min_size=count, max_size=count))
        meta = torch.cat([meta, torch.frombuffer(bytearray(zeros), dtype=torch.uint8)])
    payload = torch.cat([torch.frombuffer(codes, dtype=torch.uint8), meta]).reshape(1, -1)
    out = codec.decode(payload)
    assert out.dtype == torch.float16 and bool(torch.isfinite(out).all())
    pool = torch.zeros(2, *TINY.block_shape, dtype=torch.float16)
    dequantize(codec, payload, pool, torch.tensor([1]), kernel=True)
    assert torch.equal(pool[1].view(torch.int16), out[0].view(torch.int16))


def test_a_codec_clamps_to_fp16s_range_whatever_its_dtype() -> None:
    for dtype, finite in (("float16", FP16_MAX), ("bfloat16", 65280.0), ("float32", FP16_MAX)):
        layout = KVLayout("edge", 2, 2, 8, dtype, 4)
        assert QuantCodec(QuantSpec("int4"), layout).finite == finite


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_a_quantized_host_tier_serves_kv_at_fp16s_edge_finite(
    codec: str, tmp_path: Path, open_store: Callable[[KVTierConfig], KVStore]
) -> None:
    plain = disk_config(tmp_path / "disk", block_tokens=16, host_blocks=4).to_dict()
    plain["tiers"]["host"].update(codec=codec)
    plain["tiers"]["disk"] = None
    store = open_store(parse_config(plain))
    tokens = list(range(32))
    shape = (store.layout.num_layers, 2, 32, store.layout.num_kv_heads, store.layout.head_dim)
    kv = torch.full(shape, FP16_MAX, dtype=torch.float16)
    kv[0, 1] = -FP16_MAX
    store.store(tokens, kv)
    store.evict("gpu", 100)
    assert store.lookup(tokens).host_tokens == 32
    got = store.load(tokens)
    assert got.num_tokens == 32 and bool(torch.isfinite(got.kv).all())
    assert float((got.kv.float() - kv.float()).abs().max()) <= FP16_MAX / 255 + 32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-{s.keys}")
def test_on_a_gpu_the_kernel_clamps_as_torch_does_there(spec: QuantSpec) -> None:
    codec = QuantCodec(spec, FP16)
    x = torch.cat([edge(name) for name in EDGES]).cuda()
    payload = codec.encode(x)
    pool = torch.full((8, *FP16.block_shape), float("nan"), dtype=torch.float16, device="cuda")
    slots = torch.tensor([7, 0, 3, 5, 1], device="cuda")
    dequantize(codec, payload, pool, slots)
    expected = codec.decode(payload)  # torch, on the same GPU
    assert torch.equal(pool[slots].view(torch.int16), expected.view(torch.int16))
    assert bool(torch.isfinite(pool[slots]).all())
