"""The exporter's translation of pure families into Prometheus' text format (no HTTP here: the
integration test scrapes the real endpoint)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.coordinator.telemetry.exporter import to_prometheus
from kvmesh.coordinator.telemetry.histogram import Histogram
from kvmesh.coordinator.telemetry.metric_family import MetricFamily, MetricKind, Sample


class Fixed:
    def __init__(self, families: list[MetricFamily]) -> None:
        self.families = families

    def collect(self):  # type: ignore[no-untyped-def]
        return [to_prometheus(f) for f in self.families]


def render(families: list[MetricFamily]) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Fixed(families))  # type: ignore[arg-type]
    return generate_latest(registry).decode()


def test_counters_keep_their_total_suffix_and_labels() -> None:
    family = MetricFamily(
        "kvmesh_requests_total",
        MetricKind.COUNTER,
        "Requests.",
        ("outcome",),
        (Sample((("outcome", "ok"),), 3), Sample((("outcome", "failed"),), 1)),
    )
    text = render([family])
    assert "# TYPE kvmesh_requests_total counter" in text
    assert 'kvmesh_requests_total{outcome="ok"} 3.0' in text
    assert 'kvmesh_requests_total{outcome="failed"} 1.0' in text


def test_histograms_expose_cumulative_buckets_with_inf_count_and_sum() -> None:
    h = Histogram((0.1, 1.0))
    for value in (0.05, 0.5, 0.7, 3.0):
        h.observe(value)
    family = MetricFamily(
        "kvmesh_ttft_seconds", MetricKind.HISTOGRAM, "TTFT.", histogram=h.snapshot()
    )
    parsed = {f.name: f for f in text_string_to_metric_families(render([family]))}
    samples = {
        (s.name, s.labels.get("le", "")): s.value for s in parsed["kvmesh_ttft_seconds"].samples
    }
    assert samples[("kvmesh_ttft_seconds_bucket", "0.1")] == 1
    assert samples[("kvmesh_ttft_seconds_bucket", "1.0")] == 3
    assert samples[("kvmesh_ttft_seconds_bucket", "+Inf")] == 4
    assert samples[("kvmesh_ttft_seconds_count", "")] == 4
    assert abs(samples[("kvmesh_ttft_seconds_sum", "")] - 4.25) < 1e-9
