"""`events`: KV events for cache-aware routers (issue 16; `kvtier/events.py`). Off unless set."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BeforeValidator, model_validator

from kvtier.config.fields import InvalidValue, Section, bytes_in, int_in, matching, one_of, rule

# a tcp host: a name, an IPv4 or a bracketed IPv6 address (a link-local one's zone after %);
# an ipc path: no NUL byte and no lone surrogate (ZMQ takes the address as UTF-8)
_ENDPOINT = re.compile(
    r"(tcp://(\[[0-9A-Fa-f:.]{1,64}(%[A-Za-z0-9_.\-]{1,32})?\]|[A-Za-z0-9_.*\-\[\]:]{1,255})"
    r":\d{1,5}|ipc://[^\x00\ud800-\udfff]{1,200})"
)
_TOPIC = re.compile(r"(?=.{1,200}$)[\x21-\x3f\x41-\x7e]+(@[\x21-\x3f\x41-\x7e]+){0,2}")
_TOPIC_TEXT = (
    "1 to 200 printable ASCII characters, no space, at most three fields split by '@' "
    "(kv@<pod>@<model>: a router reads the pod from the second and a tenant from a fourth)"
)


_WHERE = "a ZMQ address to bind: tcp://HOST:PORT (a port in 0..65535) or ipc://PATH"
_PEERS = "a list of up to 16 ZMQ addresses to connect to: tcp://HOST:PORT (no *) or ipc://PATH"


def is_bind_address(entry: object) -> bool:
    """Is `entry` a ZMQ address to bind: an endpoint's shape and a TCP port in 0..65535 (0: one
    the system picks). A larger port is refused: ZMQ bound it modulo 65536 (`:99999` listened
    on 34463), so routers told the configured address heard nothing."""
    if not isinstance(entry, str) or not _ENDPOINT.fullmatch(entry):
        return False
    return not entry.startswith("tcp://") or int(entry.rpartition(":")[2]) < 65536


def is_peer_address(entry: object) -> bool:
    """Is `entry` a ZMQ address to connect to: an endpoint's shape, but no `*` (a wildcard
    binds; nothing connects to it), and a TCP port in 1..65535?"""
    if not isinstance(entry, str) or "*" in entry or not is_bind_address(entry):
        return False
    return not entry.startswith("tcp://") or int(entry.rpartition(":")[2]) > 0


def _peers(value: object) -> object:
    entries = tuple(value) if isinstance(value, list) else value
    if not isinstance(entries, tuple) or len(entries) > 16:
        raise InvalidValue(value, _PEERS)
    for entry in entries:
        if not is_peer_address(entry):
            raise InvalidValue(entry, _PEERS)
    return entries


class EventsConfig(Section):
    """A ZMQ PUB at `endpoint` in llm-d's KV-event layout (positional events); a ROUTER at
    `replay_endpoint` answers replay requests from the last `buffer` messages per topic (and
    `buffer_bytes` of them at most). No message's payload passes `max_message_bytes`: longer
    runs of blocks go out as several events (a router refuses messages past its own bound:
    `kvtier.routing.Subscriber`). `topic` defaults to `kv@<host name>@<model name>`; with
    `per_tenant_topic` each tenant's events go to `<topic>@<tenant>` only. The PUB also
    connects to each address of `connect`: a subscriber that binds and waits for publishers to
    come to it, as llm-d's indexer does with a static `zmqEndpoint` (and vLLM connects to it),
    gets every message too.

    A topic is unambiguous: a router splits it at '@' (`kv@<pod>@<model>[@<tenant>]`,
    `kvtier.routing`), so `topic` has at most three fields, and exactly three with
    `per_tenant_topic` (the tenant's is the fourth); a default topic refuses a model name with
    an '@' (`assembly._events`). Tenant names hold none."""

    endpoint: Annotated[str, rule(is_bind_address, _WHERE)]
    replay_endpoint: Annotated[
        str | None, rule(lambda v: v is None or is_bind_address(v), _WHERE)
    ] = None
    connect: Annotated[tuple[str, ...], BeforeValidator(_peers)] = ()
    topic: Annotated[str | None, matching(_TOPIC, _TOPIC_TEXT, True)] = None
    per_tenant_topic: Annotated[bool, one_of((True, False))] = False
    buffer: Annotated[int, int_in(1, 1_000_000)] = 10_000
    buffer_bytes: Annotated[int, bytes_in(1 << 16, 1 << 36)] = 64 << 20
    max_message_bytes: Annotated[int, bytes_in(1 << 16, 1 << 30)] = 8 << 20

    @model_validator(mode="after")
    def _tenant_is_fourth(self) -> EventsConfig:
        if self.per_tenant_topic and self.topic is not None and self.topic.count("@") != 2:
            expected = "kv@<pod>@<model>: three fields split by '@' (a tenant's is fourth)"
            raise InvalidValue(self.topic, expected, key="topic")
        return self
