"""Configuration, the command line and `kvtier serve`'s start, against an outside audit (AQ):
an SRE running kvtier next to an engine at 3 a.m.

- A file field (`tiers.disk.path`, `service.state_dir`, the TLS files) that starts with `~` or
  holds `$NAME` / `${NAME}` is refused naming the field: nothing expands them, and
  `path: ~/kvtier-data` made a directory named `~` in the working directory.
- A config file another user owns (mode 0644) is read, as before the audit's refusal of it,
  which review 2 found broke a checkout bind-mounted into a container that runs as root.
- SIGTERM or SIGINT while `kvtier serve` starts (here: while it waits for its config from a
  FIFO) ends it with one line and status 0; SIGINT was a KeyboardInterrupt's traceback and
  SIGTERM a death by the signal (143).
- A YAML file of two documents says so in a whole sentence (it said "but found another
  document").
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.config import load_config, parse_config
from kvtier.errors import ConfigError

MODEL = "model: {name: t, num_layers: 1, num_kv_heads: 1, head_dim: 8, dtype: float16}\n"

# ---- a shell's `~` or `$NAME` in a path field is refused, naming it ----------------------------

UNEXPANDED = [
    ("tiers.disk.path", {"tiers": {"disk": {"capacity": "1MiB", "path": "~/kvtier-data"}}}),
    ("tiers.disk.path", {"tiers": {"disk": {"capacity": "1MiB", "path": "$HOME/kvtier-data"}}}),
    ("service.state_dir", {"service": {"state_dir": "${STATE_DIRECTORY}/state"}}),
    ("service.state_dir", {"service": {"state_dir": "~kvtier/state"}}),
    (
        "tiers.remote.tls.ca_file",
        {"tiers": {"remote": {"nodes": ["127.0.0.1:7000"], "tls": {"ca_file": "~/ca.pem"}}}},
    ),
]


@pytest.mark.parametrize(
    ("field", "data"), UNEXPANDED, ids=[f"{u[0]}-{i}" for i, u in enumerate(UNEXPANDED)]
)
def test_a_path_with_a_shell_tilde_or_variable_is_refused_naming_its_field(
    field: str, data: dict[str, object]
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert info.value.field == field
    assert "expands no '~' or '$NAME'" in info.value.expected


def test_paths_with_a_tilde_or_dollar_inside_a_name_still_load() -> None:
    for path in ("/data/kvtier~", "./a$", "/x/$5/data", "./kvtier-data"):
        disk = parse_config({"tiers": {"disk": {"capacity": "1MiB", "path": path}}}).tiers.disk
        assert disk is not None and disk.path == path


def test_info_refuses_a_tilde_path_and_makes_no_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "kvtier.yaml"
    config.write_text(MODEL + "tiers: {disk: {capacity: 1MiB, path: ~/kvtier-data}}\n")
    assert main(["info", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "tiers.disk.path" in err and "'~/kvtier-data'" in err
    assert not (tmp_path / "~").exists()


# ---- a config file another user owns is read ---------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_config_file_another_user_owns_is_read_and_one_others_can_write_refused(
    tmp_path: Path,
) -> None:
    config = tmp_path / "kvtier.yaml"
    config.write_text(MODEL)
    config.chmod(0o644)
    os.chown(config, 65534, -1)  # a host user's file bind-mounted into a root container
    assert load_config(config).model.name == "t"
    config.chmod(0o646)
    with pytest.raises(ConfigError, match="other users cannot write"):
        load_config(config)


# ---- SIGTERM or SIGINT while serve starts --------------------------------------------------------


class _Unhandled(Exception):
    """What the test's own handler raises: the signal reached no handler of `kvtier serve`."""


def _raise_unhandled(signum: int, frame: object) -> None:
    raise _Unhandled(signum)


@pytest.fixture
def saved_handlers() -> Iterator[None]:
    """The test's handlers for SIGTERM and SIGINT (so that the code before the fix ends in an
    exception here, not in a dead pytest), and every handler put back after."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    signal.signal(signal.SIGTERM, _raise_unhandled)
    signal.signal(signal.SIGINT, _raise_unhandled)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@pytest.mark.usefixtures("saved_handlers")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_while_serve_reads_its_config_ends_it_with_one_line_and_status_0(
    tmp_path: Path, sig: signal.Signals, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = tmp_path / "kvtier.yaml"
    os.mkfifo(fifo, 0o600)
    writer: list[int] = []

    def stop_once_it_reads() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:  # succeeds once serve has the FIFO open to read its config
                writer.append(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                break
            except OSError:
                time.sleep(0.01)
        os.kill(os.getpid(), sig)

    stopper = threading.Thread(target=stop_once_it_reads, daemon=True)
    stopper.start()
    try:
        code = main(["serve", "--config", str(fifo)])
    except _Unhandled:
        code = None
    finally:
        stopper.join(timeout=10)
        for fd in writer:
            os.close(fd)
    assert writer, "serve never opened its config"
    err = capsys.readouterr().err
    assert code == 0, err
    assert err.strip() == f"kvtier: {sig.name} while starting: stopped before serving anything"


# ---- YAML of two documents ---------------------------------------------------------------------


def test_a_second_yaml_document_is_named_in_a_whole_sentence(tmp_path: Path) -> None:
    config = tmp_path / "kvtier.yaml"
    config.write_text(MODEL + "---\n" + MODEL)
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert info.value.field == "<yaml>"
    assert "expected a single document in the stream, but found another document" in (
        info.value.expected
    )


# ---- a model no tier could hold a block of ------------------------------------------------------


def test_a_model_of_a_block_past_any_size_is_refused_naming_the_model() -> None:
    model = {"name": "t", "num_layers": 2**63, "num_kv_heads": 1, "head_dim": 1, "dtype": "float16"}
    with pytest.raises(ConfigError) as info:
        parse_config({"model": model})
    assert info.value.field == "model"  # was tiers.gpu.capacity, "at least one block (64PiB...)"
    assert f"{2**63} layers" in str(info.value.value)


def test_ctrl_c_in_a_command_says_one_line_and_ends_the_program_by_sigint() -> None:
    """`kvtier status` against a server that never answers, then Ctrl-C: one line, no
    traceback, and the process dies of SIGINT (review 2: an exit status of 130 let a shell
    script's loop go on to its next command; bash stops one only on a child SIGINT ended)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        command = [sys.executable, "-m", "kvtier.cli", "status", "--url", url]
        process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        try:
            silent.settimeout(60)
            connection, _ = silent.accept()  # its request came: it waits for the reply
            with connection:
                time.sleep(0.3)
                process.send_signal(signal.SIGINT)
                _, err = process.communicate(timeout=30)
        finally:
            process.kill()
    assert process.returncode == -signal.SIGINT, (process.returncode, err)
    assert err.strip() == "kvtier: interrupted" and "Traceback" not in err
