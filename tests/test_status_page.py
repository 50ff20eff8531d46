"""The status page at `/` (issue 18, point 2) without a browser: a real `kvtier serve` read over
HTTP, its figures held to `/v1/status`, its auth, its headers; the history ring and the
renderer on hand-made figures. The page in a real browser is `test_status_browser.py`.
"""

from __future__ import annotations

import base64
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from page_reader import at, figures, mismatches
from service_server import (
    ADMIN_KEY,
    Server,
    free_port,
    kv_of,
    running,
    tokens_of,
    write_config,
)
from starlette.testclient import TestClient

from kvtier.client import Client
from kvtier.config import parse_config
from kvtier.errors import ClosedError
from kvtier.service import render
from kvtier.service.app import create_app
from kvtier.service.history import History, Sample, rates_between
from kvtier.store import KVStore

KEY_A = "tenant-a-key-0123456789"
KEY_B = "tenant-b-key-9876543210"


def basic(key: str, user: str = "operator") -> dict[str, str]:
    token = base64.b64encode(f"{user}:{key}".encode()).decode()
    return {"authorization": f"Basic {token}"}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Keyless, with a disk tier and KV events: the page shows gpu, host and disk, and the
    events' counts."""
    path = write_config(tmp_path_factory.mktemp("page"), disk="1MiB")
    document = yaml.safe_load(path.read_text())
    document["events"] = {"endpoint": f"tcp://127.0.0.1:{free_port()}"}
    path.write_text(yaml.safe_dump(document))
    with running(path) as live:
        yield live


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tenants = {"a": {"api_keys": [KEY_A]}, "b": {"api_keys": [KEY_B]}}
    with running(write_config(tmp_path_factory.mktemp("page-auth"), tenants=tenants)) as live:
        yield live


def quiet_status(server: Server, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """The status once nothing moves: two reads in a row that agree (but for path rates)."""
    previous: dict[str, Any] | None = None
    for _ in range(100):
        status: dict[str, Any] = server.get("/v1/status", headers=headers).json()
        if previous is not None and previous["tiers"] == status["tiers"]:
            return status
        previous = status
    raise AssertionError("the store never settled")


def test_the_page_shows_every_tier_with_the_figures_of_the_status(server: Server) -> None:
    client = Client(server.url)
    for i in range(6):
        tokens = tokens_of(1000 * i, 32)
        client.store(tokens, kv_of(32, seed=i))
        assert client.lookup(tokens).num_tokens == 32
    server.admin("/v1/admin/persist")
    status = quiet_status(server)
    page = server.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    shown = figures(page.text)
    # every tier, and every figure of each tier's row
    assert {p.split(".")[1] for p in shown if p.startswith("tiers.")} == {"gpu", "host", "disk"}
    tier_fields = [f"tiers.{t}.{k}" for t, fig in status["tiers"].items() for k in fig]
    numbers = [p for p in tier_fields if isinstance(at(status, p), (int, str))]
    assert set(numbers) <= set(shown), set(numbers) - set(shown)
    assert shown["tiers.disk.blocks"] == status["tiers"]["disk"]["blocks"] > 0
    assert shown["ops.stores"] == 6
    assert shown["events.messages"] == status["events"]["messages"] > 0  # the KV events' too
    # all that the page shows of the status, equal to it (the status is still; path rates and
    # the figures that are not the status' own are left out)
    compared = [p for p in shown if not p.endswith("recent_bytes_per_s")]
    compared = [p for p in compared if p not in ("as_of", "readiness")]
    assert len(compared) > 60
    assert mismatches(shown, status, compared) == []
    assert shown["readiness"] == "ready"


def test_the_live_part_alone_and_a_bad_part(server: Server) -> None:
    part = server.get("/", params={"part": "main"})
    assert part.status_code == 200
    assert part.text.startswith('<main id="live">') and part.text.endswith("</main>")
    bad = server.get("/", params={"part": "<script>"})
    assert bad.status_code == 400
    assert bad.json()["error"] == "bad_argument" and "<script>" not in bad.text.replace(
        "'<script>'", ""
    )


def test_the_page_carries_no_inline_script_or_style_and_forbids_them(server: Server) -> None:
    page = server.get("/")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert "unsafe-inline" not in policy
    assert page.headers["cache-control"] == "no-store"
    scripts = re.findall(r"<script([^>]*)>(.*?)</script>", page.text, re.S)
    assert scripts == [(' src="/page.js" defer', "")]
    assert " style=" not in page.text and "<style" not in page.text
    for path, media in (("/page.js", "text/javascript"), ("/page.css", "text/css")):
        asset = server.get(path)
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(media)
        assert asset.text.strip()


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_the_charts_grow_with_the_history(server: Server) -> None:
    """The server samples every 2 s: the hit-rate chart gains points while lookups go on."""
    client = Client(server.url)
    tokens = tokens_of(50_000, 16)
    client.store(tokens, kv_of(16, seed=9))
    points = []
    for _ in range(3):
        for _ in range(20):
            client.lookup(tokens)
        page = server.get("/").text
        found = re.search(r'data-series="all tiers" data-points="(\d+)"', page)
        points.append(0 if found is None else int(found[1]))  # none before two samples
        threading.Event().wait(2.5)
    assert points[0] < points[1] < points[2]


def test_auth_is_the_status_routes_and_basic_credentials_work(auth_server: Server) -> None:
    Client(auth_server.url, api_key=KEY_A).store(tokens_of(0, 16), kv_of(16, seed=1))
    # no key: 401 asking for Basic credentials (a browser then prompts)
    refused = auth_server.get("/")
    assert refused.status_code == 401
    assert refused.headers["www-authenticate"].startswith("Basic ")
    # an unknown key: Basic asks again, Bearer is forbidden; the key is never echoed
    assert auth_server.get("/", headers=basic("not-a-key-0123456789")).status_code == 401
    assert auth_server.get("/", headers=bearer("not-a-key-0123456789")).status_code == 403
    assert "not-a-key" not in auth_server.get("/", headers=basic("not-a-key-0123456789")).text
    assert auth_server.get("/", headers={"authorization": "Basic %%%"}).status_code == 401
    # the admin key, as Basic (password, or user with an empty password) or Bearer: global
    for headers in (basic(ADMIN_KEY), basic("", user=ADMIN_KEY), bearer(ADMIN_KEY)):
        page = auth_server.get("/", headers=headers)
        assert page.status_code == 200, page.text
        assert "all tenants" in page.text and "Config" in page.text and "<svg" in page.text
        assert KEY_A not in page.text and ADMIN_KEY not in page.text  # keys redacted
    # a tenant's key: its own figures only, no charts and no config (they are global)
    own = auth_server.get("/", headers=basic(KEY_B))
    assert own.status_code == 200
    shown = figures(own.text)
    status_b = auth_server.get("/v1/status", headers=bearer(KEY_B)).json()
    assert status_b["tenant"] == "b"
    assert shown["tiers.gpu.blocks"] == status_b["tiers"]["gpu"]["blocks"] == 0
    assert "tiers.gpu.used_bytes" not in shown and "tiers.gpu.held_blocks" in shown
    assert "Config" not in own.text and 'class="chart"' not in own.text
    assert "tenant b" in own.text


def test_the_page_answers_while_the_store_recovers() -> None:
    """In-process app, a store whose start is held: the page says so, with its build."""
    go = threading.Event()

    small = parse_config({"tiers": {"gpu": {"capacity": "4MiB"}, "host": {"capacity": "4MiB"}}})

    def slow_store() -> KVStore:
        go.wait(30)
        return KVStore(small)

    with TestClient(create_app(small, slow_store), base_url="http://127.0.0.1") as client:
        page = client.get("/")
        assert page.status_code == 200
        assert figures(page.text)["readiness"] == "recovering"
        assert "torch" in page.text
        go.set()


# ---- the history ring and the renderer, on figures made by hand --------------------------------


def sample(t: float, asked: int, found: int, hits: dict[str, int], moved: int) -> Sample:
    return Sample(
        t=t,
        lookup_tokens=asked,
        hit_tokens=found,
        hits=hits,
        used_bytes=dict.fromkeys(hits, 0),
        path_bytes={"gpu->host": moved},
        block_tokens=16,
    )


def test_rates_between_two_samples() -> None:
    a = sample(0.0, 1000, 400, {"gpu": 10, "host": 5}, 0)
    b = sample(2.0, 1640, 880, {"gpu": 30, "host": 15}, 4096)
    rates = rates_between(a, b)
    assert rates.hit_rate == 480 / 640
    assert rates.tier_hit_rate == {"gpu": 20 * 16 / 640, "host": 10 * 16 / 640}
    assert rates.bytes_per_s == {"gpu->host": 2048.0}
    quiet = rates_between(b, sample(4.0, 1640, 880, {"gpu": 30, "host": 15}, 4096))
    assert quiet.hit_rate is None and quiet.tier_hit_rate == {"gpu": None, "host": None}


class _Counting:
    """A stand-in for the store's `status()` only, counting up: the ring's own behaviour."""

    def __init__(self) -> None:
        self.n = 0

    def status(self) -> dict[str, Any]:
        self.n += 1
        tier = {"hits": self.n, "used_bytes": 0}
        return {
            "tiers": {"gpu": tier},
            "ops": {"lookup_tokens": 16 * self.n, "hit_tokens": 16 * self.n},
            "paths": {},
            "layout": {"block_tokens": 16},
        }


def test_the_ring_keeps_its_newest_samples_in_order() -> None:
    history = History(interval_s=0.01, keep=5)
    source = _Counting()
    for _ in range(8):
        history.take(source)
        history.check()
    kept = history.samples()
    assert [s.hits["gpu"] for s in kept] == [4, 5, 6, 7, 8]
    assert [r.hit_rate for r in history.rates()] == [1.0] * 4


def test_the_sampler_thread_samples_and_stops() -> None:
    history = History(interval_s=0.01, keep=50)
    source = _Counting()
    history.start(source)
    threading.Event().wait(0.3)
    history.stop()
    taken = len(history.samples())
    assert taken >= 5
    threading.Event().wait(0.05)
    assert len(history.samples()) == taken
    history.check()


def test_everything_from_outside_is_escaped() -> None:
    hostile = "<script>alert(1)</script>"
    small = parse_config({"tiers": {"gpu": {"capacity": "4MiB"}, "host": {"capacity": "4MiB"}}})
    with KVStore(small) as store:
        status = store.status()
    status["mover"]["last_error"] = hostile
    status["tiers"]["gpu"]["location"] = hostile
    status["paths"] = {hostile: {"bytes": 1, "recent_bytes_per_s": 1}}
    view = render.View(
        status=status,
        readiness=hostile,
        tenant=hostile,
        rates=[],
        config={"model": {"name": hostile}, "tenants": {hostile: {}}},
        build={"kvtier": hostile},
        as_of=hostile,
    )
    html = render.document(view)
    assert "<script>alert" not in html
    assert html.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 6
    assert figures(html)["mover.last_error"] == hostile  # and read back as it was


def test_a_failed_sample_is_skipped_and_a_closed_store_ends_the_sampling() -> None:
    class Flaky(_Counting):
        """Fails its 2nd and 3rd status (a transient error), then closes at its 8th."""

        calls = 0

        def status(self) -> dict[str, Any]:
            self.calls += 1
            if self.calls in (2, 3):
                raise RuntimeError("transient")
            if self.calls >= 8:
                raise ClosedError("the store is closed")
            return super().status()

    history = History(interval_s=0.01, keep=50)
    source = Flaky()
    history.start(source)
    deadline = time.monotonic() + 10
    while source.calls < 8:  # before: the thread ended at the 2nd, one sample in the ring
        assert time.monotonic() < deadline, source.calls
        threading.Event().wait(0.01)
    threading.Event().wait(0.1)
    assert source.calls == 8 and history.failed == 2  # no status asked after the close
    assert len(history.samples()) == 5
    history.stop()
    history.check()
