"""Keys and files under hostile conditions (issue 11, point 8), against real `kvtier serve`
processes: a key never acts as two tenants and never shows in an error; the state and disk
directories are private whatever the umask; a secret another user can read, a link, or a
dangling link is refused with a typed error; the superblock write never follows a planted link.

A refused start is `kvtier serve` exiting with status 2 and the `ConfigError` on stderr (no
traceback); a store that cannot start leaves the process up with /readyz 503 and the reason.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from refusals import refused_start, unready_detail
from service_server import ADMIN_KEY, kv_of, running, tokens_of, write_config

from kvtier.client import Client

KEY = "shared-key-0123456789abcdef"
OTHER_KEY = "other-key-0123456789abcdef"


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@contextlib.contextmanager
def umask(value: int) -> Iterator[None]:
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


SLOW = pytest.mark.slow  # each starts a server process: run by `.ci/run` (`pytest -m slow`)


# ---- keys -----------------------------------------------------------------------------------


@pytest.mark.parametrize("spelled", ["literal", pytest.param("env", marks=SLOW)])
def test_one_key_under_two_tenants_is_refused_naming_both_tenants_never_the_key(
    tmp_path: Path, spelled: str
) -> None:
    keys = ([KEY], [KEY]) if spelled == "literal" else (["env:KEY_OF_A"], ["env:KEY_OF_B"])
    config = write_config(
        tmp_path, tenants={"a": {"api_keys": keys[0]}, "b": {"api_keys": keys[1]}}
    )
    error = refused_start(config, {"KEY_OF_A": KEY, "KEY_OF_B": KEY})
    assert "tenants.b.api_keys.0" in error and "'a'" in error and "'b'" in error
    assert KEY not in error
    assert not (tmp_path / "state").exists()  # refused before anything was created


@SLOW
def test_the_admin_key_may_not_be_a_tenants_key(tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        tenants={"a": {"api_keys": [OTHER_KEY, ADMIN_KEY]}},
    )
    error = refused_start(config)
    assert "service.admin_key" in error and "tenants.a.api_keys.1" in error
    assert ADMIN_KEY not in error


@pytest.mark.parametrize(
    ("yaml_tenants", "place"),
    [
        ("{a: {api_keys: [short-secret-1]}}", "tenants.a.api_keys.0"),
        pytest.param("{a: {api_keys: short-secret-1}}", "tenants.a.api_keys", marks=SLOW),
        pytest.param("{a: {api_keys: [987654321]}}", "tenants.a.api_keys.0", marks=SLOW),
    ],
    ids=["too short", "not a list", "a number"],
)
def test_a_rejected_key_is_never_echoed(tmp_path: Path, yaml_tenants: str, place: str) -> None:
    config = write_config(tmp_path)
    text = config.read_text().replace("tenants:\n  default: {}", f"tenants: {yaml_tenants}")
    config.write_text(text)
    error = refused_start(config)
    assert place in error
    assert "short-secret-1" not in error and "987654321" not in error


@SLOW
def test_a_yaml_error_on_a_key_line_does_not_show_the_key(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    text = config.read_text().replace(
        f"admin_key: {ADMIN_KEY}", f"admin_key: {ADMIN_KEY}\n  admin_key: {OTHER_KEY}"
    )
    config.write_text(text)
    error = refused_start(config)
    assert "a key repeated" in error and "line" in error
    assert OTHER_KEY not in error and ADMIN_KEY not in error


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_refusals_of_a_presented_key_do_not_echo_it(tmp_path: Path) -> None:
    config = write_config(tmp_path, tenants={"a": {"api_keys": [KEY]}})
    wrong = "wrong-key-0123456789abcdef"
    with running(config) as server:
        for headers in ({"authorization": f"Bearer {wrong}"}, {"authorization": wrong}):
            response = server.post("/v1/lookup", json={"tokens": [1, 2, 3, 4]}, headers=headers)
            assert response.status_code in (401, 403)
            assert wrong not in response.text
        response = server.post("/v1/admin/check", headers={"authorization": f"Bearer {wrong}"})
        assert response.status_code == 403 and wrong not in response.text


# ---- the state directory and its secret ---------------------------------------------------------


def test_under_umask_0_the_state_and_disk_files_are_private(tmp_path: Path) -> None:
    config = write_config(tmp_path, disk="256KiB")  # its own file other users cannot write
    with umask(0), running(config) as server, Client(server.url, shared_memory=False) as client:
        client.store(tokens_of(0, 8), kv_of(8, seed=1))
        server.admin("/v1/admin/persist")
        state, disk = tmp_path / "state", tmp_path / "disk"
        assert (mode(state), mode(state / "secret")) == (0o700, 0o600)
        assert mode(disk) == 0o700
        files = sorted(p.name for p in disk.iterdir())
        assert files == ["kvtier-disk.json", "kvtier.lock", "slab-00000.kvt"]
        assert {p.name: mode(p) for p in disk.iterdir()} == dict.fromkeys(files, 0o600)


@SLOW
def test_missing_parents_of_the_state_dir_are_made_without_group_or_other_write(
    tmp_path: Path,
) -> None:
    config = write_config(tmp_path, service={"state_dir": str(tmp_path / "a" / "b" / "state")})
    with umask(0), running(config):
        pass
    assert (mode(tmp_path / "a"), mode(tmp_path / "a" / "b")) == (0o755, 0o755)
    assert mode(tmp_path / "a" / "b" / "state") == 0o700


@SLOW
def test_a_state_dir_others_can_write_is_refused_naming_it_and_its_mode(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o775)
    error = refused_start(write_config(tmp_path))
    assert str(state) in error and "0775" in error
    assert not (state / "secret").exists()


def _secret_file(state: Path) -> Path:
    state.mkdir(mode=0o700)
    secret = state / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    return secret


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        ("readable by others", "0644"),
        pytest.param("dangling link", "dangling symbolic link", marks=SLOW),
        pytest.param("link to a good secret", "symbolic link", marks=SLOW),
        pytest.param("a directory", "a directory", marks=SLOW),
        pytest.param("too short", "32 bytes", marks=SLOW),
    ],
)
def test_a_secret_that_is_not_private_whole_and_regular_is_refused(
    tmp_path: Path, damage: str, said: str
) -> None:
    secret = _secret_file(tmp_path / "state")
    if damage == "readable by others":
        secret.chmod(0o644)
    elif damage == "dangling link":
        secret.unlink()
        secret.symlink_to(tmp_path / "nowhere")
    elif damage == "link to a good secret":
        secret.rename(tmp_path / "elsewhere")
        secret.symlink_to(tmp_path / "elsewhere")
    elif damage == "a directory":
        secret.unlink()
        secret.mkdir()
    else:
        secret.write_bytes(b"x" * 31)
    error = refused_start(write_config(tmp_path))
    assert str(secret) in error and said in error and "service.state_dir" in error


@SLOW
def test_planted_temporary_file_links_are_never_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "disk").mkdir(mode=0o700)
    (tmp_path / "state").mkdir(mode=0o700)
    planted = [
        tmp_path / "disk" / "kvtier-disk.tmp",  # what the superblock write used to open
        tmp_path / "disk" / "kvtier-disk.json.tmp",
        tmp_path / "state" / "secret.tmp",
    ]
    for link in planted:
        link.symlink_to(victim)
    with running(write_config(tmp_path, disk="256KiB")):
        pass
    assert victim.read_bytes() == b"precious"
    superblock = tmp_path / "disk" / "kvtier-disk.json"
    assert stat.S_ISREG(os.lstat(superblock).st_mode) and b"slot_bytes" in superblock.read_bytes()
    assert not (tmp_path / "disk" / "kvtier-disk.json.tmp").exists()
    assert stat.S_ISREG(os.lstat(tmp_path / "state" / "secret").st_mode)


def test_a_disk_dir_others_can_write_is_refused_naming_it_and_its_mode(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    disk.chmod(0o777)
    detail = unready_detail(write_config(tmp_path, disk="256KiB"))
    assert str(disk) in detail and "0777" in detail and "tiers.disk.path" in detail
    assert list(disk.iterdir()) == []  # nothing was written there
