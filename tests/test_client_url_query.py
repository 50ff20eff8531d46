"""A client URL with a query or a fragment is refused naming `url`: every call dropped them
unread (`http://h:1/?tenant=a` acted as the default tenant), blocking and async alike, and
the vLLM connector's `kvtier.url` with them (audit BC)."""

from __future__ import annotations

import pytest

from kvtier.client import AsyncClient, Client
from kvtier.client.connections import check_url
from kvtier.errors import ConfigError, InvalidArgumentError
from kvtier.integrations.settings import sidecar_urls


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:9/?tenant=a", "http://127.0.0.1:9#x", "http://h:1/p?", "http://h:1/#"]
)
def test_a_query_or_fragment_is_refused(url: str) -> None:
    with pytest.raises(InvalidArgumentError, match=r"url: .*no query or fragment"):
        Client(url)
    with pytest.raises(InvalidArgumentError, match=r"url: .*no query or fragment"):
        AsyncClient(url)
    with pytest.raises(ConfigError, match=r"kvtier\.url"):
        sidecar_urls({"kvtier.url": url})


@pytest.mark.parametrize("url", ["http://127.0.0.1:9", "http://127.0.0.1:9/", "https://h/base/"])
def test_plain_urls_are_taken(url: str) -> None:
    assert check_url(url)[0].hostname in ("127.0.0.1", "h")
    assert sidecar_urls({"kvtier.url": url}) == [url]
