"""The status page in a real headless Chromium (issue 18, point 2).

A real `kvtier serve` on the embedded default config (no `--config`: gpu, host and the disk
tier at `./kvtier-data`, here in a 2.25 GiB tmpfs mounted for the test, so that nothing is
preallocated on the shared root filesystem) under load from a client thread; Debian's
`chromium` driven by Selenium through Debian's `chromedriver`. The test checks that:
- the page shows all three tiers and updates by itself (its script's refreshes, its figures);
- under load, every counter it shows lies between `/v1/status` read just before and just after
  the page fetched its figures; once the load stops, every figure equals the status;
- a screenshot is saved (`$KVTIER_TEST_ARTIFACTS/status-page.png`, else the test's directory).

Without chromium and chromedriver the test skips, saying so; `.ci/run` installs both and sets
`KVTIER_REQUIRE_BROWSER=1`, which makes their absence a failure.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from conftest import mounted_tmpfs
from page_reader import at, figures, mismatches
from service_server import free_port

from kvtier.client import Client

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
LAYERS, HEADS, DIM, BT = 30, 3, 64, 16  # the embedded default's SmolLM2-135M
COUNTERS = ("hits", "promotions", "demotions", "evictions", "bytes_in", "bytes_out")


def browser() -> Any:
    """A headless Chromium under Selenium, or a skip (a failure under KVTIER_REQUIRE_BROWSER)."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if shutil.which(p) is None]
    if missing:
        reason = f"no {' or '.join(missing)}: apt-get install chromium chromium-driver"
        if os.environ.get("KVTIER_REQUIRE_BROWSER") == "1":
            pytest.fail(reason)
        pytest.skip(reason=reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,2000"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


@contextlib.contextmanager
def default_serve(cwd: Path) -> Iterator[str]:
    """`kvtier serve` with no config, in `cwd`, on a free port; its URL once /readyz is 200."""
    port = free_port()
    log = (cwd / "serve.log").open("wb")
    command = [sys.executable, "-m", "kvtier.cli", "serve", "--port", str(port)]
    process = subprocess.Popen(command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, (cwd / "serve.log").read_text()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "not ready within 60 s"
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        assert process.wait(60) == 0, (cwd / "serve.log").read_text()[-4000:]
        log.close()


class Load:
    """A client thread: prompts sharing 4 system prompts, each looked up, stored and, when
    found, loaded, until `stop()`."""

    def __init__(self, url: str) -> None:
        self.client = Client(url)
        self.done = threading.Event()
        self.requests = 0
        self.kv = torch.ones((LAYERS, 2, 512, HEADS, DIM), dtype=torch.bfloat16)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        n = 0
        while not self.done.is_set():
            system = [1_000_000 * (n % 4) + i for i in range(256)]
            tokens = system + [10_000 * n + i for i in range(BT * (1 + n % 16))]
            hit = self.client.lookup(tokens)
            self.client.store(tokens, self.kv[:, :, : len(tokens)])
            if hit.num_tokens:
                self.client.load(tokens[: hit.num_tokens])
            n += 1
            self.requests = n

    def stop(self) -> None:
        self.done.set()
        self.thread.join(60)


def status(url: str) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(url + "/v1/status", timeout=30).json()
    return body


def refreshed(driver: Any) -> dict[str, Any]:
    """The page's figures after its own script fetched them once more."""
    for _ in range(50):
        done = driver.execute_async_script(
            "window.kvtierRefresh().then(arguments[arguments.length - 1])"
        )
        if done:  # False: a refresh of its own was under way; ask again
            return figures(driver.page_source)
        time.sleep(0.05)
    raise AssertionError("the page did not refresh")


def counters(page: dict[str, Any]) -> list[str]:
    """The figures of the page that only grow: operation counts, tier traffic, path bytes."""
    return [
        path
        for path in page
        if path.startswith("ops.")
        or (path.startswith("tiers.") and path.rsplit(".", 1)[1] in COUNTERS)
        or (path.startswith("paths.") and path.endswith(".bytes"))
    ]


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_the_status_page_in_a_browser(tmp_path: Path) -> None:
    driver = browser()
    try:
        with mounted_tmpfs(tmp_path / "fs", "2304m") as cwd, default_serve(cwd) as url:
            driver.get(url + "/")
            rows = driver.find_elements("css selector", "table.tiers tr[data-tier]")
            assert [r.get_attribute("data-tier") for r in rows] == ["gpu", "host", "disk"]
            load = Load(url)
            try:
                check_updates_and_counters(driver, url, load)
            finally:
                load.stop()
            check_still(driver, url)
            shot = Path(os.environ.get("KVTIER_TEST_ARTIFACTS", tmp_path)) / "status-page.png"
            shot.parent.mkdir(parents=True, exist_ok=True)
            assert driver.save_screenshot(str(shot))
            assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    finally:
        driver.quit()


def check_updates_and_counters(driver: Any, url: str, load: Load) -> None:
    """Under load: the page refreshes by itself and its figures move; each counter it shows
    lies between the status read before and after it fetched."""
    first = figures(driver.page_source)
    start = int(driver.execute_script("return document.body.dataset.refreshes"))
    deadline = time.monotonic() + 30
    while True:
        now = int(driver.execute_script("return document.body.dataset.refreshes"))
        later = figures(driver.page_source)
        if now >= start + 2 and later["ops.stores"] > first["ops.stores"] and load.requests > 40:
            break
        assert time.monotonic() < deadline, (start, now, load.requests)
        time.sleep(0.2)
    for _ in range(3):
        before = status(url)
        page = refreshed(driver)
        after = status(url)
        grow = counters(page)
        assert len(grow) >= 20, grow
        for path in grow:
            assert at(before, path) <= page[path] <= at(after, path), path
    assert 'data-series="all tiers"' in driver.page_source  # the history has points by now


def check_still(driver: Any, url: str) -> None:
    """With the load stopped and the mover idle, every figure the page shows is the status'."""
    deadline = time.monotonic() + 60
    while True:
        before = status(url)
        page = refreshed(driver)
        after = status(url)
        mover = after["mover"]
        idle = mover["in_flight"] == mover["queued_transfers"] == 0
        if idle and before["tiers"] == after["tiers"] and before["ops"] == after["ops"]:
            break
        assert time.monotonic() < deadline, "the store did not settle"
        time.sleep(0.5)
    compared = [p for p in page if p not in ("as_of", "readiness")]
    compared = [p for p in compared if not p.endswith("recent_bytes_per_s")]  # decays with time
    assert mismatches(page, after, compared) == []
    assert len(compared) > 80
    assert page["tiers.host.blocks"] > 0 and page["ops.stores"] > 40
