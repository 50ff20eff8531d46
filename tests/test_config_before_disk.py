"""A config is checked whole before the disk tier opens, and what a lowered capacity cuts is
counted (a real `kvtier serve` and `kvtier validate`).

Pins:
- tenant floors that do not fit a lowered `tiers.disk.capacity` are refused before the slabs
  are cut: the refused start leaves the slab as it was, and the old config finds every copy;
  on a new path, the refused start creates no directory (no slab, superblock);
- `kvtier validate` refuses that file too (the same check, `preflight.py`);
- a start at a lowered capacity counts the copies its cut dropped in `status()["recovery"]`
  (`cut`) and says so in one log line;
- a quota that is given but holds no block (1 KiB of a 4 KiB block, a fraction of 1e-10) is a
  `ConfigError` naming the field and the block size, in `validate` and at start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from refusals import refused_start
from service_server import ADMIN_KEY, BLOCK_BYTES, Server, kv_of, running, tokens_of, write_config

from kvtier.cli import main
from kvtier.client import Client

KA, KB = "key-a-0123456789abcdef", "key-b-0123456789abcdef"
TENANTS: dict[str, Any] = {"a": {"api_keys": [KA]}, "b": {"api_keys": [KB]}}
BLOCKS = 40  # stored and persisted by `fill`
SLOT_BYTES = 2 * BLOCK_BYTES  # a disk slot of the tiny layout: header region and payload


def validate(config: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`kvtier validate config` (the command's own entry point): its exit status and stderr."""
    status = main(["validate", str(config)])
    return status, capsys.readouterr().err


def recovery(server: Server) -> dict[str, float]:
    reply = server.get("/v1/status", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert reply.status_code == 200, reply.text
    found: dict[str, float] = reply.json()["recovery"]
    return found


def fill(config: Path) -> None:
    """Store `BLOCKS` blocks as tenant a and persist them to disk."""
    with running(config) as server:
        with Client(server.url, api_key=KA, shared_memory=False) as client:
            client.store(tokens_of(0, BLOCKS * 4), kv_of(BLOCKS * 4, seed=1))
        server.admin("/v1/admin/persist")


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_floors_that_do_not_fit_a_lowered_disk_are_refused_before_the_slab_is_cut(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = write_config(tmp_path, disk="1MiB", tenants=TENANTS)
    fill(good)
    slab = tmp_path / "disk" / "slab-00000.kvt"
    size = slab.stat().st_size
    floors = {t: {**s, "floor": {"disk": "200KiB"}} for t, s in TENANTS.items()}
    bad = write_config(tmp_path, disk="256KiB", tenants=floors, name="bad.yaml")
    said = refused_start(bad)  # exit 2, as `validate`'s, before the store opens the disk
    assert "tenants.*.floor.disk" in said and "32 slots" in said
    assert slab.stat().st_size == size  # nothing cut
    status, said = validate(bad, capsys)
    assert status == 2 and "tenants.*.floor.disk" in said, said
    with running(good) as server:
        found = recovery(server)
        assert found["recovered"] == BLOCKS and found["cut"] == 0, found


def test_a_refused_config_creates_nothing_on_a_new_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    floors = {t: {**s, "floor": {"disk": "200KiB"}} for t, s in TENANTS.items()}
    bad = write_config(tmp_path, disk="256KiB", tenants=floors)
    status, said = validate(bad, capsys)
    assert status == 2 and "tenants.*.floor.disk" in said and "32 slots" in said, said
    assert "tenants.*.floor.disk" in refused_start(bad)  # exit 2, as `validate`'s
    assert not (tmp_path / "disk").exists()


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_lowered_capacity_counts_the_copies_it_cut(tmp_path: Path) -> None:
    fill(write_config(tmp_path, disk="1MiB", tenants=TENANTS))
    lower = write_config(tmp_path, disk=f"{32 * SLOT_BYTES}", tenants=TENANTS, name="low.yaml")
    with running(lower) as server:
        found = recovery(server)
    assert found["slots_scanned"] == 32, found
    assert found["cut"] > 0 and found["recovered"] + found["cut"] == BLOCKS, found
    assert f"cut {int(found['cut'])} copies" in server.output()


def test_a_quota_of_no_block_is_refused_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for quota, name in (("1KiB", "kib.yaml"), (1e-10, "tiny.yaml")):
        tenants = {"a": {"api_keys": [KA], "quota": {"gpu": quota}}, "b": TENANTS["b"]}
        config = write_config(tmp_path, tenants=tenants, name=name)
        status, said = validate(config, capsys)
        assert status == 2, said
        assert "tenants.a.quota.gpu" in said and f"{BLOCK_BYTES} bytes" in said, said
    assert "tenants.a.quota.gpu" in refused_start(config)
    assert yaml.safe_load(config.read_text())["tenants"]["a"]["quota"]["gpu"] == 1e-10
