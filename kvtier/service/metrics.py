"""Prometheus metrics of the sidecar (`GET /metrics`), read from the live store at each scrape.

Store figures are not tallied here: a collector turns one `store.status()` into metric
families when Prometheus scrapes, so they can never drift from `/v1/status`. Only request
latency is the service's own (a histogram per route). Names:

    kvtier_ready                                         1 once the store serves
    kvtier_metrics_errors_total                          scrapes whose `store.status()` raised
                                                         (a bug: logged; the store's figures are
                                                         missing from that scrape)
    kvtier_tier_{capacity,used}_bytes{tier}              gauges
    kvtier_tier_{blocks,dirty_blocks,leased_blocks,free_slots}{tier}  gauges
    kvtier_tier_{reserved,quarantined,in_flight}_slots{tier}          gauges: slots in use that
                                                         hold no block (reservations, copies)
    kvtier_tier_{hits,promotions,demotions,evictions}_total{tier}
    kvtier_tier_cleared_total{tier}                      blocks a reset or admin clear dropped
    kvtier_tier_bytes_{in,out}_total{tier}               counters
    kvtier_tier_faults_total{tier,kind}                  disk faults: enospc, write_errors,
                                                         sync_errors, retire_errors, read_errors,
                                                         corrupt_reads (failed verification),
                                                         unquantizable
    kvtier_tier_refused_writes_total{tier}               disk writes refused while backing off
    kvtier_tier_write_backoff_seconds{tier}              the disk's current write backoff
    kvtier_tier_bandwidth_bytes_per_second{tier}         the disk's reads and writes together,
                                                         over the last minute of their copies
    kvtier_recovery_slots{outcome}                       the last start's recovery: scanned,
                                                         recovered, corrupt, orphans, ...
    kvtier_recovery_seconds                              how long that recovery took
    kvtier_path_bytes_total{path}                        bytes copied per path (gpu->host, ...)
    kvtier_path_bandwidth_bytes_per_second{path}         over the last minute of copies
    kvtier_index_{blocks,nodes,namespaces} kvtier_leases gauges (leases: clients')
    kvtier_reservations                                  live reservations
    kvtier_ops_total{op}                                 lookups, stores, loads, prefetches, ...
    kvtier_hit_rate                                      hit tokens / looked-up tokens
    kvtier_mover_{in_flight,queued_transfers,pending_leases}     gauges
    kvtier_mover_flights_total{kind}                     prefetch, demote, insert
    kvtier_mover_{failed_flights,backpressure_drops,throttled_stores}_total  counters
    kvtier_mover_{failed_blocks,leases_failed,leases_cancelled}_total       counters
    kvtier_mover_step_errors_total                       a mover step that raised (a bug)
    kvtier_prefetch_to_ready_seconds{quantile}           p50 / p99 of recent prefetches
    kvtier_request_seconds{route}                        histogram of request latency
    kvtier_client_disconnects_total                      clients that hung up mid-body
    kvtier_lane_requests_total                           requests answered over the local lane
                                                         (in kvtier_request_seconds too)
    kvtier_lane_connections                              open connections of the local lane
    kvtier_inflight_bytes                                bodies and load replies held now
    kvtier_inflight_limit_bytes                          their bound (`budget.py`)
    kvtier_inflight_{waits,busy}_total                   calls that waited for room; refused
                                                         503 busy at their deadline
    kvtier_remote_connected                              with tiers.remote: 1 while connected
    kvtier_remote_writer_pending_bytes                   the write backlog
    kvtier_remote_<counter>_total                        every count of the status' `remote`
    kvtier_events_{events,messages,dropped_events,replays,replays_asked,resyncs,retells}_total
                                                         `events`: KV events sent, lost to a
                                                         full queue, replays answered, asked ...
    kvtier_events_{queued,unsynced_topics}               events waiting to be sent; topics
                                                         that lost events, not yet told again
    python_gc_{objects_collected,objects_uncollectable,collections}_total{generation}
    kvtier_gc_frozen_objects                             start-up objects the collector skips
                                                         (read once, after the start's freeze)
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvtier.errors import ClosedError

if TYPE_CHECKING:
    from kvtier.service.admission import Service

_LOG = logging.getLogger("kvtier.metrics")

ROUTES = (
    "/v1/lookup", "/v1/prefetch", "/v1/release", "/v1/store", "/v1/load", "/v1/reserve",
    "/v1/commit", "/v1/abort", "/v1/status", "/v1/pools",
)  # fmt: skip
"""Routes with their own latency series; others are counted under `other`."""

BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class Metrics:
    def __init__(self, service: Service) -> None:
        self.registry = CollectorRegistry()
        self.requests = Histogram(
            "kvtier_request_seconds",
            "Time to answer a request, by route",
            ["route"],
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.disconnects = Counter(
            "kvtier_client_disconnects",
            "Clients that hung up before their request body was complete",
            registry=self.registry,
        )
        self.lane_requests = Counter(
            "kvtier_lane_requests",
            "Requests answered over the local lane (`kvtier_request_seconds` has them too)",
            registry=self.registry,
        )
        self.lane_connections = Gauge(
            "kvtier_lane_connections", "Open connections of the local lane", registry=self.registry
        )
        GCCollector(registry=self.registry)  # the collector's passes, by generation
        frozen = Gauge(
            "kvtier_gc_frozen_objects",
            "Objects frozen out of the garbage collector's passes at start (kvtier serve)",
            registry=self.registry,
        )
        frozen.set_function(_FreezeCount())
        self.registry.register(_StoreCollector(service))

    def disconnected(self) -> None:
        self.disconnects.inc()

    def observe(self, path: str, seconds: float) -> None:
        route = path if path in ROUTES else "other"
        self.requests.labels(route=route).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _FreezeCount:
    """`gc.get_freeze_count()`, read until it is not 0, then that reading: the call walks every
    frozen object (221,000 after `kvtier serve`'s start-up: 25-100 ms, on the event loop that
    answers every request, at each scrape), and the server freezes once, before it serves. An
    empty frozen set costs nothing to read again."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> float:
        if not self.count:
            self.count = gc.get_freeze_count()
        return float(self.count)


class _StoreCollector(Collector):
    def __init__(self, service: Service) -> None:
        self.service = service
        self.errors = 0  # scrapes whose `store.status()` raised (not a closed store)
        self.logged: set[str] = set()  # the kinds of error logged with their traceback

    def _failed(self, exc: Exception | None) -> CounterMetricFamily:
        """`kvtier_metrics_errors_total`, counting `exc` (None: none this scrape). Before, every
        exception of `status()` was taken for a store closing: the store's figures vanished
        from /metrics, `kvtier_ready` stayed 1, and nothing said why. A kind of error is logged
        with its traceback once, then in one line at each scrape."""
        if exc is not None:
            self.errors += 1
            kind = type(exc).__name__
            if kind in self.logged:
                _LOG.error("kvtier: /metrics: store.status() raised %s: %s", kind, exc)
            else:
                self.logged.add(kind)
                _LOG.error("kvtier: /metrics: store.status() raised (a bug)", exc_info=exc)
        family = CounterMetricFamily(
            "kvtier_metrics_errors",
            "Scrapes whose read of the store's status raised (a bug: its figures are missing)",
        )
        family.add_metric([], self.errors)
        return family

    def collect(self) -> Iterator[Any]:
        budget = self.service.budget
        yield _gauge("kvtier_inflight_bytes", "Request bodies and load replies held", budget.held)
        yield _gauge("kvtier_inflight_limit_bytes", "service.max_inflight_bytes", budget.total)
        for name, value, text in (("waits", budget.waits, "Calls that waited for room"),
                                  ("busy", budget.refused, "Calls refused 503 busy")):  # fmt: skip
            family = CounterMetricFamily(f"kvtier_inflight_{name}", text)
            family.add_metric([], value)
            yield family
        store = self.service.store
        ready = GaugeMetricFamily("kvtier_ready", "1 once the store serves")
        ready.add_metric([], 0.0 if store is None else 1.0)
        yield ready
        if store is None:
            return
        try:
            status = store.status()
        except ClosedError:  # closing between the check and the call: nothing to report
            return
        except Exception as exc:  # a bug in `status()`: said, counted, never a 500 of /metrics
            yield self._failed(exc)
            return
        yield self._failed(None)
        yield from _tiers(status["tiers"])
        yield from _faults(status["tiers"])
        yield from _recovery(status["recovery"])
        yield from _paths(status["paths"])
        for name in ("blocks", "nodes", "namespaces"):
            yield _gauge(f"kvtier_index_{name}", f"Index {name}", status["index"][name])
        yield _gauge("kvtier_leases", "Live leases of clients", status["index"]["leases"])
        yield _gauge("kvtier_reservations", "Live reservations", status["index"]["reservations"])
        ops = CounterMetricFamily("kvtier_ops", "Store operations and tokens", labels=["op"])
        for op, count in status["ops"].items():
            ops.add_metric([op], count)
        yield ops
        yield _gauge("kvtier_hit_rate", "Hit tokens over looked-up tokens", status["hit_rate"])
        yield from _mover(status["mover"])
        if "remote" in status:
            yield from _remote(status["remote"])
        if "events" in status:
            yield from _events(status["events"])


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation)
    family.add_metric([], value)
    return family


def _tiers(tiers: dict[str, dict[str, Any]]) -> Iterator[Any]:
    gauges = {
        "capacity_bytes": "Tier capacity in bytes",
        "used_bytes": "Bytes of the tier's slots in use (capacity_bytes' unit)",
        "blocks": "Blocks with a copy in the tier",
        "dirty_blocks": "Blocks whose slowest copy is in the tier (nothing below them)",
        "leased_blocks": (
            "Blocks of the tier that clients' leases hold (not the pins of reservations or of "
            "the mover)"
        ),
        "free_slots": "Free slots of the tier",
        "reserved_slots": "Slots of live and quarantined reservations",
        "quarantined_slots": "Slots of expired reservations in quarantine",
        "in_flight_slots": "Slots of the mover's copies not yet in the index",
    }
    counters = {
        "hits": "Blocks found by lookups with their fastest copy here",
        "promotions": "Blocks copied up into the tier",
        "demotions": "Copies freed here after a copy below existed",
        "evictions": "Blocks dropped from the cache from this tier",
        "cleared": "Blocks a reset or an admin clear dropped with their fastest copy here",
        "bytes_in": "Bytes copied into the tier",
        "bytes_out": "Bytes copied out of the tier",
    }
    for field, doc in gauges.items():
        family = GaugeMetricFamily(f"kvtier_tier_{field}", doc, labels=["tier"])
        for tier, figures in tiers.items():
            family.add_metric([tier], figures[field])
        yield family
    for field, doc in counters.items():
        counter = CounterMetricFamily(f"kvtier_tier_{field}", doc, labels=["tier"])
        for tier, figures in tiers.items():
            counter.add_metric([tier], figures[field])
        yield counter


def _faults(tiers: dict[str, dict[str, Any]]) -> Iterator[Any]:
    """A disk tier's fault counts, refused writes, backoff and bandwidth (the families exist,
    empty, without one, so that alert rules always find them)."""
    faults = CounterMetricFamily(
        "kvtier_tier_faults", "Disk faults by kind", labels=["tier", "kind"]
    )
    refused = CounterMetricFamily(
        "kvtier_tier_refused_writes", "Disk writes refused while backing off", labels=["tier"]
    )
    backoff = GaugeMetricFamily(
        "kvtier_tier_write_backoff_seconds", "Current disk write backoff", labels=["tier"]
    )
    busy = GaugeMetricFamily(
        "kvtier_tier_bandwidth_bytes_per_second",
        "A disk's reads and writes together over the last minute of their copies",
        labels=["tier"],
    )
    for tier, figures in tiers.items():
        if "faults" not in figures:
            continue
        for kind, count in figures["faults"].items():
            faults.add_metric([tier, kind], count)
        refused.add_metric([tier], figures["refused_writes"])
        backoff.add_metric([tier], figures["backoff_s"])
        busy.add_metric([tier], figures["recent_bytes_per_s"])
    yield faults
    yield refused
    yield backoff
    yield busy


def _recovery(recovery: dict[str, Any]) -> Iterator[Any]:
    """The last start's disk recovery: slots by outcome, and its duration (zeros without a
    disk tier)."""
    slots = GaugeMetricFamily(
        "kvtier_recovery_slots", "Disk slots by recovery outcome at start", labels=["outcome"]
    )
    for outcome, count in recovery.items():
        if outcome != "seconds":
            slots.add_metric([outcome], count)
    yield slots
    yield _gauge(
        "kvtier_recovery_seconds", "Disk recovery time at start", recovery.get("seconds", 0.0)
    )


def _paths(paths: dict[str, dict[str, Any]]) -> Iterator[Any]:
    moved = CounterMetricFamily("kvtier_path_bytes", "Bytes copied per path", labels=["path"])
    bandwidth = GaugeMetricFamily(
        "kvtier_path_bandwidth_bytes_per_second",
        "Copy bandwidth per path over the last minute of copies",
        labels=["path"],
    )
    for path, figures in paths.items():
        moved.add_metric([path], figures["bytes"])
        bandwidth.add_metric([path], figures["recent_bytes_per_s"])
    yield moved
    yield bandwidth


def _mover(mover: dict[str, Any]) -> Iterator[Any]:
    for field in ("in_flight", "queued_transfers", "pending_leases"):
        yield _gauge(f"kvtier_mover_{field}", f"Mover: {field.replace('_', ' ')}", mover[field])
    flights = CounterMetricFamily(
        "kvtier_mover_flights", "Flights planned by the mover, by kind", labels=["kind"]
    )
    for kind in ("prefetch", "demote", "insert"):
        flights.add_metric([kind], mover[f"{kind}_flights"])
    yield flights
    for field in _MOVER_COUNTERS:
        counter = CounterMetricFamily(f"kvtier_mover_{field}", f"Mover: {field}")
        counter.add_metric([], mover[field])
        yield counter
    ready = GaugeMetricFamily(
        "kvtier_prefetch_to_ready_seconds",
        "Time from prefetch to ready lease over recent prefetches",
        labels=["quantile"],
    )
    ready.add_metric(["0.5"], mover["prefetch_to_ready_s"]["p50"])
    ready.add_metric(["0.99"], mover["prefetch_to_ready_s"]["p99"])
    yield ready


def _events(events: dict[str, Any]) -> Iterator[Any]:
    fields = ("events", "messages", "dropped_events", "replays", "replays_asked", "resyncs")
    for field in (*fields, "retells"):
        counter = CounterMetricFamily(f"kvtier_events_{field}", f"KV events: {field}")
        counter.add_metric([], events[field])
        yield counter
    yield _gauge("kvtier_events_queued", "KV events waiting to be sent", events["queued"])
    yield _gauge(
        "kvtier_events_unsynced_topics",
        "Topics that lost KV events and are not yet told again",
        events["unsynced_topics"],
    )


_MOVER_COUNTERS = (
    "failed_flights", "backpressure_drops", "throttled_stores", "failed_blocks", "leases_failed",
    "leases_cancelled", "step_errors",
)  # fmt: skip


_REMOTE_GAUGES = {"connected", "writer_pending_bytes"}  # every other number is a count


def _remote(remote: dict[str, Any]) -> Iterator[Any]:
    """Every figure of the status' `remote` section: its two gauges and its counters."""
    yield _gauge("kvtier_remote_connected", "1 while connected to the cluster", remote["connected"])
    yield _gauge(
        "kvtier_remote_writer_pending_bytes",
        "Bytes queued for the cluster, not yet written",
        remote["writer_pending_bytes"],
    )
    for field, value in remote.items():
        if field not in _REMOTE_GAUGES and isinstance(value, (int, float)):
            counter = CounterMetricFamily(f"kvtier_remote_{field}", f"Remote tier: {field}")
            counter.add_metric([], value)
            yield counter
