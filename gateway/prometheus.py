"""Counters, gauges and histograms with labels, rendered in the Prometheus text format (0.0.4).

A few dozen lines instead of a dependency: the gateway needs only these three kinds, all updated
from the event loop thread (so no locking).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    pairs = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        pairs.append(extra)
    return "{" + ",".join(pairs) + "}" if pairs else ""


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Metric:
    kind = ""

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()):
        self.name = name
        self.help = help
        self.labelnames = tuple(labelnames)

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} {self.kind}"
        yield from self._samples()

    def _samples(self) -> Iterable[str]:
        raise NotImplementedError

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {tuple(labels)}")
        return tuple(str(labels[n]) for n in self.labelnames)


class _Values(Metric):
    """One value per label set."""

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()):
        super().__init__(name, help, labelnames)
        self._values: dict[tuple[str, ...], float] = {}

    def value(self, **labels: str) -> float:
        return self._values.get(self._key(labels), 0.0)

    def forget(self, **labels: str) -> None:
        """Drop the series of `labels`, which no longer exists."""
        self._values.pop(self._key(labels), None)

    def _samples(self) -> Iterable[str]:
        for key, value in sorted(self._values.items()):
            yield f"{self.name}{_labels(self.labelnames, key)} {_number(value)}"


class Counter(_Values):
    """A value that only goes up (its name should end in _total)."""

    kind = "counter"

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        self._values[key] = self._values.get(key, 0.0) + amount

    def set_total(self, total: float, **labels: str) -> None:
        """Take the running total of a count kept elsewhere (an engine's, read when /metrics is
        scraped). NOTE: a total lower than the last is read by Prometheus as a counter reset, as
        when an engine worker restarts."""
        self._values[self._key(labels)] = float(total)


class Gauge(_Values):
    """A value that is set (read from the engines when /metrics is scraped)."""

    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        self._values[self._key(labels)] = float(value)


class Histogram(Metric):
    """Observations counted into cumulative `le` buckets, with their sum and count."""

    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: Sequence[float],
                 labelnames: Sequence[str] = ()):
        super().__init__(name, help, labelnames)
        self.buckets = tuple(sorted(buckets)) + (math.inf,)
        self._series: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}

    def labels(self, **labels: str) -> "BoundHistogram":
        return BoundHistogram(self, self._key(labels))

    def observe(self, value: float, **labels: str) -> None:
        self._observe(self._key(labels), value)

    def count(self, **labels: str) -> int:
        series = self._series.get(self._key(labels))
        return 0 if series is None else sum(series[0])

    def sum(self, **labels: str) -> float:
        series = self._series.get(self._key(labels))
        return 0.0 if series is None else series[1][0]

    def _observe(self, key: tuple[str, ...], value: float) -> None:
        counts, total = self._series.setdefault(key, ([0] * len(self.buckets), [0.0]))
        counts[bisect_left(self.buckets, value)] += 1
        total[0] += value

    def _samples(self) -> Iterable[str]:
        for key, (counts, total) in sorted(self._series.items()):
            cumulative = 0
            for bound, count in zip(self.buckets, counts):
                cumulative += count
                le = f'le="{_number(bound)}"'
                yield f"{self.name}_bucket{_labels(self.labelnames, key, le)} {cumulative}"
            yield f"{self.name}_sum{_labels(self.labelnames, key)} {_number(total[0])}"
            yield f"{self.name}_count{_labels(self.labelnames, key)} {cumulative}"


class BoundHistogram:
    """A histogram with its labels fixed, for hot paths that observe often."""

    def __init__(self, histogram: Histogram, key: tuple[str, ...]):
        self._histogram = histogram
        self._key = key

    def observe(self, value: float) -> None:
        self._histogram._observe(self._key, value)


def render(metrics: Iterable[Metric]) -> str:
    return "\n".join(line for metric in metrics for line in metric.render()) + "\n"
