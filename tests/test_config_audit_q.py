"""Config paths, `env:` secrets and what a refused file shows, against an outside audit (Q).

- Every path field (`tiers.disk.path`, `service.state_dir`, the remote tier's TLS files, an
  `ipc://` events endpoint) refuses a NUL byte or a lone surrogate at parse time, naming the
  field, so `kvtier validate` says so instead of `info` / `serve` dying with a ValueError;
  `service.host` refuses them too, and `private_dir` refuses them from Python.
- `kvtier serve`'s start-up reads the remote tier's `env:` secret and password before the port
  is bound or the store built: an unset one is a `ConfigError` naming its field, not a server
  left up with /healthz 503.
- A file that is no config (a `.env` of secrets, /etc/shadow) is refused without its text: a top
  level that is not a mapping, or a scalar where a section goes, shows its kind (and the top
  level its line and column), and an unknown key that is not letters, digits, `_`, `-`, `.` is
  not shown.
- `--config` on a FIFO with no writer is refused within `loading.FIFO_WAIT_S`, a device at
  once, naming the path (opened with O_NONBLOCK);
  a symbolic link to a regular file is followed.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

import kvtier.config
from kvtier.config import load_config, parse_config
from kvtier.errors import ConfigError
from kvtier.private_files import private_dir
from kvtier.service.server import build_app

SECRET = "Sup3rSecretAdminKey-0123456789"
TLS = {"ca_file": "/tmp/ca.pem"}


def _remote(**fields: object) -> dict[str, object]:
    return {"remote": {"nodes": ["127.0.0.1:7000"], **fields}}


# ---- a path no system call takes is refused at parse time --------------------------------------

BAD_PATHS = [
    ("tiers.disk.path", {"tiers": {"disk": {"capacity": "1MiB", "path": "/tmp/a\0b"}}}),
    ("tiers.disk.path", {"tiers": {"disk": {"capacity": "1MiB", "path": "/tmp/a\ud800"}}}),
    ("service.state_dir", {"service": {"state_dir": "/tmp/s\0t"}}),
    ("tiers.remote.tls.ca_file", {"tiers": _remote(tls={"ca_file": "/tmp/c\0a"})}),
    (
        "tiers.remote.tls.cert_file",
        {"tiers": _remote(tls={**TLS, "cert_file": "c\0", "key_file": "k"})},
    ),
    (
        "tiers.remote.tls.key_file",
        {"tiers": _remote(tls={**TLS, "cert_file": "c", "key_file": "k\0"})},
    ),
    ("events.endpoint", {"events": {"endpoint": "ipc:///tmp/e\udcff"}}),
    ("service.host", {"service": {"host": "127.0.0.1\0"}}),
]


@pytest.mark.parametrize(
    ("field", "data"), BAD_PATHS, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_PATHS)]
)
def test_a_path_with_a_nul_byte_or_a_lone_surrogate_is_refused_naming_its_field(
    field: str, data: dict[str, object]
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert info.value.field == field


def test_a_nul_byte_in_a_disk_path_is_refused_by_validate_not_a_traceback_later(
    tmp_path: Path,
) -> None:
    path = tmp_path / "nul.yaml"
    path.write_text('tiers: {disk: {capacity: 1MiB, path: "/tmp/a\\0b"}}\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert (info.value.field, info.value.value) == ("tiers.disk.path", "/tmp/a\0b")
    assert "NUL byte" in info.value.expected
    # U+DC80-U+DCFF stand for bytes the filesystem's encoding cannot decode: a path still
    disk = parse_config({"tiers": {"disk": {"capacity": "1MiB", "path": "/tmp/a\udcffb"}}}).tiers
    assert disk.disk is not None and disk.disk.path == "/tmp/a\udcffb"


def test_private_dir_refuses_a_nul_byte_with_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        private_dir(f"{tmp_path}/a\0b", "tiers.disk.path")
    assert info.value.field == "tiers.disk.path"
    assert os.listdir(tmp_path) == []


# ---- env: secrets are read before the server binds ---------------------------------------------


@pytest.mark.parametrize("name", ["secret", "password"])
def test_an_unset_remote_env_secret_stops_the_start_naming_its_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.delenv("KVT_AUDIT_Q_UNSET", raising=False)
    config = parse_config(
        {
            "service": {"state_dir": str(tmp_path / "state"), "shared_memory": False},
            "tiers": _remote(**{name: "env:KVT_AUDIT_Q_UNSET"}),
        }
    )
    with pytest.raises(ConfigError) as info:
        build_app(config, "127.0.0.1")
    assert info.value.field == f"tiers.remote.{name}"
    assert "env:KVT_AUDIT_Q_UNSET" in str(info.value)
    assert not (tmp_path / "state").exists()  # before the server secret is written
    monkeypatch.setenv("KVT_AUDIT_Q_UNSET", SECRET)  # set, the start goes on
    build_app(config, "127.0.0.1")
    assert (tmp_path / "state" / "secret").is_file()


# ---- a file that is no config is refused without its text --------------------------------------

NOT_CONFIGS = [
    ("one line", f"KVTIER_ADMIN_KEY={SECRET}\n", ("a string", 1, 1)),
    ("two lines", f"# keys\nKVTIER_ADMIN_KEY={SECRET}\nOTHER=x\n", ("a string", 2, 1)),
    ("a list", f"- {SECRET}\n- other\n", ("a list", 1, 1)),
    ("a number", "12345678901234567890\n", ("an integer", 1, 1)),
]


@pytest.mark.parametrize(
    ("text", "shown"), [n[1:] for n in NOT_CONFIGS], ids=[n[0] for n in NOT_CONFIGS]
)
def test_a_top_level_that_is_not_a_mapping_shows_its_kind_not_its_text(
    tmp_path: Path, text: str, shown: tuple[str, int, int]
) -> None:
    path = tmp_path / "secrets.env"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert SECRET not in str(info.value) and "12345678901234567890" not in str(info.value)
    value = kvtier.config.HiddenText(*shown)  # the kind, line and column, never the text
    assert (info.value.field, info.value.value) == ("<top level>", value)
    assert repr(value) in str(info.value) and str(path) in str(info.value)


def test_a_list_from_python_is_refused_without_its_items() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config([SECRET], source="request body")
    assert SECRET not in str(info.value)
    assert info.value.value == kvtier.config.HiddenText("a list")


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (f"tenants: {{a: {SECRET}}}\n", "tenants.a"),
        (f"tenants: [{SECRET}]\n", "tenants"),
        (f"service: {SECRET}\n", "service"),
        (f"tiers: {{remote: [{SECRET}]}}\n", "tiers.remote"),
    ],
)
def test_a_scalar_or_a_list_where_a_section_goes_is_not_shown(
    tmp_path: Path, text: str, field: str
) -> None:
    path = tmp_path / "kvtier.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.field == field
    assert SECRET not in str(info.value)
    assert isinstance(info.value.value, kvtier.config.HiddenText)


def test_an_unknown_key_that_is_a_line_of_a_secrets_file_is_not_shown(tmp_path: Path) -> None:
    path = tmp_path / "shadow"
    path.write_text("root:$6$salt$Hash0123456789abcdef:20228:0:99999:7::\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "Hash0123456789abcdef" not in str(info.value)
    assert "a known key" in info.value.expected
    with pytest.raises(ConfigError) as info:  # a misspelled key is still named
        parse_config({"tiers": {"gpu": {"high-watermark": 0.9}}})
    assert (info.value.field, info.value.value) == ("tiers.gpu.high-watermark", "high-watermark")


# ---- only a regular file is read ---------------------------------------------------------------


def test_a_fifo_given_as_the_config_is_refused_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvtier.config.loading, "FIFO_WAIT_S", 0.5)  # no writer: refused then
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    caught: list[BaseException] = []

    def load() -> None:
        try:
            load_config(fifo)
        except BaseException as exc:
            caught.append(exc)

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(timeout=5)
    blocked = reader.is_alive()
    if blocked:  # the code before: open() waits for a writer; one comes and goes
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=5)
    assert not blocked, "load_config blocked on a FIFO"
    assert len(caught) == 1 and isinstance(caught[0], ConfigError)
    assert (caught[0].field, caught[0].value) == ("<file>", str(fifo))
    assert "a FIFO" in caught[0].expected


def test_a_device_is_refused_and_a_link_to_a_regular_file_followed(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config("/dev/null")
    assert "a character device" in info.value.expected
    real = tmp_path / "real.yaml"
    real.write_text("block_tokens: 8\n")
    link = tmp_path / "link.yaml"
    link.symlink_to(real)
    assert load_config(link).block_tokens == 8
