"""What the sidecar tells operators, audited (status page, history, metrics): each test a
finding that was reproduced against a real store, app or browser.

- A scrape of `/metrics` walked every object `kvtier serve` froze at start
  (`gc.get_freeze_count()`, some 221,000: 25-100 ms) on the event loop that answers every
  request, at every scrape, for a count that never changes: read once now.
- The page's Config was a `<details>` inside the live part, which the script replaces every
  2 s: one the viewer opened came back closed before it could be read.
- The charts' time axis and the page's uptime were on the wall clock: a jump of it (a
  correction, a resume from suspend) drew the points out of order, labelled the axis with the
  jump (`-60 min` over a few seconds of samples) and showed a negative uptime.
"""

from __future__ import annotations

import contextlib
import gc
import re
import shutil
import signal
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from page_reader import figures
from service_server import ADMIN_KEY, BT, MODEL, kv_of, running, tokens_of, write_config
from starlette.testclient import TestClient

from kvtier.config import parse_config
from kvtier.service import history as history_module
from kvtier.service import page as page_module
from kvtier.service import render
from kvtier.service.admission import Service
from kvtier.service.app import create_app
from kvtier.service.history import History
from kvtier.store import KVStore

SMALL = {
    "model": MODEL,
    "block_tokens": BT,
    "tiers": {"gpu": {"capacity": "1MiB"}, "host": {"capacity": "1MiB"}},
}
HOUR = 3600.0


def small_store() -> KVStore:
    return KVStore(parse_config(SMALL))


@contextlib.contextmanager
def frozen_objects() -> Iterator[int]:
    """Objects frozen out of the collector (as `kvtier serve` does at start), for the block."""
    kept = [[i] for i in range(50_000)]
    gc.freeze()
    try:
        yield gc.get_freeze_count()
    finally:
        gc.unfreeze()
        del kept


def test_a_scrape_reads_the_frozen_count_once_not_at_every_scrape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads: list[int] = []
    real = gc.get_freeze_count

    def counted() -> int:
        reads.append(1)
        return real()

    monkeypatch.setattr(gc, "get_freeze_count", counted)
    service = Service(parse_config(SMALL), small_store)
    service.start()
    try:
        with frozen_objects() as frozen:
            reads.clear()
            for _ in range(5):
                body, _ = service.metrics.render()
                shown = re.search(rb"^kvtier_gc_frozen_objects (\S+)$", body, re.M)
                assert shown is not None and float(shown[1]) > 50_000 and frozen > 50_000
            assert len(reads) == 1, f"{len(reads)} walks of the frozen objects in 5 scrapes"
    finally:
        service.stop()


def test_the_config_is_no_toggle_that_a_refresh_closes() -> None:
    """Every element the live part holds is rendered anew at each refresh: it must hold no
    state of the viewer's (an opened <details>), and the config must be shown as it is."""
    config = parse_config(SMALL)
    with TestClient(create_app(config, small_store), base_url="http://127.0.0.1") as client:
        live = client.get("/", params={"part": "main"}).text
        whole = client.get("/").text
    assert "<details" not in live and "<details" not in whole
    assert "<h2>Config</h2>" in live
    assert re.search(r"<dt>tiers\.gpu\.capacity</dt><dd>[^<]+</dd>", live)


class _Clock:
    """The `time` module as a module sees it, with its wall clock moved by `offset` seconds."""

    def __init__(self) -> None:
        self.offset = 0.0

    def module(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            time=lambda: time.time() + self.offset,
            monotonic=time.monotonic,
            strftime=time.strftime,
            localtime=time.localtime,
        )


def _chart(html: str, title: str) -> str:
    found = re.search(rf'aria-label="{re.escape(title)}".*?</svg>', html, re.S)
    assert found is not None, f"no chart {title!r}"
    return found[0]


def _out_of_order(chart: str) -> list[str]:
    """The series of `chart` whose points, in the order drawn (oldest first), go back in x."""
    wrong = []
    for name, group in re.findall(r'data-series="([^"]*)"[^>]*>(.*?)</g>', chart, re.S):
        found = re.findall(r'cx="([\d.]+)"|([\d.]+),[\d.]+', group)  # circles, lines' points
        xs = [float(circle or point) for circle, point in found]
        if xs != sorted(xs):
            wrong.append(f"{name}: {xs}")
    return wrong


def test_the_charts_keep_their_order_and_span_across_a_wall_clock_jump(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = _Clock()
    monkeypatch.setattr(history_module, "time", clock.module())
    history = History(interval_s=60, keep=10)
    with small_store() as store:
        for step in range(4):
            tokens = tokens_of(1000 * step, 64)
            store.store(tokens, kv_of(64, seed=step))
            store.lookup(tokens)
            if step == 2:
                clock.offset = -HOUR  # the wall clock set back an hour between two samples
            history.take(store)
            time.sleep(0.01)
        status = store.status()
    view = render.View(status, "ready", None, history.rates(), None, {}, "now")
    html = render.document(view)
    chart = _chart(html, "Hit rate by tier (tokens found / asked)")
    drawn = re.search(r'data-series="all tiers" data-points="(\d+)"', chart)
    assert drawn is not None and int(drawn[1]) == 3  # every interval had lookups
    assert _out_of_order(chart) == []
    label = re.search(r'text-anchor="start">-([^<]+)</text>', chart)
    assert label is not None and label[1].endswith(" s") and float(label[1][:-2]) < 60, label


def test_the_uptime_is_not_moved_by_a_wall_clock_jump(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(page_module, "time", clock.module())
    config = parse_config(SMALL)
    with TestClient(create_app(config, small_store), base_url="http://127.0.0.1") as client:
        clock.offset = -HOUR
        page = client.get("/").text
    up = re.search(r"<dt>up</dt><dd>([^<]+)</dd>", page)
    assert up is not None and up[1].endswith(" s") and 0 <= float(up[1][:-2]) < 60, up


# ---- the page in a real browser ---------------------------------------------------------------


def _browser() -> Any:
    if shutil.which("/usr/bin/chromium") is None or shutil.which("/usr/bin/chromedriver") is None:
        pytest.skip(reason="no chromium or chromedriver: apt-get install chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service as Driver

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,2000"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Driver("/usr/bin/chromedriver"), options=options)


def _until(check: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "not within the bound"
        threading.Event().wait(0.05)


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_the_config_stays_readable_in_a_browser_across_refreshes(tmp_path: Path) -> None:
    with running(write_config(tmp_path)) as server:
        driver = _browser()
        try:
            driver.get(server.url + "/")
            rows = driver.find_elements("css selector", "dl.config dd")
            assert rows and rows[0].is_displayed()  # shown without a click
            start = int(driver.execute_script("return document.body.dataset.refreshes"))
            _until(
                lambda: (
                    int(driver.execute_script("return document.body.dataset.refreshes"))
                    >= start + 2
                )
            )
            rows = driver.find_elements("css selector", "dl.config dd")
            assert rows and all(row.is_displayed() for row in rows[:3])
            assert figures(driver.page_source)["readiness"] == "ready"
        finally:
            driver.quit()


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_a_page_opened_with_its_key_in_the_address_keeps_refreshing(tmp_path: Path) -> None:
    # fetch refuses a URL with credentials in it, and the script's relative URL took the
    # page's own: "Not updating: ... cannot be constructed from a URL that includes credentials"
    with running(write_config(tmp_path)) as server:
        driver = _browser()
        try:
            driver.get(f"http://:{ADMIN_KEY}@{server.url.removeprefix('http://')}/")
            assert figures(driver.page_source)["readiness"] == "ready"
            answers = [
                driver.execute_async_script(
                    "window.kvtierRefresh().then(arguments[arguments.length - 1])"
                )
                for _ in range(3)
            ]
            assert True in answers, driver.find_element("id", "stale").text
            assert not driver.find_element("id", "stale").is_displayed()
        finally:
            driver.quit()


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_a_server_that_stops_answering_is_said_on_the_page(tmp_path: Path) -> None:
    """A refresh that gets no answer (the server SIGSTOPped) ends after the page's patience
    (5 s at the 2 s refresh) and says so; the next answer clears the line. Before, `fetch` had
    no bound: the figures froze with no warning until the server answered again. Without
    `AbortSignal.timeout` (browsers before 2022) the page refreshes as it did (review 1)."""
    with running(write_config(tmp_path)) as server:
        driver = _browser()
        try:
            old = {"source": "delete AbortSignal.timeout;"}
            driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", old)
            driver.get(server.url + "/")
            assert driver.execute_script("return typeof AbortSignal.timeout") == "undefined"
            refreshes = "return Number(document.body.dataset.refreshes)"
            _until(lambda: driver.execute_script(refreshes) >= 1)
            stale = driver.find_element("id", "stale")
            assert not stale.is_displayed(), stale.text
            server.process.send_signal(signal.SIGSTOP)
            try:
                _until(stale.is_displayed, 15)
                assert "Not updating: no answer in 5 s" in stale.text, stale.text
            finally:
                server.process.send_signal(signal.SIGCONT)
            _until(lambda: not stale.is_displayed(), 20)
            assert figures(driver.page_source)["readiness"] == "ready"
        finally:
            driver.quit()
