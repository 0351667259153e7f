"""The metrics endpoint: the collector's families over HTTP in Prometheus' text format.

The one module that imports prometheus_client. It keeps a private registry (no process-wide
default, so two deployments in one process never share series) and serves it on a thread.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvmesh.coordinator.telemetry.collector import MetricsCollector
from kvmesh.coordinator.telemetry.metric_family import MetricFamily, MetricKind


def to_prometheus(family: MetricFamily) -> Metric:
    """One pure family as the client library's family."""
    labels = list(family.label_names)
    metric: Any
    if family.kind is MetricKind.HISTOGRAM:
        snap = family.histogram
        assert snap is not None  # MetricFamily guarantees it
        buckets = [
            (_le(b), float(c)) for b, c in zip(snap.bounds, snap.cumulative_counts, strict=True)
        ]
        buckets.append(("+Inf", float(snap.count)))
        metric = HistogramMetricFamily(family.name, family.help, labels=labels)
        metric.add_metric([], buckets, snap.total)
        return metric
    if family.kind is MetricKind.COUNTER:
        metric = CounterMetricFamily(family.name, family.help, labels=labels)
    else:
        metric = GaugeMetricFamily(family.name, family.help, labels=labels)
    for sample in family.samples:
        metric.add_metric([v for _, v in sample.labels], sample.value)
    return metric


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


class _Bridge(Collector):
    def __init__(self, collector: MetricsCollector) -> None:
        self.collector = collector

    def collect(self) -> Iterator[Metric]:
        for family in self.collector.collect():
            yield to_prometheus(family)


class MetricsExporter:
    """Serves `GET /metrics` on host:port until `stop`; port 0 picks a free port.

    The port is bound at construction, before anything slow starts, so a port in use fails a
    start-up at once; the collector is attached once the coordinator exists (`serve`). Until
    then a scrape answers with no kvmesh series."""

    def __init__(self, host: str, port: int) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:  # the one line `kvmesh up` prints must name the metrics port
            raise OSError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from exc
        self.host = host
        self.port: int = self._server.server_port

    def serve(self, collector: MetricsCollector) -> None:
        self.registry.register(_Bridge(collector))

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
