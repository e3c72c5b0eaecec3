"""Which engine worker runs a request: adapter affinity within a load bound.

- A worker much busier than the least loaded one (more than `slack` requests more) is passed over,
  so one hot adapter cannot pile every request onto the worker that holds it: its overflow goes to
  another worker, which then holds the adapter too, and the two share it.
- Among the others, a worker whose device slots hold the request's adapter comes first, then one
  holding it in host memory (cheap to page in), the least loaded first.
- An adapter held nowhere goes to its home: the worker ranking highest for it by rendezvous
  hashing. Every gateway computes the same home without talking to the others, each adapter keeps
  one home while the pool is stable, and homes spread adapters evenly over workers, so workers do
  not all cycle through all adapters evicting each other's (no eviction storms); when a worker
  leaves, only its adapters move.
- Base-model requests go to the least loaded worker, ties spread by the request's own hash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_SLACK = 4


@dataclass(frozen=True)
class Candidate:
    """A worker that serves the request's model, as placement sees it."""

    id: str
    load: int  # requests it holds (running and waiting)
    adapters_device: frozenset[str] = frozenset()
    adapters_host: frozenset[str] = frozenset()


def place(candidates: Sequence[Candidate], key: str, adapter: str | None = None,
          slack: int = DEFAULT_SLACK) -> Candidate:
    """The worker for a request (see the module docstring). `key` spreads ties: the adapter's
    digest for adapter requests, the request id otherwise. ValueError if there is no candidate."""
    if not candidates:
        raise ValueError("no worker to place the request on")
    least = min(c.load for c in candidates)
    eligible = [c for c in candidates if c.load <= least + slack]
    if adapter is not None:
        for holders in ([c for c in eligible if adapter in c.adapters_device],
                        [c for c in eligible if adapter in c.adapters_host]):
            if holders:
                return _least_loaded(holders, adapter)
        return max(eligible, key=lambda c: _rank(adapter, c.id))
    return _least_loaded(eligible, key)


def home_of(adapter: str, worker_ids: Sequence[str]) -> str:
    """The worker an adapter held nowhere goes to when loads are equal."""
    return max(worker_ids, key=lambda w: _rank(adapter, w))


def _least_loaded(candidates: list[Candidate], key: str) -> Candidate:
    return min(candidates, key=lambda c: (c.load, -_rank(key, c.id)))


def _rank(key: str, worker_id: str) -> int:
    """Rendezvous (highest random weight) score of a worker for a key."""
    digest = hashlib.blake2b(f"{key}\0{worker_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
