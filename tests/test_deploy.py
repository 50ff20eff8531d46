"""deploy/: every file parses and says what it must, and the dashboard and the alert rules use
only names, labels and values a real `kvtier serve` exports.

- The Grafana dashboard (JSON), the alert rules and the pod (YAML), the systemd unit (its
  sections and keys) and the Containerfile (known instructions) parse.
- The example configs (the container's, the pod's ConfigMap) pass kvtier's own parser and
  `kvtier validate`, and with their `env:` keys set they turn auth on, so the non-loopback
  address they serve on is allowed.
- Every PromQL expression is checked against the /metrics of one real sidecar with a disk tier
  and a remote tier whose cluster is down (its metrics exist without a connection), after a
  store and a lookup (`promql_refs.py` says what is checked).
- Every query parses as PromQL (promql-parser); `systemd-analyze verify` runs where it is
  installed.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml
from promql_refs import Exported, Query, grouping, matchers, names, printed
from service_server import ADMIN_KEY, free_port, kv_of, running, tokens_of, write_config

from kvtier.cli import main
from kvtier.client import Client
from kvtier.config import KVTierConfig, load_config
from kvtier.errors import ConfigError
from kvtier.service.auth import Auth, require_loopback

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
DASHBOARD = DEPLOY / "grafana" / "kvtier.json"
RULES = DEPLOY / "prometheus" / "kvtier-alerts.yml"
UNIT = DEPLOY / "systemd" / "kvtier.service"
CONTAINERFILE = DEPLOY / "container" / "Containerfile"
CONTAINER_CONFIG = DEPLOY / "container" / "kvtier.yaml"
POD = DEPLOY / "kubernetes" / "pod.yaml"
KEYS = {
    "KVTIER_API_KEY": "engine-key-0123456789abcdef",
    "KVTIER_ADMIN_KEY": "admin-0123456789abcdef",
}
SERVE = ["kvtier", "serve", "--config", "/etc/kvtier/kvtier.yaml", "--host", "0.0.0.0"]
STOP_S = 30 + 30 + 30 + 10
"""The longest clean stop after SIGTERM: uvicorn's graceful shutdown, the mover's drain and its
thread's join, the remote writer's join (service/server.py, transfer/mover.py)."""


# ---- the files' queries --------------------------------------------------------------------


def dashboard_queries() -> list[Query]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [
        Query(f"variable {var['name']}", var["definition"], frozenset({var["name"]}))
        for var in dashboard["templating"]["list"]
        if var["type"] == "query"
    ]
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            where = f"panel {panel['title']!r} {target['refId']}"
            queries.append(Query(where, target["expr"], printed(target.get("legendFormat", ""))))
    return queries


def rules() -> list[dict[str, Any]]:
    return [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]


def rule_queries() -> list[Query]:
    return [
        Query(f"rule {r['alert']}", r["expr"], printed(" ".join(r["annotations"].values())))
        for r in rules()
    ]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    """The /metrics of a sidecar with gpu, host, disk, a remote tier nobody listens for, and
    KV events."""
    directory = tmp_path_factory.mktemp("deploy")
    path = write_config(directory, disk="1MiB")
    config = yaml.safe_load(path.read_text())
    config["tiers"]["remote"] = {"nodes": [f"127.0.0.1:{free_port()}"], "timeout_s": 0.2}
    config["events"] = {"endpoint": f"tcp://127.0.0.1:{free_port()}"}
    path.write_text(yaml.safe_dump(config))
    with running(path) as server, Client(server.url) as client:
        tokens = tokens_of(0, 16)
        assert client.store(tokens, kv_of(16, seed=1)).stored_tokens == 16
        assert client.lookup(tokens).num_tokens == 16
        response = server.get("/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert response.status_code == 200, response.text
    assert "kvtier_remote_connected 0.0" in response.text  # the remote tier is there, down
    assert "kvtier_events_unsynced_topics 0.0" in response.text  # the events, in step
    # `kvtier serve` froze its start-up objects out of the collector's passes (torch alone
    # makes some 100,000), and the collector's own counts are there
    frozen = re.search(r"^kvtier_gc_frozen_objects (\S+)$", response.text, re.M)
    assert frozen is not None and float(frozen.group(1)) > 50_000, frozen
    assert 'python_gc_collections_total{generation="2"}' in response.text
    return Exported.parse(response.text)


# ---- the checker itself ----------------------------------------------------------------------


def test_the_promql_helpers_find_names_matchers_and_labels() -> None:
    expr = (
        'sum by (instance, tier) (rate(kvtier_tier_hits_total{tier=~"gpu|host", job="kvtier_x"}'
        '[5m])) / on (instance) kvtier_tier_blocks and up{job=~".*kvtier_y.*"}'
    )
    assert names(expr) == {"kvtier_tier_hits_total", "kvtier_tier_blocks"}  # not in strings
    assert [(m.metric, m.label, m.op, m.value) for m in matchers(expr)] == [
        ("kvtier_tier_hits_total", "tier", "=~", "gpu|host"),
        ("kvtier_tier_hits_total", "job", "=", "kvtier_x"),
    ]
    assert grouping(expr) == {"instance", "tier"}
    assert printed("{{instance}} {{ tier }} on {{ $labels.kind }}") == {"instance", "tier", "kind"}


def test_made_up_names_labels_and_values_are_reported(exported: Exported) -> None:
    query = Query(
        "made up",
        "sum by (colour) (rate(kvtier_tier_nonexistent_total[5m])) + kvtier_tier_hits"
        ' + kvtier_tier_faults_total{kind="melted", shade="red"} + kvtier_ops_total{op=~".*"}',
        frozenset({"flavour"}),
    )
    assert exported.problems(query) == [
        "made up: kvtier_tier_hits is not exported",  # a counter is kvtier_tier_hits_total
        "made up: kvtier_tier_nonexistent_total is not exported",
        "made up: kvtier_tier_faults_total{kind='melted'} is not exported",
        "made up: kvtier_tier_faults_total has no label 'shade'",
        "made up: kvtier_ops_total{op=~'.*'}: not a list of plain values",
        "made up: label 'colour' is on none of " + str(sorted(names(query.expr))),
        "made up: label 'flavour' is on none of " + str(sorted(names(query.expr))),
    ]


# ---- what a running sidecar exports ----------------------------------------------------------


def test_every_name_label_and_value_the_dashboard_uses_is_exported(exported: Exported) -> None:
    queries = dashboard_queries()
    assert [p for q in queries for p in exported.problems(q)] == []
    used = set().union(*(names(q.expr) for q in queries))
    wanted = {  # what the dashboard is for (deploy/README.md)
        "kvtier_ready", "kvtier_tier_used_bytes", "kvtier_tier_capacity_bytes",
        "kvtier_tier_blocks", "kvtier_tier_leased_blocks", "kvtier_hit_rate",
        "kvtier_tier_hits_total", "kvtier_path_bytes_total",
        "kvtier_path_bandwidth_bytes_per_second", "kvtier_mover_in_flight",
        "kvtier_mover_queued_transfers", "kvtier_mover_pending_leases",
        "kvtier_mover_backpressure_drops_total", "kvtier_mover_failed_flights_total",
        "kvtier_mover_throttled_stores_total", "kvtier_request_seconds_bucket",
        "kvtier_tier_faults_total",
    }  # fmt: skip
    assert wanted - used == set()


def test_every_name_label_and_value_the_alert_rules_use_is_exported(exported: Exported) -> None:
    queries = rule_queries()
    assert [p for q in queries for p in exported.problems(q)] == []
    selected = {(m.label, m.value) for q in queries for m in matchers(q.expr)}
    assert {("kind", "corrupt_reads"), ("op", "corrupt_dropped"), ("tier", "disk")} <= selected


# ---- Grafana and Prometheus ------------------------------------------------------------------


def test_the_dashboard_takes_its_data_source_and_sidecars_as_variables() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    variables = {var["name"]: var for var in dashboard["templating"]["list"]}
    assert variables["instance"]["multi"] and variables["instance"]["includeAll"]
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = [cell for panel in panels for cell in grid_cells(panel["gridPos"])]
    assert len(cells) == len(set(cells)) and max(x for x, _ in cells) < 24  # no overlap
    for panel in panels:
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
            assert 'instance=~"$instance"' in target["expr"], panel["title"]


def grid_cells(pos: dict[str, int]) -> list[tuple[int, int]]:
    return [
        (x, y)
        for x in range(pos["x"], pos["x"] + pos["w"])
        for y in range(pos["y"], pos["y"] + pos["h"])
    ]


def test_every_rule_has_a_duration_a_severity_and_words_for_the_operator() -> None:
    found = rules()
    assert len({r["alert"] for r in found}) == len(found)
    for rule in found:
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    exprs = [r["expr"] for r in found]
    assert any(e.startswith("up{") and e.endswith("== 0") for e in exprs)


def test_every_query_is_valid_promql() -> None:
    """Parsed by promql-parser (the Rust parser of Prometheus' grammar), Grafana's variables
    as Grafana substitutes them (a variable's `label_values(expr, label)`: its expr); a broken
    query is refused, as the last line shows."""
    for query in (*dashboard_queries(), *rule_queries()):
        expr = query.expr.replace("$__rate_interval", "1m")
        variable = re.fullmatch(r"label_values\((.*), *\w+\)", expr)
        expr = expr if variable is None else variable[1]
        try:
            promql_parser.parse(expr)
        except ValueError as exc:
            raise AssertionError(f"{query.where}: {exc}\n{query.expr}") from None
    with pytest.raises(ValueError, match="parenthesis"):
        promql_parser.parse("rate(kvtier_ops_total[5m]")


# ---- systemd ---------------------------------------------------------------------------------


def unit_sections() -> dict[str, dict[str, list[str]]]:
    """Section -> key -> values in order (systemd keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        assert current is not None and "=" in line, line
        key, value = line.split("=", 1)
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_the_systemd_unit_serves_as_its_own_user_and_stops_gracefully() -> None:
    sections = unit_sections()
    assert set(sections) == {"Unit", "Service", "Install"}
    service = {key: values[-1] for key, values in sections["Service"].items()}
    assert shlex.split(service["ExecStart"])[1:] == SERVE[1:4]
    assert Path(shlex.split(service["ExecStart"])[0]).name == "kvtier"
    assert service["User"] not in ("root", "0")
    assert (service["KillSignal"], service["Restart"]) == ("SIGTERM", "on-failure")
    assert int(service["TimeoutStopSec"]) >= STOP_S
    assert service["StateDirectory"] and service["RuntimeDirectory"]
    assert (service["ProtectSystem"], service["NoNewPrivileges"]) == ("strict", "yes")
    # nothing that hides /dev/shm (and the GPUs) or removes the segments an engine maps
    assert {"PrivateDevices", "DevicePolicy", "PrivateIPC", "DynamicUser"} & service.keys() == set()
    assert service["RemoveIPC"] == "no"


def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip(reason="systemd-analyze is not installed")
    # verify wants ExecStart to exist: the kvtier of this environment stands in
    exec_start = shlex.split(unit_sections()["Service"]["ExecStart"][-1])[0]
    unit = tmp_path / "kvtier.service"
    unit.write_text(
        UNIT.read_text().replace(exec_start, str(Path(sys.executable).parent / "kvtier"))
    )
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, timeout=60)
    assert (result.returncode, result.stderr.decode()) == (0, "")  # an unknown key warns


# ---- the image and its config ------------------------------------------------------------------

INSTRUCTIONS = {
    "FROM", "RUN", "CMD", "LABEL", "MAINTAINER", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT",
    "VOLUME", "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL",
}  # fmt: skip


def containerfile() -> list[tuple[str, str]]:
    """(instruction, arguments), continuation lines joined, comments dropped."""
    logical = re.sub(r"\\\n\s*", " ", CONTAINERFILE.read_text())
    lines = [line.strip() for line in logical.splitlines()]
    return [
        (word.upper(), rest.strip())
        for word, _, rest in (line.partition(" ") for line in lines if line and line[0] != "#")
    ]


def test_the_containerfile_builds_a_non_root_image_that_serves_with_auth() -> None:
    steps = containerfile()
    assert {word for word, _ in steps} <= INSTRUCTIONS
    assert steps[0] == ("FROM", "python:3.11-slim")
    args = dict(rest.split("=", 1) for word, rest in steps if word == "ARG")
    assert args["TORCH_VERSION"] == "2.13.0" and args["TORCH_INDEX_URL"].endswith("/whl/cpu")
    for word, rest in steps:  # everything it copies is in the source tree
        if word == "COPY":
            assert all((DEPLOY.parent / src).exists() for src in rest.split()[:-1]), rest
    assert ("COPY", "deploy/container/kvtier.yaml /etc/kvtier/kvtier.yaml") in steps
    assert [rest for word, rest in steps if word == "USER"][-1].split(":")[0] not in ("root", "0")
    config = load_config(CONTAINER_CONFIG)
    assert ("EXPOSE", str(config.service.port)) in steps
    assert json.loads(dict(steps)["CMD"]) == SERVE
    volume = Path(json.loads(dict(steps)["VOLUME"])[0])
    assert config.tiers.disk is not None and Path(config.tiers.disk.path).is_relative_to(volume)
    assert Path(config.service.state_dir).is_relative_to(volume)
    health = dict(steps)["HEALTHCHECK"]
    command = json.loads(health[health.index("CMD") + 3 :])
    assert command[:2] == ["python", "-c"] and "/healthz" in command[2] and "curl" not in health
    compile(command[2], "HEALTHCHECK", "exec")


def test_the_image_builds_kvtier_from_what_it_copies(tmp_path: Path) -> None:
    """The sources the Containerfile copies before `pip install .` make a wheel with the
    `kvtier` command (built here without the network, as the image builds it)."""
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip(reason="setuptools (the build backend) is not installed")
    steps = containerfile()
    install = steps.index(("RUN", "pip install . && rm -rf /src"))
    assert ("WORKDIR", "/src") in steps[:install]
    src = tmp_path / "src"
    for word, rest in steps[:install]:
        *sources, dest = rest.split()
        for source in sources if word == "COPY" else []:
            origin = DEPLOY.parent / source
            target = src / dest / origin.name if dest.endswith("/") else src / dest
            if origin.is_dir():
                shutil.copytree(origin, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(origin, target)
    wheels = tmp_path / "wheels"
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    result = subprocess.run(
        [*build, "--no-index", "-w", str(wheels), str(src)], capture_output=True, timeout=300
    )
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
    with zipfile.ZipFile(next(wheels.glob("kvtier-*.whl"))) as wheel:
        entry_points = next(n for n in wheel.namelist() if n.endswith("entry_points.txt"))
        assert "kvtier = kvtier.program:run" in wheel.read(entry_points).decode()


def pod_config_file(tmp_path: Path) -> Path:
    config_map = next(d for d in yaml.safe_load_all(POD.read_text()) if d["kind"] == "ConfigMap")
    path = tmp_path / "kvtier.yaml"
    path.write_text(config_map["data"]["kvtier.yaml"])
    return path


@pytest.mark.parametrize("source", ["container", "pod"])
def test_the_example_configs_are_valid_and_turn_auth_on(
    source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = CONTAINER_CONFIG if source == "container" else pod_config_file(tmp_path)
    assert main(["validate", str(path)]) == 0
    assert capsys.readouterr().out.startswith(f"{path}: ok")
    config = load_config(path)
    assert config.service.host == "0.0.0.0"
    for name in KEYS:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError):  # the keys are env: references, read at start
        Auth(config)
    for name, value in KEYS.items():
        monkeypatch.setenv(name, value)
    auth = Auth(config)
    require_loopback(config.service.host, auth)  # auth is on: 0.0.0.0 is allowed
    assert auth.is_admin(f"Bearer {KEYS['KVTIER_ADMIN_KEY']}")
    assert auth.tenant(f"Bearer {KEYS['KVTIER_API_KEY']}", None) == "engine"


# ---- Kubernetes ------------------------------------------------------------------------------


def test_the_pod_shares_dev_shm_and_probes_the_sidecar(tmp_path: Path) -> None:
    pod = next(d for d in yaml.safe_load_all(POD.read_text()) if d["kind"] == "Pod")["spec"]
    config: KVTierConfig = load_config(pod_config_file(tmp_path))
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    containers = {c["name"]: c for c in pod["containers"] + pod.get("initContainers", [])}
    kvtier, engine = containers["kvtier"], containers["engine"]
    assert pod["terminationGracePeriodSeconds"] >= STOP_S
    shm = {
        name: m["name"] for name, c in containers.items()
        for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"
    }  # fmt: skip
    assert shm.keys() == {"kvtier", "engine"} and len(set(shm.values())) == 1
    volume = volumes[shm["kvtier"]]["emptyDir"]
    assert volume["medium"] == "Memory"
    host = config.tiers.host
    assert host is not None and host.capacity.nbytes and config.tiers.gpu.capacity.nbytes
    pools = config.tiers.gpu.capacity.nbytes + host.capacity.nbytes
    assert quantity(volume["sizeLimit"]) >= pools  # the pools fit in the shared /dev/shm
    port = {p["name"]: p["containerPort"] for p in kvtier["ports"]}
    assert list(port.values()) == [config.service.port]
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = kvtier[probe]["httpGet"]
        assert get["path"] == path and port.get(get["port"], get["port"]) == config.service.port
    assert kvtier["command"] == SERVE
    mounts = {m["mountPath"]: m["name"] for m in kvtier["volumeMounts"]}
    assert volumes[mounts["/etc/kvtier"]]["configMap"]["name"] == "kvtier-config"
    assert config.tiers.disk is not None
    assert any(Path(config.tiers.disk.path).is_relative_to(m) for m in mounts if m != "/dev/shm")
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in kvtier["env"]}
    referenced = {ref.removeprefix("env:") for ref in re.findall(r"env:\w+", str(config))}
    assert referenced == env.keys() == set(KEYS)
    engine_env = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef") for e in engine["env"]}
    assert engine_env["KVTIER_API_KEY"] == env["KVTIER_API_KEY"]
    assert f"http://127.0.0.1:{config.service.port}" in " ".join(engine["args"])
    for container in containers.values():  # one user for both, the pod's (see its comment)
        assert "resources" in container
        assert "runAsUser" not in container.get("securityContext", {})


def quantity(text: str) -> int:
    """A Kubernetes quantity in bytes: `24Gi`, `512Mi`, `1000`."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "": 1}
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|)", text)
    assert match is not None, text
    return int(match.group(1)) * units[match.group(2)]


def test_the_readme_shows_a_scrape_config_with_the_admin_key() -> None:
    text = (DEPLOY / "README.md").read_text()
    scrape = re.search(r"```yaml\n(scrape_configs:.*?)```", text, flags=re.S)
    assert scrape is not None
    job = yaml.safe_load(scrape.group(1))["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["authorization"]["type"] == "Bearer"
    assert any(rule["expr"].startswith(f'up{{job=~".*{job["job_name"]}.*"}}') for rule in rules())
    assert RULES.name in text and DASHBOARD.name in text
