"""`Sender`: how `Client` (`blocking.py`) sends its requests: one POST or GET, over the
server's lane where it is reached (`frames.PATHS`), else over keep-alive HTTP
(`connections.py`); the releases owed carried by a prefetch or reserve, and the give-back of
a request token whose reply may be lost (`releases.py`, `owing.py`).

Every request is checked first, before any socket is touched (`arguments.KeyTenant`): the
process is the client's maker's (a fork's requests would cross its parent's replies on the
same sockets), and with an API key, a call's tenant is the key's. `AsyncSender` gives
`AsyncClient` (whose requests are its own, `asynchronous.py`) the store's `cancel`, and
`lease_state` its wait on a lease.
"""

from __future__ import annotations

import urllib.parse
from typing import Any, Protocol

import httpx

from kvtier.client.arguments import KeyTenant, lease_of
from kvtier.client.calls import Calls
from kvtier.client.connections import Connections
from kvtier.client.lane import AsyncLaneConnections
from kvtier.client.mapper import Mapper
from kvtier.client.owing import Alone, Owing
from kvtier.client.releases import may_have_reached, new_token
from kvtier.client.transport import (
    REFUSALS,
    RequestHeaders,
    httpx_headers,
    httpx_send,
    reply_body,
)
from kvtier.results import Lease
from kvtier.service import frames, wire


class Sender:
    """`Client`'s requests (module doc), and what they owe (`owing`)."""

    def __init__(
        self,
        http: Connections,
        headers: RequestHeaders,
        server: Mapper,
        calls: Calls,
        alone: Alone,
    ) -> None:
        """`server`: the pools and lane (`Mapper`); `alone`: a give-back's POST on a
        connection of its own (after `close()`)."""
        self.http, self.headers, self.server = http, headers, server
        self.key = KeyTenant(calls, "authorization" in headers.common)
        self.owing = Owing(self.post, alone)  # releases, give-backs owed

    def post(self, path: str, body: dict[str, Any], tenant: str = "default") -> dict[str, Any]:
        """POST `body` to `path` for `tenant` (checked first: module doc); the reply's body."""
        if self.key.due(tenant):  # with a key, its tenant learnt before a call names one
            self.key.learn(self.get("/v1/status"))
        self.key.check(tenant)
        headers, encoded = self.headers.for_tenant(tenant), wire.encode(body, True)
        lane = self.server.lane  # one for the call: `Mapper.instance` may replace it
        if lane is not None and path in frames.PATHS:
            reply = lane.request(path, encoded, headers)
            if reply is not None:  # None: the lane cannot be reached, and nothing was sent
                return reply_body(reply)
        return reply_body(self.http.request("POST", path, encoded, headers))

    def get(self, path: str) -> dict[str, Any]:
        """GET `path` (the process checked first); the reply's body."""
        self.key.calls.check_process()
        return reply_body(self.http.request("GET", path, None, self.headers.common))

    def carrying(self, path: str, body: dict[str, Any], tenant: str) -> dict[str, Any]:
        """`post`, carrying the releases owed for `tenant` (`releases.py`), after giving back
        what lost replies of that tenant may have been granted."""
        owed = self.owing.owed
        self.owing.send_requests(owed.take_requests(tenant))
        ids = owed.take(tenant)
        try:
            return self.post(path, {**body, "release": ids} if ids else body, tenant)
        except BaseException:
            if ids:
                self.owing.owe_again(tenant, ids)
            raise

    def granting(
        self, kind: str, path: str, request: dict[str, Any], tenant: str, deadline: float
    ) -> tuple[str, dict[str, Any]]:
        """`carrying` of a prefetch or reserve with a fresh token; a failure that may have
        reached the server owes the token's give-back (sent by the call's `deadline` once the
        client is closed: `Owing.give_back`). The token and the reply."""
        token = new_token()
        try:
            return token, self.carrying(path, {**request, "request": token}, tenant)
        except BaseException as exc:
            if may_have_reached(exc, REFUSALS):
                self.owing.give_back(kind, token, tenant, deadline)
            raise

    def lease_state(self, lease: Lease, wait_s: float) -> dict[str, Any]:
        """`GET /v1/leases/{id}?wait_s=`, as the lease's tenant; over the lane where it is
        reached (`frames.PATHS`)."""
        self.key.calls.check_process()
        headers, lane = self.headers.for_tenant(lease.tenant), self.server.lane
        if lane is not None:
            request = wire.encode({"lease_id": lease.lease_id, "wait_s": wait_s}, True)
            reply = lane.request("/v1/leases", request, headers)
            if reply is not None:  # None: the lane cannot be reached, and nothing was sent
                return reply_body(reply)
        query = urllib.parse.urlencode({"wait_s": wait_s})
        path = f"/v1/leases/{lease.lease_id}?{query}"
        return reply_body(self.http.request("GET", path, None, headers))


async def lease_state(
    http: httpx.AsyncClient,
    lane: AsyncLaneConnections | None,
    headers: dict[str, str],
    asked: tuple[Lease, float],
    limit: int,
) -> dict[str, Any]:
    """`AsyncClient`'s `Sender.lease_state`: `GET /v1/leases/{id}?wait_s=` for `asked` (the
    lease, the wait), with the lease's tenant's `headers`; over the `lane` where it is reached
    (`frames.PATHS`), else over `http`, a reply longer than `limit` refused (`ReplyError`)."""
    lease, wait_s = asked
    if lane is not None:
        request = wire.encode({"lease_id": lease.lease_id, "wait_s": wait_s}, True)
        reply = await lane.request("/v1/leases", request, headers)
        if reply is not None:  # None: the lane cannot be reached, and nothing was sent
            return reply_body(reply)
    path, params = f"/v1/leases/{lease.lease_id}", {"wait_s": wait_s}
    built = http.build_request("GET", path, params=params, headers=httpx_headers(headers))
    return reply_body(await httpx_send(http, built, limit))


class Releases(Protocol):
    async def release(self, lease: Lease | int) -> None: ...


class AsyncSender:
    """`AsyncClient`'s `cancel`, on its `release` (`Client.cancel`)."""

    async def cancel(self: Releases, lease: Lease) -> None:
        """`Client.cancel`: a pending lease cancelled, a ready one released."""
        await self.release(lease_of(lease))
