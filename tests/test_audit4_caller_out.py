"""Audit 4: the tensors a caller hands in are read and written by their own strides, or refused.

Pinned here:
- `PagedAttention.extend` reads `v_new` by its own strides (it read it with `k_new`'s: a
  `v_new` sliced from a fused buffer gave wrong attention, a contiguous `v_new` beside a
  strided `k_new` was read past its end), and lengths given as a strided int32 tensor are
  read by index, not as if contiguous. The Triton kernels run under the interpreter here and
  are compared with the torch reference.
- A load's `out` that torch would not let the store write, or whose elements share memory
  (`expand()`ed, overlapping `as_strided`), or an inference tensor outside inference mode, is
  an `InvalidKVError` naming `out`, before anything is written: in process, and through both
  clients over shared memory and over HTTP (a real `kvtier serve`). An `out` that merely looks
  odd (transposed, strided) and a store's expanded `kv` (only read) still work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch
from conftest import bits, build_store, kv_for, same
from service_server import BT, DIM, HEADS, LAYERS, Server, running, write_config

from kvtier import caller_kv
from kvtier.client import AsyncClient, Client
from kvtier.errors import InvalidKVError
from kvtier.kernels import paged_attention as kernels
from kvtier.kernels.attention import PagedAttention
from kvtier.store import KVStore

needs_kernels = pytest.mark.skipif(
    not (kernels.available() and kernels.INTERPRETED), reason="needs Triton's interpreter"
)


@pytest.fixture
def store() -> Iterator[KVStore]:
    """The tiny fp32 store of `conftest.build_store` (2 layers, 2 kv heads, head_dim 4, 4
    tokens a block) holding the KV of tokens 0..15."""
    made = build_store(gpu_blocks=8, host_blocks=16)
    made.store(list(range(16)), kv_for(made, 16, seed=1))
    yield made
    made.close()


# ---- extend reads k_new and v_new by their own strides -----------------------------------


def fused(tokens: int, heads: int, dim: int, seed: int) -> torch.Tensor:
    """A fused qkv-like buffer `[tokens, 3 * heads, dim]`; `[:, heads:2 * heads]` is a
    `[tokens, heads, dim]` slice whose token stride is three times a dense one's."""
    return torch.randn(tokens, 3 * heads, dim, generator=torch.Generator().manual_seed(seed))


@needs_kernels
@pytest.mark.parametrize("strided", ["v_new", "k_new"])
def test_extend_reads_each_of_k_new_and_v_new_by_its_own_strides(
    store: KVStore, strided: str
) -> None:
    attn = PagedAttention(store)
    assert attn.backend == "triton"
    heads, dim = store.layout.num_kv_heads, store.layout.head_dim
    lease = store.prefetch(list(range(8)))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 2 * heads, dim, generator=gen)
    dense = torch.randn(5, heads, dim, generator=gen)
    sliced = fused(5, heads, dim, seed=2)[:, heads : 2 * heads]
    k_new, v_new = (dense, sliced) if strided == "v_new" else (sliced, dense)
    got = attn.extend(q, k_new, v_new, 1, [lease], [5])
    table = torch.tensor([list(lease.block_table)], dtype=torch.int32)
    want = kernels.paged_extend_reference(
        q, k_new, v_new, store.gpu_pool.buffer, 1, table, torch.tensor([8]), torch.tensor([5])
    )
    store.release(lease)
    error = float((got - want).abs().max())
    assert torch.isfinite(got).all(), f"{strided} strided: a read past a tensor's end"
    assert error <= 1e-5, f"{strided} strided: max |triton - reference| {error}"


@needs_kernels
def test_decode_reads_strided_int32_lengths_by_index(store: KVStore) -> None:
    """seq_lens [8, 5] as every other element of [8, 4, 5, 4]: read as contiguous, the second
    sequence would get 4 tokens."""
    attn = PagedAttention(store)
    heads, dim = store.layout.num_kv_heads, store.layout.head_dim
    lease = store.prefetch(list(range(8)))
    table = torch.tensor([list(lease.block_table)] * 2, dtype=torch.int32)
    lens = torch.tensor([8, 4, 5, 4], dtype=torch.int32)[::2]
    q = torch.randn(2, heads, dim, generator=torch.Generator().manual_seed(3))
    got = attn.decode_table(q, 1, table, lens)
    want = kernels.paged_decode_reference(q, store.gpu_pool.buffer, 1, table, lens.contiguous())
    store.release(lease)
    assert float((got - want).abs().max()) <= 1e-5


# ---- a load's out: writable, each element its own memory ---------------------------------

PROMPT = [*range(16), 900, 901, 902, 903, 904, 905]  # 16 cached tokens, 22 asked


def shared_outs(
    shape: tuple[int, ...], blocks: bool, dtype: torch.dtype = torch.float32
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Outs of `shape` whose elements share memory, each with the base whose bytes it views."""
    if blocks:
        page = torch.full((1, *shape[1:]), 7.0, dtype=dtype)
        return {"expand-blocks": (page.expand(shape), page)}
    layers, two, tokens, heads, dim = shape
    one_token = torch.full((layers, two, 1, heads, dim), 7.0, dtype=dtype)
    one_kv = torch.full((layers, 1, tokens, heads, dim), 7.0, dtype=dtype)
    # tokens step by one head's width: head 1 of token t is head 0 of token t + 1
    raw = torch.full((layers * two * tokens * dim + heads * dim,), 7.0, dtype=dtype)
    overlap = raw.as_strided(shape, (two * tokens * dim, tokens * dim, dim, dim, 1))
    return {
        "expand-tokens": (one_token.expand(shape), one_token),
        "expand-kv": (one_kv.expand(shape), one_kv),
        "as_strided-overlap": (overlap, raw),
    }


def layers_shape(layers: int, heads: int, dim: int, tokens: int = 24) -> tuple[int, ...]:
    return (layers, 2, tokens, heads, dim)


def test_an_out_whose_elements_share_memory_is_refused_unwritten(store: KVStore) -> None:
    lay = store.layout
    shape = layers_shape(lay.num_layers, lay.num_kv_heads, lay.head_dim)
    for layout, outs in (
        ("layers", shared_outs(shape, False)),
        ("blocks", shared_outs((6, *lay.block_shape), True)),
    ):
        for name, (out, viewed) in outs.items():
            with pytest.raises(InvalidKVError, match=r"^out: .*share memory") as caught:
                store.load(PROMPT, out=out, layout=layout)
            assert "clone()" in str(caught.value), name
            assert bool((viewed == 7).all()), f"{name}: written before the refusal"
    store.check()  # raises on an inconsistent index or pool
    # odd but writable outs still load, and a store's expanded kv (only read) is stored
    kv = kv_for(store, 16, seed=1)
    transposed = torch.full((*shape[:3], shape[4], shape[3]), 7.0).transpose(3, 4)
    every_other_layer = torch.full((2 * shape[0], *shape[1:]), 7.0)[::2]
    for out in (transposed, every_other_layer):
        assert store.load(PROMPT, out=out).num_tokens == 16
        assert same(out[:, :, :16].contiguous(), kv) and bool((out[:, :, 16:] == 7).all())
    one_token = kv_for(store, 1, seed=5)
    expanded = one_token.expand(*one_token.shape[:2], 8, *one_token.shape[3:])
    assert store.store([50, 51, 52, 53, 54, 55, 56, 57], expanded).stored_tokens == 8
    assert same(store.load([50, 51, 52, 53, 54, 55, 56, 57]).kv, expanded.contiguous())


def test_an_inference_out_is_refused_unwritten_outside_inference_mode(store: KVStore) -> None:
    lay = store.layout
    with torch.inference_mode():
        out = torch.full(layers_shape(lay.num_layers, lay.num_kv_heads, lay.head_dim), 7.0)
    with pytest.raises(InvalidKVError, match=r"^out: an inference tensor"):
        store.load(PROMPT, out=out)
    assert bool((out == 7).all()), "the prefix was written before the refusal"
    with torch.inference_mode():  # where torch lets it be written, it is
        assert store.load(PROMPT, out=out).num_tokens == 16
    assert same(out[:, :, :16].contiguous(), kv_for(store, 16, seed=1))


def test_check_writable_refuses_a_layout_it_cannot_prove_apart() -> None:
    """The sufficient test: [2, 3] with strides (3, 2) does not overlap (0 2 4 / 3 5 7) but
    interleaves, so it is refused (the docstring says so); dense and sliced ones pass."""
    raw = torch.zeros(8)
    with pytest.raises(InvalidKVError, match=r"^kv: .*strides \(3, 2\)"):
        caller_kv.check_writable(raw.as_strided((2, 3), (3, 2)), "kv")
    caller_kv.check_writable(torch.zeros(4, 5)[:, ::2].t(), "kv")
    caller_kv.check_writable(torch.zeros(0, 3).expand(0, 3), "kv")


# ---- the same through the client: shared memory and HTTP ---------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(write_config(tmp_path_factory.mktemp("audit4-out"))) as live:
        yield live


def client_kv(tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, 2, tokens, HEADS, DIM, generator=gen).half()


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "http"])
def test_the_client_refuses_the_same_outs_unwritten(server: Server, shared_memory: bool) -> None:
    base = 1000 if shared_memory else 5000
    tokens = list(range(base, base + 16))
    prompt = [*tokens, 7, 8, 9, 10, 11, 12]
    kv = client_kv(16, seed=1)
    with Client(server.url, shared_memory=shared_memory) as client:
        assert (client.mapped_instance is not None) == shared_memory
        client.store(tokens, kv)
        shape = layers_shape(LAYERS, HEADS, DIM)
        for layout, outs in (
            ("layers", shared_outs(shape, False, torch.float16)),
            ("blocks", shared_outs((6, LAYERS, 2, BT, HEADS, DIM), True, torch.float16)),
        ):
            for name, (out, viewed) in outs.items():
                with pytest.raises(InvalidKVError, match=r"^out: .*share memory"):
                    client.load(prompt, out=out, layout=layout)
                assert bool((viewed == 7).all()), f"{name}: written before the refusal"
        with torch.inference_mode():
            inference = torch.full(shape, 7.0).half()
        with pytest.raises(InvalidKVError, match=r"^out: an inference tensor"):
            client.load(prompt, out=inference)
        assert bool((inference == 7).all()), "the prefix was written before the refusal"
        good = torch.full(shape, 7.0).half()
        assert client.load(prompt, out=good).num_tokens == 16
        assert torch.equal(bits(good[:, :, :16]), bits(kv))


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "http"])
def test_the_async_client_refuses_them_too(server: Server, shared_memory: bool) -> None:
    tokens = list(range(9000 if shared_memory else 9500, 9016 if shared_memory else 9516))
    shape = layers_shape(LAYERS, HEADS, DIM)
    one_token = torch.full((LAYERS, 2, 1, HEADS, DIM), 7.0).half()
    with torch.inference_mode():
        inference = torch.full(shape, 7.0).half()

    async def main() -> None:
        async with AsyncClient(server.url, shared_memory=shared_memory) as client:
            await client.store(tokens, client_kv(16, seed=2))
            with pytest.raises(InvalidKVError, match=r"^out: .*share memory"):
                await client.load(tokens, out=one_token.expand(shape))
            with pytest.raises(InvalidKVError, match=r"^out: an inference tensor"):
                await client.load(tokens, out=inference)

    asyncio.run(main())
    assert bool((one_token == 7).all()) and bool((inference == 7).all())
