"""The quiet period after the sidecar did not answer (`integrations/lookups.Quiet`) ends as
soon as it answers again: a probe (a one-token lookup every `PROBE_S`, on a thread of its own)
asks it meanwhile. Before, every lookup, load and save of the vLLM connector (and every call of
the SGLang backend) was skipped for the whole 10 s after one unanswered call, even when the
sidecar was back the next moment (restarted by systemd, resumed). A sidecar that stays hung
keeps the quiet: a probe that is not answered opens nothing."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from service_server import Server, running, write_config

from kvtier.client import TransportError
from kvtier.client.connections import TransportTimeout
from kvtier.integrations.lookups import PROBE_S, Clients, Lookups

TOKENS = list(range(64))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One sidecar for the module (a test that stops it resumes it before it ends)."""
    with running(write_config(tmp_path_factory.mktemp("quiet"))) as started:
        yield started


def _stopped(server: Server) -> None:
    server.process.send_signal(signal.SIGSTOP)
    status = Path(f"/proc/{server.process.pid}/stat")
    deadline = time.monotonic() + 10
    while status.read_text().split(")")[-1].split()[0] != "T":
        assert time.monotonic() < deadline, "the sidecar never stopped"
        time.sleep(0.01)


def _open_within(quiet: Lookups | Clients, seconds: float) -> float:
    began = time.monotonic()
    while not quiet.open():
        assert time.monotonic() - began < seconds, "still quiet"
        time.sleep(0.02)
    return time.monotonic() - began


@pytest.mark.parametrize("kind", [Lookups, Clients])
def test_a_resumed_sidecar_is_asked_again_within_a_probe_not_the_whole_quiet(
    server: Server, kind: type[Lookups]
) -> None:
    quiet = kind(server.url, timeout_s=1.0, quiet_s=60.0)
    try:
        client = quiet.client("")
        assert client.lookup(TOKENS).num_tokens == 0  # mapped, answered
        _stopped(server)
        try:
            with pytest.raises(TransportError) as error:
                client.lookup(TOKENS)
            quiet.failed(error.value)
            assert not quiet.open()
            time.sleep(4 * PROBE_S)  # probes go unanswered: still quiet
            assert not quiet.open() and quiet.probes_answered == 0
        finally:
            server.process.send_signal(signal.SIGCONT)
        took = _open_within(quiet, 10.0)  # was: 60 s (the whole quiet period)
        assert quiet.probes_answered == 1, took
        assert client.lookup(TOKENS).num_tokens == 0
    finally:
        quiet.close()


def test_a_new_quiet_after_a_probe_ended_one_gets_its_own_probe(server: Server) -> None:
    quiet = Lookups(server.url, timeout_s=1.0, quiet_s=60.0)
    try:
        assert quiet.client("").lookup(TOKENS).num_tokens == 0
        for round_ in (1, 2, 3):
            quiet.failed(TransportError("the sidecar did not answer"))  # it answers probes
            assert not quiet.open()
            _open_within(quiet, 5.0)
            assert quiet.probes_answered == round_
    finally:
        quiet.close()


def test_a_call_that_timed_out_on_a_sidecar_that_answers_keeps_the_whole_quiet(
    server: Server,
) -> None:
    """A save larger than its timeout allows (the sidecar alive, only slow): its probe is
    answered at once, and ending the quiet then made each save queued behind it wait a whole
    timeout again (review 3). Only a sidecar seen out of reach has its quiet ended early."""
    quiet = Clients(server.url, timeout_s=1.0, quiet_s=2.5)
    try:
        assert quiet.client("").lookup(TOKENS).num_tokens == 0
        quiet.failed(TransportTimeout("POST /v1/store: TimeoutError: not done within 0.5 s"))
        time.sleep(4 * PROBE_S)  # its probe answered: still quiet
        assert not quiet.open() and quiet.probes_answered == 0
        took = _open_within(quiet, 5.0)  # the quiet period's end
        assert took > 0.5
        quiet.failed(TransportError("POST /v1/store: ConnectionResetError"))  # out of reach
        _open_within(quiet, 5.0 * PROBE_S)
        assert quiet.probes_answered == 1
    finally:
        quiet.close()
