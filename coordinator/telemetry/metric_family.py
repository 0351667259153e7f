"""A metric as the pure core produces it: name, kind, help and samples, no client library.

The exporter (`exporter.py`, the one module that imports prometheus_client) turns these into the
library's families; tests read them directly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from kvmesh.coordinator.telemetry.histogram import HistogramSnapshot

_NAME = re.compile(r"^kvmesh_[a-z0-9_]+$")


class MetricKind(Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True, slots=True)
class Sample:
    labels: tuple[tuple[str, str], ...]
    """(label name, value) pairs, in the family's `label_names` order."""
    value: float


@dataclass(frozen=True, slots=True)
class MetricFamily:
    """Naming follows Prometheus' conventions: counters end in `_total`, durations are
    `_seconds`, ratios `_ratio`; everything starts with `kvmesh_`."""

    name: str
    kind: MetricKind
    help: str
    label_names: tuple[str, ...] = ()
    samples: tuple[Sample, ...] = ()
    histogram: HistogramSnapshot | None = None
    """The one (unlabelled) series of a HISTOGRAM family."""

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"metric name {self.name!r} must match {_NAME.pattern}")
        if self.kind is MetricKind.COUNTER and not self.name.endswith("_total"):
            raise ValueError(f"counter {self.name!r} must end in _total")
        if (self.kind is MetricKind.HISTOGRAM) != (self.histogram is not None):
            raise ValueError(f"{self.name}: a histogram family has a snapshot, others have none")
        for sample in self.samples:
            if tuple(k for k, _ in sample.labels) != self.label_names:
                raise ValueError(
                    f"{self.name}: sample labels {sample.labels} do not match {self.label_names}"
                )

    def value(self, **labels: str) -> float | None:
        """The sample with exactly these labels; None if there is none."""
        wanted = tuple((k, labels[k]) for k in self.label_names if k in labels)
        if len(wanted) != len(labels):
            return None
        return next((s.value for s in self.samples if s.labels == wanted), None)
