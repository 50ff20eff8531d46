"""A host tier that keeps its blocks quantized (`tiers.host.codec`), in a real store: what it holds
and serves, promotion to gpu, a disk tier of the same codec taking payloads as they are (one
rounding, not two) and of another codec, KV it cannot keep, and what a sidecar client is
offered.

Layout: the disk tests' tiny fp16 model (conftest) with 16-token blocks (16 KiB raw); gpu
holds 4 blocks, host 8 KiB x 8 of raw bytes (an int8 block's payload is 8.5 KiB); of six
2-block sequences the first ones go below gpu.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import disk_config, fill, hit, same, tier

from kvtier.config import KVTierConfig, parse_config
from kvtier.errors import ConfigError, InvalidKVError
from kvtier.quant import QuantCodec, QuantSpec
from kvtier.service.bodies import pools
from kvtier.store import KVStore
from kvtier.tiers.quantized import QuantPool

OpenStore = Callable[[KVTierConfig], KVStore]
BT = 16
RAW = 16384
SEQS = [list(range(1000 * i, 1000 * i + 2 * BT)) for i in range(6)]


def config(
    path: Path, host: str = "int8", disk: str | None = "int8", **policy: object
) -> KVTierConfig:
    plain = disk_config(path, block_tokens=BT, host_blocks=4, codec=disk or "none").to_dict()
    plain["tiers"]["host"].update(codec=host)
    if disk is None:
        plain["tiers"]["disk"] = None
    plain["policy"].update(policy)
    return parse_config(plain)


def quantized(store: KVStore, kv: torch.Tensor, *specs: QuantSpec) -> torch.Tensor:
    """`kv` through each codec in turn, block by block, back in KV layout."""
    L, _, T, H, D = kv.shape
    blocks = kv.reshape(L, 2, T // BT, BT, H, D).permute(2, 0, 1, 3, 4, 5).contiguous()
    for spec in specs:
        codec = QuantCodec(spec, store.layout)
        blocks = codec.decode(codec.encode(blocks))
    return blocks.permute(1, 2, 0, 3, 4, 5).reshape(kv.shape)


def test_the_host_tier_holds_payloads_and_serves_what_they_decode_to(
    tmp_path: Path, open_store: OpenStore
) -> None:
    store = open_store(config(tmp_path / "disk", disk=None))
    host = tier(store, "host")
    codec = QuantCodec(QuantSpec("int8"), store.layout)
    assert host["codec"] == codec.id == "i8k80v80"
    assert host["slots"] == 4 * RAW // codec.payload_nbytes == 7  # 4 raw blocks' bytes
    assert isinstance(store.host_pool, QuantPool)
    kvs = fill(store, SEQS[:5])
    # 7 host slots keep A0..A2 (6 blocks); raw, the same bytes (4 blocks) would have dropped A0
    assert [store.lookup(s) for s in SEQS[:5]] == [hit(host=32)] * 3 + [hit(gpu=32)] * 2
    for i in range(3):
        assert same(store.load(SEQS[i]).kv, quantized(store, kvs[i], QuantSpec("int8")))
    assert tier(store, "host")["used_bytes"] == tier(store, "host")["blocks"] * codec.payload_nbytes
    store.check()


def test_a_prefetch_decodes_into_the_gpu_pool(tmp_path: Path, open_store: OpenStore) -> None:
    store = open_store(config(tmp_path / "disk", disk=None))
    kvs = fill(store, SEQS[:4])
    first = next(i for i, s in enumerate(SEQS) if store.lookup(s).host_tokens == 32)
    lease = store.prefetch(SEQS[first])
    assert lease.num_tokens == 32
    blocks = store.gpu_pool.buffer[list(lease.block_table)]
    got = blocks.permute(1, 2, 0, 3, 4, 5).reshape(kvs[first].shape)
    assert same(got, quantized(store, kvs[first], QuantSpec("int8")))
    store.release(lease)
    store.check()


@pytest.mark.parametrize(
    ("disk", "rounds"),
    [("int8", [QuantSpec("int8")]), ("int4", [QuantSpec("int8"), QuantSpec("int4")])],
)
def test_a_disk_tier_of_the_same_codec_takes_the_payloads_as_they_are(
    tmp_path: Path, open_store: OpenStore, disk: str, rounds: list[QuantSpec]
) -> None:
    path = tmp_path / "disk"
    store = open_store(config(path, disk=disk))
    kvs = fill(store, SEQS)
    assert store.lookup(SEQS[0]).disk_tokens >= BT  # demoted through host
    store.persist()  # the rest: from gpu (encoded by the disk tier) and host (payloads)
    store.close()
    store = open_store(config(path, disk=disk))
    assert store.recovery["recovered"] == 12
    # through host (int8) to disk: the same codec is one rounding; int4 rounds the int8 again
    expected = quantized(store, kvs[0], *rounds)
    assert same(store.load(SEQS[0]).kv, expected)
    lease = store.prefetch(SEQS[0])  # disk -> host (payloads or encoded) -> gpu (decoded)
    blocks = store.gpu_pool.buffer[list(lease.block_table)]
    served = blocks.permute(1, 2, 0, 3, 4, 5).reshape(kvs[0].shape)
    if disk == "int8":
        assert same(served, expected)  # payloads moved as they are, all the way up
    store.release(lease)
    store.check()


def test_kv_a_quantized_host_cannot_keep_is_refused_and_nothing_is_stored(
    tmp_path: Path, open_store: OpenStore
) -> None:
    store = open_store(config(tmp_path / "disk", disk=None, write="write_through"))
    bad = torch.zeros(2, 2, 2 * BT, 2, 64, dtype=torch.float16)
    bad[0, 1, 5, 0, 0] = float("nan")
    free = (tier(store, "gpu")["free_slots"], tier(store, "host")["free_slots"])
    with pytest.raises(InvalidKVError, match="not finite"):
        store.store(SEQS[0], bad)
    assert (tier(store, "gpu")["free_slots"], tier(store, "host")["free_slots"]) == free
    assert store.lookup(SEQS[0]) == hit()
    store.check()


def test_a_demotion_leaves_out_a_block_the_host_cannot_keep(
    tmp_path: Path, open_store: OpenStore
) -> None:
    store = open_store(config(tmp_path / "disk", disk=None))  # write_back: gpu first
    bad = torch.zeros(2, 2, 2 * BT, 2, 64, dtype=torch.float16)
    bad[0, 1, BT + 5, 0, 0] = float("inf")  # the second block
    store.store(SEQS[0], bad)
    fill(store, SEQS[1:4])
    found = store.lookup(SEQS[0])
    assert found.host_tokens <= BT  # the second block never reached host
    loaded = store.load(SEQS[0])
    assert same(loaded.kv, bad[:, :, : loaded.num_tokens])  # zeros decode to zeros
    store.check()


def test_a_sidecar_client_is_not_offered_a_quantized_host_pool(
    tmp_path: Path, open_store: OpenStore
) -> None:
    store = open_store(config(tmp_path / "disk", disk=None))
    offered = {pool["tier"]: pool for pool in pools(store, share=True)["pools"]}
    assert offered["host"]["shared_memory"] is None and offered["host"]["cuda_ipc"] is None


def test_lz4_on_host_is_refused_naming_the_field(tmp_path: Path, open_store: OpenStore) -> None:
    with pytest.raises(ConfigError, match=r"tiers\.host\.codec.*one size"):
        open_store(config(tmp_path / "disk", host="lz4", disk=None))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_a_prefetch_decodes_host_payloads_with_the_kernel(
    tmp_path: Path, open_store: OpenStore
) -> None:
    plain = config(tmp_path / "disk", disk=None).to_dict()
    plain["tiers"]["gpu"]["device"] = "cuda"
    store = open_store(parse_config(plain))
    kvs = fill(store, [SEQS[0]], seed=3)
    fill(store, SEQS[1:4])
    assert store.lookup(SEQS[0]) == hit(host=32)
    # what torch decodes of the payloads the host tier holds (encoded on the GPU, as a
    # demotion from a CUDA gpu tier does: a CPU encode of the same KV may round differently)
    decoded = store.load(SEQS[0], device="cpu").kv
    assert store.lookup(SEQS[0]) == hit(host=32)
    step = kvs[0].abs().amax().item() / 127
    assert (decoded.float() - kvs[0].float()).abs().max().item() <= step
    lease = store.prefetch(SEQS[0])  # decoded by the kernel, straight into the gpu slots
    blocks = store.gpu_pool.buffer[list(lease.block_table)].cpu()
    got = blocks.permute(1, 2, 0, 3, 4, 5).reshape(kvs[0].shape)
    assert same(got, decoded)
    store.release(lease)
    store.check()
