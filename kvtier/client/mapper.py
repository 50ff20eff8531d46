"""A client's view of its server's pools and lane, kept to the server instance behind the URL.

`Mapper` (for `Client`) and `AsyncMapper` (for `AsyncClient`) hold the `MappedPools` and the
lane the server's `/v1/pools` reply names, and take them again when a reply that names slots
is of another server instance than the pools mapped (the sidecar restarted at the URL:
`pools.py`), once per instance.

Invariants:
- No slot of a reply is read or written through a mapping of another instance (`pools.py`).
- The lane taken before a re-map is retired (its server is gone): a call still holding it
  takes HTTP (`lane.py`).
- A re-map that fails (the new server's `/v1/pools` unreachable, or of another layout than
  this client serves) leaves nothing mapped and the client `due` to map again before its next
  store or load (`Mapper.refresh`; `AsyncClient._map`), never left on the body path for good;
  and the lease or reservation the failing reply granted is given back at once (`give_back`),
  never left to its ttl.
"""

from __future__ import annotations

import contextlib
from typing import Any

import httpx

from kvtier.client.connections import Connections
from kvtier.client.lane import AsyncLaneConnections, LaneConnections
from kvtier.client.pools import MappedPools
from kvtier.client.transport import RequestHeaders, httpx_headers, httpx_send, reply_body
from kvtier.errors import KVTierError
from kvtier.service import replies, wire

GIVE_BACK = {"lease": ("/v1/release", "lease_id"), "reservation": ("/v1/abort", "reservation_id")}
"""What a reply that names slots granted (`where`), and how it is given back."""


def give_back(body: dict[str, Any], where: str) -> tuple[str, bytes] | None:
    """The request (path, encoded body) that gives back what reply `body` granted, when it
    names a well-formed id; None otherwise (nothing known to give back)."""
    path, field = GIVE_BACK[where]
    value = body.get(field)
    if type(value) is not int or not 0 <= value <= replies.MAX_ID:
        return None
    return path, wire.encode({field: value}, True)


class Mapper:
    """`Client`'s pools (`pools`) and lane (`lane`) of its server instance (module doc)."""

    def __init__(
        self, http: Connections, headers: RequestHeaders, limits: tuple[float, int]
    ) -> None:
        self.http, self.headers, self.limits = http, headers, limits  # timeout_s, max reply
        self.pools = MappedPools()
        self.lane: LaneConnections | None = None  # the small calls' Unix socket (`lane.py`)
        self.due = False  # a re-map failed: map again before the next store or load

    def map(self) -> None:
        """Map the server's pools and take its lane; the lane taken before is retired."""
        pools = reply_body(self.http.request("GET", "/v1/pools", None, self.headers.common))
        self.pools.map(pools)
        lane, self.lane = (
            self.lane,
            LaneConnections.of(pools.get("lane"), *self.limits, pools.get("lane_max_frame_bytes")),
        )
        self.due = False
        if lane is not None:
            lane.retire()

    def refresh(self) -> None:
        """Map again if a re-map failed (module doc); a failure is the caller's call's."""
        if self.due:
            self.map()

    def instance(self, body: dict[str, Any], where: str, tenant: str | None) -> str | None:
        """The server instance of a reply that names slots (`where`: lease or reservation),
        checked; the pools mapped again first if it is another than the one mapped. If that
        fails, what the reply granted `tenant` is given back (None: the caller's already)."""
        instance = replies.instance(body, where)
        if self.pools.stale(instance):  # every mapping forgotten: no old byte is touched
            try:
                self.map()
            except BaseException:
                self.due = True
                request = give_back(body, where)
                if tenant is not None and request is not None:
                    with contextlib.suppress(KVTierError, OSError):
                        self.http.request("POST", *request, self.headers.for_tenant(tenant))
                raise
        return instance


class AsyncMapper:
    """`Mapper` for `AsyncClient`; `mapped` False until a `/v1/pools` reply is taken (`take`),
    and again after a re-map that failed (its `_map` asks at the next call)."""

    def __init__(
        self, http: httpx.AsyncClient, headers: RequestHeaders, limits: tuple[float, int]
    ) -> None:
        self.http, self.headers, self.limits = http, headers, limits  # timeout_s, max reply
        self.pools = MappedPools()
        self.lane: AsyncLaneConnections | None = None  # the small calls' socket (`lane.py`)
        self.mapped = False

    def take(self, pools: dict[str, Any]) -> None:
        """Map the pools of a `/v1/pools` reply and take its lane; the lane taken before is
        retired (its server is gone: a call that still holds it takes HTTP)."""
        self.pools.map(pools)
        lane, self.lane = (
            self.lane,
            AsyncLaneConnections.of(
                pools.get("lane"), *self.limits, pools.get("lane_max_frame_bytes")
            ),
        )
        if lane is not None:
            lane.retire()
        self.mapped = True

    async def instance(self, body: dict[str, Any], where: str, tenant: str | None) -> str | None:
        """`Mapper.instance`."""
        instance = replies.instance(body, where)
        if self.pools.stale(instance):  # every mapping forgotten: no old byte is touched
            try:
                common = httpx_headers(self.headers.common)
                request = self.http.build_request("GET", "/v1/pools", headers=common)
                self.take(reply_body(await httpx_send(self.http, request, self.limits[1])))
            except BaseException:
                self.mapped = False
                back = give_back(body, where)
                if tenant is not None and back is not None:
                    with contextlib.suppress(KVTierError, httpx.HTTPError):
                        headers = httpx_headers(self.headers.for_tenant(tenant))
                        sent = self.http.build_request("POST", back[0], content=back[1],
                                                       headers=headers)  # fmt: skip
                        await httpx_send(self.http, sent, self.limits[1])
                raise
        return instance
