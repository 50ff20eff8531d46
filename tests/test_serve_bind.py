"""`bind`: a host that names no address is refused naming `service.host` (`--host '[::1]'`,
bracketed as in a URL, was blamed on `service.port`); a port in use still names the port."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.service.server import bind


def test_a_host_that_names_no_address_is_refused_naming_the_host() -> None:
    with pytest.raises(ConfigError, match=r"'service\.host': got '\[::1\]'.*an address of"):
        bind("[::1]", 0)


def test_a_port_in_use_still_names_the_port() -> None:
    first = bind("127.0.0.1", 0)
    try:
        first.listen()
        port = first.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"'service\.port': got {port}"):
            bind("127.0.0.1", port)
    finally:
        first.close()
