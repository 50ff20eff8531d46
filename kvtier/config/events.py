"""`events`: KV events for cache-aware routers (issue 16; `kvtier/events.py`). Off unless set."""

from __future__ import annotations

import re
from typing import Annotated

from kvtier.config.fields import Section, int_in, matching, one_of

_ENDPOINT = re.compile(r"(tcp://[A-Za-z0-9_.*\-\[\]:]{1,255}:\d{1,5}|ipc://[^\x00]{1,200})")
_TOPIC = re.compile(r"[\x21-\x7e]{1,200}")  # printable ASCII, no space


_WHERE = "a ZMQ address to bind: tcp://HOST:PORT or ipc://PATH"


class EventsConfig(Section):
    """A ZMQ PUB at `endpoint` in vLLM's KV-event wire format (llm-d reads it); a ROUTER at
    `replay_endpoint` answers replay requests from the last `buffer` messages per topic (and
    `buffer_bytes` of them at most). No message's payload passes `max_message_bytes`: longer
    runs of blocks go out as several events (a router refuses messages past its own bound:
    `kvtier.routing.Subscriber`). `topic` defaults to `kv@<host name>@<model name>`; with
    `per_tenant_topic` each tenant's events go to `<topic>@<tenant>` only."""

    endpoint: Annotated[str, matching(_ENDPOINT, _WHERE)]
    replay_endpoint: Annotated[str | None, matching(_ENDPOINT, _WHERE, True)] = None
    topic: Annotated[
        str | None, matching(_TOPIC, "1 to 200 printable ASCII characters, no space", True)
    ] = None
    per_tenant_topic: Annotated[bool, one_of((True, False))] = False
    buffer: Annotated[int, int_in(1, 1_000_000)] = 10_000
    buffer_bytes: Annotated[int, int_in(1 << 16, 1 << 36)] = 64 << 20
    max_message_bytes: Annotated[int, int_in(1 << 16, 1 << 30)] = 8 << 20
