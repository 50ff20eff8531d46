"""A store without a host tier (`tiers.host: null`): gpu is the lowest tier, its victims are
dropped, nothing is copied to host, and status, metrics and the sidecar's pools have no host.

Tiny stores (4 tokens a block, conftest's layout) on the CPU; every step is followed by
`store.check()`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import TINY_BLOCK_TOKENS, TINY_MODEL, bits, kv_for, tiny_block_bytes
from prometheus_client.parser import text_string_to_metric_families
from service_server import kv_of, running, tokens_of, write_config

from kvtier.blocks import to_blocks
from kvtier.cli import main
from kvtier.client import Client
from kvtier.config import parse_config
from kvtier.errors import ConfigError, InvalidArgumentError
from kvtier.results import LookupResult, StoreResult
from kvtier.store import KVStore

BLOCK_BYTES = tiny_block_bytes("float32")
BT = TINY_BLOCK_TOKENS
A, B, C = list(range(0, 8)), list(range(100, 108)), list(range(200, 208))  # two blocks each


def gpu_only(gpu_blocks: int, write: str = "write_through", background: bool = False) -> KVStore:
    config = parse_config(
        {
            "model": {**TINY_MODEL, "dtype": "float32"},
            "block_tokens": BT,
            "tiers": {
                "gpu": {"capacity": gpu_blocks * BLOCK_BYTES, "device": "cpu"},
                "host": None,
            },
            "policy": {"write": write, "selective_hits": 1},
            "mover": {"background": background},
        }
    )
    return KVStore(config)


@pytest.fixture
def stores() -> Iterator[list[KVStore]]:
    made: list[KVStore] = []
    yield made
    for store in made:
        store.close()


def assert_no_host(store: KVStore) -> None:
    status = store.status()
    assert list(status["tiers"]) == ["gpu"]
    assert not any("host" in path for path in status["paths"])
    assert list(store.status("default")["tiers"]) == ["gpu"]
    assert store.memory == [store.gpu_pool] and store.host_pool.num_slots == 0


# ---- the config ------------------------------------------------------------------------------


def test_host_null_parses_round_trips_and_validates(
    tmp_path: Path, stores: list[KVStore], capsys: pytest.CaptureFixture[str]
) -> None:
    stores.append(store := gpu_only(4))
    config = store.config
    assert config.tiers.host is None and config.tier_names == ("gpu", "host")
    assert parse_config(config.to_dict()) == config
    path = tmp_path / "gpu-only.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    assert main(["validate", str(path)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("; gpu 2KiB, host none)")


def test_host_null_with_a_disk_tier_is_refused_naming_the_field(tmp_path: Path) -> None:
    tiers = {"host": None, "disk": {"capacity": "1MiB", "path": str(tmp_path)}}
    with pytest.raises(ConfigError, match=r"a host tier when tiers\.disk is set") as info:
        parse_config({"tiers": tiers})
    assert info.value.field == "tiers.host"


# ---- store, lookup, evict, load --------------------------------------------------------------


@pytest.mark.parametrize("write", ["write_through", "write_back", "selective"])
def test_gpu_victims_are_dropped_and_nothing_goes_to_host(
    stores: list[KVStore], write: str
) -> None:
    store = gpu_only(4, write)
    stores.append(store)
    kv_a, kv_b, kv_c = kv_for(store, 8, 1), kv_for(store, 8, 2), kv_for(store, 8, 3)
    assert store.store(A, kv_a) == StoreResult(8, 8, 0)
    store.check()
    assert store.store(B, kv_b) == StoreResult(8, 8, 0)
    store.check()
    assert store.lookup(A) == LookupResult(8, 8, 0, 0)  # A is used now: B is the LRU
    store.check()
    assert store.store(C, kv_c) == StoreResult(8, 8, 0)  # B's two blocks make room
    store.check()
    assert store.lookup(B) == LookupResult(0, 0, 0, 0)
    assert bits(store.load(A).kv).equal(bits(kv_a)) and bits(store.load(C).kv).equal(bits(kv_c))
    store.check()
    gpu = store.status()["tiers"]["gpu"]
    assert (gpu["evictions"], gpu["demotions"], gpu["blocks"], gpu["free_slots"]) == (2, 0, 4, 0)
    assert store.evict("gpu", 1) == 1  # the LRU leaf, A's last block (C was loaded last)
    store.check()
    assert store.lookup(A) == LookupResult(4, 4, 0, 0)
    with pytest.raises(InvalidArgumentError, match=r"tier: got 'host', expected one of \('gpu',\)"):
        store.evict("host", 1)
    lease = store.prefetch(C)
    assert (lease.num_tokens, len(lease.block_table)) == (8, 2)
    store.release(lease)
    store.check()
    assert_no_host(store)
    assert store.status()["paths"] == {}  # nothing was ever copied


def test_a_store_with_every_gpu_slot_leased_is_dropped_and_counted(
    stores: list[KVStore],
) -> None:
    store = gpu_only(2)
    stores.append(store)
    store.store(A, kv_for(store, 8))
    lease = store.prefetch(A)
    store.check()
    assert store.store(B, kv_for(store, 8)) == StoreResult(0, 0, 8)  # nothing below gpu
    store.check()
    assert store.status()["ops"]["dropped_tokens"] == 8
    store.release(lease)
    assert store.store(B, kv_for(store, 8)) == StoreResult(8, 8, 0)  # A is dropped for it
    store.check()
    assert store.lookup(A).num_tokens == 0
    assert_no_host(store)


def test_a_reservation_takes_gpu_slots_only(stores: list[KVStore]) -> None:
    store = gpu_only(4)
    stores.append(store)
    reservation = store.reserve(A)
    assert (reservation.tier, len(reservation.slots)) == ("gpu", 2)
    kv = kv_for(store, 8)
    store.gpu_pool.write(list(reservation.slots), to_blocks(kv, BT))
    assert store.commit(reservation) == StoreResult(8, 8, 0)
    store.check()
    assert bits(store.load(A).kv).equal(bits(kv))
    assert_no_host(store)


def test_a_background_mover_leaves_gpu_over_its_watermark(stores: list[KVStore]) -> None:
    # nothing below gpu to demote to: its leaves leave only when a store needs their room
    store = gpu_only(4, background=True)
    stores.append(store)
    for first in range(0, 1000, 100):
        store.store(list(range(first, first + 8)), kv_for(store, 8, first))
        store.check()
    assert store.drain()
    store.check()
    gpu = store.status()["tiers"]["gpu"]
    assert (gpu["blocks"], gpu["evictions"], gpu["demotions"]) == (4, 16, 0)
    assert store.status()["mover"]["backpressure_drops"] == 0
    assert_no_host(store)


# ---- the sidecar: status, metrics, pools -----------------------------------------------------


def test_a_sidecar_without_host_offers_and_reports_gpu_only(tmp_path: Path) -> None:
    path = write_config(tmp_path, gpu_blocks=8)
    config: dict[str, Any] = yaml.safe_load(path.read_text())
    config["tiers"]["host"] = None
    path.write_text(yaml.safe_dump(config))
    with running(path) as server, Client(server.url) as client:
        assert client.pool_buffer("gpu") is not None and client.pool_buffer("host") is None
        # 8 blocks fill the 8 gpu slots; 4 more drop 4 of them: nothing below gpu
        assert client.store(tokens_of(0, 32), kv_of(32, seed=1)) == StoreResult(32, 32, 0)
        assert client.store(tokens_of(500, 16), kv_of(16, seed=2)) == StoreResult(16, 16, 0)
        assert client.lookup(tokens_of(0, 32)) == LookupResult(16, 16, 0, 0)
        status = client.status()
        assert list(status["tiers"]) == ["gpu"] and status["paths"] == {}
        metrics = server.get("/metrics").text
        tiers = {
            sample.labels["tier"]
            for family in text_string_to_metric_families(metrics)
            for sample in family.samples
            if "tier" in sample.labels
        }
        assert tiers == {"gpu"}
        assert torch.equal(client.load(tokens_of(500, 16)).kv, kv_of(16, seed=2))
