"""Config, keys and the command line against an outside audit (third round).

- A YAML syntax error shows no text of the file, nor the YAML reader's quoted words: a key on
  the bad line (a passphrase, a key before ':', an alias name) never reaches stderr.
- An API key is one a request can present: printable latin-1 without a space at either end. A
  literal that is not is refused at load, an `env:` value loses one trailing newline (a secret
  file's) and is then held to the same rule; duplicates are found among the keys so read. A
  client's key that is no header value is an `InvalidArgumentError` naming `api_key`.
- `kvtier status --key <tenant key>` prints the tenant's status; a malformed `--url` is one line,
  exit 2; `kvtier validate` refuses the keys `serve` refuses, writing nothing.
- `kvtier replay`: a request of more than `MAX_REQUEST_TOKENS` tokens, or ids that are not
  chained, are refused naming the trace's line before any store is built; `--config` is read in
  every mode; `--block-tokens 0` is refused.
- A state directory the secret cannot be written in stops `serve` naming `service.state_dir`.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest
import yaml
from refusals import refused_start
from service_server import ADMIN_KEY, running, write_config
from test_cli import run

from kvtier.client import AsyncClient, Client, ServiceError
from kvtier.config import load_config, parse_config
from kvtier.config.fields import resolve_key
from kvtier.errors import ConfigError, InvalidArgumentError, TraceError
from kvtier.replay.trace import MAX_REQUEST_TOKENS, read_trace
from kvtier.service.auth import Auth

pytestmark = pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite

KEY = "tenant-key-0123456789abcdef"
PASSPHRASE = "correct horse battery staple"
UUID = "7c9e6679-7425-40de-944b-e07fc1f90ae7"
ALIAS = "Xk9pQ2vL7mN4rT8wZ1"


def refused(done: subprocess.CompletedProcess[str]) -> str:
    """The stderr of a command that stopped on a typed error: exit 2, no traceback."""
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done.stderr


# ---- a YAML error shows nothing of the file ------------------------------------------------------

BAD_YAML = [
    ("admin passphrase", f'service: {{admin_key: "{PASSPHRASE}", port: 8750}}}}\n', PASSPHRASE, 1),
    ("tenant passphrase", f'tenants: {{a: {{api_keys: ["{PASSPHRASE}"]}}}}}}\n', PASSPHRASE, 1),
    (
        "remote password",
        'tiers: {remote: {nodes: ["127.0.0.1:1"], password: "my redis pass phrase 2026"}}}\n',
        "my redis pass phrase 2026",
        1,
    ),
    ("key before a colon", f"tenants:\n  a:\n    api_keys:\n      - {UUID} : x: y\n", UUID, 4),
    ("undefined alias", f"tenants:\n  a:\n    api_keys:\n      - *{ALIAS}\n", ALIAS, 4),
    ("unknown tag", f"tenants:\n  a:\n    api_keys: [!{ALIAS} x]\n", ALIAS, 3),
    ("repeated key", f"tenants: {{a: {{}}, {UUID}: {{}}, {UUID}: {{}}}}\n", UUID, 1),
]


@pytest.mark.parametrize(
    ("text", "secret", "line"), [b[1:] for b in BAD_YAML], ids=[b[0] for b in BAD_YAML]
)
def test_a_yaml_error_names_line_and_column_never_the_text(
    tmp_path: Path, text: str, secret: str, line: int
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    error = info.value
    assert error.field == "<yaml>"
    assert f"line {line}, column " in str(error) and str(path) in str(error)
    assert secret not in str(error) and secret not in repr(error.value)
    assert error.__cause__ is None and error.__context__ is None  # no YAML error chained


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
@pytest.mark.parametrize("command", ["validate", "serve"])
@pytest.mark.parametrize(
    ("text", "secret"), [(b[1], b[2]) for b in BAD_YAML[:5]], ids=[b[0] for b in BAD_YAML[:5]]
)
def test_the_cli_prints_no_key_of_a_file_it_cannot_read(
    tmp_path: Path, command: str, text: str, secret: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    args = ["validate", str(path)] if command == "validate" else ["serve", "--config", str(path)]
    stderr = refused(run(*args))
    assert "<yaml>" in stderr and "line " in stderr
    for word in secret.split():
        if len(word) > 4:
            assert word not in stderr, stderr


def test_the_yaml_reader_s_words_stay_when_they_show_nothing(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("tiers: {gpu: {capacity: [256MiB}\n")
    with pytest.raises(ConfigError, match=r"expected ',' or '\]', but got '\}'"):
        load_config(path)


# ---- API keys as requests present them -----------------------------------------------------------


def _tenants(*keys: str) -> dict[str, object]:
    return {"tenants": {f"t{i}": {"api_keys": [key]} for i, key in enumerate(keys)}}


@pytest.mark.parametrize(
    "key",
    [f" {KEY}", f"{KEY}\n", f"{KEY}\t", "ключключключключключ", f"{KEY}\x00", f"{KEY}\xa0"],
    ids=["leading space", "newline", "tab", "cyrillic", "nul", "trailing nbsp"],
)
def test_a_literal_key_no_request_can_present_is_refused(key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(_tenants(key))
    assert info.value.field == "tenants.t0.api_keys.0"
    assert "printable latin-1" in str(info.value)
    assert key.strip() not in str(info.value)
    with pytest.raises(ConfigError) as info:
        parse_config({"service": {"admin_key": key}})
    assert info.value.field == "service.admin_key" and key.strip() not in str(info.value)


def test_a_passphrase_with_inner_spaces_is_still_a_key() -> None:
    Auth(parse_config(_tenants(PASSPHRASE)))


def test_a_latin_1_key_still_starts_and_logs_in(tmp_path: Path) -> None:
    """http.client sends a header as latin-1 and the server reads it so: such keys worked before
    the key rule, and must still (a server with one must not stop starting after an upgrade)."""
    key = "schlüssel-0123456789"
    config = write_config(tmp_path, tenants={"a": {"api_keys": [key]}})
    with running(config) as server, Client(server.url, api_key=key) as client:
        assert client.lookup([1, 2, 3, 4]).num_tokens == 0
        other = Client(server.url, api_key="schlussel-0123456789", shared_memory=False)
        with other, pytest.raises(ServiceError, match="403"):
            other.lookup([1, 2, 3, 4])

        async def through_httpx() -> int:  # httpx encodes a str header as ASCII unless told
            async with AsyncClient(server.url, api_key=key, shared_memory=False) as aclient:
                return (await aclient.lookup([1, 2, 3, 4])).num_tokens

        assert asyncio.run(through_httpx()) == 0


@pytest.mark.parametrize("value", [f" {KEY}", f"{KEY} \n", f"{KEY}\n\n", "ключключключключключ\n"])
def test_an_env_key_no_request_can_present_is_refused(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("KVTIER_AUDIT3_KEY", value)
    with pytest.raises(ConfigError) as info:
        Auth(parse_config(_tenants("env:KVTIER_AUDIT3_KEY")))
    assert info.value.field == "tenants.t0.api_keys.0"
    assert "env:KVTIER_AUDIT3_KEY" in str(info.value) and value.strip() not in str(info.value)


def test_an_env_key_and_the_same_literal_are_one_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_AUDIT3_KEY", KEY + "\n")  # a secret file's trailing newline
    with pytest.raises(ConfigError, match="list the same key") as info:
        Auth(parse_config(_tenants("env:KVTIER_AUDIT3_KEY", KEY)))
    assert KEY not in str(info.value)
    config = parse_config({**_tenants(KEY), "service": {"admin_key": "env:KVTIER_AUDIT3_KEY"}})
    with pytest.raises(ConfigError, match="a key no tenant uses"):
        Auth(config)


def test_an_env_secret_loses_a_secret_files_trailing_newline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`tiers.remote.secret` / `password` as `env:NAME` (`resolve_key`): one trailing newline is
    not the secret's (a Redis password read with it fails AUTH); the rest counts, short is
    refused naming the field, never the value."""
    for value in (KEY + "\n", KEY + "\r\n", KEY):
        monkeypatch.setenv("KVTIER_AUDIT3_SECRET", value)
        assert resolve_key("env:KVTIER_AUDIT3_SECRET", "tiers.remote.secret") == KEY
    monkeypatch.setenv("KVTIER_AUDIT3_SECRET", KEY + "\n\n")
    assert resolve_key("env:KVTIER_AUDIT3_SECRET", "tiers.remote.password") == KEY + "\n"
    monkeypatch.setenv("KVTIER_AUDIT3_SECRET", "short-secret-01\n")  # 15 characters then
    with pytest.raises(ConfigError) as short:
        resolve_key("env:KVTIER_AUDIT3_SECRET", "tiers.remote.password")
    assert short.value.field == "tiers.remote.password" and "short-secret" not in str(short.value)


def test_an_env_key_from_a_secret_file_logs_in(tmp_path: Path) -> None:
    config = write_config(tmp_path, tenants={"a": {"api_keys": ["env:KVTIER_AUDIT3_KEY"]}})
    with running(config, env={"KVTIER_AUDIT3_KEY": KEY + "\n"}) as server:
        for presented in (KEY, KEY + "\n", KEY + "\r\n"):
            with Client(server.url, api_key=presented, shared_memory=False) as client:
                assert client.lookup([1, 2, 3, 4]).num_tokens == 0
        wrong = {"authorization": "Bearer wrong-key-0123456789"}
        refused_key = server.post("/v1/lookup", json={"tokens": [1, 2, 3, 4]}, headers=wrong)
        assert refused_key.status_code == 403


@pytest.mark.parametrize("key", ["ключключключключключ", f"{KEY[:8]}\n{KEY[8:]}", f"{KEY}\x7f"])
def test_a_client_key_that_is_no_header_value_is_a_typed_error(key: str) -> None:
    for make in (Client, AsyncClient):
        with pytest.raises(InvalidArgumentError, match="api_key") as info:
            make("http://127.0.0.1:9", api_key=key, shared_memory=False)
        assert key not in str(info.value) and KEY[:8] not in str(info.value)


# ---- the command line ----------------------------------------------------------------------------


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_status_with_a_tenant_key_prints_the_tenant_s_figures(tmp_path: Path) -> None:
    config = write_config(tmp_path, tenants={"a": {"api_keys": [KEY]}, "b": {}})
    with running(config) as server:
        done = run("status", "--url", server.url, "--key", KEY)
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr
        assert done.stdout.startswith("tenant a: model tiny")
        rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()[2:4]}
        assert set(rows) == {"gpu", "host"} and rows["gpu"][2] == "0"  # no blocks yet
        assert "leases live" in done.stdout
        admin = run("status", "--url", server.url, "--key", ADMIN_KEY)
        assert admin.returncode == 0 and "write policy" in admin.stdout, admin.stderr


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
@pytest.mark.parametrize("url", ["localhost:8750", "http://[::1", "http://127.0.0.1:99999"])
@pytest.mark.parametrize("command", ["status", "reset"])
def test_a_malformed_url_is_one_line_naming_url(command: str, url: str) -> None:
    stderr = refused(run(command, "--url", url, "--key", KEY))
    assert stderr.startswith("kvtier: url: got") and len(stderr.splitlines()) == 1
    for make in (Client, AsyncClient):
        with pytest.raises(InvalidArgumentError, match="url: got"):
            make(url, shared_memory=False)


def test_a_malformed_url_s_credentials_are_not_shown() -> None:
    for make in (Client, AsyncClient):
        with pytest.raises(InvalidArgumentError, match="url: got") as info:
            make("http://user:hunter2-password@127.0.0.1:99999", shared_memory=False)
        assert "hunter2" not in str(info.value) and "127.0.0.1:99999" in str(info.value)


def _config_file(tmp_path: Path, data: dict[str, object]) -> Path:
    path = tmp_path / "k.yaml"
    path.write_text(yaml.safe_dump({"service": {"state_dir": str(tmp_path / "st")}, **data}))
    return path


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
@pytest.mark.parametrize(
    ("data", "place"),
    [
        ({"tenants": {"a": {"api_keys": [KEY]}, "b": {"api_keys": [KEY]}}}, "tenants.b.api_keys"),
        (
            {"tenants": {t: {"api_keys": ["env:KVTIER_AUDIT3_UNSET"]} for t in "ab"}},
            "tenants.b.api_keys",
        ),
        ({"tenants": {"a": {"api_keys": [KEY]}}, "admin_key": KEY}, "service.admin_key"),
        ({"tenants": {"a": {}}, "host": "0.0.0.0"}, "service.host"),
    ],
    ids=["two tenants", "one variable twice", "admin reused", "open without keys"],
)
def test_validate_refuses_what_serve_refuses(
    tmp_path: Path, data: dict[str, object], place: str
) -> None:
    data = dict(data)
    service = {k: data.pop(k) for k in ("admin_key", "host") if k in data}
    path = _config_file(tmp_path, data)
    text = yaml.safe_load(path.read_text())
    text["service"].update(service)
    path.write_text(yaml.safe_dump(text))
    stderr = refused(run("validate", str(path)))
    assert place in stderr and KEY not in stderr
    assert place in refused_start(path, env={"KVTIER_AUDIT3_UNSET": KEY})  # set for serve
    assert not (tmp_path / "st").exists()  # validate wrote no state


def test_validate_takes_an_unset_env_key_as_given(tmp_path: Path) -> None:
    path = _config_file(tmp_path, {"tenants": {"a": {"api_keys": ["env:KVTIER_AUDIT3_UNSET"]}}})
    done = run("validate", str(path))
    assert done.returncode == 0 and ": ok (" in done.stdout, done.stderr


def test_a_state_dir_the_secret_cannot_be_written_in_is_named(tmp_path: Path) -> None:
    config = write_config(tmp_path, service={"state_dir": "/proc/self"})
    stderr = refused_start(config)
    assert "service.state_dir" in stderr and "/proc/self" in stderr


# ---- kvtier replay -------------------------------------------------------------------------------


def _trace(path: Path, requests: list[list[int]], block_tokens: int = 512) -> Path:
    with path.open("w") as out:
        for i, ids in enumerate(requests):
            line = {"timestamp": i, "input_length": len(ids) * block_tokens, "output_length": 1,
                    "hash_ids": ids}  # fmt: skip
            out.write(json.dumps(line) + "\n")
    return path


def test_a_request_past_max_request_tokens_is_refused_naming_its_line(tmp_path: Path) -> None:
    most = MAX_REQUEST_TOKENS // 65536
    trace = _trace(tmp_path / "wide.jsonl", [[0], list(range(1, most + 2))], 65536)
    with pytest.raises(TraceError) as info:
        read_trace(trace, block_tokens=65536)
    assert info.value.line == 2 and str(MAX_REQUEST_TOKENS) in str(info.value)
    assert len(read_trace(trace, limit=1, block_tokens=65536)) == 1
    fits = _trace(tmp_path / "fits.jsonl", [list(range(most))], 65536)
    assert read_trace(fits, block_tokens=65536)[0].num_tokens == MAX_REQUEST_TOKENS
    stderr = refused(run("replay", str(trace), "--trace-block-tokens", "65536", "--jobs", "1"))
    assert "wide.jsonl:2" in stderr and str(MAX_REQUEST_TOKENS) in stderr


@pytest.mark.parametrize(
    ("requests", "line"),
    [([[1, 2], [3, 2]], 2), ([[0, 0]], 1), ([[5, 6], [7], [6]], 3)],
    ids=["another parent", "repeated in a request", "first after a parent"],
)
def test_ids_that_are_not_chained_are_refused_naming_the_line(
    tmp_path: Path, requests: list[list[int]], line: int
) -> None:
    trace = _trace(tmp_path / "t.jsonl", requests)
    with pytest.raises(TraceError, match="expected chained ids") as info:
        read_trace(trace)
    assert info.value.line == line


@pytest.mark.parametrize(
    "extra", [[], ["--replicas", "2"], ["--replicas", "2", "--route", "round-robin"]]
)
def test_replay_refuses_an_unchained_trace_before_it_runs(tmp_path: Path, extra: list[str]) -> None:
    trace = _trace(tmp_path / "t.jsonl", [[0, 1], [0, 2], [9, 2]])
    stderr = refused(run("replay", str(trace), "--jobs", "1", *extra))
    assert "t.jsonl:3" in stderr and "hash_ids[1]: id 2" in stderr


@pytest.mark.parametrize("extra", [["--json"], ["--replicas", "2"], ["--json", "--sweep"]])
def test_replay_reads_config_in_every_mode(tmp_path: Path, extra: list[str]) -> None:
    trace = _trace(tmp_path / "t.jsonl", [[0, 1], [0, 2]])
    missing = str(tmp_path / "nope.yaml")
    stderr = refused(run("replay", str(trace), "--jobs", "1", "--config", missing, *extra))
    assert "'<file>'" in stderr and "nope.yaml" in stderr


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_replay_refuses_block_tokens_0_and_names_the_fraction_s_bounds(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.jsonl", [[0, 1]])
    assert "block_tokens: got 0" in refused(run("replay", str(trace), "--block-tokens", "0"))
    stderr = refused(run("replay", str(trace), "--gpu", "1e308"))
    assert "--gpu: got 1e+308" in stderr and "at most 100" in stderr


@pytest.mark.parametrize(
    "url", ["http://side car:8750", "http://127.0.0.1:8750/a b", "http://h\n:1"]
)
def test_a_url_with_a_space_or_a_control_is_refused_naming_url(url: str) -> None:
    """http.client refuses them at the first call with its own InvalidURL (audit AK): the
    clients refuse them when made, as any other unusable URL."""
    for make in (Client, AsyncClient):
        with pytest.raises(InvalidArgumentError, match="url: got"):
            make(url, shared_memory=False)


def test_a_url_read_with_its_newline_or_surrounding_spaces_is_the_url() -> None:
    """urllib strips them, and the clients took such URLs before spaces were refused (review
    3): a URL read from a file keeps working."""
    for url in ("http://127.0.0.1:8750\n", " http://127.0.0.1:8750 "):
        Client(url, shared_memory=False).close()
        asyncio.run(AsyncClient(url, shared_memory=False).aclose())


def test_the_vllm_settings_never_show_a_urls_credentials() -> None:
    from kvtier.integrations.settings import ConnectorSettings

    secret = "http://u:hunter2-password@h:1"
    for extra in (
        {"kvtier.urls": [secret, secret]},  # one per rank: 1 here
        {"kvtier.urls": [secret, 5]},
        {"kvtier.url": secret, "kvtier.urls": [secret]},
    ):
        with pytest.raises(ConfigError, match=r"kvtier\.url") as info:
            ConnectorSettings.parse(extra, 1)
        assert "hunter2" not in str(info.value)
