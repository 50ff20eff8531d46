"""Audit L: KV a quantized tier cannot keep, and the codec's bounds.

Pins:
- A block whose copy down a quantized tier refuses (a NaN, or a finite bf16 value past fp16's
  range) does not hold its gpu slot for good once the blocks after it have lower copies: the
  inline demoter and the background mover's demotion flights drop it with everything cached
  below it, count the drops as evictions, and free every slot; the blocks before it go down as
  usual, and a prefetch needing every gpu slot then succeeds.
- A group of fp32/bf16 KV in [65000, 65504] decodes from int8 within fp16's range, so an int4
  disk tier below an int8 host keeps it (it was refused there as past fp16's range).
- `codec_group` past the codec's bound (255) is refused at config load, naming the field.
- Such a drop counts each block under the tier of its fastest copy; it never takes another
  tenant's blocks under its floor in a lower tier (the block stays, as before: another
  tenant's prefetch then fails, told "not all" of the gpu slots, not how many, which moves
  with the other tenant's use); a victim with no room below is not read to ask its codec.

Layout: a tiny model (2 layers, 2 kv heads, head dim 64) with 16-token blocks; gpu holds 4
blocks; the mover runs inline unless a test says otherwise. `store.check()` after each step.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import hit, tier, wait_until

import kvtier.transfer.demotion as demotion
from kvtier.blocks import KVLayout
from kvtier.config import KVTierConfig, parse_config
from kvtier.errors import CapacityError, ConfigError
from kvtier.quant import QuantCodec, QuantSpec
from kvtier.store import KVStore
from kvtier.tiers.base import Tier
from kvtier.tiers.pool import SlotPool
from kvtier.transfer.encoded import unkeepable

OpenStore = Callable[[KVTierConfig], KVStore]
BT = 16
BAD = list(range(4 * BT))
OTHER = list(range(90000, 90000 + 4 * BT))


def config(
    path: Path,
    host: str,
    disk: str | None,
    dtype: str = "float16",
    background: bool = False,
    gpu_watermarks: tuple[float, float] = (1.0, 1.0),
) -> KVTierConfig:
    """gpu of 4 blocks, a `host` host tier of 8 raw blocks' bytes, an optional `disk` tier."""
    block_bytes = 2 * 2 * BT * 2 * 64 * {"float16": 2, "bfloat16": 2, "float32": 4}[dtype]
    high, low = gpu_watermarks
    tiers: dict[str, object] = {
        "gpu": {
            "capacity": 4 * block_bytes,
            "device": "cpu",
            "high_watermark": high,
            "low_watermark": low,
        },
        "host": {
            "capacity": 8 * block_bytes,
            "pinned": False,
            "high_watermark": 1.0,
            "low_watermark": 1.0,
            "codec": host,
        },
        "disk": None if disk is None else {"capacity": "1MiB", "path": str(path), "codec": disk},
    }
    return parse_config(
        {
            "model": {
                "name": "tiny",
                "num_layers": 2,
                "num_kv_heads": 2,
                "head_dim": 64,
                "dtype": dtype,
            },
            "block_tokens": BT,
            "tiers": tiers,
            "policy": {"write": "write_back", "disk_admission_hits": 0},
            "mover": {"background": background},
        }
    )


def kv(store: KVStore, seed: int) -> torch.Tensor:
    layout = store.layout
    shape = (layout.num_layers, 2, 4 * BT, layout.num_kv_heads, layout.head_dim)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(layout.dtype)


def store_bad_prefix(store: KVStore, value: float) -> None:
    """Store BAD (4 blocks, all on gpu) with one `value` in block 1."""
    bad = kv(store, 1)
    bad[0, 0, BT + 3, 0, 0] = value
    assert store.store(BAD, bad).stored_tokens == 4 * BT
    store.check()
    assert store.lookup(BAD) == hit(gpu=4 * BT)


@pytest.mark.parametrize(
    ("host", "disk", "dtype", "value"),
    [
        ("int8", None, "float16", float("nan")),
        ("int8", "int4", "float16", float("nan")),
        ("int8", "int4", "bfloat16", 70000.0),
    ],
)
def test_the_inline_demoter_drops_a_block_its_host_codec_refuses_with_what_is_below_it(
    host: str, disk: str | None, dtype: str, value: float, tmp_path: Path, open_store: OpenStore
) -> None:
    store = open_store(config(tmp_path / "disk", host, disk, dtype))
    store_bad_prefix(store, value)
    assert store.store(OTHER, kv(store, 2)).stored_tokens == 4 * BT  # needs every gpu slot
    store.check()
    # blocks 2, 3 were copied down, block 1 was refused: it goes with them, block 0 goes down
    assert store.lookup(BAD) == hit(host=BT)
    assert store.lookup(OTHER) == hit(gpu=4 * BT)
    assert tier(store, "gpu")["evictions"] == 1  # each under the tier of its fastest copy
    assert tier(store, "host")["evictions"] == 2
    assert tier(store, "gpu")["blocks"] == 4
    assert tier(store, "host")["blocks"] == 1
    store.store(list(range(50000, 50000 + 4 * BT)), kv(store, 3))  # OTHER goes below gpu
    store.check()
    lease = store.prefetch(OTHER)  # every gpu slot can be freed, and is
    assert lease.num_tokens == 4 * BT
    store.release(lease)
    store.check()


def test_a_watermark_demotion_flight_drops_a_block_its_host_codec_refuses(
    tmp_path: Path, open_store: OpenStore
) -> None:
    store = open_store(
        config(tmp_path / "disk", "int8", None, background=True, gpu_watermarks=(0.5, 0.25))
    )
    store_bad_prefix(store, float("nan"))
    # the watermark's flight: blocks 1-3 to host, block 1 refused; a drain alone could end
    # before the mover had planned it (a flake under load: the lookup found all 4 on gpu)
    assert wait_until(lambda: tier(store, "gpu")["evictions"] == 3, 10.0)
    assert store.drain(10.0)
    store.check()
    assert store.lookup(BAD) == hit(gpu=BT)  # 1 block left on gpu: the low watermark
    assert tier(store, "gpu")["blocks"] == tier(store, "gpu")["slots"] - 3 == 1
    assert tier(store, "gpu")["evictions"] == 3
    assert tier(store, "host")["blocks"] == 0


@pytest.mark.parametrize(
    ("dtype", "lo", "hi"),
    [(torch.float32, 65000.0, 65504.0), (torch.bfloat16, -65000.0, 65280.0)],  # bf16's top within
)  # fp16's range is 65280: a wide group's decode rounded up past it, to 65536
def test_kv_at_fp16s_edge_decoded_from_int8_is_kept_by_int4(
    dtype: torch.dtype, lo: float, hi: float
) -> None:
    layout = KVLayout("edge", 2, 2, 64, str(dtype).removeprefix("torch."), BT)
    row = torch.linspace(lo, hi, 128).reshape(2, 64)  # one int8 group a token's row
    block = row.expand(1, *layout.block_shape).to(dtype)
    int8, int4 = QuantCodec(QuantSpec("int8"), layout), QuantCodec(QuantSpec("int4"), layout)
    assert bool(int8.keepable(block).all())
    decoded = int8.decode(int8.encode(block))
    assert float(decoded.float().abs().max()) <= 65504.0
    assert bool(int4.keepable(decoded).all()) and bool(int8.keepable(decoded).all())


def test_the_same_kv_goes_from_an_int8_host_to_an_int4_disk(
    tmp_path: Path, open_store: OpenStore
) -> None:
    store = open_store(config(tmp_path / "disk", "int8", "int4", "float32"))
    edge = kv(store, 1)
    edge[:, :, :BT] = torch.linspace(65000.0, 65504.0, 64).to(edge.dtype)
    assert store.store(BAD[:BT], edge[:, :, :BT]).stored_tokens == BT
    for seed in range(2, 14):  # push it down: gpu, then host, then disk
        tokens = list(range(1000 * seed, 1000 * seed + 4 * BT))
        store.store(tokens, kv(store, seed))
        store.check()
    assert store.lookup(BAD[:BT]) == hit(disk=BT)
    assert tier(store, "disk")["faults"]["unquantizable"] == 0
    assert float(store.load(BAD[:BT]).kv.float().abs().max()) <= 65504.0


@pytest.mark.parametrize("group", [256, 4096])
def test_a_codec_group_past_the_codecs_bound_is_refused_at_config_load(
    group: int, tmp_path: Path
) -> None:
    plain = config(tmp_path / "disk", "int8", None).to_dict()
    plain["tiers"]["host"]["codec_group"] = group
    with pytest.raises(ConfigError, match="codec_group") as raised:
        parse_config(plain)
    assert "255" in str(raised.value)
    plain["tiers"]["host"]["codec_group"] = 255
    host = parse_config(plain).tiers.host
    assert host is not None and host.codec_group == 255


def two_tenants(path: Path, b_floor: dict[str, object], a_floor: object = 1) -> KVTierConfig:
    """`config` (int8 host, no disk) for tenants a and b, each of quota every slot; floors in
    bytes (1: none) or fractions."""
    plain = config(path, "int8", None).to_dict()
    whole = {"gpu": 1.0, "host": 1.0}
    plain["tenants"] = {
        "a": {"quota": whole, "floor": {"gpu": a_floor, "host": a_floor}},
        "b": {"quota": whole, "floor": b_floor},
    }
    return parse_config(plain)


def store_bad_prefix_as_b(store: KVStore) -> None:
    """b stores BAD (a NaN in block 1), then 2 blocks that push BAD's blocks 2, 3 to host."""
    bad = kv(store, 1)
    bad[0, 0, BT + 3, 0, 0] = float("nan")
    store.store(BAD, bad, tenant="b")
    store.store(OTHER[: 2 * BT], kv(store, 2)[:, :, : 2 * BT], tenant="b")
    store.load(OTHER[: 2 * BT], tenant="b")  # BAD is the older
    store.check()
    assert store.lookup(BAD, tenant="b") == hit(gpu=2 * BT, host=2 * BT)


def test_a_drop_for_another_tenant_keeps_blocks_within_the_owners_floors_below(
    tmp_path: Path, open_store: OpenStore
) -> None:
    store = open_store(two_tenants(tmp_path, {"gpu": 0.25, "host": 0.5}))  # b: 1 gpu, 7 host
    store_bad_prefix_as_b(store)
    tokens = list(range(70000, 70000 + 3 * BT))
    assert store.store(tokens, kv(store, 3)[:, :, : 3 * BT], tenant="a").stored_tokens == 3 * BT
    store.check()
    # block 1 cannot go down and its drop would take b's host blocks under b's floor: it stays
    assert store.lookup(BAD, tenant="b") == hit(gpu=2 * BT, host=2 * BT)
    assert store.status("b")["tiers"]["host"]["blocks"] == 4


def test_a_prefetch_stuck_on_another_tenants_blocks_does_not_tell_how_many_are_free(
    tmp_path: Path, open_store: OpenStore
) -> None:
    store = open_store(two_tenants(tmp_path, {"gpu": 1, "host": 0.5}))  # b: no gpu floor
    store_bad_prefix_as_b(store)
    tokens = list(range(70000, 70000 + 4 * BT))
    store.store(tokens, kv(store, 3), tenant="a")
    store.store(list(range(80000, 80000 + 2 * BT)), kv(store, 4)[:, :, : 2 * BT], tenant="b")
    store.check()
    assert store.lookup(tokens, tenant="a").gpu_tokens < 4 * BT
    with pytest.raises(CapacityError, match="not all 4 gpu slots could be freed") as raised:
        store.prefetch(tokens, tenant="a")  # BAD's blocks 0, 1 stay: can_make_room said yes
    assert "only" not in str(raised.value)
    store.check()


def test_a_victim_with_no_room_below_is_not_read_to_ask_its_codec(
    tmp_path: Path, open_store: OpenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(two_tenants(tmp_path, {"gpu": 1, "host": 1.0}))  # b: all of host
    for k in range(8):  # b fills host, within its floor: no room there for a
        store.store(list(range(1000 * (k + 1), 1000 * (k + 1) + 4 * BT)), kv(store, k), tenant="b")
    assert tier(store, "host")["free_slots"] == 0
    asked: list[int] = []

    def spy(src: SlotPool, dst: Tier, slot: int) -> bool:  # counts, then asks the real codec
        asked.append(slot)
        return unkeepable(src, dst, slot)

    monkeypatch.setattr(demotion, "unkeepable", spy)
    for seed, first in ((20, 90000), (21, 80000)):  # a's gpu victims: no copy down is tried
        tokens = list(range(first, first + 4 * BT))
        assert store.store(tokens, kv(store, seed), tenant="a").stored_tokens == 4 * BT
        store.check()
    assert asked == []
    assert tier(store, "gpu")["evictions"] == 8
