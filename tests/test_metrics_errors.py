"""`/metrics` when reading the store's status raises (a bug): before, every exception was taken
for a store closing, so the store's figures vanished from the scrape, `kvtier_ready` stayed 1
and nothing said why. Now it is counted (`kvtier_metrics_errors_total`, with an alert) and
logged; a closed store still yields no figures and no error."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
from service_server import BT, MODEL

from kvtier.config import parse_config
from kvtier.service.admission import Service
from kvtier.store import KVStore

SMALL = {
    "model": MODEL,
    "block_tokens": BT,
    "tiers": {"gpu": {"capacity": "1MiB"}, "host": {"capacity": "1MiB"}},
}


def _figure(body: bytes, name: str) -> float | None:
    shown = re.search(rb"^" + name.encode() + rb" (\S+)$", body, re.M)
    return None if shown is None else float(shown[1])


def test_a_status_that_raises_is_counted_and_logged_not_hidden(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    service = Service(parse_config(SMALL), lambda: KVStore(parse_config(SMALL)))
    service.start()
    try:
        store = service.store
        assert store is not None
        body, _ = service.metrics.render()
        assert _figure(body, "kvtier_metrics_errors_total") == 0.0
        assert _figure(body, "kvtier_index_blocks") == 0.0

        def broken(tenant: Any = None) -> dict[str, Any]:
            raise KeyError("tiers")  # a bug's error, as status() might raise one

        monkeypatch.setattr(store, "status", broken)
        with caplog.at_level(logging.ERROR, logger="kvtier.metrics"):
            for scrape in (1, 2, 3):
                body, _ = service.metrics.render()
                assert _figure(body, "kvtier_metrics_errors_total") == float(scrape)
                assert _figure(body, "kvtier_ready") == 1.0
                assert _figure(body, "kvtier_index_blocks") is None
        records = [r for r in caplog.records if r.name == "kvtier.metrics"]
        assert len(records) == 3
        assert records[0].exc_info is not None  # the traceback, once for its kind
        assert all(r.exc_info is None for r in records[1:])
        assert "KeyError" in records[2].getMessage()
        monkeypatch.undo()
        store.close()  # a closed store: no figures, and no error counted
        body, _ = service.metrics.render()
        assert _figure(body, "kvtier_index_blocks") is None
        assert _figure(body, "kvtier_metrics_errors_total") is None
    finally:
        service.stop()
