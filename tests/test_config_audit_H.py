"""Audit H: configuration, the CLI and deployment, as an operator meets them.

Each scenario runs the real parts: `kvtier` as a process (its exit status and what it prints),
config files on disk, a real ZMQ bind, a real `kvtier serve` sent a real SIGHUP, real
directories of another owner.
"""

from __future__ import annotations

import os
import pwd
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import zmq

from kvtier.cli import main
from kvtier.config import load_config, parse_config
from kvtier.config.events import is_bind_address, is_peer_address
from kvtier.errors import ConfigError
from kvtier.preflight import preflight
from kvtier.private_files import private_dir
from kvtier.service.auth import server_secret

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def test_an_empty_config_path_is_refused_not_the_embedded_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvtier info --config "$CONFIG"` with the variable unset ran the embedded default (and
    made its 2 GiB disk tier in the working directory) without a word."""
    monkeypatch.chdir(tmp_path)
    assert main(["info", "--config", ""]) == 2
    assert "config field '<file>': got ''" in capsys.readouterr().err
    assert not (tmp_path / "kvtier-data").exists()
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}\n')
    assert main(["replay", str(trace), "--config", ""]) == 2  # sized for no model but its own
    assert "config field '<file>': got ''" in capsys.readouterr().err


def test_a_link_local_ipv6_address_with_its_zone_is_an_address() -> None:
    # ZMQ connects to it; the shape check refused the '%' (a router could not add such a pod)
    assert is_peer_address("tcp://[fe80::1%eth0]:5557")
    assert is_bind_address("tcp://[fe80::1%eth0]:0") and not is_peer_address("tcp://[::1]:0")
    for outside in ("tcp://%%%:5557", "tcp://10.0.0.1%eth0:5557", "tcp://host%:1"):
        assert not is_peer_address(outside) and not is_bind_address(outside), outside


def test_an_events_port_past_65535_is_refused_naming_it() -> None:
    """`tcp://127.0.0.1:99999` passed, and ZMQ bound port 34463 (99999 - 65536): routers told
    the configured address heard nothing."""
    for field in ("endpoint", "replay_endpoint"):
        events = {"endpoint": "tcp://127.0.0.1:5557", field: "tcp://127.0.0.1:99999"}
        with pytest.raises(ConfigError, match=r"0\.\.65535") as info:
            parse_config({"events": events})
        assert (info.value.field, info.value.value) == (f"events.{field}", "tcp://127.0.0.1:99999")
    # what ZMQ does with such a port, which the check keeps from happening
    with zmq.Context() as context, context.socket(zmq.PUB) as pub:
        pub.bind("tcp://127.0.0.1:99999")
        assert pub.getsockopt_string(zmq.LAST_ENDPOINT).endswith(":34463")
    # the ephemeral port (0), the top port and a connect address still pass
    config = parse_config(
        {"events": {"endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://[::1]:65535"}}
    )
    assert config.events is not None and config.events.replay_endpoint == "tcp://[::1]:65535"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_sighup_leaves_the_sidecar_serving(tmp_path: Path) -> None:
    """SIGHUP (a reload, or a hung-up terminal) killed `kvtier serve` at once: no clean stop,
    its pools left in /dev/shm, and systemd's Restart=on-failure takes a death by SIGHUP for a
    clean exit. Now it is logged and ignored; SIGTERM still stops it cleanly, exit 0."""
    port = _free_port()
    config = tmp_path / "kvtier.yaml"
    config.write_text(
        f"tiers: {{gpu: {{capacity: 4MiB}}, host: {{capacity: 8MiB}}}}\n"
        f"service: {{port: {port}, state_dir: {tmp_path / 'state'}}}\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli", "serve", "--config", str(config)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}/readyz"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2) as reply:
                    assert reply.status == 200
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
        proc.send_signal(signal.SIGHUP)
        time.sleep(1)
        assert proc.poll() is None, "SIGHUP ended the sidecar"
        with urllib.request.urlopen(url, timeout=5) as reply:
            assert reply.status == 200
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert "SIGHUP ignored" in out


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_a_closed_pipe_ends_the_cli_quietly(tmp_path: Path) -> None:
    """`kvtier validate ... | head -1` (or `kvtier status | head`) printed two BrokenPipeError
    tracebacks once the reader had gone."""
    config = tmp_path / "ok.yaml"
    config.write_text("block_tokens: 16\n")
    for unbuffered in ("1", None):  # a pipe's stdout is buffered unless PYTHONUNBUFFERED
        env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
        env.update({"PYTHONUNBUFFERED": unbuffered} if unbuffered else {})
        read, write = os.pipe()
        os.close(read)  # the reader is gone before the first line
        try:
            run = subprocess.run(
                [sys.executable, "-m", "kvtier.cli", "validate", *[str(config)] * 3],
                stdout=write,
                stderr=subprocess.PIPE,
                text=True,
                timeout=60,
                env=env,
            )
        finally:
            os.close(write)
        assert "Traceback" not in run.stderr and "Exception" not in run.stderr, run.stderr
        assert run.returncode == 141, (unbuffered, run.returncode)
    closed = subprocess.run(  # started with stdout closed (`>&-`): sys.stdout is None
        [sys.executable, "-m", "kvtier.cli", "validate", str(config)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=60,
        preexec_fn=lambda: os.close(1),
    )  # fmt: skip
    assert closed.returncode == 0 and "Traceback" not in closed.stderr, closed.stderr


def _nobody() -> int:
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        return 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_state_dir_another_user_owns_is_refused(tmp_path: Path) -> None:
    """`private_dir` promised a directory no other user can write, and took one another user
    owns (mode 0700): its owner can delete or swap the server secret in it (every tenant's
    salts, so every block on disk, gone at the next start)."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.chown(state, _nobody(), _nobody())
    with pytest.raises(ConfigError, match="owned by this process's user") as info:
        server_secret(state)
    assert info.value.field == "service.state_dir"
    assert f"owner uid {_nobody()}" in str(info.value.value)
    assert not (state / "secret").exists()
    mine = tmp_path / "mine"
    assert private_dir(mine, "service.state_dir") == mine  # made here: this user's, 0700
    assert len(server_secret(mine)) == 32


def test_config_file_errors_say_why(tmp_path: Path) -> None:
    """An unreadable or non-UTF-8 file was refused as "a readable YAML file", saying nothing of
    why; one API key where a list goes said pydantic's "Input should be a valid tuple"."""
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"# caf\xe9\nblock_tokens: 16\n")
    with pytest.raises(ConfigError, match=r"in UTF-8 \(it holds bytes that are not UTF-8"):
        load_config(latin1)
    loop = tmp_path / "loop.yaml"
    loop.symlink_to(loop)
    with pytest.raises(ConfigError, match="Too many levels of symbolic links"):
        load_config(loop)
    one_key = {"tenants": {"a": {"api_keys": "k" * 20}}}
    with pytest.raises(ConfigError, match=r"a list of API keys") as info:
        parse_config(one_key)
    assert info.value.field == "tenants.a.api_keys"
    assert "k" * 20 not in str(info.value)


def test_the_systemd_unit_runs_in_its_state_directory() -> None:
    """Without a WorkingDirectory the unit ran in /, read-only under ProtectSystem=strict: a
    config with relative paths (the defaults, configs/*.yaml) could not start."""
    lines = (DEPLOY / "systemd" / "kvtier.service").read_text().splitlines()
    assert "WorkingDirectory=/var/lib/kvtier" in lines
    assert "StateDirectory=kvtier" in lines


def test_an_events_topic_a_router_would_ignore_is_refused() -> None:
    """A router's subscriber ignores every event on a topic past `MAX_TOPIC_CHARS` (256); a
    long model name (the default topic) or a 200-character `events.topic` with a tenant's
    `@<tenant>` published there, and nothing said so."""
    model = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"}
    events = {"endpoint": "tcp://127.0.0.1:0"}
    config = parse_config({"model": {"name": "m" * 300, **model}, "events": events})
    with pytest.raises(ConfigError, match="at most 256 characters") as info:
        preflight(config, None)
    assert (info.value.field, info.value.value) == ("model.name", "a name of 300 characters")
    topic = "kv@pod@" + "m" * 193  # 200 characters: as events.topic allows
    per_tenant = {**events, "topic": topic, "per_tenant_topic": True}
    config = parse_config({"events": per_tenant, "tenants": {"t" * 64: {}}})
    with pytest.raises(ConfigError, match="this one has 265") as info:
        preflight(config, None)
    assert info.value.field == "events.topic"
    preflight(parse_config({"events": per_tenant, "tenants": {"t" * 55: {}}}), None)  # 256


def test_request_byte_limits_are_sizes_a_reply_can_carry() -> None:
    """`service.max_body_bytes: 10**30` passed; the sidecar then served, but `/v1/pools`, which
    names it in msgpack (64-bit integers), was a 500: no client could be made against it."""
    for field, most in (("max_body_bytes", 2**50), ("max_inflight_bytes", 2**60)):
        with pytest.raises(ConfigError, match=rf"\(\[\d+, {most}\] bytes\)") as info:
            parse_config({"service": {field: 10**30}})
        assert (info.value.field, info.value.value) == (f"service.{field}", 10**30)
    top = parse_config({"service": {"max_body_bytes": 2**50}}).service
    assert top.inflight_bytes == 2**52  # four bodies: what the budget holds at most
