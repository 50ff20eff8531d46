"""The caller's KV in either layout (`kvtier/caller_kv.py`, issue 19): `load` into a caller's
`out` or a new tensor, layer-major or as pages, and `store` from pages, bit-exact whatever
tier each block comes from; a bad `out` or page count refused before anything changes."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import disk_config, fill, kv_for, same

from kvtier.blocks import encode_tokens as key
from kvtier.blocks import from_blocks, to_blocks
from kvtier.config import KVTierConfig
from kvtier.errors import InvalidArgumentError, InvalidKVError
from kvtier.results import Lease, StoreResult
from kvtier.store import KVStore

OpenStore = Callable[[KVTierConfig], KVStore]
MakeStore = Callable[..., KVStore]
BT = 4  # the tiny layout's block tokens


def test_load_into_out_writes_the_prefix_in_place_and_leaves_the_rest(
    make_store: MakeStore,
) -> None:
    store = make_store(gpu_blocks=8, host_blocks=16)
    tokens, kv = list(range(16)), kv_for(store, 16, seed=1)
    store.store(tokens, kv)
    store.check()
    prompt = [*tokens, 900, 901, 902, 903, 904, 905]  # one more full block, not cached, + 2
    out = torch.full((2, 2, 24, 2, 4), 7.0)  # room for more than the 5 full blocks asked
    loaded = store.load(prompt, out=out)
    assert loaded.num_tokens == 16
    assert loaded.kv.data_ptr() == out.data_ptr() and same(loaded.kv, kv)
    assert same(out[:, :, :16], kv) and bool((out[:, :, 16:] == 7).all())
    pages = torch.full((6, 2, 2, BT, 2, 4), 7.0)
    loaded = store.load(prompt, out=pages, layout="blocks")
    assert loaded.kv.data_ptr() == pages.data_ptr() and same(loaded.kv, to_blocks(kv, BT))
    assert bool((pages[4:] == 7).all())
    fresh = store.load(prompt, layout="blocks")  # a new tensor of pages
    assert same(fresh.kv, to_blocks(kv, BT)) and fresh.kv.is_contiguous()
    store.check()


def test_pages_stored_load_back_in_either_layout(make_store: MakeStore) -> None:
    store = make_store(gpu_blocks=8, host_blocks=16, write="write_back")
    kv = kv_for(store, 12, seed=2)
    pages = to_blocks(kv, BT).contiguous()
    assert store.store(list(range(14)), pages, layout="blocks") == StoreResult(12, 12, 0)
    store.check()
    assert same(store.load(list(range(12))).kv, kv)
    # a last page partly filled is taken and not stored; a writer of the tail only passes `start`
    tail_kv = kv_for(store, 8, seed=3)
    tail = to_blocks(tail_kv, BT).contiguous()
    partial = torch.cat([tail, torch.zeros(1, *tail.shape[1:])])  # 3 pages for 10 tokens
    assert store.store(list(range(22)), partial, layout="blocks", start=12) == StoreResult(20, 8, 0)
    store.check()
    assert same(store.load(list(range(20))).kv, torch.cat([kv, tail_kv], dim=2))


def over_three_tiers(store: KVStore, seed: int) -> tuple[list[int], torch.Tensor, Lease]:
    """A 16-token prefix whose blocks are fastest on gpu (1), host (1) and disk (2), held so by
    a lease on its first block (released by the caller): its tokens, KV and the lease."""
    long = list(range(16))
    kv = kv_for(store, 16, seed=seed)
    store.store(long, kv)
    seqs = [list(range(100 * i, 100 * i + 8)) for i in range(1, 5)]
    fill(store, seqs[:3])  # the long sequence's leaves go down first (test_disk_store.py)
    store.lookup(long)
    fill(store, seqs[3:], seed=10)
    store.lookup(seqs[3])
    lease = store.prefetch(list(range(4)))  # its first block back on gpu
    hit = store.lookup(long)
    assert (hit.gpu_tokens, hit.host_tokens, hit.disk_tokens) == (4, 4, 8)
    return long, kv, lease


def test_a_prefix_over_three_tiers_loads_into_out_in_both_layouts(
    tmp_path: Path, open_store: OpenStore
) -> None:
    store = open_store(disk_config(tmp_path / "disk"))
    long, kv, lease = over_three_tiers(store, seed=42)
    out = torch.zeros(kv.shape, dtype=kv.dtype)
    assert same(store.load(long, out=out).kv, kv) and same(out, kv)
    pages = torch.zeros((4, *store.layout.block_shape), dtype=kv.dtype)
    assert same(store.load(long, out=pages, layout="blocks").kv, to_blocks(kv, BT))
    store.release(lease)
    store.check()


def test_scattered_slots_are_written_and_read_in_runs(make_store: MakeStore) -> None:
    # one-block sequences fill both pools, a clear frees them, and the next store gets slots
    # in the order freed last first: no two consecutive, so every block is a run of its own
    store = make_store(gpu_blocks=8, host_blocks=8, write="write_through", background=False)
    fill(store, [[100 * i + j for j in range(BT)] for i in range(8)])
    store.clear()
    tokens, kv = [5000 + j for j in range(16)], kv_for(store, 16, seed=9)
    store.store(tokens, kv)
    store.check()
    lease = store.prefetch(tokens)
    table = list(lease.block_table)
    assert all(b != a + 1 for a, b in itertools.pairwise(table)), table
    assert same(store.load(tokens).kv, kv)
    pages = torch.zeros((4, *store.layout.block_shape))
    assert same(store.load(tokens, out=pages, layout="blocks").kv, to_blocks(kv, BT))
    store.release(lease)
    store.evict("gpu", 4)  # the host copies, written to scattered slots too
    hit = store.lookup(tokens)
    assert (hit.gpu_tokens, hit.host_tokens) == (0, 16)
    assert same(store.load(tokens).kv, kv)
    store.check()


@pytest.mark.parametrize(
    ("out", "layout", "message"),
    [
        (torch.zeros(2, 2, 16, 2, 4, dtype=torch.float16), "layers", "dtype"),
        (torch.zeros(2, 2, 12, 2, 4), "layers", ">= 16"),  # too few tokens for 4 full blocks
        (torch.zeros(2, 2, 16, 4, 2), "layers", "shape"),
        (torch.zeros(3, 2, 2, BT, 2, 4), "blocks", ">= 4"),
        (torch.zeros(2, 2, 16, 2, 4), "blocks", "shape"),
        (torch.zeros(2, 2, 16, 2, 4, requires_grad=True), "layers", "grad"),
        ("not a tensor", "layers", "torch.Tensor"),
    ],
)
def test_a_bad_out_is_refused_before_anything_is_read(
    make_store: MakeStore, out: object, layout: str, message: str
) -> None:
    store = make_store()
    tokens, kv = list(range(16)), kv_for(store, 16, seed=4)
    store.store(tokens, kv)
    before = store.status()["ops"]
    with pytest.raises(InvalidKVError) as refused:
        store.load(tokens, out=out, layout=layout)  # type: ignore[arg-type]
    assert message in str(refused.value)
    assert store.status()["ops"] == before  # not counted as a load: nothing was read
    store.check()


def test_a_bad_layout_device_or_page_count_is_a_typed_error_naming_it(
    make_store: MakeStore,
) -> None:
    store = make_store()
    tokens, kv = list(range(16)), kv_for(store, 16, seed=5)
    with pytest.raises(InvalidArgumentError, match="layout: got 'pages'"):
        store.store(tokens, kv, layout="pages")
    with pytest.raises(InvalidArgumentError, match="layout: got 'rows'"):
        store.load(tokens, layout="rows")
    pages = to_blocks(kv, BT).contiguous()
    with pytest.raises(InvalidKVError, match=r"expected \[4, "):
        store.store(tokens, pages[:3], layout="blocks")
    with pytest.raises(InvalidKVError, match=r"expected \[3 or 4, "):
        store.store(tokens[:15], pages[:2], layout="blocks")
    with pytest.raises(InvalidKVError, match="layout 'blocks'"):
        store.store(tokens, kv, layout="blocks")  # layer-major KV named as pages
    assert store.lookup(tokens).num_tokens == 0  # nothing stored by any of them
    if torch.cuda.is_available():  # without CUDA, "cuda" is refused as a device already
        out = torch.zeros(kv.shape)
        with pytest.raises(InvalidArgumentError, match="out is on cpu"):
            store.load(tokens, out=out, device="cuda")
    store.store(tokens, pages, layout="blocks")
    assert same(from_blocks(store.load(tokens, layout="blocks").kv), kv)
    store.check()


def test_a_node_whose_blocks_are_fastest_in_two_tiers_loads_block_by_block(
    make_store: MakeStore,
) -> None:
    # write_through: every block on gpu and host; evicting two gpu blocks leaves one node
    # whose head is fastest on gpu and tail on host (no split): the per-block path of
    # `read_prefix`, beside the per-node one
    store = make_store(gpu_blocks=4, host_blocks=8, write="write_through", background=False)
    tokens, kv = list(range(16)), kv_for(store, 16, seed=12)
    store.store(tokens, kv)
    assert store.evict("gpu", 2) == 2
    hit = store.lookup(tokens)
    assert (hit.gpu_tokens, hit.host_tokens) == (8, 8)
    (node,) = store.index.path(store.index.match(store.namespaces.seed("default"), key(tokens)).end)
    assert node.slots[0].count(None) == 2 and None not in node.slots[1]
    out = torch.zeros(kv.shape)
    assert same(store.load(tokens, out=out).kv, kv)
    assert same(store.load(tokens, layout="blocks").kv, to_blocks(kv, BT))
    store.check()


def test_a_load_from_start_copies_only_the_tail_over_three_tiers(
    tmp_path: Path, open_store: OpenStore
) -> None:
    """`load(start=)`: an engine that holds the head of a prompt asks for the rest. Every start
    on a block boundary of a prefix spread over gpu, host and disk (its head skipped inside a
    node, at a node's edge, inside the disk tail) gives exactly the full load's tail, into a
    new tensor, an `out` sized for the tail only, and pages; only the tail is counted."""
    store = open_store(disk_config(tmp_path / "disk"))
    long, kv, lease = over_three_tiers(store, seed=43)
    prompt = [*long, 900, 901]  # two tokens past the cached prefix: not a full block
    for start in range(0, 20, BT):
        before = store.status()["ops"]["loaded_tokens"]
        got = store.load(prompt, start=start)
        assert got.num_tokens == 16
        assert same(got.kv, kv[:, :, start:16]), start
        assert store.status()["ops"]["loaded_tokens"] - before == max(0, 16 - start)
        layers, _, _, heads, dim = kv.shape  # an out with room for the tail only
        out = torch.full((layers, 2, max(0, 16 - start), heads, dim), 7.0, dtype=kv.dtype)
        assert same(store.load(prompt, start=start, out=out).kv, kv[:, :, start:16])
        assert same(out, kv[:, :, start:16])
        pages = store.load(prompt, start=start, layout="blocks").kv
        assert same(pages, to_blocks(kv, BT)[start // BT :])
        store.check()
    store.release(lease)
    store.check()


def test_a_load_from_past_the_cached_prefix_gives_no_tokens(make_store: MakeStore) -> None:
    store = make_store(gpu_blocks=8, host_blocks=16)
    store.store(list(range(8)), kv_for(store, 8, seed=5))
    got = store.load(list(range(16)), start=12)  # 8 cached, the caller holds 12
    assert got.num_tokens == 8 and got.kv.shape[2] == 0
    store.check()


@pytest.mark.parametrize("start", [-4, 2, 20, 4.0, True, "4", None])
def test_a_bad_load_start_is_a_typed_error_naming_it(make_store: MakeStore, start: object) -> None:
    store = make_store(gpu_blocks=8, host_blocks=16)
    store.store(list(range(8)), kv_for(store, 8, seed=6))
    before = store.status()["ops"]
    with pytest.raises(InvalidArgumentError, match="start: got"):
        store.load(list(range(16)), start=start)  # type: ignore[arg-type]
    assert store.status()["ops"] == before  # nothing read, nothing counted
    store.check()
