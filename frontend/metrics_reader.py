"""vLLM's metric reader (vllm/v1/metrics/reader.py): typed records read back from a registry.

`LLM.get_metrics()` returns these, so code and tests written against vLLM's reader run
unchanged. The difference from vLLM: tidal reads an engine's own `CollectorRegistry` (never the
process-global one, so two engines in one process stay apart; called without one, as vLLM's,
it reads prometheus_client's global registry), and metrics kept under another prefix are read
back under vLLM's; records always carry `vllm:` names, and tidal's own (`tidal:...`) are not
among them, as they are not vLLM's.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry
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
    """An ordered array of integer counters: vLLM's (and tidal's) one use is
    `vllm:spec_decode_num_accepted_tokens_per_pos`, its counters per draft position."""

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


SPEC_DECODE_PER_POS = "spec_decode_num_accepted_tokens_per_pos"  # a Vector: one counter per `position`


def get_metrics_snapshot(registry: CollectorRegistry | None = None, prefix: str = VLLM_PREFIX) -> list[Metric]:
    """The registry's gauges, counters and histograms named `prefix...`, as records renamed
    to `vllm:...`. Other collector types (summary, info, ...) are skipped, as vLLM's reader
    skips what it cannot represent."""
    collected: list[Metric] = []
    for metric in (REGISTRY if registry is None else registry).collect():
        if not metric.name.startswith(prefix):
            continue
        short = metric.name[len(prefix):]
        name = VLLM_PREFIX + short
        if metric.type == "gauge":
            collected.extend(Gauge(name, s.labels, s.value) for s in _samples(metric, ""))
        elif metric.type == "counter":
            samples = _samples(metric, "_total")
            if short == SPEC_DECODE_PER_POS:
                collected.extend(_vectors(name, samples))
            else:
                collected.extend(Counter(name, s.labels, int(s.value)) for s in samples)
        elif metric.type == "histogram":
            collected.extend(_histograms(name, metric))
    return collected


def _vectors(name: str, samples: list[Sample]) -> Iterable[Vector]:
    """One record per label set but `position`: the counts by position, 0.. the largest seen
    (a position without a sample counts 0)."""
    by_labels: dict[_LabelsKey, dict[int, int]] = {}
    for s in samples:
        labels = {k: v for k, v in s.labels.items() if k != "position"}
        by_labels.setdefault(frozenset(labels.items()), {})[int(s.labels["position"])] = int(s.value)
    for key, by_pos in by_labels.items():
        yield Vector(name, dict(key), [by_pos.get(p, 0) for p in range(max(by_pos) + 1)])


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
