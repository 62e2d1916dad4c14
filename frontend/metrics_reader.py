"""vLLM's metric reader (vllm/v1/metrics/reader.py): typed records read back from a registry.

`LLM.get_metrics()` returns these, so code and tests written against vLLM's reader run
unchanged. The difference from vLLM: tidal reads an engine's own `CollectorRegistry` (never the
process-global one, so two engines in one process stay apart) and its metrics may live under
another prefix (`tidal:` for the server's `/metrics`); records always carry `vllm:` names.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client import Metric as PromMetric
from prometheus_client.samples import Sample

VLLM_PREFIX = "vllm:"

_LabelsKey = frozenset[tuple[str, str]]


@dataclass
class Metric:
    """One metric with one set of labels (a metric with several label sets, e.g.
    `vllm:request_success` per `finished_reason`, gives one record per set)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A monotonically increasing integer counter."""

    value: int


@dataclass
class Vector(Metric):
    """An ordered array of integer counters (vLLM uses it for speculative decoding only;
    tidal defines it so code that dispatches on the record types imports unchanged)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A value that can go up or down."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations in cumulative buckets: `buckets` maps each upper bound, as Prometheus
    writes it ("0.5", "1.0", ..., "+Inf"), to the number of observations <= that bound;
    `count` equals `buckets["+Inf"]`; `sum` is the sum of all observations."""

    count: int
    sum: float
    buckets: dict[str, int]


def get_metrics_snapshot(registry: CollectorRegistry, prefix: str = VLLM_PREFIX) -> list[Metric]:
    """The registry's gauges, counters and histograms named `prefix...`, as records renamed
    to `vllm:...`. Other collector types (summary, info, ...) are skipped, as vLLM's reader
    skips what it cannot represent."""
    collected: list[Metric] = []
    for metric in registry.collect():
        if not metric.name.startswith(prefix):
            continue
        name = VLLM_PREFIX + metric.name[len(prefix):]
        if metric.type == "gauge":
            collected.extend(Gauge(name, s.labels, s.value) for s in _samples(metric, ""))
        elif metric.type == "counter":
            collected.extend(Counter(name, s.labels, int(s.value)) for s in _samples(metric, "_total"))
        elif metric.type == "histogram":
            collected.extend(_histograms(name, metric))
    return collected


def _samples(metric: PromMetric, suffix: str) -> list[Sample]:
    # A counter's samples include `_created` (a timestamp), a histogram's `_created`,
    # `_bucket`, `_count` and `_sum`: pick the one kind asked for.
    wanted = metric.name + suffix
    return [s for s in metric.samples if s.name == wanted]


def _histograms(name: str, metric: PromMetric) -> Iterable[Histogram]:
    """One record per label set: the `_bucket` samples (told apart by their `le` label)
    grouped with the `_count` and `_sum` samples of the same labels."""
    buckets: dict[_LabelsKey, dict[str, int]] = {}
    for s in _samples(metric, "_bucket"):
        labels = {k: v for k, v in s.labels.items() if k != "le"}
        buckets.setdefault(frozenset(labels.items()), {})[s.labels["le"]] = int(s.value)
    counts = {frozenset(s.labels.items()): int(s.value) for s in _samples(metric, "_count")}
    sums = {frozenset(s.labels.items()): s.value for s in _samples(metric, "_sum")}
    for key, by_bound in buckets.items():
        yield Histogram(name, dict(key), counts[key], sums[key], by_bound)
