"""A disk tier that keeps its copies quantized (`tiers.disk.codec: int4 | int8 | fp8`), in a real
store on real files: what it serves, how many more blocks it holds, restarts, a torn or
mis-scaled copy, KV it cannot keep, `kvtier check`, and the config errors.

Layout: the disk tests' tiny fp16 model (conftest) with 16-token blocks, 16 KiB raw; gpu and
host hold 4 blocks each, so of six 2-block sequences A0..A5 the first two end on disk.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import disk_config, fill, hit, same, tier

from kvtier.config import KVTierConfig, parse_config
from kvtier.errors import ConfigError
from kvtier.quant import QuantCodec, QuantSpec
from kvtier.store import KVStore
from kvtier.tiers.disk.format import BlockHeader, checksum, decode_header, encode_header

OpenStore = Callable[[KVTierConfig], KVStore]
BT = 16
SEQS = [list(range(1000 * i, 1000 * i + 2 * BT)) for i in range(6)]


def config(path: Path, codec: str = "int4", **disk: object) -> KVTierConfig:
    plain = disk_config(path, block_tokens=BT, codec=codec).to_dict()
    plain["tiers"]["disk"].update(disk)
    return parse_config(plain)


def served(store: KVStore, kv: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """What a copy of `kv` decodes to: the blocks through the codec, back in KV layout."""
    layout = store.layout
    L, _, T, H, D = kv.shape
    blocks = kv.reshape(L, 2, T // BT, BT, H, D).permute(2, 0, 1, 3, 4, 5).contiguous()
    codec = QuantCodec(spec, layout)
    out = codec.decode(codec.encode(blocks))
    return out.permute(1, 2, 0, 3, 4, 5).reshape(kv.shape)


def copies(path: Path) -> dict[int, tuple[int, BlockHeader]]:
    """Valid headers of the first slab, by the first token of their block: (slot, header)."""
    geometry = json.loads((path / "kvtier-disk.json").read_text())
    slot_bytes, region = geometry["slot_bytes"], geometry["header_region"]
    data = (path / "slab-00000.kvt").read_bytes()
    found = {}
    for slot in range(len(data) // slot_bytes):
        header = decode_header(data[slot * slot_bytes : slot * slot_bytes + region])
        if header is not None:
            found[int.from_bytes(header.tokens[:4], "little")] = (slot, header)
    return found


def rewrite_payload(path: Path, slot: int, edit: Callable[[bytearray], None]) -> None:
    """Change a copy's payload with `edit` and write a header whose checksum matches it: a
    copy as a broken encoder would leave it, which no checksum catches."""
    geometry = json.loads((path / "kvtier-disk.json").read_text())
    slot_bytes, region = geometry["slot_bytes"], geometry["header_region"]
    slab = path / "slab-00000.kvt"
    data = bytearray(slab.read_bytes())
    start = slot * slot_bytes
    header = decode_header(bytes(data[start : start + region]))
    assert header is not None
    payload = bytearray(data[start + region : start + region + header.payload_nbytes])
    edit(payload)
    fixed = dataclasses.replace(header, payload_checksum=checksum(bytes(payload)))
    data[start : start + region] = encode_header(fixed, region)
    data[start + region : start + region + len(payload)] = payload
    slab.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("codec", "spec"),
    [("int4", QuantSpec("int4")), ("int8", QuantSpec("int8")), ("fp8", QuantSpec("fp8"))],
)
def test_a_quantized_tier_serves_what_its_copies_decode_to_after_a_restart(
    tmp_path: Path, open_store: OpenStore, codec: str, spec: QuantSpec
) -> None:
    store = open_store(config(tmp_path / "disk", codec))
    kvs = fill(store, SEQS)
    assert [store.lookup(s) for s in SEQS[:3]] == [hit(disk=32)] * 2 + [hit(host=32)]
    disk = tier(store, "disk")
    assert disk["codec"] == QuantCodec(spec, store.layout).id
    expected = [served(store, kv, spec) for kv in kvs[:2]]
    assert not same(expected[0], kvs[0])  # lossy: the test below can tell them apart
    assert same(store.load(SEQS[0]).kv, expected[0])
    store.check()
    store.close()

    store = open_store(config(tmp_path / "disk", codec))
    assert store.recovery["recovered"] == 4
    assert same(store.load(SEQS[1]).kv, expected[1])
    assert same(store.load(SEQS[0]).kv, expected[0])
    assert tier(store, "disk")["faults"]["corrupt_reads"] == 0
    store.check()


def test_the_same_bytes_hold_more_quantized_blocks(tmp_path: Path, open_store: OpenStore) -> None:
    slots = {}
    for codec in ("none", "int8", "int4"):
        store = open_store(config(tmp_path / codec, codec))
        slots[codec] = tier(store, "disk")["slots"]
        store.close()
    # 16 KiB raw; a 4 KiB header region; payloads rounded up to 4 KiB: 20, 16 and 12 KiB slots
    assert (slots["none"], slots["int8"], slots["int4"]) == (51, 64, 85)


def test_a_mis_scaled_or_torn_copy_is_never_served(tmp_path: Path, open_store: OpenStore) -> None:
    path = tmp_path / "disk"
    store = open_store(config(path))
    kvs = fill(store, SEQS)
    store.close()
    found = copies(path)
    codec = QuantCodec(QuantSpec("int4"), config(path).layout)

    def nan_scale(payload: bytearray) -> None:
        payload[codec.code_nbytes : codec.code_nbytes + 2] = b"\x00\x7e"  # fp16 NaN

    rewrite_payload(path, found[SEQS[0][0]][0], nan_scale)  # A0's first block: valid checksum
    slab = path / "slab-00000.kvt"
    data = bytearray(slab.read_bytes())
    geometry = json.loads((path / "kvtier-disk.json").read_text())
    torn = found[SEQS[1][BT]][0] * geometry["slot_bytes"] + geometry["header_region"] + 100
    data[torn] ^= 0x40  # A1's second block: a flipped bit, which the checksum catches
    slab.write_bytes(bytes(data))

    check = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "check", str(path)], capture_output=True, text=True
    )
    assert check.returncode == 1 and "1 valid" in check.stdout, check.stdout
    lines = [line.split() for line in check.stdout.splitlines()]
    assert ["corrupt", "payloads", "2"] in lines and ["orphans", "1"] in lines  # A0's second

    store = open_store(config(path))
    assert store.lookup(SEQS[0]) == hit(disk=32)  # recovery reads headers only
    loaded = store.load(SEQS[0])
    assert loaded.num_tokens == 0  # the first block did not decode: nothing is served
    part = store.load(SEQS[1])
    assert part.num_tokens == BT
    assert same(part.kv, served(store, kvs[1], QuantSpec("int4"))[:, :, :BT])
    assert tier(store, "disk")["faults"]["corrupt_reads"] == 2
    store.check()


def test_kv_the_codec_cannot_keep_gets_no_copy_and_is_counted(
    tmp_path: Path, open_store: OpenStore
) -> None:
    store = open_store(config(tmp_path / "disk"))
    bad = torch.zeros(2, 2, 2 * BT, 2, 64, dtype=torch.float16)
    bad[1, 0, 3, 1, 7] = float("inf")
    store.store(SEQS[0], bad)
    fill(store, SEQS[1:])
    disk = tier(store, "disk")
    assert disk["faults"]["unquantizable"] == 1  # the one demotion that tried it
    assert disk["faults"]["write_errors"] == 0 and disk["backoff_s"] == 0
    # its copy down can never be made: the first block is dropped from host with its child
    # (all zeros, on disk by then), rather than hold its host slot for good (audit L)
    assert store.lookup(SEQS[0]) == hit()
    assert tier(store, "host")["evictions"] >= 1  # each under the tier of its fastest copy
    assert tier(store, "disk")["evictions"] >= 1
    assert store.lookup(SEQS[1]) == hit(disk=32)
    store.check()


def test_config_errors_name_the_field(tmp_path: Path, open_store: OpenStore) -> None:
    with pytest.raises(ConfigError, match=r"tiers\.disk\.codec_group.*divisor"):
        open_store(config(tmp_path / "a", codec_group=48))
    store = open_store(config(tmp_path / "b", "none"))
    store.close()
    with pytest.raises(ConfigError, match=r"tiers\.disk\.path.*another path"):
        open_store(config(tmp_path / "b", "int4"))  # slots of another size
