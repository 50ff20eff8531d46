"""A config file any local user can write is refused: it gives the server its API keys, admin
key, state and disk directories, so another user could have taken the tenants' data (their own
key added, the disk tier pointed at a directory of theirs). One its group can write is taken
(an operators' group), as is a FIFO (`<(envsubst < tmpl)`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.config import load_config
from kvtier.errors import ConfigError

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
