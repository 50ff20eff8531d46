"""Audit BF: quantized blocks at the edges: no blocks at all, and fp8 engine pools decoded by
the Triton kernel.

Each test failed before its fix: encoding no blocks raised torch's `RuntimeError` (`amax()` of
an empty tensor), and so did decoding a payload of no blocks with int8 or int4 (a reshape to
`-1` of nothing), hence `QuantPool.write([], ...)` and `read([])`, which a raw pool takes; the
Triton decoder, under the interpreter, wrote 8% of an fp8 pool's values wrong (1.99 became
1.0: the interpreter's fp32 -> fp8 rounding does not carry into the exponent), where torch's
decode and a GPU round to nearest.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.blocks import KVLayout
from kvtier.kernels.dequant import dequantize
from kvtier.kernels.paged_attention import available
from kvtier.quant import QuantCodec, QuantSpec
from kvtier.tiers.quantized import QuantPool

LAYOUT = KVLayout("m", 2, 2, 4, "float16", 4)
SPECS = [
    QuantSpec("fp8"),
    QuantSpec("int8"),
    QuantSpec("int4"),
    QuantSpec("int8", keys="channel"),
    QuantSpec("int4", 4, "channel"),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: f"{spec.kind}-{spec.keys}")
def test_no_blocks_encode_and_decode_to_none(spec: QuantSpec) -> None:
    codec = QuantCodec(spec, LAYOUT)
    none = torch.zeros((0, *LAYOUT.block_shape), dtype=LAYOUT.dtype)
    payload = codec.encode(none)
    assert payload.shape == (0, codec.payload_nbytes) and payload.dtype == torch.uint8
    assert codec.decode(payload).shape == (0, *LAYOUT.block_shape)
    pool = QuantPool(codec, 3)
    pool.write([], none)  # as a raw pool takes it
    assert pool.read([]).shape == (0, *LAYOUT.block_shape)
    pool.check()
    kv = torch.randn((2, *LAYOUT.block_shape)).to(LAYOUT.dtype)  # and it still codes blocks
    slots = pool.allocate(2)
    pool.write(slots, kv)
    assert torch.equal(pool.read(slots), codec.decode(codec.encode(kv)))
    pool.check()


@pytest.mark.skipif(not available(), reason="needs Triton (its interpreter on the CPU)")
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_the_triton_decoder_rounds_into_an_fp8_pool_as_torch_does(dtype: str) -> None:
    """Random int8 payloads whose scales span 2**-24 .. 2**6: every finite fp8 value, the
    subnormal ones and the ties among them, bit for bit."""
    layout = KVLayout("m", 1, 8, 16, dtype, 1)  # 2 programs a block: the interpreter is slow
    codec = QuantCodec(QuantSpec("int8", 16), layout)
    gen = torch.Generator().manual_seed(0)
    n, groups = 32, layout.num_layers * (codec.k_groups + codec.v_groups)
    payload = torch.randint(0, 256, (n, codec.payload_nbytes), dtype=torch.uint8, generator=gen)
    powers = 2.0 ** torch.randint(-24, 6, (n, groups), generator=gen).float()
    scales = ((torch.rand(n, groups, generator=gen) + 1) * powers).half()
    payload[:, codec.code_nbytes : codec.code_nbytes + 2 * groups] = scales.view(torch.uint8)
    expected = codec.decode(payload)
    assert torch.unique(expected.view(torch.uint8)).numel() > 200  # (most of the 256 codes)
    pool = torch.zeros((n + 2, *layout.block_shape), dtype=layout.dtype)
    slots = torch.randperm(n + 2, generator=gen)[:n]
    dequantize(codec, payload, pool, slots, kernel=True)
    assert torch.equal(pool[slots].view(torch.uint8), expected.view(torch.uint8))
    others = torch.ones(n + 2, dtype=torch.bool)
    others[slots] = False
    assert not pool[others].view(torch.uint8).any()  # nothing written outside its slots
