"""How sure a model was of its answer, from the log-probabilities of the tokens it chose.

A cascade answers with a cheap model when its confidence clears a threshold. Three measures:
- `mean_logprob`: the mean token log-probability (<= 0); grows more negative with any doubt, but
  a long answer with one bad token looks as good as a short sure one.
- `min_prob`: the probability of the least likely token; one guessed digit sinks it.
- `quantile`: a low quantile (default the 10th percentile) of the token probabilities; like
  `min_prob` but less sensitive to answer length (a long answer has more chances of one
  unlucky token), which the routing literature finds more robust.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

MEASURES = ("mean_logprob", "min_prob", "quantile")
DEFAULT_QUANTILE = 0.1


def confidence(logprobs: Sequence[float], measure: str, quantile: float = DEFAULT_QUANTILE) -> float:
    """The `measure` of the chosen tokens' log-probabilities; 0 tokens count as fully sure
    (0.0 for mean_logprob, 1.0 for the probability measures)."""
    if measure not in MEASURES:
        raise ValueError(f"unknown confidence measure {measure!r}; use one of {', '.join(MEASURES)}")
    if measure == "mean_logprob":
        return sum(logprobs) / len(logprobs) if logprobs else 0.0
    probs = sorted(math.exp(lp) for lp in logprobs)
    if not probs:
        return 1.0
    if measure == "min_prob":
        return probs[0]
    return _quantile(probs, quantile)


def _quantile(ordered: list[float], q: float) -> float:
    """Linear-interpolated quantile of sorted values (numpy's default method)."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
