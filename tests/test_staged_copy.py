"""Block copies between a CUDA pool and a strided host view through a device stage
(`kernels/staged.py`). On the CPU the arrangement is tested with both sides in host memory (the
stage on the CPU too): every block lands bit-exact in the layer-major view, runs joined on the
host side whatever their device slots, chunked by the stage's size, nothing else touched. On a
GPU: a store's load into a pinned and a pageable layer-major `out`, and a store from one, take
this path and round-trip bit-exact."""

from __future__ import annotations

import random

import pytest
import torch

from kvtier import KVStore, parse_config
from kvtier.blocks import blocks_of
from kvtier.kernels import staged
from kvtier.kernels.block_copy import contiguous_runs

L, T, H, D = 3, 4, 2, 5  # layers, block tokens, kv heads, head dim
BLOCK = (L, 2, T, H, D)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16)


def pool(slots: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**15), 2**15, (slots, *BLOCK), dtype=torch.int16, generator=gen).view(
        torch.bfloat16
    )


def layer_major(tokens: int, fill: float = 7.0) -> torch.Tensor:
    return torch.full((L, 2, tokens, H, D), fill, dtype=torch.bfloat16)


@pytest.mark.parametrize("stage_blocks", [1, 3, 64])
@pytest.mark.parametrize("seed", range(4))
def test_blocks_land_in_a_layer_major_view_from_any_slots(stage_blocks: int, seed: int) -> None:
    rng = random.Random(seed)
    src = pool(40, seed)
    n = rng.randint(1, 12)
    out = layer_major((n + 2) * T)  # room for more than the n blocks: the rest untouched
    view = blocks_of(out, T, 0, n + 2)
    assert not view.is_contiguous() and not staged.applies(src, view)  # both on the CPU
    src_slots = rng.sample(range(40), n) if seed % 2 else list(range(5, 5 + n))
    positions = sorted(rng.sample(range(n + 2), n)) if seed % 3 else list(range(n))
    runs = contiguous_runs(src_slots, positions)
    block_bytes = src[0].numel() * src.element_size()
    staged.copy_runs(src, view, runs, host_is_dst=True, stage_bytes=stage_blocks * block_bytes)
    for slot, position in zip(src_slots, positions, strict=True):
        assert torch.equal(bits(view[position]), bits(src[slot]))
    untouched = [p for p in range(n + 2) if p not in positions]
    for p in untouched:
        assert bool((view[p].float() == 7).all())


@pytest.mark.parametrize("stage_blocks", [1, 2, 64])
@pytest.mark.parametrize("seed", range(4))
def test_blocks_leave_a_layer_major_view_into_any_slots(stage_blocks: int, seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 12)
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn((L, 2, n * T, H, D), generator=gen).to(torch.bfloat16)
    view = blocks_of(kv, T, 0, n)
    dst = pool(40, 100 + seed)
    before = dst.clone()
    dst_slots = rng.sample(range(40), n) if seed % 2 else list(range(3, 3 + n))
    runs = contiguous_runs(list(range(n)), dst_slots)
    block_bytes = dst[0].numel() * dst.element_size()
    staged.copy_runs(view, dst, runs, host_is_dst=False, stage_bytes=stage_blocks * block_bytes)
    for i, slot in enumerate(dst_slots):
        assert torch.equal(bits(dst[slot]), bits(view[i]))
    others = [s for s in range(40) if s not in dst_slots]
    assert torch.equal(bits(dst[others]), bits(before[others]))


def test_it_applies_only_between_a_cuda_side_and_a_strided_host_side() -> None:
    src, out = pool(4, 0), layer_major(4 * T)
    assert not staged.applies(src, blocks_of(out, T, 0, 4))  # no CUDA side
    assert not staged.applies(src, src.clone())


def test_as_words_views_both_sides_as_the_widest_word_they_allow() -> None:
    src = pool(6, 3)  # head_dim 5 bf16: 10 bytes a row, no word wider than 2 bytes divides it
    view = blocks_of(layer_major(6 * T), T, 0, 6)
    first, second = staged.as_words(view, src)
    assert first is view and second is src
    wide = torch.randint(-(2**15), 2**15, (6, 3, 2, T, 2, 8), dtype=torch.int16).view(
        torch.bfloat16
    )
    kv = torch.zeros((3, 2, 6 * T, 2, 8), dtype=torch.bfloat16)
    dst, words = staged.as_words(blocks_of(kv, T, 0, 6), wide)
    assert dst.dtype == words.dtype == torch.int64 and dst.shape[-1] == 2
    dst[1:4].copy_(words[2:5])  # slices of the views are views of the slices
    got = blocks_of(kv, T, 0, 6)
    assert torch.equal(bits(got[1:4]), bits(wide[2:5]))
    assert not bits(got[[0, 4, 5]]).any()
    shifted = torch.zeros(3 * 2 * (6 * T) * 2 * 8 + 1, dtype=torch.bfloat16)[1:]  # offset 2 B
    c, d = staged.as_words(shifted.view(3, 2, 6 * T, 2, 8), kv)
    assert c.dtype == torch.bfloat16 and d.dtype == torch.bfloat16  # no word divides 2 bytes
    other = kv.float()
    first, second = staged.as_words(kv, other)  # two dtypes: left as they are
    assert first is kv and second is other


CUDA = torch.cuda.is_available()


def cuda_store(blocks: int) -> KVStore:
    return KVStore(
        parse_config(
            {
                "model": {
                    "name": "staged",
                    "num_layers": L,
                    "num_kv_heads": H,
                    "head_dim": D,
                    "dtype": "bfloat16",
                },
                "block_tokens": T,
                "tiers": {
                    "gpu": {"capacity": 2 * blocks * L * 2 * T * H * D * 2, "device": "cuda"},
                    "host": {"capacity": 2 * blocks * L * 2 * T * H * D * 2, "pinned": True},
                },
                "mover": {"background": False},
            }
        )
    )


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("pinned", [True, False])
def test_on_a_gpu_a_load_into_a_layer_major_host_out_is_staged_and_exact(pinned: bool) -> None:
    blocks = 300
    tokens = list(range(blocks * T))
    gen = torch.Generator(device="cuda").manual_seed(1)
    kv = torch.randint(-(2**15), 2**15, (L, 2, len(tokens), H, D), dtype=torch.int16,
                       device="cuda", generator=gen).view(torch.bfloat16)  # fmt: skip
    with cuda_store(blocks) as store:
        store.store(tokens, kv)
        store.check()
        out = layer_major(len(tokens) + 2 * T)
        out = out.pin_memory() if pinned else out
        loaded = store.load(tokens, out=out)  # gpu -> strided host
        assert loaded.num_tokens == len(tokens) and loaded.kv.data_ptr() == out.data_ptr()
        assert torch.equal(bits(out[:, :, : len(tokens)]), bits(kv.cpu()))
        assert bool((out[:, :, len(tokens) :].float() == 7).all())
        store.clear()
        host_kv = kv.cpu()
        host_kv = host_kv.pin_memory() if pinned else host_kv
        store.store(tokens, host_kv)  # strided host -> gpu slots
        store.check()
        back = store.load(tokens, device="cuda").kv
        assert torch.equal(bits(back.cpu()), bits(kv.cpu()))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("stage_blocks", [1, 5, 64])
def test_on_a_gpu_chunks_through_two_stages_land_exact_both_ways(stage_blocks: int) -> None:
    rng = random.Random(stage_blocks)
    src = pool(64, 7).cuda()
    n = 40
    out = layer_major(n * T).pin_memory()
    view = blocks_of(out, T, 0, n)
    slots = rng.sample(range(64), n)  # scattered on the device side, one run on the host side
    block_bytes = src[0].numel() * src.element_size()
    assert staged.applies(src, view)
    staged.copy_runs(src, view, contiguous_runs(slots, list(range(n))),
                     stage_bytes=stage_blocks * block_bytes)  # fmt: skip
    want = src.cpu()
    for i, slot in enumerate(slots):
        assert torch.equal(bits(view[i]), bits(want[slot]))
    dst = torch.zeros_like(src)
    back = rng.sample(range(64), n)
    staged.copy_runs(view, dst, contiguous_runs(list(range(n)), back),
                     stage_bytes=stage_blocks * block_bytes)  # fmt: skip
    got = dst.cpu()
    for i, slot in enumerate(back):
        assert torch.equal(bits(got[slot]), bits(want[slots[i]]))
    assert int(bits(got[[s for s in range(64) if s not in back]]).count_nonzero()) == 0
