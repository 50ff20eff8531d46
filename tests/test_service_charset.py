"""A body's `Content-Type` names no charset but UTF-8's, against a real `kvtier serve`: bodies
are read as UTF-8 whatever it says, so `application/json; charset=utf-16` was served as if
UTF-8 (a UTF-16 body then failed as malformed JSON, a 400 blaming the body, not the header);
now 415 `unsupported_media` naming the header, before the body is read (audit AZ)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from service_server import Server, running, write_config

LOOKUP = json.dumps({"tokens": [1, 2, 3, 4]})


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(write_config(tmp_path_factory.mktemp("charset"))) as live:
        yield live


@pytest.mark.parametrize(
    "content_type",
    ["application/json", "application/json; charset=utf-8", 'application/json;Charset="UTF-8"',
     "application/json; charset=utf8; x=y", "application/json; charset=us-ascii"],
)  # fmt: skip
def test_utf8_or_no_charset_is_read(server: Server, content_type: str) -> None:
    reply = server.post("/v1/lookup", content=LOOKUP, headers={"content-type": content_type})
    assert reply.status_code == 200 and reply.json()["num_tokens"] == 0, reply.text


@pytest.mark.parametrize("charset", ["utf-16", "latin-1", "utf-32le", ""])
def test_another_charset_is_refused_naming_it(server: Server, charset: str) -> None:
    content_type = f"application/json; charset={charset}"
    body = LOOKUP.encode("utf-16") if charset == "utf-16" else LOOKUP.encode()
    reply = server.post("/v1/lookup", content=body, headers={"content-type": content_type})
    assert reply.status_code == 415, reply.text  # before: 200, or 400 blaming the body
    assert reply.json()["error"] == "unsupported_media" and "charset" in reply.json()["detail"]
