"""Audit 4: the codecs and the block copies on KV at the edges.

- Every block a codec calls keepable encodes to a payload its own `validate` accepts and that
  decodes within the codec's bound, on seeded groups of tiny, denormal, huge and mixed-sign
  values in every engine dtype: an fp32 head of denormals once got an fp8 scale of 0 (amax /
  448 underflowed), so 0 / 0 wrote NaN codes that a store acknowledged and could never load
  (host: every load raised; disk: a miss blamed on the disk). The Triton decoder reads such a
  payload as torch does.
- fp8 pools on the CPU: `gather` copies their bits (torch's CPU `index_copy_` has no float8
  kernel: loads of pages from scattered slots and demoting stores raised NotImplementedError),
  and a strategy that raises is refused for that kind of copy, never retried, while another
  copies (`InvalidArgumentError` only when none is left).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.blocks import KVLayout
from kvtier.config import parse_config
from kvtier.errors import InvalidArgumentError
from kvtier.kernels import block_copy
from kvtier.kernels.block_copy import CopyStrategy, applies_anywhere, copy_blocks_gather
from kvtier.kernels.dequant import dequantize
from kvtier.kernels.paged_attention import available
from kvtier.quant import QuantCodec, QuantSpec
from kvtier.store import KVStore
from kvtier.transfer.planner import BlockCopier, CopyPlanner

SPECS = [
    QuantSpec("fp8"),
    QuantSpec("int8"),
    QuantSpec("int4"),
    QuantSpec("int4", keys="channel"),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP8_SCALE_MIN = 2.0**-117  # the fp8 scale's floor (`kvtier.quant`'s module doc)
TINY = KVLayout("tiny", 2, 2, 8, "float32", 4)  # R = 16, 4 tokens


def denormal_block(layout: KVLayout) -> torch.Tensor:
    """One block of zeros but one fp32 denormal, 1e-44, in layer 0's K, head 0."""
    x = torch.zeros(1, *layout.block_shape, dtype=layout.dtype)
    x[0, 0, 0, 0, 0, 0] = 1e-44
    return x


def groups(seed: int, n: int, shape: Sequence[int]) -> torch.Tensor:
    """`n` blocks of `shape` (fp32, `[L, 2, T, H, D]`), each head's values (an fp8 scale's)
    from one of the hard cases: zeros, fp32 denormals (some a lone one), tiny normals, values at
    fp16's edge, mixed signs over many binades, one sign far from 0."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.empty(n, *shape)
    heads = x.permute(0, 1, 2, 4, 3, 5).reshape(-1, shape[2] * shape[4])  # a copy, [.., T*D]
    size = heads.shape[1]
    for i in range(heads.shape[0]):
        case = int(torch.randint(0, 8, (1,), generator=gen))
        head = torch.randn(size, generator=gen)
        if case == 0:
            head.zero_()
        elif case == 1:  # fp32 denormals below 448 * 2**-149: amax / 448 rounds to 0
            head = head * 1e-43 * (torch.rand(size, generator=gen) < 0.3)
        elif case == 2:  # denormals bf16 keeps too
            head = head * 1e-39
        elif case == 3:
            head = head * 1e-30
        elif case == 4:
            head = (head.sign() * 65504 * torch.rand(size, generator=gen)).clamp(-65504, 65504)
        elif case == 5:  # mixed signs, magnitudes from 1e-40 to 1e4
            head = head.sign() * 10 ** (torch.rand(size, generator=gen) * 44 - 40)
        elif case == 6:
            head = 60000 + head.abs() * 100
        else:
            head = -(1e-20 + head.abs() * 1e-21)
        heads[i] = head
    T, H, D = shape[2], shape[3], shape[4]
    return heads.reshape(n, shape[0], 2, H, T, D).permute(0, 1, 2, 4, 3, 5).contiguous()


def bound(spec: QuantSpec, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per value of `x` (fp32, `[n, L, 2, T, H, D]`), how far the round trip may move it: the
    codec's step (module doc of `kvtier.quant`) and the engine dtype's rounding on top."""
    info = torch.finfo(dtype)
    rounding = x.abs() * info.eps + info.smallest_normal * info.eps
    if spec.kind == "fp8":
        amax = x.abs().amax(dim=(3, 5), keepdim=True)
        scale = (amax / 448).clamp(min=FP8_SCALE_MIN)
        return x.abs() / 16 + scale * 2**-9 + rounding
    levels = (1 << spec.bits) - 1
    n = x.shape[0]
    # a loose step for every group: the block's widest spread (or far-from-0 group) over
    # levels, rounded up to fp16, and at least fp16's smallest step
    span = (x.amax(dim=(1, 2, 3, 4, 5)) - x.amin(dim=(1, 2, 3, 4, 5))) / levels
    far = x.abs().amax(dim=(1, 2, 3, 4, 5)) / (levels + 127)
    step = torch.maximum(span, far) * (1 + 2**-9) + 2**-24
    return 1.5 * step.reshape(n, 1, 1, 1, 1, 1) + rounding


# -- the codecs ---------------------------------------------------------------------------------


def test_fp8_keeps_an_fp32_head_of_denormals() -> None:
    codec = QuantCodec(QuantSpec("fp8"), TINY)
    x = denormal_block(TINY)
    assert bool(codec.keepable(x)[0])
    payload = codec.encode(x)
    codec.validate(payload)  # no NaN code: the old encoder wrote 0 / 0 here
    y = codec.decode(payload)
    assert bool(torch.isfinite(y).all())
    assert float((y - x).abs().max()) <= FP8_SCALE_MIN * 2**-10


def test_every_keepable_block_encodes_to_a_payload_that_validates_and_decodes_in_bound() -> None:
    for seed, dtype in enumerate(DTYPES):
        layout = KVLayout("fuzz", 2, 2, 8, str(dtype).removeprefix("torch."), 4)
        x = groups(seed, 32, layout.block_shape).to(dtype)
        for spec in SPECS:
            codec = QuantCodec(spec, layout)
            kept = codec.keepable(x)
            assert bool(kept.all()), f"{spec} {dtype}"  # all within fp16's range
            payload = codec.encode(x)
            assert codec.validate(payload) == len(x), f"{spec} {dtype}"
            for i in range(len(x)):  # one block at a time: per-block scales, exact bounds
                one = x[i : i + 1].float()
                y = codec.decode(payload[i : i + 1]).float()
                assert bool(torch.isfinite(y).all()), f"{spec} {dtype} block {i}"
                err = (y - one).abs()
                limit = bound(spec, one, dtype)
                assert bool((err <= limit).all()), (
                    f"{spec} {dtype} block {i}: error {float((err - limit).max()):g} past bound"
                )


@pytest.mark.skipif(not available(), reason="needs Triton (its interpreter on the CPU)")
def test_the_triton_decoder_reads_a_payload_of_denormals_as_torch_does() -> None:
    layout = TINY
    codec = QuantCodec(QuantSpec("fp8"), layout)
    x = groups(7, 2, layout.block_shape)
    x[0] = denormal_block(TINY)[0]
    payload = codec.encode(x.to(layout.dtype))
    pool = torch.full((3, *layout.block_shape), float("nan"), dtype=layout.dtype)
    dequantize(codec, payload, pool, torch.tensor([2, 0]), kernel=True)
    expected = codec.decode(payload)
    assert torch.equal(pool[[2, 0]].view(torch.uint8), expected.view(torch.uint8))


def model(dtype: str) -> dict[str, Any]:
    return {"name": "m", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": dtype}


def denormal_prefix() -> torch.Tensor:
    """8 tokens of fp32 KV `[L, 2, T, H, D]`: zeros and one denormal."""
    kv = torch.zeros(2, 2, 8, 2, 8)
    kv[0, 0, 0, 0, 0] = 1e-44
    return kv


def test_a_host_fp8_tier_serves_a_prefix_of_denormals() -> None:
    bb = KVLayout("m", 2, 2, 8, "float32", 4).block_bytes
    config = parse_config(
        {
            "model": model("float32"),
            "block_tokens": 4,
            "tiers": {
                "gpu": {"capacity": 2 * bb, "device": "cpu"},
                "host": {"capacity": 8 * bb, "pinned": False, "codec": "fp8"},
            },
            "policy": {"write": "write_back"},
            "mover": {"background": False},
        }
    )
    store = KVStore(config)
    try:
        tokens, kv = list(range(8)), denormal_prefix()
        assert store.store(tokens, kv).stored_tokens == 8
        store.store(list(range(100, 108)), torch.randn(2, 2, 8, 2, 8))  # demotes the prefix
        hit = store.lookup(tokens)
        assert (hit.gpu_tokens, hit.host_tokens) == (0, 8)
        loaded = store.load(tokens)
        assert loaded.num_tokens == 8
        assert float((loaded.kv - kv).abs().max()) <= FP8_SCALE_MIN * 2**-10
        lease = store.prefetch(tokens)
        assert lease.wait(timeout=5)
        assert lease.num_tokens == 8
        store.release(lease)
    finally:
        store.close()


def test_a_disk_fp8_tier_serves_a_prefix_of_denormals(tmp_path: Path) -> None:
    bb = KVLayout("m", 2, 2, 8, "float32", 4).block_bytes
    config = parse_config(
        {
            "model": model("float32"),
            "block_tokens": 4,
            "tiers": {
                "gpu": {"capacity": 2 * bb, "device": "cpu"},
                "host": {"capacity": 2 * bb, "pinned": False},
                "disk": {"capacity": "1MiB", "path": str(tmp_path / "disk"), "codec": "fp8"},
            },
            "policy": {"write": "write_through", "disk_admission_hits": 0},
            "mover": {"background": False},
        }
    )
    store = KVStore(config)
    try:
        tokens, kv = list(range(8)), denormal_prefix()
        assert store.store(tokens, kv).stored_tokens == 8
        for i in range(1, 4):  # pushes the prefix out of gpu and host
            store.store(list(range(1000 * i, 1000 * i + 8)), torch.randn(2, 2, 8, 2, 8))
        assert store.lookup(tokens).disk_tokens == 8
        loaded = store.load(tokens)
        assert loaded.num_tokens == 8
        assert float((loaded.kv - kv).abs().max()) <= FP8_SCALE_MIN * 2**-10
        assert store.status()["tiers"]["disk"]["faults"]["corrupt_reads"] == 0
    finally:
        store.close()


# -- the block copies ---------------------------------------------------------------------------

FP8 = ["float8_e4m3fn", "float8_e5m2"]


@pytest.mark.parametrize("dtype", FP8)
def test_gather_copies_fp8_pools_bit_for_bit(dtype: str) -> None:
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(0, 256, (6, 2, 2, 4, 2, 8), dtype=torch.uint8, generator=gen)
    dst = torch.zeros_like(src)
    fp8 = getattr(torch, dtype)
    copy_blocks_gather(src.view(fp8), dst.view(fp8), [5, 0, 3], [1, 4, 2])
    assert torch.equal(dst[[1, 4, 2]], src[[5, 0, 3]])  # every byte, NaN codes included
    assert not dst[[0, 3, 5]].any()


def fp8_store(dtype: str, write: str) -> tuple[KVStore, KVLayout]:
    layout = KVLayout("m", 2, 2, 8, dtype, 4)
    config = parse_config(
        {
            "model": model(dtype),
            "block_tokens": 4,
            "tiers": {
                "gpu": {"capacity": 32 * layout.block_bytes, "device": "cpu"},
                "host": {"capacity": 64 * layout.block_bytes, "pinned": False},
            },
            "policy": {"write": write},
            "mover": {"background": False},
        }
    )
    return KVStore(config), layout


def interleaved(store: KVStore, dtype: torch.dtype) -> tuple[list[int], torch.Tensor]:
    """Prefix A stored a block at a time between blocks of prefix B: A's 8 blocks lie in
    scattered slots. Returns A's tokens and KV."""
    gen = torch.Generator().manual_seed(2)
    a, b = list(range(32)), list(range(1000, 1032))
    kv_a = torch.randn(2, 2, 32, 2, 8, generator=gen).to(dtype)
    kv_b = torch.randn(2, 2, 32, 2, 8, generator=gen).to(dtype)
    for i in range(1, 9):
        store.store(a[: 4 * i], kv_a[:, :, : 4 * i])
        store.store(b[: 4 * i], kv_b[:, :, : 4 * i])
    return a, kv_a


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_pages_load_from_scattered_slots_bit_for_bit(dtype: str) -> None:
    store, layout = fp8_store(dtype, "write_through")
    try:
        tokens, kv = interleaved(store, layout.dtype)
        pages = kv.reshape(2, 2, 8, 4, 2, 8).permute(2, 0, 1, 3, 4, 5).contiguous()
        for _ in range(10):  # every candidate strategy, measured, then the chosen one
            loaded = store.load(tokens, layout="blocks")
            assert loaded.num_tokens == 32
            assert torch.equal(loaded.kv.view(torch.uint8), pages.view(torch.uint8))
    finally:
        store.close()


def test_fp8_stores_that_demote_keep_every_bit() -> None:
    store, layout = fp8_store("float8_e4m3fn", "write_back")
    try:
        tokens, kv = interleaved(store, layout.dtype)
        gen = torch.Generator().manual_seed(3)
        for i in range(12):  # each fills the gpu tier further: demotions of scattered slots
            fill = torch.randn(2, 2, 16, 2, 8, generator=gen).to(layout.dtype)
            store.store(list(range(5000 + 100 * i, 5016 + 100 * i)), fill)
        store.check()
        loaded = store.load(tokens)
        assert loaded.num_tokens == 32
        assert torch.equal(loaded.kv.view(torch.uint8), kv.view(torch.uint8))
    finally:
        store.close()


def raising(name: str, calls: list[str]) -> CopyStrategy:
    """A strategy torch cannot run on these buffers: it counts its calls and raises."""

    def copy(
        src: torch.Tensor, dst: torch.Tensor, src_slots: Sequence[int], dst_slots: Sequence[int]
    ) -> None:
        calls.append(name)
        raise NotImplementedError(f'"{name}" not implemented for these buffers')

    return CopyStrategy(name, copy, applies_anywhere)


def test_a_strategy_that_raises_is_refused_and_the_copy_goes_on() -> None:
    calls: list[str] = []
    slices = CopyStrategy("slices", block_copy.copy_blocks_slices, applies_anywhere)
    copier = BlockCopier(CopyPlanner((raising("broken", calls), slices), samples=2))
    src = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)
    for _ in range(6):
        dst = torch.zeros_like(src)
        assert copier.copy(src, dst, [0, 2, 4], [5, 3, 1]) == "slices"
        assert torch.equal(dst[[5, 3, 1]], src[[0, 2, 4]])
    assert calls == ["broken"]  # tried once, never again
    assert list(copier.planner.choices.values()) == ["slices"]
    with pytest.raises(InvalidArgumentError, match="out of range"):  # the caller's error passes
        copier.copy(src, torch.zeros_like(src), [0, 2, 4], [9, 3, 1])
    assert copier.copy(src, torch.zeros_like(src), [0, 2, 4], [5, 3, 1]) == "slices"


def test_when_every_strategy_raises_the_copy_raises_a_typed_error() -> None:
    calls: list[str] = []
    copier = BlockCopier(CopyPlanner((raising("one", calls), raising("two", calls))))
    src = torch.zeros(4, 4)
    with pytest.raises(InvalidArgumentError, match="no strategy copies"):
        copier.copy(src, torch.zeros_like(src), [0, 2], [1, 3])
    assert sorted(calls) == ["one", "two"]
