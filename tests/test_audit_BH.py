"""Audit BH of the observability surface: `kvtier status` against a hostile or broken sidecar.

- A reply whose `tiers` is empty prints its table's header and the rest (before, the location
  column's width was `max(10, *())`, a `TypeError` and a traceback, exit 1).
- The location column is at most `LOCATION_COLUMN` wide: a long location overflows its own row
  only (before, every tier's row was padded to the longest location: a reply of 277 KB, one
  location of 100,000 characters and 2,000 tiers, printed 200 MB in 54 s; at the client's 8 MiB
  reply bound, hundreds of GB).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvtier import KVStore, parse_config
from kvtier.cli import main
from kvtier.cli_status import LOCATION_COLUMN


@contextlib.contextmanager
def sidecar(body: dict[str, Any]) -> Iterator[str]:
    """A real HTTP server on a thread answering every GET with `body` as JSON; its URL."""
    data = json.dumps(body).encode()

    class Answer(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def real_status() -> dict[str, Any]:
    """A real store's global status (gpu and host tiers)."""
    config = parse_config({"tiers": {"gpu": {"capacity": "1MiB"}, "host": {"capacity": "1MiB"}}})
    with KVStore(config) as store:
        store.check()
        return store.status()


def test_a_reply_without_tiers_prints_the_table_header_alone(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status = real_status()
    status["tiers"] = {}
    with sidecar(status) as url:
        assert main(["status", "--url", url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("tier  location"), lines
    assert lines[2].startswith("ops: "), lines  # no tier row, the rest as ever


def test_a_long_location_overflows_its_own_row_only(capsys: pytest.CaptureFixture[str]) -> None:
    status = real_status()
    long = "/" + "d" * 99_999
    status["tiers"]["host"]["location"] = long
    row = status["tiers"]["gpu"]
    for i in range(200):
        status["tiers"][f"t{i}"] = {**row, "location": "cpu"}
    with sidecar(status) as url:
        assert main(["status", "--url", url]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines()}
    assert long in rows["host"]  # shown whole, on its own row
    assert len(rows["t7"]) < 6 + LOCATION_COLUMN + 100, len(rows["t7"])
    assert len(rows["gpu"]) == len(rows["t7"])  # the short ones line up
    assert len(out) < len(long) + 300 * 200, len(out)  # before: 200 rows of 100,000 each


@pytest.mark.parametrize(
    ("field", "value"),
    [("hit_rate", float("nan")), ("hit_rate", float("inf")), ("p99", float("-inf"))],
)
def test_nan_or_infinity_in_a_rate_is_refused_naming_the_field(
    field: str, value: float, capsys: pytest.CaptureFixture[str]
) -> None:
    """JSON has no NaN nor Infinity, but Python's parser takes them: before, `kvtier status`
    printed `hit rate nan%` or `p99 -inf ms` as figures."""
    status = real_status()
    if field == "p99":
        status["mover"]["prefetch_to_ready_s"]["p99"] = value
    else:
        status[field] = value
    with sidecar(status) as url:
        assert main(["status", "--url", url]) == 2
    out = capsys.readouterr()
    assert out.out == ""  # nothing of the table printed
    assert "expected a finite number" in out.err and f".{field}: got " in out.err, out.err


def test_the_request_budget_line_has_a_tenants_share(capsys: pytest.CaptureFixture[str]) -> None:
    """The README says `kvtier status` prints `inflight`'s figures, `share_bytes` among them."""
    status = real_status()
    status["inflight"] = {
        "held_bytes": 0, "limit_bytes": 2**30, "share_bytes": 2**28, "waits": 3, "busy": 1
    }  # fmt: skip
    with sidecar(status) as url:
        assert main(["status", "--url", url]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("requests"))
    assert line == (
        "requests in flight: 0B of 1GiB held (a tenant's most 256MiB), 3 waited for room, "
        "1 refused busy"
    ), line


def test_json_output_of_a_reply_with_nan_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """`kvtier status --json` printed `"hit_rate": NaN`, which no JSON reader takes."""
    status = real_status()
    status["hit_rate"] = float("nan")
    with sidecar(status) as url:
        assert main(["status", "--url", url, "--json"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "NaN or Infinity" in out.err, out
    status["hit_rate"] = 0.5  # a finite reply prints as ever, JSON that parses
    with sidecar(status) as url:
        assert main(["status", "--url", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hit_rate"] == 0.5
