"""A config file any local user can write is refused: it gives the server its API keys, admin
key, state and disk directories, so another user could have taken the tenants' data (their own
key added, the disk tier pointed at a directory of theirs). One its group can write is taken
(an operators' group), as is a FIFO (`<(envsubst < tmpl)`). So is the remote tier's TLS key
that other users can read."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from test_remote_audit_n import tls_config

from kvtier import KVStore
from kvtier.cli import main
from kvtier.config import load_config, parse_config
from kvtier.errors import ConfigError
from kvtier.tiers.remote.local import make_certificates

YAML = "model: {name: tiny, num_layers: 2, num_kv_heads: 2, head_dim: 64, dtype: float16}\n"


def test_a_config_other_users_can_write_is_refused_naming_its_mode(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.yaml"
    path.write_text(YAML)
    path.chmod(0o666)
    with pytest.raises(ConfigError, match=r"0666.*chmod o-w") as refused:
        load_config(path)
    assert str(path) in str(refused.value)
    link = tmp_path / "link.yaml"
    link.symlink_to(path)  # the file the link names is the one checked
    with pytest.raises(ConfigError, match="chmod o-w"):
        load_config(link)
    path.chmod(0o664)  # its group may: an operators' group
    assert load_config(path).model.name == "tiny"


def test_kvtier_info_exits_2_on_a_world_writable_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "kvtier.yaml"
    path.write_text(YAML)
    path.chmod(0o646)
    assert main(["info", "--config", str(path)]) == 2
    assert "chmod o-w" in capsys.readouterr().err


def test_a_tls_key_other_users_can_read_is_refused_at_start(tmp_path: Path) -> None:
    """This node's private key for the remote tier's cluster (`tiers.remote.tls.key_file`):
    one any local user can read lets them pose as this node to the cluster."""
    if shutil.which("openssl") is None:
        pytest.skip(reason="no openssl on PATH: the TLS files are made with it")
    tls = make_certificates(tmp_path / "tls")
    files = {
        "ca_file": str(tls.ca_file),
        "cert_file": str(tls.cert_file),
        "key_file": str(tls.key_file),
    }
    config = tls_config(files)
    Path(str(tls.key_file)).chmod(0o644)
    with pytest.raises(ConfigError, match="chmod o-rw") as refused:
        KVStore(parse_config(config)).close()
    assert refused.value.field == "tiers.remote.tls.key_file"
    Path(str(tls.key_file)).chmod(0o640)  # its group may: the server's own group
    KVStore(parse_config(config)).close()


def test_a_disk_floor_without_a_disk_tier_is_refused_naming_it() -> None:
    """`tenants.a.floor.disk` in a config with no disk tier was ignored without a word (the
    operator believed a's disk blocks kept)."""
    with pytest.raises(ConfigError, match="no disk tier") as refused:
        parse_config({"tenants": {"a": {"floor": {"disk": "1GiB"}}, "b": {}}})
    assert refused.value.field == "tenants.a.floor.disk"
    disk = {"capacity": "64MiB", "path": "/nonexistent-kvtier-disk"}  # parsed, never opened
    config = parse_config({"tiers": {"disk": disk}, "tenants": {"a": {"floor": {"disk": 0.5}}}})
    assert config.tenants["a"].floor.disk is not None


def test_a_fifo_other_users_can_write_is_refused_a_pipe_is_taken(tmp_path: Path) -> None:
    """A named FIFO of mode 0666 lets any local user write the config into it; the pipe of a
    `<(envsubst < tmpl)` is 0600 and is read as before."""
    fifo = tmp_path / "kvtier.fifo"
    os.mkfifo(fifo)
    fifo.chmod(0o666)
    with pytest.raises(ConfigError, match="chmod o-w"):
        load_config(fifo)  # refused at the open's fstat: no writer needed
    read, write = os.pipe()
    os.write(write, YAML.encode())
    os.close(write)
    try:
        assert load_config(f"/proc/self/fd/{read}").model.name == "tiny"
    finally:
        os.close(read)
