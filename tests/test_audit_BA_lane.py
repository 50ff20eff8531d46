"""Audit BA: the local lane and a tenant the config does not list (a real `kvtier serve`).

Without API keys a lane frame names its tenant. One the config does not list was refused
(403 `unknown_tenant`) only by the handler, after its body had been held in
`service.max_inflight_bytes` under that name (a share of its own, as a tenant's) and read: a
peer that stalled such bodies held the budget under as many made-up names as it liked, for
`body_timeout_s` each. It is now refused on its head, nothing held, as a key refused is.
"""

from __future__ import annotations

import struct
import time
from pathlib import Path

import msgpack  # type: ignore[import-untyped]
import pytest
from lane_peer import lane_of, opened, read_frame
from service_server import running, write_config

from kvtier.blocks import encode_tokens


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_a_frame_of_an_unlisted_tenant_is_refused_before_its_body(tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        tenants={"a": {}, "b": {}},
        service={"body_timeout_s": 8},  # no tenant has a key: no auth
    )
    with running(config) as server:
        name = lane_of(server, "")
        body = msgpack.packb({"tokens": encode_tokens(list(range(100_000)))})  # 400 KB
        frame = msgpack.packb(["/v1/lookup", None, "nobody", body])
        with opened(name, timeout_s=5.0) as sock:
            sock.sendall(struct.pack("<I", len(frame)) + frame[: 100 << 10])  # the rest: stalled
            started = time.monotonic()
            status, reply = read_frame(sock)  # before: nothing until the body's deadline
            assert status == 403, (status, reply)
            assert msgpack.unpackb(reply)["error"] == "unknown_tenant"
            assert time.monotonic() - started < 4.0
            sock.sendall(frame[100 << 10 :])  # its rest read and dropped: the connection goes on
            good = msgpack.packb(
                ["/v1/lookup", None, "a", msgpack.packb({"tokens": encode_tokens([1, 2, 3, 4])})]
            )
            sock.sendall(struct.pack("<I", len(good)) + good)
            assert read_frame(sock)[0] == 200
        status = server.get("/v1/status").json()
        assert status["inflight"]["held_bytes"] == 0
        assert server.admin("/v1/admin/check").json()["ok"] is True
