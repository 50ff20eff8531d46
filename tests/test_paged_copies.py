"""`kvtier.integrations.paged`: an engine's paged KV (vLLM's per-layer `[blocks, heads,
block_size, 2 * head_dim]`) to kvtier's `[layers, 2, tokens, heads, head_dim]` and back,
bit-exact, touching only the blocks named."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import InvalidKVError
from kvtier.integrations.paged import (
    HOST_LAYOUTS,
    MLA_HOST_LAYOUTS,
    gather,
    geometry,
    host_gather,
    host_scatter,
    mla_host_view,
    scatter,
)


def paged(
    layers: int = 3, blocks: int = 10, heads: int = 2, size: int = 16, dim: int = 8
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(layers * blocks)
    return [
        torch.randn(blocks, heads, size, 2 * dim, generator=gen).to(torch.float16)
        for _ in range(layers)
    ]


def test_gather_reads_k_then_v_of_each_token_in_block_order() -> None:
    layers = paged()
    kv = gather(layers, [7, 2])
    assert kv.shape == (3, 2, 32, 2, 8) and kv.is_contiguous()
    for layer in range(3):
        for token, (block, slot) in enumerate(
            [(7, p) for p in range(16)] + [(2, p) for p in range(16)]
        ):
            for head in range(2):
                row = layers[layer][block, head, slot]
                assert torch.equal(kv[layer, 0, token, head], row[:8])
                assert torch.equal(kv[layer, 1, token, head], row[8:])


def test_scatter_then_gather_round_trips_and_leaves_other_blocks_alone() -> None:
    layers = paged()
    before = [layer.clone() for layer in layers]
    kv = torch.randn(3, 2, 48, 2, 8).to(torch.float16)
    scatter(layers, [4, 0, 9], kv)
    assert torch.equal(gather(layers, [4, 0, 9]).view(torch.int16), kv.view(torch.int16))
    untouched = [b for b in range(10) if b not in (4, 0, 9)]
    for layer, old in zip(layers, before, strict=True):
        assert torch.equal(layer[untouched], old[untouched])
    fresh = [torch.zeros_like(layer) for layer in layers]
    scatter(fresh, [1, 2, 3], gather(layers, [4, 0, 9]))
    for layer, new in zip(layers, fresh, strict=True):
        assert torch.equal(new[[1, 2, 3]].view(torch.int16), layer[[4, 0, 9]].view(torch.int16))


def test_shapes_that_do_not_fit_are_refused_naming_what_was_expected() -> None:
    layers = paged()
    assert geometry(layers) == (10, 2, 16, 8, torch.float16)
    with pytest.raises(InvalidKVError, match=r"expected each in \[0, 10\)"):
        gather(layers, [10])
    with pytest.raises(InvalidKVError, match="expected"):
        scatter(layers, [1], torch.zeros(3, 2, 15, 2, 8, dtype=torch.float16))
    with pytest.raises(InvalidKVError, match="expected"):
        scatter(layers, [1], torch.zeros(3, 2, 16, 2, 8, dtype=torch.float32))
    with pytest.raises(InvalidKVError, match="like the first"):
        geometry([layers[0], layers[1][:5]])
    with pytest.raises(InvalidKVError, match="equal size"):
        geometry([torch.zeros(2, 2, 16, 7)])
    with pytest.raises(InvalidKVError, match="no layers"):
        geometry([])


def host_buffer(layout: str, canonical: torch.Tensor, page_size: int) -> torch.Tensor:
    """SGLang's kv_buffer of `layout` holding `canonical` ([layers, 2, slots, heads, dim]),
    built slot by slot from SGLang's documented dims (the reference the copies must meet)."""
    layers, _, slots, heads, dim = canonical.shape
    pages = slots // page_size
    dims = {
        "layer_first": (2, layers, slots, heads, dim),
        "page_first": (2, slots, layers, heads, dim),
        "page_first_direct": (2, pages, layers, page_size, heads, dim),
        "page_head": (2, pages, heads, page_size, layers, dim),
    }[layout]
    buffer = torch.zeros(dims, dtype=canonical.dtype)
    for kv in range(2):
        for layer in range(layers):
            for slot in range(slots):
                page, at = divmod(slot, page_size)
                for head in range(heads):
                    value = canonical[layer, kv, slot, head]
                    if layout == "layer_first":
                        buffer[kv, layer, slot, head] = value
                    elif layout == "page_first":
                        buffer[kv, slot, layer, head] = value
                    elif layout == "page_first_direct":
                        buffer[kv, page, layer, at, head] = value
                    else:
                        buffer[kv, page, head, at, layer] = value
    return buffer


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_sglang_host_pages_read_and_write_as_kvtier_kv(layout: str) -> None:
    canonical = torch.randn(3, 2, 32, 2, 4).to(torch.float16)  # 4 pages of 8 slots
    buffer = host_buffer(layout, canonical, 8)
    slots = torch.tensor(list(range(16, 24)) + list(range(0, 8)))  # pages 2 and 0, in that order
    got = host_gather(buffer, layout, slots, 8)
    assert torch.equal(got.view(torch.int16), canonical[:, :, slots].view(torch.int16))
    fresh = torch.randn(3, 2, 16, 2, 4).to(torch.float16)
    host_scatter(buffer, layout, slots, 8, fresh)
    want = canonical.clone()
    want[:, :, slots] = fresh
    assert torch.equal(buffer.view(torch.int16), host_buffer(layout, want, 8).view(torch.int16))
    with pytest.raises(InvalidKVError, match="whole aligned pages"):
        host_gather(buffer, layout if layout.startswith("page_") and layout != "page_first"
                    else "page_head", torch.arange(4, 12), 8)  # fmt: skip
    with pytest.raises(InvalidKVError, match="expected one of"):
        host_scatter(buffer, "page_unified", slots, 8, fresh)


def latent_buffer(layout: str, latents: torch.Tensor, page: int) -> torch.Tensor:
    """SGLang's MLA host `kv_buffer` in `layout` holding `latents` (`[layers, slots, C]`), each
    slot's latent put where SGLang's documented dims say, one by one."""
    layers, slots, width = latents.shape
    shapes = {"layer_first": (layers, slots, 1, width), "page_first": (slots, layers, 1, width),
              "page_first_direct": (slots // page, layers, page, 1, width),
              "page_unified": (slots // page, layers, page, width)}  # fmt: skip
    buffer = torch.zeros(shapes[layout], dtype=latents.dtype)
    for layer in range(layers):
        for slot in range(slots):
            p, at = divmod(slot, page)
            where = {"layer_first": (layer, slot, 0), "page_first": (slot, layer, 0),
                     "page_first_direct": (p, layer, at, 0),
                     "page_unified": (p, layer, at)}  # fmt: skip
            buffer[where[layout]] = latents[layer, slot]
    return buffer


@pytest.mark.parametrize("layout", list(MLA_HOST_LAYOUTS))
def test_an_mla_host_pool_reads_and_writes_as_one_head_of_the_latents_halves(layout: str) -> None:
    latents = torch.randn(3, 32, 12).to(torch.float16)  # 4 pages of 8 slots, a latent of 12
    buffer = latent_buffer(layout, latents, 8)
    view, mha = mla_host_view(buffer, layout)
    slots = torch.tensor(list(range(16, 24)) + list(range(0, 8)))
    got = host_gather(view, mha, slots, 8)
    assert got.shape == (3, 2, 16, 1, 6)  # K the first half, V the second
    want = latents[:, slots].view(3, 16, 2, 6).transpose(1, 2).unsqueeze(3)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    fresh = torch.randn(3, 2, 16, 1, 6).to(torch.float16)
    host_scatter(view, mha, slots, 8, fresh)  # lands in `buffer` itself
    changed = latents.clone()
    changed[:, slots] = fresh.squeeze(3).transpose(1, 2).reshape(3, 16, 12)
    expected = latent_buffer(layout, changed, 8)
    assert torch.equal(buffer.view(torch.int16), expected.view(torch.int16))


def test_an_mla_host_pool_kvtier_cannot_copy_is_refused_naming_it() -> None:
    with pytest.raises(InvalidKVError, match="page_first_kv_split"):
        mla_host_view(torch.zeros(4, 2, 8, 1, 12), "page_first_kv_split")
    with pytest.raises(InvalidKVError, match="even size"):
        mla_host_view(torch.zeros(2, 32, 1, 11), "layer_first")  # an odd latent
    with pytest.raises(InvalidKVError, match="4 dims"):
        mla_host_view(torch.zeros(2, 32, 12), "page_first")
