"""`events`: KV events for cache-aware routers (issue 16; `kvtier/events.py`). Off unless set."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BeforeValidator

from kvtier.config.fields import InvalidValue, Section, int_in, matching, one_of

_ENDPOINT = re.compile(r"(tcp://[A-Za-z0-9_.*\-\[\]:]{1,255}:\d{1,5}|ipc://[^\x00]{1,200})")
_TOPIC = re.compile(r"[\x21-\x7e]{1,200}")  # printable ASCII, no space


_WHERE = "a ZMQ address to bind: tcp://HOST:PORT or ipc://PATH"
_PEERS = "a list of up to 16 ZMQ addresses to connect to: tcp://HOST:PORT (no *) or ipc://PATH"


def is_peer_address(entry: object) -> bool:
    """Is `entry` a ZMQ address to connect to: an endpoint's shape, but no `*` (a wildcard
    binds; nothing connects to it), and a TCP port in 1..65535?"""
    if not isinstance(entry, str) or "*" in entry or not _ENDPOINT.fullmatch(entry):
        return False
    return not entry.startswith("tcp://") or 0 < int(entry.rpartition(":")[2]) < 65536


def _peers(value: object) -> object:
    entries = tuple(value) if isinstance(value, list) else value
    if not isinstance(entries, tuple) or len(entries) > 16:
        raise InvalidValue(value, _PEERS)
    for entry in entries:
        if not is_peer_address(entry):
            raise InvalidValue(entry, _PEERS)
    return entries


class EventsConfig(Section):
    """A ZMQ PUB at `endpoint` in vLLM's KV-event wire format (llm-d reads it); a ROUTER at
    `replay_endpoint` answers replay requests from the last `buffer` messages per topic (and
    `buffer_bytes` of them at most). No message's payload passes `max_message_bytes`: longer
    runs of blocks go out as several events (a router refuses messages past its own bound:
    `kvtier.routing.Subscriber`). `topic` defaults to `kv@<host name>@<model name>`; with
    `per_tenant_topic` each tenant's events go to `<topic>@<tenant>` only. The PUB also
    connects to each address of `connect`: a subscriber that binds and waits for publishers to
    come to it, as llm-d's indexer does with a static `zmqEndpoint` (and vLLM connects to it),
    gets every message too."""

    endpoint: Annotated[str, matching(_ENDPOINT, _WHERE)]
    replay_endpoint: Annotated[str | None, matching(_ENDPOINT, _WHERE, True)] = None
    connect: Annotated[tuple[str, ...], BeforeValidator(_peers)] = ()
    topic: Annotated[
        str | None, matching(_TOPIC, "1 to 200 printable ASCII characters, no space", True)
    ] = None
    per_tenant_topic: Annotated[bool, one_of((True, False))] = False
    buffer: Annotated[int, int_in(1, 1_000_000)] = 10_000
    buffer_bytes: Annotated[int, int_in(1 << 16, 1 << 36)] = 64 << 20
    max_message_bytes: Annotated[int, int_in(1 << 16, 1 << 30)] = 8 << 20
