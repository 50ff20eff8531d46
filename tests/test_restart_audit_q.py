"""Restarts under a changed config (audit Q), pinned:

- a reset or clear of a tenant retires, durably, the disk copies recovery left under that
  tenant's id in namespaces the config does not know (the secret changed), and `clear()` those
  of every tenant: rolling the config back serves nothing from before the reset. They are
  counted in what was dropped, shown as `tiers.disk.kept_blocks`, and a kept slot that a new
  copy has taken since is never retired with them;
- a changed `hashing.algorithm` is refused at start like a changed model; a superblock
  written before the field is not compared on it (an upgrade keeps a directory of any
  algorithm), its copies of another algorithm recovered as namespaces the config does not know;
- the refusal of a changed model names the field that changed;
- `kvtier info` keys the store with `service.state_dir`'s server secret, as `serve` does, and
  never creates it;
- a disk directory that cannot be made private (/proc/self) is a `ConfigError` naming
  `tiers.disk.path`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier import KVStore, parse_config
from kvtier.cli import main
from kvtier.errors import ConfigError, UnknownTenantError
from kvtier.service.auth import server_secret
from kvtier.tiers.disk.slabs import SUPERBLOCK

TOKENS = list(range(100, 132))  # 8 blocks of 4 tokens


def config(path: Path, tenants: tuple[str, ...] = ("a",), **more: Any) -> Any:
    data: dict[str, Any] = {
        "model": {
            "name": "demo",
            "num_layers": 2,
            "num_kv_heads": 2,
            "head_dim": 8,
            "dtype": "float32",
        },
        "block_tokens": 4,
        "mover": {"background": False},
        "tenants": {t: {} for t in tenants},
        "tiers": {
            "gpu": {"capacity": "64KiB", "device": "cpu"},
            "host": {"capacity": "256KiB"},
            "disk": {"capacity": "1MiB", "path": str(path)},
        },
    }
    data.update(more)
    return parse_config(data)


def kv() -> torch.Tensor:
    return torch.randn(2, 2, len(TOKENS), 2, 8)


def persisted(path: Path, secret: bytes, tenants: tuple[str, ...] = ("a",)) -> None:
    with KVStore(config(path, tenants), secret=secret) as store:
        for tenant in tenants:
            store.store(TOKENS, kv(), tenant=tenant)
        assert store.persist() == 8 * len(tenants)


def test_reset_retires_unknown_namespace_copies_of_the_tenant(tmp_path: Path) -> None:
    persisted(tmp_path, b"S1" * 10, ("a", "b"))
    with KVStore(config(tmp_path, ("a", "b")), secret=b"S2" * 10) as store:
        assert store.status()["recovery"]["unknown_namespace"] == 16
        assert store.status()["tiers"]["disk"]["kept_blocks"] == 16
        assert store.reset("a")["dropped_blocks"] == 8
        assert store.clear("a") == 0  # retired once
        assert store.status()["tiers"]["disk"]["kept_blocks"] == 8  # b's
    with KVStore(config(tmp_path, ("a", "b")), secret=b"S1" * 10) as store:
        assert store.lookup(TOKENS, tenant="a").num_tokens == 0  # rolled back: no stale KV
        assert store.lookup(TOKENS, tenant="b").num_tokens == len(TOKENS)  # b's kept


def test_a_clear_of_a_tenant_out_of_the_config_retires_its_copies_alone(tmp_path: Path) -> None:
    """An operator forgets one removed tenant's KV without clearing every tenant's: before, a
    clear naming it was an unknown tenant's error, and only a clear of all retired its copies."""
    persisted(tmp_path, b"S1" * 10, ("a", "b", "c"))
    with KVStore(config(tmp_path, ("a",)), secret=b"S1" * 10) as store:  # b and c taken out
        assert store.status()["tiers"]["disk"]["kept_blocks"] == 16
        assert store.clear("b") == 8
        assert store.status()["tiers"]["disk"]["kept_blocks"] == 8  # c's
        assert store.lookup(TOKENS, tenant="a").num_tokens == len(TOKENS)  # a's untouched
        with pytest.raises(UnknownTenantError):  # nothing left under b's id: unknown again
            store.clear("b")
        with pytest.raises(UnknownTenantError):
            store.clear("nobody")
    with KVStore(config(tmp_path, ("a", "b", "c")), secret=b"S1" * 10) as store:
        assert store.lookup(TOKENS, tenant="b").num_tokens == 0  # put back: nothing from before
        assert store.lookup(TOKENS, tenant="c").num_tokens == len(TOKENS)


def test_clear_all_retires_every_tenants_unknown_copies(tmp_path: Path) -> None:
    persisted(tmp_path, b"S1" * 10, ("a", "b"))
    # b is out of the config, a's secret changed: all 16 copies are of unknown namespaces
    with KVStore(config(tmp_path, ("a",)), secret=b"S2" * 10) as store:
        assert store.clear() == 16
        assert store.status()["tiers"]["disk"]["kept_blocks"] == 0
    with KVStore(config(tmp_path, ("a", "b")), secret=b"S1" * 10) as store:
        assert store.status()["recovery"]["recovered"] == 0
        assert store.lookup(TOKENS, tenant="b").num_tokens == 0


def test_a_kept_slot_taken_since_is_not_retired(tmp_path: Path) -> None:
    cfg = config(tmp_path, ("a", "b"))
    persisted(tmp_path, b"S1" * 10, ("a",))
    with KVStore(cfg, secret=b"S2" * 10) as store:
        disk = store.parts.state.disk
        assert disk is not None and store.status()["tiers"]["disk"]["kept_blocks"] == 8
        taken = disk.allocate(disk.num_free)  # every free slot: the kept ones among them
        assert store.status()["tiers"]["disk"]["kept_blocks"] == 0
        disk.free(taken)
        assert store.clear("a") == 0


def test_changed_hash_algorithm_is_refused_unless_the_superblock_predates_it(
    tmp_path: Path,
) -> None:
    persisted(tmp_path, b"")
    with pytest.raises(ConfigError) as refused:
        KVStore(config(tmp_path, hashing={"algorithm": "sha256"}))
    assert refused.value.field == "tiers.disk.path"
    assert "hashing: recorded 'blake2b-128', now 'sha256'" in str(refused.value)
    superblock = tmp_path / SUPERBLOCK  # as written before the fields
    geometry = json.loads(superblock.read_text())
    del geometry["hashing"], geometry["model"]
    superblock.write_text(json.dumps(geometry))
    with KVStore(config(tmp_path)) as store:
        assert store.status()["recovery"]["recovered"] == 8
    with KVStore(config(tmp_path, hashing={"algorithm": "sha256"})) as store:  # an upgrade
        recovery = store.status()["recovery"]
        assert recovery["recovered"] == 0 and recovery["unknown_namespace"] == 8


def test_refusal_names_the_changed_model_field(tmp_path: Path) -> None:
    persisted(tmp_path, b"")
    cfg = config(tmp_path).to_dict()
    cfg["model"]["name"] = "other"
    with pytest.raises(ConfigError) as refused:
        KVStore(parse_config(cfg))
    assert "model.name: recorded 'demo', now 'other'" in str(refused.value)
    assert "layout" not in str(refused.value).split("differs in")[1]


def test_info_keys_the_store_with_the_server_secret(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    disk, state = tmp_path / "disk", tmp_path / "state"
    cfg = config(disk, service={"state_dir": str(state)})
    file = tmp_path / "c.json"
    file.write_text(json.dumps(cfg.to_dict()))
    assert main(["info", "--config", str(file), "--json"]) == 0  # no secret yet: none made
    assert not state.exists()
    capsys.readouterr()
    with KVStore(cfg, secret=server_secret(state)) as store:
        store.store(TOKENS, kv(), tenant="a")
        store.persist()
    assert main(["info", "--config", str(file), "--json"]) == 0
    recovery = json.loads(capsys.readouterr().out)["recovery"]
    assert recovery["recovered"] == 8 and recovery.get("unknown_namespace", 0) == 0


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs procfs")
def test_disk_path_that_cannot_be_made_private_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as refused:
        KVStore(config(Path("/proc/self")))
    assert refused.value.field == "tiers.disk.path"
    assert "/proc/self" in str(refused.value) and "chmod 700" in str(refused.value)
